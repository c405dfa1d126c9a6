//! CPU proxy: GPU->CPU command rings and RMA-posting worker threads. (Being written: issue 3.)

/// Errors from the proxy.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("{0}")]
    Other(String),
}
