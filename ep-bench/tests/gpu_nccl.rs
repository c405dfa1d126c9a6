//! GPU: the standard-stack baseline ep-bench compares against (ep-bench/src/nccl.rs: permute +
//! NCCL all-to-all + un-permute) computes the same dispatch and combine as the reference.
//! Ignored without `--include-ignored` (CI has no GPU); scripts/gpu-check.sh runs it with
//! FEP_NCCL_LIB pointing at the PyTorch wheel's NCCL.

use ep_bench::ep_gpu::{run_normal_gpu, run_normal_gpu_split, GpuBenchParams, GpuSplit};
use ep_bench::nccl::{nccl_library, run_nccl_baseline};
use fabric_ep::cuda::{device_count, gpu_available, Device};
use std::time::Duration;

#[test]
#[ignore = "needs a GPU and NCCL: scripts/gpu-check.sh runs it"]
fn nccl_baseline_matches_reference() {
    if !gpu_available() {
        eprintln!("SKIP: no GPU visible");
        return;
    }
    let lib = nccl_library().expect("NCCL must load on the GPU machine (FEP_NCCL_LIB)");
    let gpus = device_count().unwrap();
    let devices: Vec<Device> = (0..gpus).map(|i| Device::new(i).unwrap()).collect();
    for (ranks, fp8, hidden) in [(1, true, 2048), (1, false, 4096), (gpus.min(2), true, 7168)] {
        let p = GpuBenchParams {
            num_ranks: ranks,
            num_tokens: 512,
            hidden,
            fp8,
            iters: 2,
            warmup: 0,
            drop_pct: 10,
            timeout: Duration::from_secs(20),
            ..GpuBenchParams::normal_standard(ranks)
        };
        // The last case also times 3 steps back to back (the last one checked).
        let b2b = if hidden == 7168 { 3 } else { 0 };
        let r = run_nccl_baseline(&devices, &p, b2b)
            .unwrap_or_else(|e| panic!("{lib}: ranks {ranks} fp8 {fp8} hidden {hidden}: {e}"));
        assert_eq!(r.len(), ranks);
        let timed = if b2b > 0 { b2b } else { p.iters };
        assert!(r.iter().all(|x| x.dispatch_s.len() == timed && x.combine_s.len() == timed));
        eprintln!("ok: NCCL baseline ranks {ranks} fp8 {fp8} hidden {hidden} ({lib})");
    }
    // Two ranks on one GPU: NCCL refuses them, and the runner says so before trying.
    let p = GpuBenchParams { num_ranks: gpus + 1, ..GpuBenchParams::normal_standard(gpus + 1) };
    let e = run_nccl_baseline(&devices, &p, 0).unwrap_err().to_string();
    assert!(e.contains("one GPU per rank"), "{e}");
    // Our normal path on the same setting still runs (the comparison's other half).
    let p = GpuBenchParams {
        iters: 1,
        warmup: 0,
        num_tokens: 512,
        ..GpuBenchParams::normal_standard(1)
    };
    run_normal_gpu(&devices[0], &p).unwrap();
    // ... and its back-to-back timing (fresh and cached), as ep-bench runs it.
    for cached in [false, true] {
        let s = GpuSplit { cached, back_to_back: 3, ..GpuSplit::one_node(1) };
        let r = run_normal_gpu_split(&devices[0], &p, &s).unwrap();
        assert!(r[0].dispatch_s.len() == 3 && r[0].combine_s.len() == 3, "cached {cached}");
    }
}
