//! Normal mode on the host backend, end to end through Buffer -> ring -> proxy -> transport:
//! ranks as threads (loopback with reordering and EAGAIN injection, and libfabric providers with
//! node splits), checked against the single-process reference built from every rank's inputs.
//! Processes: tests/ep_normal_host_multiproc.rs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ep_bench::ep::{check_dispatch, combine_input, rank_inputs, NormalBenchParams, RankInputs};
use fabric_ep::bootstrap::{Bootstrap, InProcGroup};
use fabric_ep::ep::buffer::{
    Backend, Buffer, BufferOptions, CombineArgs, DispatchArgs, OwnedTokens, Tokens,
};
use fabric_ep::protocol::config::{DispatchDtype, EpConfig, EpSettings};
use fabric_ep::protocol::quant::{bf16_to_f32, f32_to_bf16};
use fabric_ep::protocol::reference as refm;
use fabric_ep::proxy::LoopbackOptions;
use fabric_ep::Error;

#[derive(Clone, Debug)]
enum Net {
    Loopback(LoopbackOptions),
    Fabric(&'static str),
}

#[derive(Clone, Debug)]
struct Case {
    num_ranks: usize,
    ranks_per_node: usize,
    experts: usize,
    hidden: usize,
    topk: usize,
    fp8: bool,
    chunk_tokens: usize,
    slots_per_peer: usize,
    /// Tokens per rank (cycled).
    tokens: Vec<usize>,
    /// Every selected expert replaced by this one (all tokens to one expert).
    one_expert: Option<i64>,
    net: Net,
    timeout: Duration,
}

impl Case {
    fn new(num_ranks: usize, ranks_per_node: usize, net: Net) -> Self {
        Case {
            num_ranks,
            ranks_per_node,
            experts: 4 * num_ranks,
            hidden: 256,
            topk: 4,
            fp8: false,
            chunk_tokens: 8,
            slots_per_peer: 2,
            tokens: vec![40, 0, 23, 57, 5],
            one_expert: None,
            net,
            timeout: Duration::from_secs(30),
        }
    }

    fn settings(&self, rank: usize) -> EpSettings {
        let mut s = EpSettings::new(rank, self.num_ranks, self.experts, self.hidden, self.topk);
        s.ranks_per_node = self.ranks_per_node;
        s.chunk_tokens = self.chunk_tokens;
        s.slots_per_peer = self.slots_per_peer;
        s.timeout = self.timeout;
        if self.fp8 {
            s.dispatch_dtype = DispatchDtype::Fp8E4m3;
        }
        s
    }

