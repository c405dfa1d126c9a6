//! fabric-ep: Mixture-of-Experts expert-parallel communication over libfabric.
//!
//! Layers (dependencies point downward only; docs/ARCHITECTURE.md maps them):
//! `ffi` -> `ep` -> {`proxy`, `cuda`, `fabric`, `bootstrap`} -> `libfabric-sys` / cudarc, and
//! `protocol` (the pure core: no CUDA, no libfabric, no threads) under `ffi`, `ep` and `proxy`.

pub mod abi;
pub mod bootstrap;
pub mod cuda;
pub mod ep;
pub mod error;
pub mod fabric;
pub mod ffi;
pub mod log;
pub mod protocol;
pub mod proxy;
pub mod trace;
pub mod util;

pub use error::{Error, Result};

/// This crate's version (Cargo.toml), for tools that report which build they ran (ep-bench's
/// result rows).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
