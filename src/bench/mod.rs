//! Benchmark and self-test runners shared by `ep-bench` and the integration tests.

pub mod fabric;
pub mod plan;
pub mod report;
pub mod stats;
pub mod ep;
