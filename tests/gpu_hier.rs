//! GPU: DeepEP's internode hierarchy on the GPU backend (`ep::hier_gpu::GpuHierBuffer`), ranks as
//! threads of one process with "forced" nodes on one GPU: the rail stage reaches the other nodes
//! through the proxy lane (libfabric RMA writes, mapped host buffers), the node stage its node's
//! ranks through device pointers. Every step is checked: dispatch against the direct path's
//! reference (same rows, order, `rank_prefix`, source indices, tokens per expert), combine
//! against the node-grouped sum (`reference::normal_combine_grouped`); fresh and cached
//! handles, `num_worst_tokens`, bf16 and fp8, hidden 2048 / 4096 / 7168, node splits 2 x 2,
//! 2 x 4 and 4 x 1, over `shm` and `tcp;ofi_rxm`. A stalled rank: a timeout naming a job rank.
//!
//! Ignored without `--include-ignored` (CI has no GPU); without a GPU they say SKIP.

mod common;
use common::gpu::gpu;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ep_bench::ep_gpu::{run_normal_gpu_hier, GpuBenchParams, GpuSplit};
use fabric_ep::bootstrap::{Bootstrap, InProcGroup};
use fabric_ep::cuda::Stream;
use fabric_ep::ep::buffer::BufferOptions;
use fabric_ep::ep::gpu::{DevSlice, GpuDispatchBuffers, GpuOptions};
use fabric_ep::ep::hier_gpu::{GpuHierBuffer, GpuHierDispatchArgs};
use fabric_ep::protocol::config::{EpConfig, EpSettings};
use fabric_ep::Error;

fn params(ranks: usize, tokens: usize, hidden: usize, fp8: bool) -> GpuBenchParams {
    GpuBenchParams {
        iters: 3,
        seed: 0x41e7 + (ranks * 7 + hidden) as u64 + fp8 as u64,
        timeout: Duration::from_secs(20),
        ..common::gpu::small(ranks, tokens, hidden, fp8)
    }
}

fn split(rpn: usize, provider: &str, cached: bool, back_to_back: usize) -> GpuSplit {
    GpuSplit {
        ranks_per_node: rpn,
        provider: provider.to_string(),
        chunk_tokens: Some(16),
        slots_per_peer: Some(8),
        cached,
        back_to_back,
    }
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn hierarchy_threads_match_the_direct_reference() {
    let Some(dev) = gpu() else { return };
    // (ranks, per node, provider, hidden, fp8, worst, cached, back to back)
    let cases = [
        (4, 2, "shm", 2048, false, false, false, 0),
        (4, 2, "shm", 7168, true, false, true, 3),
        (4, 2, "tcp;ofi_rxm", 4096, true, true, false, 0),
        (8, 4, "shm", 2048, true, false, true, 0),
        (4, 1, "shm", 4096, false, true, true, 2),
    ];
    for (ranks, rpn, provider, hidden, fp8, worst, cached, b2b) in cases {
        let p = GpuBenchParams { worst, ..params(ranks, 200, hidden, fp8) };
        let t0 = Instant::now();
        let (r, bytes) = run_normal_gpu_hier(&dev, &p, &split(rpn, provider, cached, b2b))
            .unwrap_or_else(|e| panic!("{provider}: {ranks} x {rpn}/node hidden {hidden}: {e}"));
        assert_eq!(r.len(), ranks);
        assert!(bytes.hier <= bytes.direct && bytes.hier > 0, "{bytes:?}");
        eprintln!(
            "ok: hierarchy {provider} {ranks} ranks, {rpn} per node, hidden {hidden} {} worst \
             {worst} cached {cached}: {} checked steps ({:.1} s)",
            if fp8 { "fp8" } else { "bf16" },
            p.iters + usize::from(b2b > 0),
            t0.elapsed().as_secs_f64()
        );
    }
}

/// Zero tokens on one rank and all tokens to one expert (both stages see empty and skewed
/// counts), through the same bench loop.
#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn hierarchy_with_few_tokens() {
    let Some(dev) = gpu() else { return };
    for tokens in [0, 1, 3] {
        let p = params(4, tokens, 2048, true);
        run_normal_gpu_hier(&dev, &p, &split(2, "shm", false, 0))
            .unwrap_or_else(|e| panic!("{tokens} tokens per rank: {e}"));
    }
}

