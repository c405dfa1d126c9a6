//! The engines: `Buffer` with normal and low-latency dispatch/combine on the host and GPU
//! backends, their proxy lanes and connect, DeepEP's internode hierarchy, the GPU layout launch.
//! What they compute from a config (layouts, plans, records, immediates, quantisation, the
//! reference) is the pure protocol core, [`crate::protocol`].

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
