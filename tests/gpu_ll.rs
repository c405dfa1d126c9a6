//! GPU: low-latency dispatch/combine (kernels/ll_*.cu, src/ep/ll_gpu.rs) against the reference
//! (src/protocol/reference.rs), ranks as threads of one process on one GPU.
//! Ignored without `--include-ignored` (CI has no GPU); scripts/gpu-check.sh runs them.
//!
//! Exactness claims checked here: bf16 dispatch rows bit-exact; fp8 rows and scales bit-exact
//! (same e4m3 bytes, same f32 scales); combine bit-exact (same fma order, same RNE rounding).

mod common;
use common::gpu::gpu;
use fabric_ep::cuda::{Device, DeviceBuffer};
use fabric_ep::ep::ll_gpu::{LlDispatchHost, LlDispatchOut, LlGpuConfig, LlGpuGroup};
use fabric_ep::protocol::quant::f32_to_bf16;
use fabric_ep::protocol::reference::{self, LlCombineInput, LlParams, LlRankInput, Tokens};
use fabric_ep::util::SplitMix64;
use fabric_ep::Error;
use std::time::Duration;

const POISON: u8 = 0xAB;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Routing {
    Random {
        mask_pct: u64,
    },
    /// Every token's first choice is expert 0 (one message carries all of a source's tokens).
    AllToExpert0,
    AllMasked,
}

struct RankData {
    t: usize,
    x: Vec<u16>,
    topk: Vec<i64>,
    w: Vec<f32>,
    y: Vec<u16>,
}

struct RankDev {
    x: DeviceBuffer,
    topk: DeviceBuffer,
    w: DeviceBuffer,
    y: DeviceBuffer,
    out: LlDispatchOut,
    comb: DeviceBuffer,
}

fn rand_bf16(rng: &mut SplitMix64, n: usize) -> Vec<u16> {
    (0..n).map(|_| f32_to_bf16((rng.unit_f32() - 0.5) * 8.0)).collect()
}

fn make_data(cfg: &LlGpuConfig, tokens: &[usize], routing: Routing, seed: u64) -> Vec<RankData> {
    let mut rng = SplitMix64(seed);
    let (h, k, e) = (cfg.hidden, cfg.num_topk, cfg.num_experts);
    let y_len = cfg.num_local_experts() * cfg.rows_per_expert() * h;
    tokens
        .iter()
        .map(|&t| {
            let x = rand_bf16(&mut rng, t * h);
            let mut topk = Vec::with_capacity(t * k);
            for _ in 0..t {
                let mut row: Vec<i64> = Vec::new();
                if routing == Routing::AllToExpert0 {
                    row.push(0);
                }
                while row.len() < k {
                    let g = rng.below(e as u64) as i64;
                    if !row.contains(&g) {
                        row.push(g);
                    }
                }
                for v in row.iter_mut() {
                    match routing {
                        Routing::AllMasked => *v = -1,
                        Routing::Random { mask_pct } if rng.below(100) < mask_pct => *v = -1,
                        _ => {}
                    }
                }
                topk.extend_from_slice(&row);
            }
            let w = (0..t * k).map(|_| rng.unit_f32()).collect();
            let y = rand_bf16(&mut rng, y_len);
            RankData { t, x, topk, w, y }
        })
        .collect()
}

fn upload(dev: &Device, cfg: &LlGpuConfig, d: &[RankData]) -> Vec<RankDev> {
    d.iter()
        .map(|r| {
            // Zero-length inputs still get a (1-element) buffer so pointers are valid.
            let x = if r.x.is_empty() { vec![0u16; 8] } else { r.x.clone() };
            let topk = if r.topk.is_empty() { vec![-1i64] } else { r.topk.clone() };
            let w = if r.w.is_empty() { vec![0f32] } else { r.w.clone() };
            RankDev {
                x: DeviceBuffer::from_slice(dev, &x).unwrap(),
                topk: DeviceBuffer::from_slice(dev, &topk).unwrap(),
                w: DeviceBuffer::from_slice(dev, &w).unwrap(),
                y: DeviceBuffer::from_slice(dev, &r.y).unwrap(),
                out: LlDispatchOut::new(dev, cfg).unwrap(),
                comb: DeviceBuffer::new(dev, (r.t * cfg.hidden * 2).max(16)).unwrap(),
            }
        })
        .collect()
}

