//! Rank discovery and all-gather/barrier of connection info. (Being written: see issue 2.)

/// Errors from bootstrapping; each names the missing or offending ranks.
#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error("{0}")]
    Other(String),
}
