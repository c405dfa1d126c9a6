//! EP logic: config and size hints, layout/plan math (pure: no GPU, no NIC), the single-process
//! reference, quantisation, and (later) Buffer with normal and low-latency dispatch/combine.

pub mod buffer;
pub mod connect;
pub mod gpu;
pub mod handle;
pub mod hier;
pub mod hier_gpu;
pub mod host;
pub mod layout_gpu;
pub mod ll_gpu;
pub mod normal_comm;
pub mod normal_gpu;
