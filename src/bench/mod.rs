//! Benchmark and self-test runners shared by `ep-bench` and the integration tests.

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
