//! DeepEP's internode hierarchy (`ep::hier`) on the host backend, ranks as threads over libfabric
//! providers with node splits: dispatch equals the direct path's reference exactly, combine the
//! node-grouped sum, cached handle, num_worst_tokens, expert_alignment, zero-token ranks, and
//! settings the hierarchy refuses.

use std::sync::Arc;
use std::time::Duration;

use ep_bench::ep::{
    check_dispatch_view, combine_input, rank_inputs, reference_grouped, run_normal,
    run_normal_hier, DispatchView, InternodeBytes, NormalBenchParams, RankInputs,
};
use fabric_ep::bootstrap::{Bootstrap, InProcGroup};
use fabric_ep::ep::buffer::{Backend, Buffer, BufferOptions};
use fabric_ep::ep::hier::{HierBuffer, HierDispatchArgs};
use fabric_ep::ep::hier_gpu::GpuHierBuffer;
use fabric_ep::protocol::config::{DispatchDtype, EpConfig, EpSettings};
use fabric_ep::protocol::quant::{bf16_to_f32, f32_to_bf16};
use fabric_ep::protocol::reference as refm;
use fabric_ep::Error;

#[derive(Clone, Debug)]
struct Case {
    nodes: usize,
    rpn: usize,
    provider: &'static str,
    fp8: bool,
    /// Tokens per rank (cycled).
    tokens: Vec<usize>,
}

impl Case {
    fn world(&self) -> usize {
        self.nodes * self.rpn
    }
    fn settings(&self, rank: usize) -> EpSettings {
        let mut s = EpSettings::new(rank, self.world(), 4 * self.world(), 256, 4);
        s.ranks_per_node = self.rpn;
        s.chunk_tokens = 8;
        s.slots_per_peer = 2;
        s.timeout = Duration::from_secs(30);
        if self.fp8 {
            s.dispatch_dtype = DispatchDtype::Fp8E4m3;
        }
        s
    }
    fn inputs(&self, cfg: &EpConfig) -> Vec<RankInputs> {
        (0..self.world())
            .map(|r| {
                let p = params(self.tokens[r % self.tokens.len()], 31 + r as u64);
                rank_inputs(cfg, &p, r).unwrap()
            })
            .collect()
    }
}

fn params(num_tokens: usize, seed: u64) -> NormalBenchParams {
    NormalBenchParams {
        num_tokens,
        seed,
        drop_pct: 10,
        iters: 2,
        warmup: 1,
        combine_weights: true,
        one_way: false,
    }
}

