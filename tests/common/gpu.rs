//! Shared by the GPU tests (`gpu()`, the gate every tests/gpu_*.rs uses) and the `Buffer` ones
//! (tests/gpu_buffer.rs, tests/gpu_ipc.rs: the small run shapes checked against the reference).

use std::time::Duration;

use ep_bench::ep_gpu::GpuBenchParams;
use fabric_ep::cuda::{gpu_available, Device};

/// This process's GPU (`LOCAL_RANK` modulo the visible GPUs), or `None` after a SKIP line.
pub fn gpu() -> Option<Device> {
    if !gpu_available() {
        eprintln!("SKIP: no GPU visible (gpu_available() is false)");
        return None;
    }
    Some(Device::from_env().expect("open the GPU"))
}

/// A small checked run: `tokens` per rank, top-8 of 64 experts, 2 iterations, 10% dropped.
pub fn small(ranks: usize, tokens: usize, hidden: usize, fp8: bool) -> GpuBenchParams {
    GpuBenchParams {
        num_ranks: ranks,
        num_tokens: tokens,
        hidden,
        num_topk: 8,
        num_experts: 64,
        fp8,
        iters: 2,
        warmup: 0,
        seed: 0x1234 + ranks as u64 + hidden as u64,
        drop_pct: 10,
        timeout: Duration::from_secs(10),
        num_sms: None,
        worst: false,
        hook: false,
        graph: false,
        one_way: false,
    }
}
