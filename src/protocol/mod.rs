//! The pure protocol core: everything the engines, the C ABI and the bench compute from a
//! configuration, with no CUDA, no libfabric and no threads (the split quinn-proto makes between
//! its state machines and the I/O around them).
//!
//! - `config`: the settings, validated once, and their size hints (`u64` bytes);
//! - `dtype`: the dispatch format;
//! - `hier`: the internode hierarchy's stage settings, metadata lane and final row order;
//! - `layout`: `get_dispatch_layout` in Rust (the GPU kernel's reference, the host backend's);
//! - `plan`: the wire protocol's math: record layouts, immediate data, memory regions, both
//!   modes' layouts and plans, cluster sizing and its table;
//! - `quant`: bf16/fp8 conversions and DeepEP's per-token fp8 quantisation;
//! - `reference`: the single-process oracle every backend is tested against.
//!
//! Why a module of its own: these parts are plain functions of their inputs (slices in, `Vec`s
//! out, `u64` byte offsets), so they can be read, tested and fuzzed without a GPU, a NIC or a
//! bootstrap, and the engines in `ep` (host and GPU backends), the proxy and `ep-bench` all build
//! on the same math. Nothing here uses `crate::cuda`, `crate::fabric`, `crate::proxy`,
//! `crate::bootstrap`, `crate::ffi`, `crate::ep`, threads or locks: `scripts/modgraph.py
//! --purity` (run by `make test`, and by `make lint` with the module graphs) fails if a file
//! does.

pub mod config;
pub mod dtype;
pub mod hier;
pub mod layout;
pub mod plan;
pub mod quant;
pub mod reference;