/// Runs `body` on every rank of `case` (threads, each with its own HierBuffer).
fn run_ranks<T: Send>(
    case: &Case,
    body: impl Fn(usize, &mut HierBuffer) -> Result<T, Error> + Sync,
) -> Vec<Result<T, Error>> {
    let boots = InProcGroup::new(case.world(), case.rpn, Duration::from_secs(60)).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = boots
            .into_iter()
            .enumerate()
            .map(|(rank, boot)| {
                let body = &body;
                s.spawn(move || {
                    let cfg = EpConfig::new(case.settings(rank))?;
                    let boot: Arc<dyn Bootstrap> = Arc::new(boot);
                    let mut buf = HierBuffer::new(cfg, boot, BufferOptions::host(case.provider))?;
                    let out = body(rank, &mut buf)?;
                    buf.destroy()?;
                    Ok(out)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
    })
}

/// Fresh dispatch == the direct reference (expert_alignment 4), cached == fresh, combine == the
/// node-grouped reference, num_worst_tokens pads (and refuses too few rows).
fn full_check(case: &Case) {
    let cfg0 = EpConfig::new(case.settings(0)).unwrap();
    let inputs = case.inputs(&cfg0);
    let (want, want_c) = reference_grouped(&cfg0, &inputs, (4, None, true), case.rpn).unwrap();
    let worst = want.iter().map(|w| w.num_recv_tokens).max().unwrap() + 3;
    let (want_worst, _) =
        reference_grouped(&cfg0, &inputs, (4, Some(worst), true), case.rpn).unwrap();
    // "Expert outputs" that differ per rank (each rank scales what it returns), so the node's
    // partial is a sum of different values and its bf16 rounding shows: the grouped reference
    // must then differ from the direct sum somewhere (else this case could not tell them apart).
    let scaled = |rank: usize, x: &[u16]| -> Vec<u16> {
        let f = 1.0 + 0.13 * (rank + 1) as f32;
        x.iter().map(|&v| f32_to_bf16(bf16_to_f32(v) * f)).collect()
    };
    let xs: Vec<Vec<u16>> = want
        .iter()
        .enumerate()
        .map(|(r, o)| scaled(r, &combine_input(&o.recv_x, case.hidden()).unwrap()))
        .collect();
    let cin: Vec<refm::NormalCombineInput> = want
        .iter()
        .zip(&xs)
        .map(|(o, x)| refm::NormalCombineInput { x, topk_weights: Some(&o.recv_topk_weights) })
        .collect();
    let p = refm::NormalParams {
        num_experts: cfg0.num_experts,
        hidden: case.hidden(),
        num_topk: cfg0.num_topk,
        expert_alignment: 4,
        num_worst_tokens: None,
    };
    let want_s = refm::normal_combine_grouped(&p, &want, &cin, case.rpn).unwrap();
    let direct_s = refm::normal_combine(&p, &want, &cin).unwrap();
    if case.nodes > 1 && case.rpn > 1 {
        assert_ne!(want_s, direct_s, "{case:?}: grouping changes no sum; the check is blind");
    }
    let results = run_ranks(case, |rank, buf| {
        let me = &inputs[rank];
        let args = HierDispatchArgs {
            x: me.tokens(),
            topk_idx: Some(&me.topk_idx),
            topk_weights: Some(&me.topk_weights),
            expert_alignment: 4,
            ..HierDispatchArgs::default()
        };
        let out = buf.dispatch(&args)?;
        check_dispatch_view(rank, &DispatchView::hier(&out), &want[rank])?;
        let cached = buf.dispatch(&HierDispatchArgs {
            topk_idx: None,
            topk_weights: None,
            handle: Some(&out.handle),
            ..args
        })?;
        assert_eq!(cached.recv_x, out.recv_x, "rank {rank}: cached-handle recv_x");
        assert!(cached.recv_topk_idx.is_empty(), "a cached dispatch returns no top-k");
        assert_eq!(cached.num_recv_tokens_per_expert, out.num_recv_tokens_per_expert);
        let x = combine_input(&out.recv_x, case.hidden())?;
        let c = buf.combine(&x, &out.handle, Some(&out.recv_topk_weights))?;
        assert_eq!(c.combined_x, want_c[rank].combined_x, "rank {rank}: combined_x");
        assert_eq!(c.combined_topk_weights, want_c[rank].combined_topk_weights, "rank {rank}");
        let cs = buf.combine(&scaled(rank, &x), &out.handle, Some(&out.recv_topk_weights))?;
        assert_eq!(
            cs.combined_x, want_s[rank].combined_x,
            "rank {rank}: scaled rows, node-grouped"
        );
        assert_eq!(cs.combined_topk_weights, want_s[rank].combined_topk_weights, "rank {rank}");
        let w = buf.dispatch(&HierDispatchArgs { num_worst_tokens: Some(worst), ..args })?;
        check_dispatch_view(rank, &DispatchView::hier(&w), &want_worst[rank])?;
        assert_eq!(w.handle.num_out_rows(), worst);
        // Combine takes the padded rows (padding ignored).
        let xw = combine_input(&w.recv_x, case.hidden())?;
        let cw = buf.combine(&xw, &w.handle, None)?;
        assert_eq!(cw.combined_x, want_c[rank].combined_x, "rank {rank}: combine of padded rows");
        let few = buf.dispatch(&HierDispatchArgs { num_worst_tokens: Some(0), ..args });
        let n = want[rank].num_recv_tokens;
        match few {
            Err(Error::InvalidArgument { arg: "num_worst_tokens", .. }) if n > 0 => {}
            Ok(_) if n == 0 => {}
            other => panic!("rank {rank} ({n} rows): num_worst_tokens 0 gave {other:?}"),
        }
        Ok(())
    });
    for (rank, r) in results.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("{case:?} rank {rank}: {e}"));
    }
}

impl Case {
    fn hidden(&self) -> usize {
        256
    }
}

#[test]
fn two_nodes_of_two_over_shm_bf16() {
    full_check(&Case {
        nodes: 2,
        rpn: 2,
        provider: "shm",
        fp8: false,
        tokens: vec![40, 0, 23, 57],
    });
}

#[test]
fn two_nodes_of_four_over_tcp_fp8() {
    full_check(&Case {
        nodes: 2,
        rpn: 4,
        provider: "tcp;ofi_rxm",
        fp8: true,
        tokens: vec![33, 5, 0, 21],
    });
}

#[test]
fn four_nodes_of_two_over_udp_rxd_out_of_order() {
    full_check(&Case {
        nodes: 4,
        rpn: 2,
        provider: "udp;ofi_rxd",
        fp8: false,
        tokens: vec![17, 29, 0],
    });
}

#[test]
fn one_rank_per_node_is_the_rail_alone() {
    full_check(&Case { nodes: 3, rpn: 1, provider: "shm", fp8: true, tokens: vec![12, 0, 30] });
}