    fn inputs(&self, cfg: &EpConfig) -> Vec<RankInputs> {
        (0..self.num_ranks)
            .map(|r| {
                let p = NormalBenchParams {
                    num_tokens: self.tokens[r % self.tokens.len()],
                    seed: 77 + r as u64,
                    drop_pct: 10,
                    iters: 1,
                    warmup: 0,
                    combine_weights: true,
                    one_way: false,
                };
                let mut inp = rank_inputs(cfg, &p, r).unwrap();
                if let Some(e) = self.one_expert {
                    for (i, g) in inp.topk_idx.iter_mut().enumerate() {
                        *g = if i % self.topk == 0 { e } else { -1 };
                    }
                }
                inp
            })
            .collect()
    }
}

/// Runs `body` on every rank (threads); returns each rank's result.
fn run_ranks<T: Send>(
    case: &Case,
    body: impl Fn(usize, &mut Buffer) -> Result<T, Error> + Sync,
) -> Vec<Result<T, Error>> {
    let boots =
        InProcGroup::new(case.num_ranks, case.ranks_per_node, Duration::from_secs(60)).unwrap();
    let cfg0 = EpConfig::new(case.settings(0)).unwrap();
    let group = match &case.net {
        Net::Loopback(o) => Some(Buffer::loopback_group(&cfg0, *o).unwrap()),
        Net::Fabric(_) => None,
    };
    std::thread::scope(|s| {
        let hs: Vec<_> = boots
            .into_iter()
            .enumerate()
            .map(|(rank, boot)| {
                let body = &body;
                let group = group.clone();
                s.spawn(move || {
                    let cfg = EpConfig::new(case.settings(rank))?;
                    let opts = match (&case.net, group) {
                        (Net::Fabric(p), _) => BufferOptions::host(p),
                        (_, Some(g)) => BufferOptions::loopback(g),
                        _ => unreachable!(),
                    };
                    let boot: Arc<dyn Bootstrap> = Arc::new(boot);
                    let mut buf = Buffer::new(cfg, boot, opts)?;
                    let out = body(rank, &mut buf)?;
                    buf.destroy()?;
                    Ok(out)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
    })
}

/// The whole normal-mode contract on one case: fresh dispatch == reference, cached-handle
/// dispatch == fresh, combine == reference, combine(dispatch(x)) == x * destination ranks,
/// num_worst_tokens (fixed rows, zero padding).
fn full_check(case: &Case) {
    let t = Instant::now();
    let cfg0 = EpConfig::new(case.settings(0)).unwrap();
    let inputs = case.inputs(&cfg0);
    let params = |worst: Option<usize>| refm::NormalParams {
        num_experts: case.experts,
        hidden: case.hidden,
        num_topk: case.topk,
        expert_alignment: 4,
        num_worst_tokens: worst,
    };
    let rin: Vec<refm::NormalRankInput> = inputs
        .iter()
        .map(|i| refm::NormalRankInput {
            x: i.tokens(),
            topk_idx: &i.topk_idx,
            topk_weights: &i.topk_weights,
        })
        .collect();
    let want = refm::normal_dispatch(&params(None), &rin).unwrap();
    let worst = want.iter().map(|w| w.num_recv_tokens).max().unwrap() + 3;
    let want_worst = refm::normal_dispatch(&params(Some(worst)), &rin).unwrap();
    let xs: Vec<Vec<u16>> =
        want.iter().map(|o| combine_input(&o.recv_x, case.hidden).unwrap()).collect();
    let cin: Vec<refm::NormalCombineInput> = want
        .iter()
        .zip(&xs)
        .map(|(o, x)| refm::NormalCombineInput { x, topk_weights: Some(&o.recv_topk_weights) })
        .collect();
    let want_c = refm::normal_combine(&params(None), &want, &cin).unwrap();
    let l = case.experts / case.num_ranks;

    let results = run_ranks(case, |rank, buf| {
        let me = &inputs[rank];
        let layout = buf.get_dispatch_layout(&me.topk_idx)?;
        let args = DispatchArgs {
            x: me.tokens(),
            topk_idx: Some(&me.topk_idx),
            topk_weights: Some(&me.topk_weights),
            layout: Some(&layout),
            expert_alignment: 4,
            ..DispatchArgs::default()
        };
        let out = buf.dispatch(&args)?;
        check_dispatch(rank, &out, &want[rank])?;
        // Cached handle: same tokens, no notify, same result.
        let cached =
            buf.dispatch(&DispatchArgs { layout: None, handle: Some(&out.handle), ..args })?;
        assert_eq!(cached, out, "rank {rank}: cached-handle dispatch differs from fresh");
        // Combine with weights against the reference.
        let x = combine_input(&out.recv_x, case.hidden)?;
        let c = buf.combine(&CombineArgs {
            x: &x,
            handle: &out.handle,
            topk_weights: Some(&out.recv_topk_weights),
        })?;
        assert_eq!(c.combined_x, want_c[rank].combined_x, "rank {rank}: combined_x");
        assert_eq!(c.combined_topk_weights, want_c[rank].combined_topk_weights, "rank {rank}");
        // DeepEP's check: combine(dispatch(x)) == x * (destination ranks of the token).
        if !case.fp8 {
            let h = case.hidden;
            for tok in 0..me.topk_idx.len() / case.topk {
                let row = &me.topk_idx[tok * case.topk..(tok + 1) * case.topk];
                let mut ranks: Vec<i64> =
                    row.iter().filter(|&&g| g >= 0).map(|&g| g / l as i64).collect();
                ranks.sort();
                ranks.dedup();
                let n = ranks.len() as f32;
                for ch in 0..h {
                    let want = f32_to_bf16(bf16_to_f32(me.x_bf16[tok * h + ch]) * n);
                    assert_eq!(c.combined_x[tok * h + ch], want, "rank {rank} token {tok}");
                }
            }
        }
        // num_worst_tokens: fixed-size outputs, padding zero / -1.
        let w = buf.dispatch(&DispatchArgs { num_worst_tokens: Some(worst), ..args })?;
        assert_eq!(w.recv_x, want_worst[rank].recv_x, "rank {rank}: worst recv_x");
        assert_eq!(w.recv_topk_idx, want_worst[rank].recv_topk_idx, "rank {rank}");
        assert_eq!(w.num_recv_tokens, want[rank].num_recv_tokens);
        // Combine accepts the padded rows and ignores the padding.
        let xw = combine_input(&w.recv_x, case.hidden)?;
        let cw = buf.combine(&CombineArgs {
            x: &xw,
            handle: &w.handle,
            topk_weights: Some(&w.recv_topk_weights),
        })?;
        assert_eq!(cw, c, "rank {rank}: combine of padded rows");
        Ok(buf.registered_bytes())
    });
    for (rank, r) in results.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("{case:?}: rank {rank}: {e}"));
    }
    eprintln!(
        "{} ranks ({} per node) over {:?}, fp8 {}: ok in {:?}",
        case.num_ranks,
        case.ranks_per_node,
        case.net,
        case.fp8,
        t.elapsed()
    );
}

fn shuffled() -> Net {
    Net::Loopback(LoopbackOptions { eagain_every: 7, reorder_seed: Some(3), max_outstanding: 64 })
}

#[test]
fn threads_loopback_2_4_8_16_unordered() {
    for (n, rpn) in [(2, 2), (4, 2), (8, 4), (16, 4)] {
        full_check(&Case::new(n, rpn, shuffled()));
    }
}

#[test]
fn threads_loopback_fp8_and_one_slot() {
    let mut c = Case::new(4, 4, shuffled());
    c.fp8 = true;
    full_check(&c);
    let mut c = Case::new(4, 2, shuffled());
    c.slots_per_peer = 1;
    c.chunk_tokens = 3;
    full_check(&c);
}

#[test]
fn threads_loopback_zero_tokens_and_one_expert() {
    let mut c = Case::new(4, 2, shuffled());
    c.tokens = vec![0, 0, 0, 0];
    full_check(&c);
    let mut c = Case::new(4, 2, shuffled());
    c.one_expert = Some(5); // rank 1's local expert 1
    c.tokens = vec![30, 0, 17, 9];
    full_check(&c);
}

#[test]
fn threads_over_libfabric_with_node_splits() {
    let mut c = Case::new(8, 4, Net::Fabric("shm"));
    c.tokens = vec![20, 0, 11, 30];
    full_check(&c);
    let mut c = Case::new(4, 2, Net::Fabric("tcp;ofi_rxm"));
    c.fp8 = true;
    full_check(&c);
    let c = Case::new(4, 2, Net::Fabric("udp;ofi_rxd"));
    full_check(&c);
}

#[test]
fn threads_16_ranks_over_shm_4_nodes() {
    let mut c = Case::new(16, 4, Net::Fabric("shm"));
    c.tokens = vec![12, 0, 7];
    c.hidden = 128;
    full_check(&c);
}

#[test]
fn threads_32_ranks_buffers_do_not_grow() {
    let mut c = Case::new(32, 8, Net::Loopback(LoopbackOptions::default()));
    c.hidden = 64;
    c.topk = 2;
    let mut sizes = Vec::new();
    for tokens in [4usize, 64] {
        c.tokens = vec![tokens];
        let cfg0 = EpConfig::new(c.settings(0)).unwrap();
        let inputs = c.inputs(&cfg0);
        let res = run_ranks(&c, |rank, buf| {
            let me = &inputs[rank];
            let out = buf.dispatch(&DispatchArgs {
                x: me.tokens(),
                topk_idx: Some(&me.topk_idx),
                topk_weights: Some(&me.topk_weights),
                ..DispatchArgs::default()
            })?;
            let x = combine_input(&out.recv_x, c.hidden)?;
            buf.combine(&CombineArgs { x: &x, handle: &out.handle, topk_weights: None })?;
            Ok(buf.registered_bytes())
        });
        let bytes: Vec<u64> = res.into_iter().map(|r| r.unwrap()).collect();
        assert!(bytes.iter().all(|&b| b == bytes[0]));
        sizes.push(bytes[0]);
    }
    assert_eq!(sizes[0], sizes[1], "registered bytes grew with the token count");
    // Per rank the buffers are linear in the rank count (per-peer queues), not quadratic.
    let per = |r: usize| {
        let mut s = EpSettings::new(0, r, 4 * r, 7168, 8);
        s.ranks_per_node = 8.min(r);
        EpConfig::new(s).unwrap().normal_recv_bytes()
    };
    assert_eq!(per(64), 2 * per(32));
    assert_eq!(per(256), 8 * per(32));
}

fn two_rank_case() -> Case {
    Case::new(2, 2, Net::Loopback(LoopbackOptions::default()))
}

fn arg_of(e: &Error) -> &'static str {
    match e {
        Error::InvalidArgument { arg, .. } => arg,
        other => panic!("expected an argument error, got {other}"),
    }
}

#[test]
fn bad_input_is_a_typed_error_before_anything_is_sent() {
    let case = two_rank_case();
    let cfg0 = EpConfig::new(case.settings(0)).unwrap();
    let inputs = case.inputs(&cfg0);
    let res = run_ranks(&case, |rank, buf| {
        let me = &inputs[rank];
        let good = DispatchArgs {
            x: me.tokens(),
            topk_idx: Some(&me.topk_idx),
            topk_weights: Some(&me.topk_weights),
            ..DispatchArgs::default()
        };
        if rank == 0 {
            let h = case.hidden;
            let short = &me.x_bf16[..me.x_bf16.len() - 1];
            let e = buf.dispatch(&DispatchArgs { x: Tokens::Bf16(short), ..good }).unwrap_err();
            assert_eq!(arg_of(&e), "x", "{e}");
            let fewer = &me.x_bf16[..me.x_bf16.len() - h];
            let e = buf.dispatch(&DispatchArgs { x: Tokens::Bf16(fewer), ..good }).unwrap_err();
            assert_eq!(arg_of(&e), "topk_idx", "{e}");
            let fp8 = vec![0u8; me.x_bf16.len()];
            let sc = vec![1f32; me.x_bf16.len() / 128];
            let e = buf
                .dispatch(&DispatchArgs { x: Tokens::Fp8 { x: &fp8, scales: &sc }, ..good })
                .unwrap_err();
            assert_eq!(arg_of(&e), "x", "fp8 on a bf16 buffer: {e}");
            let mut idx = me.topk_idx.clone();
            idx[3] = case.experts as i64;
            let e = buf.dispatch(&DispatchArgs { topk_idx: Some(&idx), ..good }).unwrap_err();
            assert_eq!(arg_of(&e), "topk_idx", "{e}");
            idx[3] = -2;
            let e = buf.dispatch(&DispatchArgs { topk_idx: Some(&idx), ..good }).unwrap_err();
            assert_eq!(arg_of(&e), "topk_idx", "{e}");
            let w = &me.topk_weights[1..];
            let e = buf.dispatch(&DispatchArgs { topk_weights: Some(w), ..good }).unwrap_err();
            assert_eq!(arg_of(&e), "topk_weights", "{e}");
            let e = buf.dispatch(&DispatchArgs { topk_idx: None, ..good }).unwrap_err();
            assert_eq!(arg_of(&e), "topk_idx", "{e}");
            let e = buf.dispatch(&DispatchArgs { expert_alignment: 0, ..good }).unwrap_err();
            assert_eq!(arg_of(&e), "expert_alignment", "{e}");
            let mut lay = buf.get_dispatch_layout(&me.topk_idx)?;
            lay.num_tokens_per_rank[1] += 1;
            let e = buf.dispatch(&DispatchArgs { layout: Some(&lay), ..good }).unwrap_err();
            assert_eq!(arg_of(&e), "layout", "{e}");
        }
        // Nothing was sent: a normal dispatch + combine still works on both ranks.
        let out = buf.dispatch(&good)?;
        // Handle misuse: more tokens than the handle's, and a too-small num_worst_tokens.
        let two = [me.x_bf16.clone(), vec![0u16; case.hidden]].concat();
        let e = buf
            .dispatch(&DispatchArgs {
                x: Tokens::Bf16(&two),
                topk_idx: None,
                topk_weights: None,
                handle: Some(&out.handle),
                ..good
            })
            .unwrap_err();
        assert_eq!(arg_of(&e), "x", "{e}");
        if out.num_recv_tokens > 0 {
            let e = buf
                .dispatch(&DispatchArgs {
                    handle: Some(&out.handle),
                    num_worst_tokens: Some(out.num_recv_tokens - 1),
                    ..good
                })
                .unwrap_err();
            assert_eq!(arg_of(&e), "num_worst_tokens", "{e}");
        }
        let x = combine_input(&out.recv_x, case.hidden)?;
        let e = buf
            .combine(&CombineArgs { x: &x[1..], handle: &out.handle, topk_weights: None })
            .unwrap_err();
        assert_eq!(arg_of(&e), "x", "{e}");
        let e = buf
            .combine(&CombineArgs { x: &x, handle: &out.handle, topk_weights: Some(&[1.0]) })
            .unwrap_err();
        assert_eq!(arg_of(&e), "topk_weights", "{e}");
        buf.combine(&CombineArgs { x: &x, handle: &out.handle, topk_weights: None })?;
        Ok(())
    });
    for r in res {
        r.unwrap();
    }
    // hidden that the layout cannot take: fp8 needs a multiple of 128.
    let mut s = case.settings(0);
    s.hidden = 200;
    s.dispatch_dtype = DispatchDtype::Fp8E4m3;
    assert_eq!(arg_of(&EpConfig::new(s).unwrap_err()), "hidden");
    let mut s = case.settings(0);
    s.hidden = 12;
    assert_eq!(arg_of(&EpConfig::new(s).unwrap_err()), "hidden");
}

#[test]
fn gpu_backend_is_refused_clearly() {
    let boot: Arc<dyn Bootstrap> =
        Arc::new(InProcGroup::new(1, 1, Duration::from_secs(5)).unwrap().remove(0));
    let cfg = EpConfig::new(EpSettings::new(0, 1, 4, 128, 2)).unwrap();
    let opts = BufferOptions { backend: Backend::Gpu, ..BufferOptions::host("shm") };
    let e = Buffer::new(cfg, boot, opts).unwrap_err();
    assert_eq!(arg_of(&e), "backend");
}

#[test]
fn config_mismatch_names_the_rank() {
    let boots = InProcGroup::new(2, 2, Duration::from_secs(10)).unwrap();
    let cfg0 = EpConfig::new(EpSettings::new(0, 2, 8, 128, 2)).unwrap();
    let group = Buffer::loopback_group(&cfg0, LoopbackOptions::default()).unwrap();
    let res: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = boots
            .into_iter()
            .enumerate()
            .map(|(rank, boot)| {
                let group = group.clone();
                s.spawn(move || {
                    let mut st = EpSettings::new(rank, 2, 8, 128, 2);
                    if rank == 1 {
                        st.chunk_tokens = 32; // same buffer size class, different protocol
                    }
                    let cfg = EpConfig::new(st).unwrap();
                    Buffer::new(cfg, Arc::new(boot), BufferOptions::loopback(group)).map(|_| ())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, r) in res.into_iter().enumerate() {
        match r {
            Err(Error::ConfigMismatch(msg)) => {
                let other = 1 - rank;
                assert!(msg.contains(&format!("rank {other}")), "rank {rank}: {msg}");
            }
            other => panic!("rank {rank}: expected ConfigMismatch, got {other:?}"),
        }
    }
}

#[test]
fn stalled_peer_is_named_within_the_timeout() {
    for net in [Net::Loopback(LoopbackOptions::default()), Net::Fabric("tcp;ofi_rxm")] {
        let mut case = Case::new(3, 3, net);
        case.timeout = Duration::from_secs(2);
        let cfg0 = EpConfig::new(case.settings(0)).unwrap();
        let inputs = case.inputs(&cfg0);
        let t = Instant::now();
        let res = run_ranks(&case, |rank, buf| {
            let me = &inputs[rank];
            if rank == 2 {
                // Stalls: never dispatches, stays alive past everyone's timeout.
                std::thread::sleep(Duration::from_secs(4));
                return Ok(());
            }
            match buf.dispatch(&DispatchArgs {
                x: me.tokens(),
                topk_idx: Some(&me.topk_idx),
                topk_weights: Some(&me.topk_weights),
                ..DispatchArgs::default()
            }) {
                Err(Error::Timeout { peers, rank: r, .. }) => {
                    assert_eq!(r, rank);
                    assert_eq!(peers, vec![2], "rank {rank}");
                    // The buffer refuses further calls instead of hanging.
                    let again = buf.dispatch(&DispatchArgs {
                        x: me.tokens(),
                        topk_idx: Some(&me.topk_idx),
                        topk_weights: Some(&me.topk_weights),
                        ..DispatchArgs::default()
                    });
                    assert!(again.is_err());
                    Ok(())
                }
                other => panic!("rank {rank}: expected a timeout naming rank 2, got {other:?}"),
            }
        });
        // destroy()'s barrier completes once rank 2 wakes up; every rank returns.
        for r in res {
            r.unwrap();
        }
        assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
        eprintln!("{:?}: stalled peer named in {:?}", case.net, t.elapsed());
    }
}

#[test]
fn fp8_recv_scales_travel() {
    let mut c = Case::new(2, 1, shuffled());
    c.fp8 = true;
    c.tokens = vec![9, 3];
    let cfg0 = EpConfig::new(c.settings(0)).unwrap();
    let inputs = c.inputs(&cfg0);
    let res = run_ranks(&c, |rank, buf| {
        let me = &inputs[rank];
        let out = buf.dispatch(&DispatchArgs {
            x: me.tokens(),
            topk_idx: Some(&me.topk_idx),
            topk_weights: Some(&me.topk_weights),
            ..DispatchArgs::default()
        })?;
        match &out.recv_x {
            OwnedTokens::Fp8 { x, scales } => {
                assert_eq!(x.len(), out.num_recv_tokens * c.hidden);
                assert_eq!(scales.len(), out.num_recv_tokens * c.hidden / 128);
                assert!(scales.iter().all(|&s| s > 0.0));
            }
            OwnedTokens::Bf16(_) => panic!("fp8 buffer returned bf16"),
        }
        Ok(())
    });
    for r in res {
        r.unwrap();
    }
}
