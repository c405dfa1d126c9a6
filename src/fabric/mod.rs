//! Safe libfabric owners. (Being written: issue 2.)
pub use libfabric_sys as sys;

/// Errors from libfabric calls; each names the call, its code and libfabric's text.
#[derive(Debug, thiserror::Error)]
pub enum FabricError {
    #[error("{0}")]
    Other(String),
}