/// A rank that never dispatches: every other rank gets a typed timeout within the stage's
/// bound, naming ranks of the job (not of a stage).
#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn a_stalled_rank_is_named_in_job_ranks() {
    let Some(dev) = gpu() else { return };
    let (ranks, rpn, t, h) = (4, 2, 32, 2048);
    let boots = InProcGroup::new(ranks, rpn, Duration::from_secs(30)).unwrap();
    let res: Vec<Result<(), Error>> = std::thread::scope(|s| {
        let hs: Vec<_> = boots
            .into_iter()
            .enumerate()
            .map(|(rank, b)| {
                let dev = dev.clone();
                s.spawn(move || -> Result<(), Error> {
                    let mut st = EpSettings::new(rank, ranks, 64, h, 8);
                    st.ranks_per_node = rpn;
                    st.timeout = Duration::from_secs(2);
                    let cfg = EpConfig::new(st)?;
                    let boot: Arc<dyn Bootstrap> = Arc::new(b);
                    let opts = GpuOptions { low_latency: false, ..GpuOptions::new(dev.clone()) };
                    let mut hb =
                        GpuHierBuffer::new(cfg.clone(), boot.clone(), BufferOptions::gpu(opts))?;
                    let mut handle = hb.new_handle(t)?;
                    let o = GpuDispatchBuffers::for_config(&dev, &cfg, t * ranks)?;
                    let x = fabric_ep::cuda::DeviceBuffer::zeroed(&dev, t * h * 2)?;
                    let idx: Vec<i64> = (0..t * 8).map(|i| (i % 64) as i64).collect();
                    let ti = fabric_ep::cuda::DeviceBuffer::from_slice(&dev, &idx)?;
                    let tw = fabric_ep::cuda::DeviceBuffer::zeroed(&dev, t * 8 * 4)?;
                    let stream = Stream::new(&dev)?;
                    boot.barrier()?;
                    let mut r = Ok(());
                    if rank != 3 {
                        // Rank 3 stalls: it never dispatches (its peers must time out, not hang).
                        let args = GpuHierDispatchArgs {
                            x: DevSlice::of(&x),
                            x_scales: None,
                            topk_idx: DevSlice::of(&ti),
                            topk_weights: DevSlice::of(&tw),
                            num_tokens: t,
                            expert_alignment: 1,
                            num_worst_tokens: None,
                            cached: false,
                            stream: &stream,
                        };
                        // SAFETY: every buffer outlives the stream's work (synchronised below).
                        r = unsafe { hb.dispatch_gpu(&args, &mut handle, &o.out()) }
                            .and_then(|_| hb.sync_gpu(&stream));
                    }
                    // Everyone waits here (the stalled rank too), then tears down together.
                    boot.barrier()?;
                    r
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    // Rank 1 waits for rank 3 in the rail stage; ranks 0 and 2 pass the rail stage (they are
    // each other's rail peers) and wait in the node stage for rank 1 and rank 3.
    let expect = [(1usize, "node"), (3, "rail"), (3, "node")];
    for (rank, r) in res.iter().enumerate() {
        match (rank, r) {
            (3, Ok(())) => {}
            (_, Err(Error::Timeout { rank: me, peers, phase, detail, .. })) if rank < 3 => {
                let (peer, stage) = expect[rank];
                assert_eq!(*me, rank, "the timeout names this rank in job ranks: {r:?}");
                assert!(phase.contains("notify"), "rank {rank}: {r:?}");
                assert_eq!(peers, &vec![peer], "rank {rank} names job rank {peer}: {r:?}");
                assert!(detail.contains(stage), "rank {rank}: the {stage} stage: {r:?}");
            }
            _ => panic!("rank {rank}: {r:?}"),
        }
    }
}
