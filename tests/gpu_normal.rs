//! GPU: normal-mode intranode dispatch/combine (kernels/normal_*.cu) with ranks as threads of one
//! process on one GPU, against the single-process reference (src/protocol/reference.rs).
//! Ignored without `--include-ignored` (CI has no GPU); scripts/gpu-check.sh runs them.

mod common;
use common::gpu::gpu;
use fabric_ep::cuda::{CudaError, Device};
use fabric_ep::ep::normal_gpu::harness::{step, RankBuffers, RankInput, StepOptions};
use fabric_ep::ep::normal_gpu::{NormalGpuRank, NormalGpuSettings};
use fabric_ep::protocol::config::DispatchDtype;
use fabric_ep::protocol::layout::{random_topk_idx, LayoutShape};
use fabric_ep::protocol::quant::{f32_to_bf16, quantize_bf16};
use fabric_ep::protocol::reference::{
    normal_combine, normal_dispatch, NormalCombineInput, NormalParams, NormalRankInput, Tokens,
    TokensRef,
};
use fabric_ep::util::SplitMix64;
use fabric_ep::Error;
use std::time::Duration;

const POISON: u8 = 0xAB;

#[derive(Clone, Debug)]
struct Case {
    ranks: usize,
    experts: usize,
    hidden: usize,
    topk: usize,
    dtype: DispatchDtype,
    tokens: Vec<usize>,
    drop_pct: u64,
    one_expert: Option<i64>,
    worst: Option<usize>,
    align: usize,
    chunk: usize,
    spp: usize,
    seed: u64,
}

impl Case {
    fn new(ranks: usize, hidden: usize, dtype: DispatchDtype, tokens: usize) -> Case {
        Case {
            ranks,
            experts: 16 * ranks,
            hidden,
            topk: 8.min(16 * ranks),
            dtype,
            tokens: vec![tokens; ranks],
            drop_pct: 10,
            one_expert: None,
            worst: None,
            align: 1,
            chunk: 16,
            spp: 4,
            seed: 1,
        }
    }
    fn settings(&self, dev: &Device) -> NormalGpuSettings {
        let sms = (dev.sm_count() as usize / self.ranks).min(32) & !1;
        NormalGpuSettings {
            chunk_tokens: self.chunk,
            slots_per_peer: self.spp,
            num_sms: sms.max(2 * self.ranks),
            timeout: Duration::from_secs(5),
            ..NormalGpuSettings::new(self.ranks, self.experts, self.hidden, self.topk, self.dtype)
        }
    }
}

/// bf16 bits from bytes (copies: a `Vec<u8>` need not be 2-byte aligned, e.g. when empty).
fn as_u16(x: &[u8]) -> Vec<u16> {
    x.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect()
}

fn random_bf16(rng: &mut SplitMix64, n: usize) -> Vec<u16> {
    // Values in [-2, 2) with a few exponents; never all zero.
    (0..n).map(|_| f32_to_bf16((rng.unit_f32() - 0.5) * 4.0 + 1e-3)).collect()
}

fn make_inputs(c: &Case, cap: usize) -> Vec<RankInput> {
    let mut rng = SplitMix64(c.seed);
    let h = c.hidden;
    (0..c.ranks)
        .map(|r| {
            let t = c.tokens[r];
            let shape = LayoutShape::new(t, c.topk, c.experts, c.ranks, c.ranks).unwrap();
            let mut idx = random_topk_idx(&mut rng, shape, c.drop_pct, false);
            if let Some(e) = c.one_expert {
                for row in idx.chunks_mut(c.topk) {
                    row.fill(-1);
                    row[0] = e;
                }
            }
            let w: Vec<f32> = (0..t * c.topk).map(|_| rng.unit_f32() + 0.25).collect();
            let xb = random_bf16(&mut rng, t * h);
            let (x, x_scales) = match c.dtype {
                DispatchDtype::Bf16 => (bytemuck::cast_slice(&xb).to_vec(), Vec::new()),
                DispatchDtype::Fp8E4m3 => quantize_bf16(&xb, h, false).unwrap(),
            };
            let combine_x = Some(random_bf16(&mut rng, cap * h));
            let combine_weights = Some((0..cap * c.topk).map(|_| rng.unit_f32()).collect());
            RankInput {
                num_tokens: t,
                x,
                x_scales,
                topk_idx: idx,
                topk_weights: w,
                combine_x,
                combine_weights,
            }
        })
        .collect()
}

