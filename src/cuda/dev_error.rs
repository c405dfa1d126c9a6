//! The device error record: one `fep_dev_error` in mapped host memory that kernels fill when a
//! bounded wait runs out or an input is out of range (kernels/include/fep_device.cuh), plus the
//! device-memory claim word that picks the first writer.

use super::device::Device;
use super::memory::{DeviceBuffer, HostMapped};
use super::{CudaError, CudaResult};
use crate::abi::{self, fep_dev_error, fep_dev_error_ref};

/// Owns one mapped `fep_dev_error` and its claim word. Pass [`DevErrorRecord::as_abi`] in a
/// kernel's params; after the stream synchronises, [`DevErrorRecord::check`] turns a recorded
/// error into [`CudaError::Device`]. [`DevErrorRecord::reset`] before reusing it.
/// NOTES: read it after the kernels that may write it have finished; a reader during a run may
/// see `code == 0` while a report is under way (fields are written before `code`).
pub struct DevErrorRecord {
    record: HostMapped,
    claim: DeviceBuffer,
}

impl DevErrorRecord {
    pub fn new(dev: &Device) -> CudaResult<DevErrorRecord> {
        Ok(DevErrorRecord {
            record: HostMapped::new(dev, std::mem::size_of::<fep_dev_error>())?,
            claim: DeviceBuffer::zeroed(dev, 4)?,
        })
    }

    /// What kernels take (`fep_dev_error_ref`).
    pub fn as_abi(&self) -> fep_dev_error_ref {
        fep_dev_error_ref { record: self.record.device_ptr(), claim: self.claim.device_ptr() }
    }

    /// The record as it stands.
    pub fn read(&self) -> CudaResult<fep_dev_error> {
        self.record.read::<fep_dev_error>(0)
    }

    /// Clears record and claim (synchronous; no kernel using it may be running).
    pub fn reset(&self) -> CudaResult<()> {
        self.claim.memset(0)?;
        self.record.write(0, fep_dev_error::default())
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