/// The bench loop (every iteration checked), and its internode byte counts: the hierarchy's rail
/// stage never sends more across nodes than the direct path, and strictly less in this routing.
#[test]
fn bench_loop_counts_fewer_internode_bytes_than_direct() {
    let case = Case { nodes: 2, rpn: 4, provider: "shm", fp8: true, tokens: vec![64] };
    let res = run_ranks(&case, |rank, buf| {
        let (rep, bytes) = run_normal_hier(buf, &params(64, 5))?;
        assert_eq!(rep.dispatch_s.len(), 2, "rank {rank}: timed iterations");
        // The routing alone gives the same counts (what the GPU bench reports).
        let me = rank_inputs(buf.config(), &params(64, 5), rank)?;
        let of = InternodeBytes::of_routing(buf.config(), &me.topk_idx)?;
        assert_eq!((of.direct, of.hier), (bytes.direct, bytes.hier), "rank {rank}");
        Ok(bytes)
    });
    let mut total = (0, 0);
    for (rank, r) in res.into_iter().enumerate() {
        let b = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert!(b.hier <= b.direct, "rank {rank}: {b:?}");
        assert!(b.hier > 0 && b.hier_forwarded > 0, "rank {rank}: {b:?}");
        total.0 += b.direct;
        total.1 += b.hier;
    }
    assert!(total.1 < total.0, "top-4 of 32 experts over 2 nodes must dedupe: {total:?}");
}

#[test]
fn settings_the_hierarchy_refuses() {
    let boots = InProcGroup::new(1, 1, Duration::from_secs(5)).unwrap();
    let boot: Arc<dyn Bootstrap> = Arc::new(boots.into_iter().next().unwrap());
    let mut s = EpSettings::new(0, 1, 8, 256, 2);
    let cfg = EpConfig::new(s.clone()).unwrap();
    let e = HierBuffer::new(
        cfg.clone(),
        boot.clone(),
        BufferOptions { backend: Backend::Gpu, ..BufferOptions::host("shm") },
    )
    .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { arg: "backend", .. }), "{e}");
    // The GPU hierarchy refuses the host backend's buffers (before touching any GPU).
    let e = GpuHierBuffer::new(cfg.clone(), boot.clone(), BufferOptions::host("shm")).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { arg: "backend", .. }), "{e}");
    s.hidden = 200;
    let e =
        HierBuffer::new(EpConfig::new(s).unwrap(), boot, BufferOptions::host("shm")).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { arg: "hidden", .. }), "{e}");
}

/// Both routings with the network and the node on different providers (`tcp;ofi_rxm` between
/// nodes, `shm` inside one, as NIC and NVLink on GPUs) and the network rate-capped: the direct
/// path through `BufferOptions::intranode_provider` (its SplitTransport) and the hierarchy,
/// every result checked by the bench loop.
#[test]
fn network_and_node_on_different_providers() {
    let case = Case { nodes: 2, rpn: 2, provider: "tcp;ofi_rxm", fp8: false, tokens: vec![48] };
    let boots = InProcGroup::new(case.world(), case.rpn, Duration::from_secs(60)).unwrap();
    // The network capped at 0.5 GB/s per rank: writes held back by the cap (backpressure)
    // must still all arrive, in any order.
    let opts = BufferOptions {
        intranode_provider: Some("shm".to_string()),
        emulate_network_gbps: Some(0.5),
        ..BufferOptions::host(case.provider)
    };
    std::thread::scope(|s| {
        let hs: Vec<_> = boots
            .into_iter()
            .enumerate()
            .map(|(rank, boot)| {
                let (case, opts) = (&case, opts.clone());
                s.spawn(move || -> Result<(), Error> {
                    let cfg = EpConfig::new(case.settings(rank))?;
                    let boot: Arc<dyn Bootstrap> = Arc::new(boot);
                    let mut b = Buffer::new(cfg.clone(), boot.clone(), opts.clone())?;
                    let rep = run_normal(&mut b, &params(48, 9))?;
                    assert_eq!(rep.dispatch_s.len(), 2);
                    b.destroy()?;
                    let mut h = HierBuffer::new(cfg, boot, opts)?;
                    run_normal_hier(&mut h, &params(48, 9))?;
                    h.destroy()
                })
            })
            .collect();
        for (rank, h) in hs.into_iter().enumerate() {
            h.join().expect("rank thread").unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        }
    });
}

/// Ranks that disagree on `intranode_provider` fail at connect, each with a ConfigMismatch
/// naming it: direct buffers and hierarchical ones.
#[test]
fn ranks_that_disagree_on_the_intranode_provider_fail_at_connect() {
    for hier in [false, true] {
        disagree_on_intranode_provider(hier);
    }
}

