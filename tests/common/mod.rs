//! Helpers shared by the integration tests (`mod common;` in each tests/*.rs):
//! - [`gpu`]: the GPU gate every tests/gpu_*.rs uses and the small checked run shapes;
//! - [`gpu_proxy`]: one rank of a GPU job whose kernels drive the real CPU proxy (also included
//!   by ep-bench/examples/gpu_proxy_bench.rs through `#[path]`, so it uses nothing from this
//!   file);
//! - [`proxy`]: one rank of the proxy-over-libfabric tests (threads or processes as ranks);
//! - here: re-executing this test binary as the ranks of a job, the provider list.
//!
//! The tests that run the ep-bench binary are ep-bench's (ep-bench/tests/).

// Every tests/*.rs is its own crate and uses only some of these helpers.
#![allow(dead_code)]

pub mod gpu;
pub mod gpu_proxy;
pub mod proxy;

use std::path::PathBuf;
use std::time::Duration;

use fabric_ep::bootstrap::{LocalJob, RankOutcome};

/// Every provider the host tests run over by default.
pub const ALL_PROVIDERS: &[&str] = &["shm", "tcp;ofi_rxm", "udp;ofi_rxd"];
/// The GPU proxy tests' default providers.
pub const GPU_PROVIDERS: &[&str] = &["shm", "tcp;ofi_rxm"];

/// `FEP_TEST_PROVIDERS` (a comma list), else `default`.
pub fn providers(default: &[&str]) -> Vec<String> {
    std::env::var("FEP_TEST_PROVIDERS")
        .map(|v| v.split(',').map(str::to_string).collect())
        .unwrap_or_else(|_| default.iter().map(|s| s.to_string()).collect())
}

/// This test binary, re-executed as the ranks of a multi-process job.
pub fn exe() -> PathBuf {
    std::env::current_exe().expect("current_exe")
}

/// libtest arguments that run only this binary's `child_rank` test, its output shown.
pub fn child_args() -> Vec<String> {
    ["--exact", "child_rank", "--nocapture", "--test-threads=1"]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

/// Runs `n` ranks (all on one node) of this binary's `child_rank` with `env`; waits `wall` at most.
pub fn run_child_ranks(n: usize, env: &[(String, String)], wall: Duration) -> Vec<RankOutcome> {
    let mut job = LocalJob::spawn(&exe(), &child_args(), n, n, env).expect("spawn ranks");
    job.wait(wall).expect("wait for ranks")
}

/// Every rank's output, in rank order.
pub fn report(out: &[RankOutcome]) -> String {
    out.iter().map(|o| o.to_string()).collect()
}
