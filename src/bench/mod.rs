//! Benchmark and self-test runners shared by `ep-bench` and the integration tests.

pub mod ep;
// The GPU runs launch the test and baseline kernels (the start gate, the copy rows, NCCL's
// permute), which exist only with the `bench-kernels` feature; so does what builds on them.
#[cfg(feature = "bench-kernels")]
pub mod ep_gpu;
pub mod fabric;
#[cfg(feature = "bench-kernels")]
pub mod nccl;
pub mod plan;
pub mod report;
pub mod stats;
pub mod trace;
pub mod verify;
#[cfg(feature = "bench-kernels")]
pub mod verify_gpu;
