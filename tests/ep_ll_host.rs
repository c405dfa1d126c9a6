//! Low-latency mode on the host backend, end to end through Buffer -> LL ring -> proxy ->
//! transport: ranks as threads (loopback with reordering and EAGAIN injection, and libfabric
//! providers with node splits), checked against the single-process reference built from every
//! rank's inputs. Processes: tests/ep_ll_host_multiproc.rs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ep_bench::ep::{
    check_ll_dispatch, ll_combine_input, ll_rank_inputs, ll_reference, LlBenchParams, LlRankInputs,
};
use fabric_ep::bootstrap::{Bootstrap, InProcGroup};
use fabric_ep::ep::buffer::{
    Buffer, BufferOptions, LlCombineArgs, LlDispatchArgs, LlDispatchOutput,
};
use fabric_ep::protocol::config::{EpConfig, EpSettings};
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
    max_tokens: usize,
    /// Tokens per rank (cycled).
    tokens: Vec<usize>,
    fp8: bool,
    round_scale: bool,
    /// Every token's first entry set to this expert, the others -1.
    one_expert: Option<i64>,
    /// Every entry -1.
    all_masked: bool,
    net: Net,
    timeout: Duration,
    /// `BufferOptions::ll_shrink`.
    shrink: bool,
}

impl Case {
    fn new(num_ranks: usize, ranks_per_node: usize, net: Net) -> Self {
        Case {
            num_ranks,
            ranks_per_node,
            experts: 4 * num_ranks,
            hidden: 256,
            topk: 4,
            max_tokens: 24,
            tokens: vec![24, 0, 13, 7, 20],
            fp8: false,
            round_scale: false,
            one_expert: None,
            all_masked: false,
            net,
            timeout: Duration::from_secs(30),
            shrink: false,
        }
    }

    fn settings(&self, rank: usize) -> EpSettings {
        let mut s = EpSettings::new(rank, self.num_ranks, self.experts, self.hidden, self.topk);
        s.ranks_per_node = self.ranks_per_node;
        s.max_tokens_per_rank = self.max_tokens;
        s.timeout = self.timeout;
        s
    }

    fn params(&self, seed: u64) -> LlBenchParams {
        LlBenchParams {
            tokens: self.tokens.clone(),
            seed,
            drop_pct: 10,
            use_fp8: self.fp8,
            round_scale: self.round_scale,
            iters: 1,
            warmup: 0,
        }
    }