/// Runs one step on every rank (threads), returns each rank's result.
fn run_all(
    ranks: &mut [NormalGpuRank],
    bufs: &mut [RankBuffers],
    o: StepOptions,
) -> Vec<fabric_ep::Result<usize>> {
    std::thread::scope(|s| {
        let hs: Vec<_> = ranks
            .iter_mut()
            .zip(bufs.iter_mut())
            .map(|(r, b)| {
                s.spawn(move || {
                    b.poison(POISON)?;
                    step(r, b, o).map(|x| x.out_rows)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
    })
}

fn check_case(dev: &Device, c: &Case) {
    let total: usize = c.tokens.iter().sum();
    let cap = c.worst.unwrap_or(total.max(1));
    let inputs = make_inputs(c, cap);
    let params = NormalParams {
        num_experts: c.experts,
        hidden: c.hidden,
        num_topk: c.topk,
        expert_alignment: c.align,
        num_worst_tokens: c.worst,
    };
    let xs16: Vec<Vec<u16>> = inputs.iter().map(|i| as_u16(&i.x)).collect();
    let ref_in: Vec<NormalRankInput> = inputs
        .iter()
        .zip(&xs16)
        .map(|(i, x16)| NormalRankInput {
            x: match c.dtype {
                DispatchDtype::Bf16 => TokensRef::Bf16(x16),
                DispatchDtype::Fp8E4m3 => TokensRef::Fp8 { x: &i.x, scales: &i.x_scales },
            },
            topk_idx: &i.topk_idx,
            topk_weights: &i.topk_weights,
        })
        .collect();
    let want = normal_dispatch(&params, &ref_in).unwrap();

    let settings = c.settings(dev);
    let mut ranks = NormalGpuRank::local_group(dev, &settings).unwrap();
    let mut bufs: Vec<RankBuffers> =
        ranks.iter().zip(&inputs).map(|(r, i)| RankBuffers::new(r, i, cap).unwrap()).collect();
    let h = c.hidden;
    let k = c.topk;
    // Fresh step, then a cached-handle step: both must match the reference.
    for cached in [false, true] {
        let o = StepOptions {
            expert_alignment: c.align,
            num_worst_tokens: c.worst,
            cached,
            skip_combine: false,
        };
        let res = run_all(&mut ranks, &mut bufs, o);
        let mut rows_all = Vec::new();
        for (r, x) in res.into_iter().enumerate() {
            rows_all.push(x.unwrap_or_else(|e| panic!("{c:?} cached={cached} rank {r}: {e}")));
        }
        let mut comb_rows: Vec<Vec<u16>> = Vec::new();
        let mut comb_w: Vec<Vec<f32>> = Vec::new();
        for (r, b) in bufs.iter().enumerate() {
            let w = &want[r];
            let rows = rows_all[r];
            let tag = format!("{c:?} cached={cached} rank {r}");
            let expect_rows = c.worst.unwrap_or(w.num_recv_tokens);
            assert_eq!(rows, expect_rows, "{tag}: rows");
            let prefix: Vec<i32> = b.handle.rank_prefix.to_vec().unwrap();
            let pw: Vec<i32> = w.rank_prefix.iter().map(|&v| v as i32).collect();
            assert_eq!(prefix, pw, "{tag}: rank_prefix");
            let pe: Vec<i32> = b.handle.recv_expert_counts.to_vec().unwrap();
            let pe_w: Vec<i32> = w.num_recv_tokens_per_expert.iter().map(|&v| v as i32).collect();
            assert_eq!(pe, pe_w, "{tag}: tokens per expert");
            let rx: Vec<u8> = b.recv_x.to_vec().unwrap();
            match &w.recv_x {
                Tokens::Bf16(v) => {
                    let got16 = as_u16(&rx[..rows * h * 2]);
                    let got: &[u16] = &got16;
                    if got != &v[..] {
                        let bad =
                            (0..rows).find(|&i| got[i * h..(i + 1) * h] != v[i * h..(i + 1) * h]);
                        panic!("{tag}: recv_x differs, first bad row {bad:?}");
                    }
                }
                Tokens::Fp8 { x, scales } => {
                    if rx[..rows * h] != x[..] {
                        let bad =
                            (0..rows).find(|&i| rx[i * h..(i + 1) * h] != x[i * h..(i + 1) * h]);
                        panic!("{tag}: recv_x differs, first bad row {bad:?}");
                    }
                    let s: Vec<f32> = b.recv_x_scales.as_ref().unwrap().to_vec().unwrap();
                    assert_eq!(&s[..rows * h / 128], &scales[..], "{tag}: scales");
                }
            }
            let ti: Vec<i64> = b.recv_topk_idx.to_vec().unwrap();
            assert_eq!(&ti[..rows * k], &w.recv_topk_idx[..], "{tag}: recv_topk_idx");
            let tw: Vec<f32> = b.recv_topk_weights.to_vec().unwrap();
            assert_eq!(&tw[..rows * k], &w.recv_topk_weights[..], "{tag}: recv_topk_weights");
            let si: Vec<i32> = b.recv_src_idx.to_vec().unwrap();
            assert_eq!(&si[..w.num_recv_tokens], &w.recv_src_idx[..], "{tag}: recv_src_idx");
            assert!(si[w.num_recv_tokens..rows].iter().all(|&v| v == -1), "{tag}: padding src");
            comb_rows.push(b.combined_x.to_vec::<u16>().unwrap()[..b.num_tokens * h].to_vec());
            comb_w.push(b.combined_weights.to_vec::<f32>().unwrap()[..b.num_tokens * k].to_vec());
        }
        // Combine against the reference on the same inputs (rows = each rank's output rows).
        let cin: Vec<NormalCombineInput> = inputs
            .iter()
            .zip(&want)
            .map(|(i, w)| {
                let rows = w.recv_topk_idx.len() / k;
                NormalCombineInput {
                    x: &i.combine_x.as_ref().unwrap()[..rows * h],
                    topk_weights: Some(&i.combine_weights.as_ref().unwrap()[..rows * k]),
                }
            })
            .collect();
        let cw = normal_combine(&params, &want, &cin).unwrap();
        for r in 0..c.ranks {
            let tag = format!("{c:?} cached={cached} rank {r}");
            if comb_rows[r] != cw[r].combined_x {
                let bad = (0..c.tokens[r]).find(|&t| {
                    comb_rows[r][t * h..(t + 1) * h] != cw[r].combined_x[t * h..(t + 1) * h]
                });
                panic!("{tag}: combined_x differs, first bad token {bad:?}");
            }
            assert_eq!(&comb_w[r], cw[r].combined_topk_weights.as_ref().unwrap(), "{tag}: weights");
        }
    }
    eprintln!(
        "ok: ranks {} hidden {} {:?} tokens {:?} worst {:?} align {} recv {:?}",
        c.ranks,
        c.hidden,
        c.dtype,
        c.tokens,
        c.worst,
        c.align,
        want.iter().map(|w| w.num_recv_tokens).collect::<Vec<_>>()
    );
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn dispatch_combine_match_reference_bf16_and_fp8() {
    let Some(dev) = gpu() else { return };
    for ranks in [1, 2, 4, 8] {
        for (hidden, dtype) in [
            (2048, DispatchDtype::Bf16),
            (4096, DispatchDtype::Fp8E4m3),
            (7168, DispatchDtype::Fp8E4m3),
            (7168, DispatchDtype::Bf16),
        ] {
            let mut c = Case::new(ranks, hidden, dtype, 200 + 37 * ranks);
            c.seed = (ranks * 131 + hidden) as u64;
            check_case(&dev, &c);
        }
    }
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn edge_cases_zero_tokens_one_expert_worst_alignment() {
    let Some(dev) = gpu() else { return };
    // Zero-token ranks and uneven counts.
    let mut c = Case::new(4, 2048, DispatchDtype::Bf16, 0);
    c.tokens = vec![0, 300, 0, 77];
    check_case(&dev, &c);
    // Every rank sends nothing at all.
    let mut c = Case::new(2, 2048, DispatchDtype::Fp8E4m3, 0);
    c.tokens = vec![0, 0];
    check_case(&dev, &c);
    // All tokens to one expert (rank 2), larger chunks, 2 slots.
    let mut c = Case::new(4, 4096, DispatchDtype::Fp8E4m3, 333);
    c.one_expert = Some(2 * 16 + 5);
    c.chunk = 32;
    c.spp = 2;
    check_case(&dev, &c);
    // num_worst_tokens (no host sync), with expert alignment and many -1 entries.
    let mut c = Case::new(4, 7168, DispatchDtype::Fp8E4m3, 250);
    c.worst = Some(4 * 250);
    c.align = 128;
    c.drop_pct = 40;
    check_case(&dev, &c);
    // One slot per peer, 1-token chunks: every chunk waits for a credit.
    let mut c = Case::new(2, 2048, DispatchDtype::Bf16, 64);
    c.chunk = 1;
    c.spp = 1;
    check_case(&dev, &c);
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn combine_of_dispatch_is_x_times_destination_ranks() {
    let Some(dev) = gpu() else { return };
    let c = Case::new(4, 4096, DispatchDtype::Bf16, 300);
    let cap = c.tokens.iter().sum::<usize>();
    let mut inputs = make_inputs(&c, cap);
    for i in inputs.iter_mut() {
        i.combine_x = None; // combine sends recv_x back
        i.combine_weights = None;
    }
    let settings = c.settings(&dev);
    let mut ranks = NormalGpuRank::local_group(&dev, &settings).unwrap();
    let mut bufs: Vec<RankBuffers> =
        ranks.iter().zip(&inputs).map(|(r, i)| RankBuffers::new(r, i, cap).unwrap()).collect();
    let res = run_all(&mut ranks, &mut bufs, StepOptions::default());
    for (r, x) in res.into_iter().enumerate() {
        x.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
    let (h, k, l) = (c.hidden, c.topk, c.experts / c.ranks);
    for (r, (b, inp)) in bufs.iter().zip(&inputs).enumerate() {
        let got: Vec<u16> = b.combined_x.to_vec().unwrap();
        let x16 = as_u16(&inp.x);
        let x: &[u16] = &x16;
        for t in 0..inp.num_tokens {
            let row = &inp.topk_idx[t * k..(t + 1) * k];
            let mut dst: Vec<i64> =
                row.iter().filter(|&&e| e >= 0).map(|&e| e / l as i64).collect();
            dst.sort();
            dst.dedup();
            let n = dst.len() as f32;
            for ch in 0..h {
                let want = f32_to_bf16(fabric_ep::protocol::quant::bf16_to_f32(x[t * h + ch]) * n);
                assert_eq!(got[t * h + ch], want, "rank {r} token {t} channel {ch} (x{n})");
            }
        }
    }
    eprintln!("ok: combine(dispatch(x)) == x * destination ranks, 4 ranks x 300 tokens");
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn stalled_peer_is_a_typed_timeout_naming_it() {
    let Some(dev) = gpu() else { return };
    let mut c = Case::new(2, 2048, DispatchDtype::Bf16, 200);
    c.spp = 2;
    let inputs = make_inputs(&c, 400);
    let mut settings = c.settings(&dev);
    settings.timeout = Duration::from_millis(300);
    // 1. Rank 1 never runs notify: rank 0's notify waits for it.
    let mut ranks = NormalGpuRank::local_group(&dev, &settings).unwrap();
    let mut b0 = RankBuffers::new(&ranks[0], &inputs[0], 400).unwrap();
    let e = step(&mut ranks[0], &mut b0, StepOptions::default()).unwrap_err();
    match &e {
        Error::Cuda(CudaError::Device {
            peer: Some(1),
            phase: 1,
            what: "WAIT_TIMEOUT",
            rank: 0,
            ..
        }) => {}
        other => panic!("expected a notify timeout naming peer 1, got {other:?}"),
    }
    eprintln!("timeout path (notify): {e}");
    // 2. Both notify, then rank 1 stalls: rank 0's dispatch names it.
    let mut ranks = NormalGpuRank::local_group(&dev, &settings).unwrap();
    let mut bufs: Vec<RankBuffers> =
        ranks.iter().zip(&inputs).map(|(r, i)| RankBuffers::new(r, i, 400).unwrap()).collect();
    let worst = Some(400);
    let res = std::thread::scope(|s| {
        let mut it = ranks.iter_mut().zip(bufs.iter_mut());
        let (r0, b0) = it.next().unwrap();
        let (r1, b1) = it.next().unwrap();
        let h1 = s.spawn(move || {
            // SAFETY: b1 outlives the finish below.
            unsafe { fabric_ep::ep::normal_gpu::harness::launch_notify(r1, b1, 1, 400) }?;
            r1.finish(&b1.stream)
        });
        let o = StepOptions { num_worst_tokens: worst, skip_combine: true, ..Default::default() };
        let r = step(r0, b0, o);
        h1.join().unwrap().unwrap();
        r
    });
    match &res {
        Err(Error::Cuda(CudaError::Device {
            peer: Some(1),
            phase: 2 | 3,
            what: "WAIT_TIMEOUT",
            ..
        })) => {}
        other => panic!("expected a dispatch timeout naming peer 1, got {other:?}"),
    }
    eprintln!("timeout path (dispatch): {}", res.unwrap_err());
    // 3. After reset on every rank, the group works again.
    for r in ranks.iter_mut() {
        r.reset().unwrap();
    }
    let res = run_all(&mut ranks, &mut bufs, StepOptions::default());
    for (r, x) in res.into_iter().enumerate() {
        x.unwrap_or_else(|e| panic!("after reset, rank {r}: {e}"));
    }
    eprintln!("ok: group usable again after reset");
}
