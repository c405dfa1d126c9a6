//! ep-bench's runners: the fabric self-test and bench, the EP runs on the host and GPU backends,
//! the NCCL baseline, the randomized verify matrix, the plan's hierarchy table, the result rows
//! and the trace breakdowns. The binary (src/main.rs), the GPU examples and fabric-ep's own
//! integration tests (a dev-dependency) use them; none of it ships in the library.
//!
//! The GPU runs launch fabric-ep's test and baseline kernels (the start gate, the copy rows,
//! NCCL's permute), which exist only with its `bench-kernels` feature: this crate turns it on.

pub mod ep;
pub mod ep_gpu;
pub mod fabric;
pub mod nccl;
pub mod plan;
pub mod report;
pub mod stats;
pub mod trace;
pub mod verify;
pub mod verify_gpu;
