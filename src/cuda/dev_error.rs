//! The device error record: one `fep_dev_error` in mapped host memory that kernels fill when a
//! bounded wait runs out or an input is out of range (kernels/include/fep_device.cuh).

use super::device::Device;
use super::memory::HostMapped;
use super::{CudaError, CudaResult};
use crate::abi::{self, fep_dev_error};

/// Owns one mapped `fep_dev_error`. Pass [`DevErrorRecord::device_ptr`] in a kernel's params;
/// after the stream synchronises, [`DevErrorRecord::check`] turns a recorded error into
/// [`CudaError::Device`].
/// NOTES: read it only after the kernels that may write it have finished: the writer sets `code`
/// first (first writer wins) and the other fields after.
pub struct DevErrorRecord {
    mem: HostMapped,
}

impl DevErrorRecord {
    pub fn new(dev: &Device) -> CudaResult<DevErrorRecord> {
        Ok(DevErrorRecord { mem: HostMapped::new(dev, std::mem::size_of::<fep_dev_error>())? })
    }

    pub fn device_ptr(&self) -> u64 {
        self.mem.device_ptr()
    }

    /// The record as it stands.
    pub fn read(&self) -> CudaResult<fep_dev_error> {
        self.mem.read::<fep_dev_error>(0)
    }

    /// Clears the record (before reusing it for the next launch).
    pub fn reset(&self) -> CudaResult<()> {
        self.mem.write(0, fep_dev_error::default())
    }

    /// `Ok` when no kernel recorded an error, else the typed error.
    pub fn check(&self) -> CudaResult<()> {
        let e = self.read()?;
        if e.code == abi::FEP_DEV_OK {
            return Ok(());
        }
        Err(CudaError::Device {
            code: e.code,
            what: code_name(e.code),
            rank: e.rank,
            phase: e.phase,
            peer: (e.peer != u32::MAX).then_some(e.peer),
            expected: e.expected,
            observed: e.observed,
        })
    }
}

/// The `FEP_DEV_*` name of a code.
pub fn code_name(code: u32) -> &'static str {
    match code {
        abi::FEP_DEV_OK => "OK",
        abi::FEP_DEV_WAIT_TIMEOUT => "WAIT_TIMEOUT",
        abi::FEP_DEV_BAD_COUNT => "BAD_COUNT",
        abi::FEP_DEV_BAD_INPUT => "BAD_INPUT",
        _ => "UNKNOWN",
    }
}