    fn inputs(&self, cfg: &EpConfig, seed: u64) -> Vec<LlRankInputs> {
        (0..self.num_ranks)
            .map(|r| {
                let mut inp = ll_rank_inputs(cfg, &self.params(seed), r).unwrap();
                for (i, g) in inp.topk_idx.iter_mut().enumerate() {
                    if self.all_masked {
                        *g = -1;
                    } else if let Some(e) = self.one_expert {
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
    let groups = match &case.net {
        Net::Loopback(o) => Some((
            Buffer::loopback_group(&cfg0, *o).unwrap(),
            Buffer::ll_loopback_group(&cfg0, *o).unwrap(),
        )),
        Net::Fabric(_) => None,
    };
    std::thread::scope(|s| {
        let hs: Vec<_> = boots
            .into_iter()
            .enumerate()
            .map(|(rank, boot)| {
                let body = &body;
                let groups = groups.clone();
                s.spawn(move || {
                    let cfg = EpConfig::new(case.settings(rank))?;
                    let mut opts = match (&case.net, groups) {
                        (Net::Fabric(p), _) => BufferOptions::host(p),
                        (_, Some((g, ll))) => BufferOptions::loopback(g).with_ll_loopback(ll),
                        _ => unreachable!(),
                    };
                    opts.ll_shrink = case.shrink;
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

fn dispatch(
    buf: &mut Buffer,
    case: &Case,
    me: &LlRankInputs,
    hook: bool,
) -> Result<LlDispatchOutput, Error> {
    buf.low_latency_dispatch(&LlDispatchArgs {
        x: &me.x,
        topk_idx: &me.topk_idx,
        use_fp8: case.fp8,
        round_scale: case.round_scale,
        return_recv_hook: hook,
    })?
    .complete(buf)
}

fn combine(
    buf: &mut Buffer,
    me: &LlRankInputs,
    d: &LlDispatchOutput,
    y: &[u16],
    hook: bool,
) -> Result<Vec<u16>, Error> {
    Ok(buf
        .low_latency_combine(&LlCombineArgs {
            x: y,
            topk_idx: &me.topk_idx,
            topk_weights: &me.topk_weights,
            handle: &d.handle,
            return_recv_hook: hook,
        })?
        .complete(buf)?
        .combined_x)
}

fn same_output(a: &LlDispatchOutput, b: &LlDispatchOutput) -> bool {
    a.recv_x == b.recv_x
        && a.recv_count == b.recv_count
        && a.recv_src_rank == b.recv_src_rank
        && a.recv_src_idx == b.recv_src_idx
        && a.layout_range == b.layout_range
}

/// The LL contract on one case: dispatch == reference (every row, padding included), combine
/// == reference (bitwise), hook == non-hook, two results alive at once (two hooked dispatches
/// outstanding, then both combined).
fn full_check(case: &Case) {
    let t = Instant::now();
    let cfg0 = EpConfig::new(case.settings(0)).unwrap();
    let inputs = case.inputs(&cfg0, 11);
    let (want_d, want_c) = ll_reference(&cfg0, &inputs, case.fp8, case.round_scale).unwrap();
    let res = run_ranks(case, |rank, buf| {
        let me = &inputs[rank];
        let h = case.hidden;
        let d1 = dispatch(buf, case, me, false)?;
        check_ll_dispatch(rank, &d1, &want_d[rank], h, true)?;
        let d2 = dispatch(buf, case, me, true)?;
        assert!(same_output(&d1, &d2), "rank {rank}: hook dispatch differs");
        let y = ll_combine_input(&d1.recv_x, &d1.recv_count, h)?;
        let c1 = combine(buf, me, &d1, &y, false)?;
        assert_eq!(c1, want_c[rank], "rank {rank}: combine differs from the reference");
        let c2 = combine(buf, me, &d2, &y, true)?;
        assert_eq!(c1, c2, "rank {rank}: hook combine differs");
        // Two results alive: two dispatches outstanding (both hooks pending), then both used.
        let ha = buf.low_latency_dispatch(&LlDispatchArgs {
            x: &me.x,
            topk_idx: &me.topk_idx,
            use_fp8: case.fp8,
            round_scale: case.round_scale,
            return_recv_hook: true,
        })?;
        let hb = buf.low_latency_dispatch(&LlDispatchArgs {
            x: &me.x,
            topk_idx: &me.topk_idx,
            use_fp8: case.fp8,
            round_scale: case.round_scale,
            return_recv_hook: true,
        })?;
        let da = ha.complete(buf)?;
        let db = hb.complete(buf)?;
        assert!(same_output(&da, &d1) && same_output(&db, &d1), "rank {rank}: two alive");
        let ca = buf.low_latency_combine(&LlCombineArgs {
            x: &y,
            topk_idx: &me.topk_idx,
            topk_weights: &me.topk_weights,
            handle: &da.handle,
            return_recv_hook: true,
        })?;
        let cb = buf.low_latency_combine(&LlCombineArgs {
            x: &y,
            topk_idx: &me.topk_idx,
            topk_weights: &me.topk_weights,
            handle: &db.handle,
            return_recv_hook: true,
        })?;
        assert_eq!(ca.complete(buf)?.combined_x, want_c[rank]);
        assert_eq!(cb.complete(buf)?.combined_x, want_c[rank]);
        Ok(())
    });
    for (r, x) in res.into_iter().enumerate() {
        x.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
    eprintln!("{} ranks {:?}: ok in {:?}", case.num_ranks, case.net, t.elapsed());
}

fn shuffled() -> Net {
    Net::Loopback(LoopbackOptions { eagain_every: 7, reorder_seed: Some(3), max_outstanding: 64 })
}

#[test]
fn threads_loopback_2_4_8_16_unordered() {
    for (n, rpn) in [(2, 2), (4, 2), (8, 4), (16, 4)] {
        let mut c = Case::new(n, rpn, shuffled());
        if n == 16 {
            c.hidden = 128;
            c.max_tokens = 12;
            c.tokens = vec![12, 0, 5];
        }
        full_check(&c);
    }
}

#[test]
fn threads_loopback_fp8_and_round_scale() {
    let mut c = Case::new(4, 2, shuffled());
    c.fp8 = true;
    full_check(&c);
    c.round_scale = true;
    full_check(&c);
}

#[test]
fn threads_loopback_imbalance() {
    // All tokens to one expert (rank 1's local expert 1), different counts, a zero-token rank.
    let mut c = Case::new(4, 2, shuffled());
    c.one_expert = Some(5);
    c.tokens = vec![24, 0, 17, 9];
    full_check(&c);
    // Every top-k entry -1.
    let mut c = Case::new(4, 2, shuffled());
    c.all_masked = true;
    full_check(&c);
    // Every rank with zero tokens.
    let mut c = Case::new(2, 1, shuffled());
    c.tokens = vec![0];
    full_check(&c);
}

#[test]
fn threads_over_libfabric_with_node_splits() {
    let mut c = Case::new(8, 4, Net::Fabric("shm"));
    c.tokens = vec![20, 0, 11, 24];
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
    c.hidden = 128;
    c.max_tokens = 12;
    c.tokens = vec![12, 0, 7];
    full_check(&c);
}

#[test]
fn twenty_reruns_are_bit_identical() {
    let mut c = Case::new(4, 2, shuffled());
    c.fp8 = true;
    let cfg0 = EpConfig::new(c.settings(0)).unwrap();
    let inputs = c.inputs(&cfg0, 5);
    let res = run_ranks(&c, |rank, buf| {
        let me = &inputs[rank];
        let mut first: Option<(LlDispatchOutput, Vec<u16>)> = None;
        for i in 0..20 {
            let d = dispatch(buf, &c, me, i % 2 == 1)?;
            let y = ll_combine_input(&d.recv_x, &d.recv_count, c.hidden)?;
            let out = combine(buf, me, &d, &y, i % 3 == 1)?;
            match &first {
                None => first = Some((d, out)),
                Some((d0, c0)) => {
                    assert!(same_output(d0, &d), "rank {rank} run {i}: dispatch differs");
                    assert_eq!(c0, &out, "rank {rank} run {i}: combine differs");
                }
            }
        }
        Ok(())
    });
    for r in res {
        r.unwrap();
    }
}

fn arg_of(e: &Error) -> &'static str {
    match e {
        Error::InvalidArgument { arg, .. } => arg,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn bad_input_is_a_typed_error_before_anything_is_sent() {
    // num_experts not divisible by ranks: refused by the config.
    let mut s = EpSettings::new(0, 3, 8, 128, 2);
    s.ranks_per_node = 3;
    assert_eq!(arg_of(&EpConfig::new(s).unwrap_err()), "num_experts");
    // Unsupported hidden.
    let s = EpSettings::new(0, 2, 8, 100, 2);
    assert_eq!(arg_of(&EpConfig::new(s).unwrap_err()), "hidden");
    let mut c = Case::new(2, 1, Net::Loopback(LoopbackOptions::default()));
    c.hidden = 64; // not a multiple of 128: no fp8
    let cfg0 = EpConfig::new(c.settings(0)).unwrap();
    let inputs = c.inputs(&cfg0, 1);
    let res = run_ranks(&c, |rank, buf| {
        let me = &inputs[rank];
        let h = c.hidden;
        let k = c.topk;
        let too_many = vec![0u16; (c.max_tokens + 1) * h];
        let idx_many = vec![-1i64; (c.max_tokens + 1) * k];
        let cases: Vec<(&str, LlDispatchArgs)> = vec![
            (
                "x",
                LlDispatchArgs {
                    x: &too_many,
                    topk_idx: &idx_many,
                    use_fp8: false,
                    round_scale: false,
                    return_recv_hook: false,
                },
            ),
            (
                "x",
                LlDispatchArgs {
                    x: &me.x[..me.x.len().saturating_sub(1)],
                    topk_idx: &me.topk_idx,
                    use_fp8: false,
                    round_scale: false,
                    return_recv_hook: false,
                },
            ),
            (
                "topk_idx",
                LlDispatchArgs {
                    x: &me.x,
                    topk_idx: &me.topk_idx[..me.topk_idx.len().saturating_sub(1)],
                    use_fp8: false,
                    round_scale: false,
                    return_recv_hook: false,
                },
            ),
            (
                "hidden",
                LlDispatchArgs {
                    x: &me.x,
                    topk_idx: &me.topk_idx,
                    use_fp8: true,
                    round_scale: false,
                    return_recv_hook: false,
                },
            ),
        ];
        for (want, a) in &cases {
            if me.x.is_empty() && *want != "hidden" && a.x.is_empty() == me.x.is_empty() {
                // Zero tokens: only the oversized x and the fp8 hidden check apply.
                if a.x.len() <= (c.max_tokens) * h {
                    continue;
                }
            }
            let e = buf.low_latency_dispatch(a).unwrap_err();
            assert_eq!(arg_of(&e), *want, "rank {rank}: {e}");
        }
        let mut bad_idx = me.topk_idx.clone();
        if !bad_idx.is_empty() {
            bad_idx[0] = c.experts as i64;
            let e = buf
                .low_latency_dispatch(&LlDispatchArgs {
                    x: &me.x,
                    topk_idx: &bad_idx,
                    use_fp8: false,
                    round_scale: false,
                    return_recv_hook: false,
                })
                .unwrap_err();
            assert_eq!(arg_of(&e), "topk_idx");
        }
        // Nothing was sent: a real step still works and matches.
        let d = dispatch(buf, &c, me, false)?;
        let y = ll_combine_input(&d.recv_x, &d.recv_count, h)?;
        // Combine: wrong x shape, wrong weights, foreign ids.
        let short = &y[..y.len() - 1];
        let e = buf
            .low_latency_combine(&LlCombineArgs {
                x: short,
                topk_idx: &me.topk_idx,
                topk_weights: &me.topk_weights,
                handle: &d.handle,
                return_recv_hook: false,
            })
            .unwrap_err();
        assert_eq!(arg_of(&e), "x");
        let e = buf
            .low_latency_combine(&LlCombineArgs {
                x: &y,
                topk_idx: &me.topk_idx,
                topk_weights: &[0.5; 1],
                handle: &d.handle,
                return_recv_hook: false,
            })
            .unwrap_err();
        assert_eq!(arg_of(&e), "topk_weights");
        let _ = combine(buf, me, &d, &y, false)?;
        Ok(())
    });
    for r in res {
        r.unwrap();
    }
}

#[test]
fn stalled_peer_is_named_then_clean_recovers() {
    for net in [Net::Loopback(shuffled_opts()), Net::Fabric("tcp;ofi_rxm")] {
        let mut case = Case::new(3, 3, net);
        case.experts = 6;
        case.timeout = Duration::from_secs(2);
        let cfg0 = EpConfig::new(case.settings(0)).unwrap();
        let inputs = case.inputs(&cfg0, 9);
        let (want_d, want_c) = ll_reference(&cfg0, &inputs, false, false).unwrap();
        let t = Instant::now();
        let res = run_ranks(&case, |rank, buf| {
            let me = &inputs[rank];
            // A good step first (connects the LL lane everywhere).
            let d = dispatch(buf, &case, me, false)?;
            check_ll_dispatch(rank, &d, &want_d[rank], case.hidden, true)?;
            if rank == 2 {
                // Stalls: skips one dispatch, stays away past everyone's timeout.
                std::thread::sleep(Duration::from_secs(4));
            } else {
                let t0 = Instant::now();
                match dispatch(buf, &case, me, rank == 1) {
                    Err(Error::Timeout { peers, rank: r, .. }) => {
                        assert_eq!(r, rank);
                        assert_eq!(peers, vec![2], "rank {rank}");
                        assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
                    }
                    other => panic!("rank {rank}: expected a timeout naming rank 2, got {other:?}"),
                }
                // Refused (no hang) until clean.
                assert!(dispatch(buf, &case, me, false).is_err());
            }
            buf.clean_low_latency_buffer()?;
            // The old handle is void after clean.
            let y = ll_combine_input(&d.recv_x, &d.recv_count, case.hidden)?;
            let e = combine(buf, me, &d, &y, false).unwrap_err();
            assert_eq!(arg_of(&e), "handle");
            for _ in 0..2 {
                let d = dispatch(buf, &case, me, false)?;
                check_ll_dispatch(rank, &d, &want_d[rank], case.hidden, true)?;
                assert_eq!(combine(buf, me, &d, &y, true)?, want_c[rank]);
            }
            Ok(())
        });
        for (r, x) in res.into_iter().enumerate() {
            x.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        }
        eprintln!("{:?}: stalled peer named and recovered in {:?}", case.net, t.elapsed());
    }
}

fn shuffled_opts() -> LoopbackOptions {
    LoopbackOptions { eagain_every: 7, reorder_seed: Some(3), max_outstanding: 64 }
}

#[test]
fn receive_wait_costs_name_the_late_rank() {
    let mut case = Case::new(3, 3, Net::Loopback(shuffled_opts()));
    case.experts = 6;
    let (late, delay) = (1usize, Duration::from_millis(400));
    let cfg0 = EpConfig::new(case.settings(0)).unwrap();
    let inputs = case.inputs(&cfg0, 21);
    let (want_d, want_c) = ll_reference(&cfg0, &inputs, false, false).unwrap();
    let l = case.experts / case.num_ranks;
    let res = run_ranks(&case, |rank, buf| {
        let me = &inputs[rank];
        // The first call connects the lane (a collective); the timed ones come after.
        let d = dispatch(buf, &case, me, false)?;
        let y = ll_combine_input(&d.recv_x, &d.recv_count, case.hidden)?;
        combine(buf, me, &d, &y, false)?;
        if rank == late {
            std::thread::sleep(delay);
        }
        let d = dispatch(buf, &case, me, true)?;
        check_ll_dispatch(rank, &d, &want_d[rank], case.hidden, true)?;
        if rank == late {
            std::thread::sleep(delay);
        }
        let c = buf
            .low_latency_combine(&LlCombineArgs {
                x: &y,
                topk_idx: &me.topk_idx,
                topk_weights: &me.topk_weights,
                handle: &d.handle,
                return_recv_hook: false,
            })?
            .complete(buf)?;
        assert_eq!(c.combined_x, want_c[rank]);
        Ok((d.recv_wait_ns, c.recv_wait_ns))
    });
    for (r, x) in res.into_iter().enumerate() {
        let (dw, cw) = x.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!((dw.len(), cw.len()), (3, 3));
        if r == late {
            continue;
        }
        // One wait per (local expert, source): the late rank's each about `delay` long.
        let floor = (l as f64 * 0.6 * delay.as_nanos() as f64) as u64;
        for (what, w) in [("dispatch", &dw), ("combine", &cw)] {
            assert!(w[late] >= floor, "rank {r} {what}: {w:?}");
            assert!((0..3).filter(|&o| o != late).all(|o| w[late] > 2 * w[o]), "rank {r}: {w:?}");
        }
    }
}

/// Rank `gone`'s tokens dropped and every expert of it masked out of the others' routing: what
/// shrink mode's survivors must get once `gone` is masked.
fn without_rank(inputs: &[LlRankInputs], gone: usize, l: usize) -> Vec<LlRankInputs> {
    inputs
        .iter()
        .enumerate()
        .map(|(s, i)| {
            if s == gone {
                return LlRankInputs { x: vec![], topk_idx: vec![], topk_weights: vec![] };
            }
            let topk_idx =
                i.topk_idx.iter().map(|&g| if g >= 0 && g as usize / l == gone { -1 } else { g });
            LlRankInputs { topk_idx: topk_idx.collect(), ..i.clone() }
        })
        .collect()
}

#[test]
fn shrink_masks_a_stalled_rank_and_cleans_among_the_others() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let mut case = Case::new(4, 4, Net::Loopback(shuffled_opts()));
    case.timeout = Duration::from_millis(1500);
    case.shrink = true;
    let (gone, l) = (3usize, case.experts / case.num_ranks);
    let cfg0 = EpConfig::new(case.settings(0)).unwrap();
    let inputs = case.inputs(&cfg0, 23);
    let (want_d, want_c) = ll_reference(&cfg0, &inputs, false, false).unwrap();
    let shrunk = without_rank(&inputs, gone, l);
    let (shr_d, shr_c) = ll_reference(&cfg0, &shrunk, false, false).unwrap();
    let done = std::sync::Barrier::new(3);
    let left = AtomicBool::new(false);
    let res = run_ranks(&case, |rank, buf| {
        let me = &inputs[rank];
        let d = dispatch(buf, &case, me, false)?;
        check_ll_dispatch(rank, &d, &want_d[rank], case.hidden, true)?;
        let y = ll_combine_input(&d.recv_x, &d.recv_count, case.hidden)?;
        assert_eq!(combine(buf, me, &d, &y, false)?, want_c[rank]);
        if rank == gone {
            // Stops taking part; back only for the collective destroy.
            while !left.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(20));
            }
            return Ok(());
        }
        let t0 = Instant::now();
        let d = dispatch(buf, &case, me, false)?;
        assert!(t0.elapsed() >= case.timeout, "{:?}", t0.elapsed());
        assert!(d.recv_wait_ns[gone] >= l as u64 * case.timeout.as_nanos() as u64 * 8 / 10);
        check_ll_dispatch(rank, &d, &shr_d[rank], case.hidden, true)?;
        assert_eq!(buf.ll_mask()?, vec![false, false, false, true]);
        let y = ll_combine_input(&d.recv_x, &d.recv_count, case.hidden)?;
        assert_eq!(combine(buf, me, &d, &y, false)?, shr_c[rank], "rank {rank}");
        // Skipped without waiting from now on, hooks included.
        let t0 = Instant::now();
        let d = dispatch(buf, &case, me, true)?;
        check_ll_dispatch(rank, &d, &shr_d[rank], case.hidden, true)?;
        assert_eq!(combine(buf, me, &d, &y, true)?, shr_c[rank]);
        assert!(t0.elapsed() < case.timeout / 2, "{:?}", t0.elapsed());
        // clean among the three (in band; `gone` takes no part), and on.
        buf.clean_low_latency_buffer()?;
        let d = dispatch(buf, &case, me, false)?;
        check_ll_dispatch(rank, &d, &shr_d[rank], case.hidden, true)?;
        assert_eq!(combine(buf, me, &d, &y, false)?, shr_c[rank]);
        // Unmasked: refused until clean, which masks it again (it does not answer).
        buf.ll_update_mask(gone, false)?;
        assert!(dispatch(buf, &case, me, false).is_err());
        buf.clean_low_latency_buffer()?;
        assert_eq!(buf.ll_mask()?, vec![false, false, false, true]);
        let d = dispatch(buf, &case, me, false)?;
        check_ll_dispatch(rank, &d, &shr_d[rank], case.hidden, true)?;
        assert!(buf.ll_update_mask(4, true).is_err());
        done.wait();
        left.store(true, Ordering::Release);
        Ok(())
    });
    for (r, x) in res.into_iter().enumerate() {
        x.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}

#[test]
fn mask_calls_need_shrink_mode() {
    let case = Case::new(2, 2, Net::Loopback(shuffled_opts()));
    let res = run_ranks(&case, |_, buf| {
        for e in [buf.ll_update_mask(0, true).unwrap_err(), buf.ll_mask().unwrap_err()] {
            assert_eq!(arg_of(&e), "enable_shrink");
        }
        Ok(())
    });
    for (r, x) in res.into_iter().enumerate() {
        x.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}
