//! GPU: `Buffer` with `Backend::Gpu`, ranks as threads of one process on one GPU, against the
//! single-process reference (src/protocol/reference.rs) on the same inputs: normal mode (two-step
//! and num_worst_tokens, bf16 and fp8, hidden 2048/4096/7168), low-latency (fp8 and bf16, hook
//! and no hook), bad input and a stalled peer. Every iteration of every run is checked.
//! Ignored without `--include-ignored` (CI has no GPU); scripts/gpu-check.sh runs them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ep_bench::ep_gpu::{run_ll_gpu, run_normal_gpu, GpuBenchParams};
use fabric_ep::bootstrap::{Bootstrap, InProcGroup};
use fabric_ep::cuda::{DeviceBuffer, Stream};
use fabric_ep::ep::buffer::{Buffer, BufferOptions};
use fabric_ep::ep::gpu::{DevSlice, GpuLlDispatchArgs, GpuOptions};
use fabric_ep::protocol::config::{DispatchDtype, EpConfig, EpSettings};
use fabric_ep::Error;

mod common;
use common::gpu::{gpu, small};

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn normal_matches_reference_1_2_4_ranks() {
    let Some(dev) = gpu() else { return };
    for ranks in [1, 2, 4] {
        for hidden in [2048, 4096, 7168] {
            for fp8 in [false, true] {
                let p = small(ranks, 300, hidden, fp8);
                let t0 = Instant::now();
                let r = run_normal_gpu(&dev, &p)
                    .unwrap_or_else(|e| panic!("ranks {ranks} hidden {hidden} fp8 {fp8}: {e}"));
                assert_eq!(r.len(), ranks);
                eprintln!(
                    "ok: normal ranks {ranks} hidden {hidden} {} tokens 300: 2 checked steps \
                     ({:.1} s)",
                    if fp8 { "fp8" } else { "bf16" },
                    t0.elapsed().as_secs_f64()
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn normal_num_worst_tokens_and_uneven() {
    let Some(dev) = gpu() else { return };
    for (ranks, fp8) in [(2, true), (4, false), (4, true)] {
        let p = GpuBenchParams { worst: true, drop_pct: 40, ..small(ranks, 200, 7168, fp8) };
        run_normal_gpu(&dev, &p).unwrap_or_else(|e| panic!("worst ranks {ranks} fp8 {fp8}: {e}"));
        eprintln!("ok: normal num_worst_tokens ranks {ranks} fp8 {fp8}");
    }
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn low_latency_matches_reference_hook_and_not() {
    let Some(dev) = gpu() else { return };
    for ranks in [1, 2, 4] {
        for fp8 in [true, false] {
            for hook in [false, true] {
                let p = GpuBenchParams { hook, ..small(ranks, 64, 2048, fp8) };
                run_ll_gpu(&dev, &p)
                    .unwrap_or_else(|e| panic!("LL ranks {ranks} fp8 {fp8} hook {hook}: {e}"));
                eprintln!("ok: low-latency ranks {ranks} fp8 {fp8} hook {hook}");
            }
        }
    }
    // DeepEP's shape: hook and no hook both equal the reference, hence each other.
    for hook in [false, true] {
        let p = GpuBenchParams { hook, iters: 2, warmup: 0, ..GpuBenchParams::ll_standard(4) };
        run_ll_gpu(&dev, &p).unwrap_or_else(|e| panic!("LL standard hook {hook}: {e}"));
        eprintln!("ok: low-latency 4 ranks x 128 tokens hidden 7168 top-8 of 256 fp8 hook {hook}");
    }
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn low_latency_cuda_graph_replay_matches_reference() {
    // Each rank captures its own phases (dispatch, combine; hook or not) once, after one eager
    // step, and replays them; two input cases (different routing and data) alternate in the
    // same device buffers, and every replay is checked bit-exactly against the reference, so
    // graph replay equals eager execution on the same inputs.
    let Some(dev) = gpu() else { return };
    for (ranks, fp8, hook) in
        [(1, true, false), (2, false, true), (4, true, false), (4, true, true)]
    {
        let p = GpuBenchParams { hook, graph: true, iters: 6, ..small(ranks, 64, 2048, fp8) };
        run_ll_gpu(&dev, &p)
            .unwrap_or_else(|e| panic!("LL graph ranks {ranks} fp8 {fp8} hook {hook}: {e}"));
        eprintln!(
            "ok: low-latency CUDA graph ranks {ranks} fp8 {fp8} hook {hook}: 1 eager + 5 replays"
        );
    }
    let p = GpuBenchParams { graph: true, iters: 4, warmup: 0, ..GpuBenchParams::ll_standard(4) };
    run_ll_gpu(&dev, &p).unwrap_or_else(|e| panic!("LL graph standard: {e}"));
    eprintln!("ok: low-latency CUDA graph 4 ranks x 128 tokens hidden 7168 top-8 of 256 fp8");
}

fn cfg(rank: usize, ranks: usize, fp8: bool, timeout: Duration) -> EpConfig {
    let mut s = EpSettings::new(rank, ranks, 16, 512, 4);
    s.timeout = timeout;
    s.max_tokens_per_rank = 16;
    if fp8 {
        s.dispatch_dtype = DispatchDtype::Fp8E4m3;
    }
    EpConfig::new(s).unwrap()
}

fn arg_of(e: &Error) -> &'static str {
    match e {
        Error::InvalidArgument { arg, .. } => arg,
        other => panic!("expected an argument error, got {other}"),
    }
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn bad_options_and_arguments_are_named() {
    let Some(dev) = gpu() else { return };
    let boot: Arc<dyn Bootstrap> =
        Arc::new(InProcGroup::new(1, 1, Duration::from_secs(5)).unwrap().remove(0));
    let too_many = GpuOptions { num_sms: Some(10_000), ..GpuOptions::new(dev.clone()) };
    let e = Buffer::new(
        cfg(0, 1, true, Duration::from_secs(5)),
        boot.clone(),
        BufferOptions::gpu(too_many),
    )
    .unwrap_err();
    assert_eq!(arg_of(&e), "num_sms");
    let mut buf = Buffer::new(
        cfg(0, 1, true, Duration::from_secs(5)),
        boot,
        BufferOptions::gpu(GpuOptions::new(dev.clone())),
    )
    .unwrap();
    let gpu = buf.gpu().unwrap();
    let x = DeviceBuffer::zeroed(&dev, 16 * 512 * 2).unwrap();
    let idx = DeviceBuffer::from_slice(&dev, &vec![-1i64; 16 * 4]).unwrap();
    let out = gpu.new_ll_dispatch_out().unwrap();
    let stream = Stream::new(&dev).unwrap();
    let mut a = GpuLlDispatchArgs {
        x: DevSlice::of(&x),
        topk_idx: DevSlice::of(&idx),
        num_tokens: 16,
        use_fp8: false,
        return_recv_hook: false,
        stream: &stream,
    };
    // SAFETY: every buffer outlives the stream synchronisation below.
    unsafe {
        assert_eq!(arg_of(&gpu.low_latency_dispatch_gpu(&a, &out).unwrap_err()), "use_fp8");
        a.use_fp8 = true;
        a.num_tokens = 17;
        assert_eq!(arg_of(&gpu.low_latency_dispatch_gpu(&a, &out).unwrap_err()), "x");
        a.num_tokens = 16;
        a.x = DevSlice { ptr: x.device_ptr(), bytes: 100 };
        assert_eq!(arg_of(&gpu.low_latency_dispatch_gpu(&a, &out).unwrap_err()), "x");
    }
    gpu.sync_gpu(&stream).unwrap();
    buf.destroy().unwrap();
    eprintln!("ok: num_sms, use_fp8 and x errors named");
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh runs it"]
fn stalled_peer_is_a_timeout_naming_it_then_clean() {
    let Some(dev) = gpu() else { return };
    let boots = InProcGroup::new(2, 2, Duration::from_secs(30)).unwrap();
    let t0 = Instant::now();
    let res: Vec<Result<(), String>> = std::thread::scope(|s| {
        let hs: Vec<_> = boots
            .into_iter()
            .enumerate()
            .map(|(rank, b)| {
                let dev = dev.clone();
                s.spawn(move || -> Result<(), String> {
                    let boot: Arc<dyn Bootstrap> = Arc::new(b);
                    let c = cfg(rank, 2, true, Duration::from_secs(2));
                    let mut buf = Buffer::new(
                        c,
                        boot.clone(),
                        BufferOptions::gpu(GpuOptions::new(dev.clone())),
                    )
                    .map_err(|e| e.to_string())?;
                    let gpu = buf.gpu().map_err(|e| e.to_string())?;
                    let x = DeviceBuffer::zeroed(&dev, 16 * 512 * 2).unwrap();
                    let idx: Vec<i64> = (0..16 * 4).map(|i| (i % 16) as i64).collect();
                    let idx = DeviceBuffer::from_slice(&dev, &idx).unwrap();
                    let out = gpu.new_ll_dispatch_out().unwrap();
                    let stream = Stream::new(&dev).unwrap();
                    if rank == 0 {
                        let a = GpuLlDispatchArgs {
                            x: DevSlice::of(&x),
                            topk_idx: DevSlice::of(&idx),
                            num_tokens: 16,
                            use_fp8: true,
                            return_recv_hook: false,
                            stream: &stream,
                        };
                        // SAFETY: buffers outlive sync_gpu.
                        unsafe { gpu.low_latency_dispatch_gpu(&a, &out).unwrap() };
                        match gpu.sync_gpu(&stream) {
                            Err(Error::Timeout { rank, peers, phase, .. }) => {
                                assert_eq!(rank, 0);
                                assert_eq!(peers, vec![1], "{phase}");
                                eprintln!("timeout path: rank 0 in {phase} names peers {peers:?}");
                            }
                            other => return Err(format!("expected a timeout, got {other:?}")),
                        }
                        // Unusable until cleaned.
                        assert!(gpu.sync_gpu(&stream).is_err());
                    }
                    boot.barrier().map_err(|e| e.to_string())?;
                    gpu.clean_low_latency_gpu().map_err(|e| e.to_string())?;
                    gpu.sync_gpu(&stream).map_err(|e| e.to_string())?;
                    boot.barrier().map_err(|e| e.to_string())?;
                    drop(out);
                    buf.destroy().map_err(|e| e.to_string())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, x) in res.into_iter().enumerate() {
        x.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
}
