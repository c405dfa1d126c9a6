//! CUDA layer on cudarc (driver API, dynamic loading). (Being written: see issue 3.)

/// Errors from the CUDA layer; each names the driver call.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("{0}")]
    Other(String),
}
