//! A rank's own communication memory in the C ABI (DeepEP's `get_local_buffer_tensor`).

use std::os::raw::c_void;

use super::guard;
use crate::error::Error;

/// `fep_buffer_local_region`: normal mode's region.
pub const FEP_REGION_NORMAL: i32 = 0;
/// `fep_buffer_local_region`: low-latency mode's region.
pub const FEP_REGION_LOW_LATENCY: i32 = 1;

/// This rank's own registered communication memory (DeepEP's `get_local_buffer_tensor`):
/// `*data` its address and `*bytes` its length. Host backend: host memory; `FEP_REGION_NORMAL`
/// is the normal-mode receive region (peers' chunks and notify records land there),
/// `FEP_REGION_LOW_LATENCY` the low-latency buffer (both sets' send staging and receive areas),
/// which exists once the first low-latency call (or `fep_clean_low_latency_buffer`) connected
/// it. GPU backend: a device address (`FEP_REGION_NORMAL`: the normal comm buffer, its chunks
/// followed by flags, credits, notify records and local state; `FEP_REGION_LOW_LATENCY`: the
/// low-latency buffer, device memory or pinned host memory mapped into the GPU). Every dispatch
/// and combine of that mode overwrites it, and writing into it while one may run corrupts that
/// call. Valid until `fep_buffer_destroy`.
///
/// Refused: NULL `buf`, `data` or `bytes`; another `region`; a region this buffer does not have
/// (a mode not allocated, the low-latency lane not connected yet).
///
/// # Safety
/// `buf` must be valid; `data` and `bytes` writable.
#[no_mangle]
pub unsafe extern "C" fn fep_buffer_local_region(
    buf: *mut super::fep_buffer,
    region: i32,
    data: *mut *mut c_void,
    bytes: *mut u64,
) -> super::fep_status {
    guard(|| {
        let data = data.as_mut().ok_or_else(|| Error::arg("data", "NULL pointer"))?;
        let bytes = bytes.as_mut().ok_or_else(|| Error::arg("bytes", "NULL pointer"))?;
        *data = std::ptr::null_mut();
        *bytes = 0;
        let low_latency = match region {
            FEP_REGION_NORMAL => false,
            FEP_REGION_LOW_LATENCY => true,
            r => {
                return Err(Error::arg(
                    "region",
                    format!(
                        "{r}: FEP_REGION_NORMAL ({FEP_REGION_NORMAL}) or FEP_REGION_LOW_LATENCY \
                         ({FEP_REGION_LOW_LATENCY})"
                    ),
                ))
            }
        };
        let b = super::buffer::buffer(buf)?;
        let (p, n) = b.local_region(low_latency).map_err(|e| {
            super::rename_arg(super::rename_arg(e, "low_latency", "region"), "mode", "region")
        })?;
        *data = p as *mut c_void;
        *bytes = n as u64;
        Ok(())
    })
}