/// One dispatch + combine over the active ranks, outputs poisoned first. Sends of every rank
/// are launched before any receive (the hook split).
fn run(
    g: &mut LlGpuGroup,
    d: &[RankData],
    dd: &[RankDev],
    active: &[bool],
) -> Result<(Vec<LlDispatchHost>, Vec<Vec<u16>>), Error> {
    for r in dd {
        r.out.poison(POISON)?;
        r.comb.memset(POISON)?;
        r.comb.device().synchronize()?; // the legacy-stream memset, before the ranks' streams
    }
    let n = g.num_ranks();
    let mut tickets = vec![None; n];
    for i in 0..n {
        if active[i] {
            // SAFETY: every buffer outlives the finish() below.
            tickets[i] = Some(unsafe {
                g.ranks[i].dispatch_send(&dd[i].x, &dd[i].topk, d[i].t, &dd[i].out)
            }?);
        }
    }
    for i in 0..n {
        if let Some(t) = tickets[i] {
            // SAFETY: as above.
            unsafe { g.ranks[i].dispatch_recv(t, &dd[i].out) }?;
        }
    }
    g.finish()?;
    let disp: Vec<LlDispatchHost> = dd.iter().map(|r| r.out.to_host().unwrap()).collect();
    for i in 0..n {
        if active[i] {
            // SAFETY: as above.
            tickets[i] = Some(unsafe { g.ranks[i].combine_send(&dd[i].y, &dd[i].out, d[i].t) }?);
        }
    }
    for i in 0..n {
        if let Some(t) = tickets[i] {
            // SAFETY: as above.
            unsafe { g.ranks[i].combine_recv(t, &dd[i].topk, &dd[i].w, &dd[i].out, &dd[i].comb) }?;
        }
    }
    g.finish()?;
    let comb = dd
        .iter()
        .zip(d)
        .map(|(r, rd)| {
            let v: Vec<u16> = r.comb.to_vec().unwrap();
            v[..rd.t * g.ranks[0].config().hidden].to_vec()
        })
        .collect();
    Ok((disp, comb))
}

fn params(cfg: &LlGpuConfig) -> LlParams {
    LlParams {
        num_experts: cfg.num_experts,
        hidden: cfg.hidden,
        num_topk: cfg.num_topk,
        max_tokens_per_rank: cfg.max_tokens_per_rank,
        use_fp8: cfg.use_fp8,
        round_scale: cfg.round_scale,
    }
}

/// Checks the GPU results against the reference; returns a one-line summary.
fn check(cfg: &LlGpuConfig, d: &[RankData], disp: &[LlDispatchHost], comb: &[Vec<u16>]) -> String {
    let p = params(cfg);
    let inputs: Vec<LlRankInput> =
        d.iter().map(|r| LlRankInput { x: &r.x, topk_idx: &r.topk }).collect();
    let want = reference::ll_dispatch(&p, &inputs).unwrap();
    let (l, s, h, nr) = (cfg.num_local_experts(), cfg.rows_per_expert(), cfg.hidden, cfg.num_ranks);
    let mut rows = 0usize;
    for (r, (got, w)) in disp.iter().zip(&want).enumerate() {
        let wc: Vec<i32> = w.recv_count.iter().map(|&c| c as i32).collect();
        assert_eq!(got.recv_count, wc, "rank {r}: recv_count");
        for e in 0..l {
            for src in 0..nr {
                let (b, c) = w.layout_range[e * nr + src];
                let i = (e * nr + src) * 2;
                assert_eq!(
                    (got.layout_range[i], got.layout_range[i + 1]),
                    (b as i32, c as i32),
                    "rank {r}: layout_range[{e}][{src}]"
                );
            }
            for i in 0..w.recv_count[e] as usize {
                let row = e * s + i;
                rows += 1;
                assert_eq!(got.recv_src_rank[row], w.recv_src_rank[row], "rank {r} e {e} row {i}");
                assert_eq!(got.recv_src_idx[row], w.recv_src_idx[row], "rank {r} e {e} row {i}");
                match &w.recv_x {
                    Tokens::Bf16(x) => {
                        let gx: &[u16] = bytemuck::cast_slice(&got.recv_x);
                        assert!(
                            gx[row * h..(row + 1) * h] == x[row * h..(row + 1) * h],
                            "rank {r} e {e} row {i}: bf16 payload differs"
                        );
                    }
                    Tokens::Fp8 { x, scales } => {
                        let gq = &got.recv_x[row * h..(row + 1) * h];
                        let wq = &x[row * h..(row + 1) * h];
                        if gq != wq {
                            let c = gq.iter().zip(wq).position(|(a, b)| a != b).unwrap();
                            panic!(
                                "rank {r} e {e} row {i}: fp8 byte {c}: got {:#x} want {:#x}",
                                gq[c], wq[c]
                            );
                        }
                        let gs = h / 128;
                        for j in 0..gs {
                            assert_eq!(
                                got.recv_scales[row * gs + j].to_bits(),
                                scales[row * gs + j].to_bits(),
                                "rank {r} e {e} row {i}: scale {j}"
                            );
                        }
                    }
                }
            }
        }
    }
    let cin: Vec<LlCombineInput> = d
        .iter()
        .map(|r| LlCombineInput { x: &r.y, topk_idx: &r.topk, topk_weights: &r.w })
        .collect();
    let wc = reference::ll_combine(&p, &want, &cin).unwrap();
    for (r, (g, w)) in comb.iter().zip(&wc).enumerate() {
        if g != w {
            let i = g.iter().zip(w).position(|(a, b)| a != b).unwrap();
            panic!(
                "rank {r}: combine differs at token {} channel {}: got {:#06x} want {:#06x}",
                i / h,
                i % h,
                g[i],
                w[i]
            );
        }
    }
    format!(
        "{rows} rows dispatched, {} tokens combined",
        comb.iter().map(|c| c.len() / h).sum::<usize>()
    )
}