fn disagree_on_intranode_provider(hier: bool) {
    let case = Case { nodes: 2, rpn: 1, provider: "shm", fp8: false, tokens: vec![4] };
    let boots = InProcGroup::new(2, 1, Duration::from_secs(20)).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = boots
            .into_iter()
            .enumerate()
            .map(|(rank, boot)| {
                let case = &case;
                s.spawn(move || {
                    let cfg = EpConfig::new(case.settings(rank)).unwrap();
                    let mut opts = BufferOptions::host("shm");
                    if rank == 1 {
                        opts.intranode_provider = Some("shm".to_string());
                    }
                    if hier {
                        HierBuffer::new(cfg, Arc::new(boot), opts).map(|_| ())
                    } else {
                        Buffer::new(cfg, Arc::new(boot), opts).map(|_| ())
                    }
                })
            })
            .collect();
        for (rank, h) in hs.into_iter().enumerate() {
            match h.join().expect("rank thread") {
                Err(Error::ConfigMismatch(m)) => assert!(m.contains("intranode_provider"), "{m}"),
                other => panic!("rank {rank} (hierarchy {hier}): {other:?}"),
            }
        }
    });
}

/// A rank that never dispatches: every other rank gets a timeout within its bound, naming job
/// ranks (not the stages' sub-ranks): rank 3's rail partner (rank 1) and node partner (rank 2)
/// name rank 3.
#[test]
fn a_stalled_rank_is_named_in_job_ranks() {
    let case = Case { nodes: 2, rpn: 2, provider: "shm", fp8: false, tokens: vec![24] };
    let boots = InProcGroup::new(4, 2, Duration::from_secs(60)).unwrap();
    let cfg0 = EpConfig::new(case.settings(0)).unwrap();
    let inputs = case.inputs(&cfg0);
    let t0 = std::time::Instant::now();
    let errs: Vec<Option<Error>> = std::thread::scope(|s| {
        let hs: Vec<_> = boots
            .into_iter()
            .enumerate()
            .map(|(rank, boot)| {
                let (case, inputs) = (&case, &inputs);
                s.spawn(move || {
                    let mut st = case.settings(rank);
                    st.timeout = Duration::from_secs(2);
                    let cfg = EpConfig::new(st).unwrap();
                    let boot: Arc<dyn Bootstrap> = Arc::new(boot);
                    let mut buf = HierBuffer::new(cfg, boot, BufferOptions::host("shm")).unwrap();
                    if rank == 3 {
                        std::thread::sleep(Duration::from_secs(5));
                        return None;
                    }
                    let me = &inputs[rank];
                    let r = buf.dispatch(&HierDispatchArgs {
                        x: me.tokens(),
                        topk_idx: Some(&me.topk_idx),
                        topk_weights: Some(&me.topk_weights),
                        ..HierDispatchArgs::default()
                    });
                    Some(r.err().unwrap_or_else(|| panic!("rank {rank}: dispatch without rank 3")))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
    for (rank, e) in errs.iter().enumerate().take(3) {
        match e {
            Some(Error::Timeout { rank: r, peers, detail, .. }) => {
                assert_eq!(*r, rank, "the error names this rank in job ranks");
                assert!(!peers.is_empty() && !peers.contains(&rank), "rank {rank}: {peers:?}");
                if rank > 0 {
                    assert_eq!(peers, &vec![3], "rank {rank} waits on rank 3 directly");
                }
                assert!(detail.contains("stage"), "{detail}");
            }
            other => panic!("rank {rank}: {other:?}"),
        }
    }
}

/// The two host-backend options are refused, naming themselves, where they cannot apply or
/// with a rate that is not positive.
#[test]
fn network_options_are_checked() {
    let cfg = EpConfig::new(EpSettings::new(0, 1, 8, 256, 2)).unwrap();
    let boot = || -> Arc<dyn Bootstrap> {
        Arc::new(InProcGroup::new(1, 1, Duration::from_secs(5)).unwrap().pop().unwrap())
    };
    let cases = [
        ("emulate_network_gbps", Some(-1.0), None, Backend::Host),
        ("emulate_network_gbps", Some(f64::NAN), None, Backend::Host),
        ("emulate_network_gbps", Some(1.0), None, Backend::Gpu),
        ("intranode_provider", None, Some("shm"), Backend::Gpu),
    ];
    for (arg, rate, near, backend) in cases {
        let opts = BufferOptions {
            backend,
            emulate_network_gbps: rate,
            intranode_provider: near.map(str::to_string),
            ..BufferOptions::host("shm")
        };
        match Buffer::new(cfg.clone(), boot(), opts) {
            Err(Error::InvalidArgument { arg: a, .. }) => assert_eq!(a, arg),
            other => panic!("{arg} {rate:?} {near:?}: {other:?}"),
        }
    }
}

#[test]
fn four_nodes_of_four_over_shm_fp8() {
    full_check(&Case { nodes: 4, rpn: 4, provider: "shm", fp8: true, tokens: vec![19, 0, 33, 8] });
}