fn small(num_ranks: usize, use_fp8: bool) -> LlGpuConfig {
    LlGpuConfig {
        num_ranks,
        num_experts: 64,
        hidden: 1024,
        num_topk: 6,
        max_tokens_per_rank: 48,
        use_fp8,
        round_scale: false,
        sm_budget: Some(8),
        timeout: Duration::from_secs(5),
    }
}

fn case(dev: &Device, cfg: &LlGpuConfig, tokens: &[usize], routing: Routing, seed: u64) {
    let mut g = LlGpuGroup::new(dev, cfg.clone()).unwrap();
    let d = make_data(cfg, tokens, routing, seed);
    let dd = upload(dev, cfg, &d);
    let active = vec![true; cfg.num_ranks];
    // Two calls: both buffer sets and the epoch advance are exercised.
    for call in 0..2 {
        let (disp, comb) = run(&mut g, &d, &dd, &active).unwrap();
        let s = check(cfg, &d, &disp, &comb);
        eprintln!(
            "ok: ranks {} fp8 {} round {} tokens {tokens:?} {routing:?} call {call}: {s}",
            cfg.num_ranks, cfg.use_fp8, cfg.round_scale
        );
    }
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn matches_reference_1_2_4_8_ranks() {
    let Some(dev) = gpu() else { return };
    for nr in [1, 2, 4, 8] {
        for (fp8, round) in [(false, false), (true, false), (true, true)] {
            let mut cfg = small(nr, fp8);
            cfg.round_scale = round;
            // Different token counts on different ranks, each <= max.
            let tokens: Vec<usize> = (0..nr).map(|r| 48 - 7 * (r % 5)).collect();
            case(&dev, &cfg, &tokens, Routing::Random { mask_pct: 10 }, 11 + nr as u64);
        }
    }
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn deepseek_shape_1_and_4_ranks() {
    let Some(dev) = gpu() else { return };
    for nr in [1, 4] {
        let cfg = LlGpuConfig { sm_budget: None, ..LlGpuConfig::bench(nr) };
        case(&dev, &cfg, &vec![128; nr], Routing::Random { mask_pct: 0 }, 7);
    }
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn imbalance_one_expert_zero_tokens_all_masked() {
    let Some(dev) = gpu() else { return };
    for fp8 in [false, true] {
        let cfg = small(4, fp8);
        case(&dev, &cfg, &[48, 48, 48, 48], Routing::AllToExpert0, 3);
        case(&dev, &cfg, &[48, 0, 30, 48], Routing::Random { mask_pct: 20 }, 4);
        case(&dev, &cfg, &[0, 0, 0, 0], Routing::Random { mask_pct: 0 }, 5);
        case(&dev, &cfg, &[48, 17, 48, 1], Routing::AllMasked, 6);
    }
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn reruns_are_bit_identical() {
    let Some(dev) = gpu() else { return };
    let cfg = small(4, true);
    let mut g = LlGpuGroup::new(&dev, cfg.clone()).unwrap();
    let d = make_data(&cfg, &[48, 40, 33, 48], Routing::Random { mask_pct: 5 }, 99);
    let dd = upload(&dev, &cfg, &d);
    let active = vec![true; 4];
    let first = run(&mut g, &d, &dd, &active).unwrap();
    check(&cfg, &d, &first.0, &first.1);
    for i in 1..20 {
        let again = run(&mut g, &d, &dd, &active).unwrap();
        assert!(again.0 == first.0, "rerun {i}: dispatch outputs differ");
        assert!(again.1 == first.1, "rerun {i}: combine outputs differ");
    }
    eprintln!("ok: 20 reruns bit-identical (dispatch incl. unwritten poison, combine)");
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn stalled_peer_is_a_timeout_naming_it() {
    let Some(dev) = gpu() else { return };
    let mut cfg = small(2, true);
    cfg.timeout = Duration::from_millis(200);
    let mut g = LlGpuGroup::new(&dev, cfg.clone()).unwrap();
    let d = make_data(&cfg, &[48, 48], Routing::Random { mask_pct: 0 }, 1);
    let dd = upload(&dev, &cfg, &d);
    let t0 = std::time::Instant::now();
    let err = run(&mut g, &d, &dd, &[true, false]).unwrap_err();
    eprintln!("timeout path: {err} (after {:?})", t0.elapsed());
    match &err {
        Error::Timeout { rank, peers, phase, .. } => {
            assert_eq!(*rank, 0);
            assert_eq!(peers, &vec![1]);
            assert!(phase.contains("dispatch receive"), "{phase}");
        }
        e => panic!("expected a timeout naming peer 1, got {e}"),
    }
    assert!(t0.elapsed() < Duration::from_secs(10));
    // Usable again after clean.
    g.clean().unwrap();
    let (disp, comb) = run(&mut g, &d, &dd, &[true, true]).unwrap();
    check(&cfg, &d, &disp, &comb);
    eprintln!("ok: after clean the group runs and matches the reference");
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn too_many_tokens_is_an_argument_error() {
    let Some(dev) = gpu() else { return };
    let cfg = small(1, true);
    let mut g = LlGpuGroup::new(&dev, cfg.clone()).unwrap();
    let d = make_data(&cfg, &[48], Routing::Random { mask_pct: 0 }, 1);
    let dd = upload(&dev, &cfg, &d);
    // SAFETY: nothing is launched (the error comes first).
    let e = unsafe { g.ranks[0].dispatch_send(&dd[0].x, &dd[0].topk, 49, &dd[0].out) }.unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { arg: "x", .. }), "{e}");
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn wait_costs_name_the_late_rank() {
    // DeepEP's *_wait_recv_cost_stats: each receive adds, per source, the %globaltimer ns from
    // the start of its wait until each of that source's flags was seen (LlTicket::with_wait_stats).
    let Some(dev) = gpu() else { return };
    let cfg = small(2, false);
    let l = cfg.num_local_experts() as i64;
    let mut g = LlGpuGroup::new(&dev, cfg.clone()).unwrap();
    let d = make_data(&cfg, &[48, 40], Routing::Random { mask_pct: 0 }, 31);
    let dd = upload(&dev, &cfg, &d);
    run(&mut g, &d, &dd, &[true, true]).unwrap(); // first launches, outside the timing
    let stats: Vec<DeviceBuffer> =
        (0..2).map(|_| DeviceBuffer::zeroed(&dev, 2 * 8).unwrap()).collect();
    let cstats: Vec<DeviceBuffer> =
        (0..2).map(|_| DeviceBuffer::zeroed(&dev, 2 * 8).unwrap()).collect();
    let delay = Duration::from_millis(200);
    // Rank 0 sends and starts waiting; rank 1 launches `delay` later.
    let mut tickets = Vec::new();
    for i in 0..2 {
        if i == 1 {
            std::thread::sleep(delay);
        }
        // SAFETY: every buffer outlives the finish() below.
        let t = unsafe { g.ranks[i].dispatch_send(&dd[i].x, &dd[i].topk, d[i].t, &dd[i].out) }
            .unwrap()
            .with_wait_stats(stats[i].device_ptr());
        unsafe { g.ranks[i].dispatch_recv(t, &dd[i].out) }.unwrap();
        tickets.push(t);
    }
    g.finish().unwrap();
    let disp: Vec<LlDispatchHost> = dd.iter().map(|r| r.out.to_host().unwrap()).collect();
    for i in 0..2 {
        if i == 1 {
            std::thread::sleep(delay);
        }
        // SAFETY: as above.
        let t = unsafe { g.ranks[i].combine_send(&dd[i].y, &dd[i].out, d[i].t) }
            .unwrap()
            .with_wait_stats(cstats[i].device_ptr());
        unsafe { g.ranks[i].combine_recv(t, &dd[i].topk, &dd[i].w, &dd[i].out, &dd[i].comb) }
            .unwrap();
    }
    g.finish().unwrap();
    let comb: Vec<Vec<u16>> = dd
        .iter()
        .zip(&d)
        .map(|(r, rd)| r.comb.to_vec::<u16>().unwrap()[..rd.t * cfg.hidden].to_vec())
        .collect();
    check(&cfg, &d, &disp, &comb);
    let floor = l * delay.as_nanos() as i64 / 2;
    for (what, s) in [("dispatch", &stats), ("combine", &cstats)] {
        let w0: Vec<i64> = s[0].to_vec().unwrap();
        let w1: Vec<i64> = s[1].to_vec().unwrap();
        eprintln!("{what} wait ns: rank 0 {w0:?}, rank 1 {w1:?}");
        assert!(w0[1] >= floor && w0[1] > 4 * w0[0].max(1), "rank 0 {what}: {w0:?}");
        assert!(w1.iter().all(|&v| v >= 0 && v < floor), "rank 1 {what}: {w1:?}");
    }
}
