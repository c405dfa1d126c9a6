//! Address vector (`FI_AV_TABLE`): peers' endpoint names in, `fi_addr_t` handles out.

use std::ptr;
use std::sync::Arc;

use libfabric_sys as sys;

use super::domain::{close_fid, Domain};
use super::error::{check_ctx, FabricError, Result};

/// A peer's address handle in an [`AddressVector`].
pub type FiAddr = sys::fi_addr_t;

pub struct AddressVector {
    ptr: *mut sys::fid_av,
    _domain: Arc<Domain>,
}

unsafe impl Send for AddressVector {}
unsafe impl Sync for AddressVector {}

impl AddressVector {
    pub fn open(domain: &Arc<Domain>, count_hint: usize) -> Result<Arc<AddressVector>> {
        let mut attr = sys::fi_av_attr {
            type_: sys::fi_av_type_FI_AV_TABLE,
            count: count_hint,
            ..Default::default()
        };
        let mut ptr = ptr::null_mut();
        // SAFETY: domain is open; attr initialised; ptr receives the new fid.
        check_ctx(
            "fi_av_open",
            unsafe { sys::fi_av_open(domain.as_raw(), &mut attr, &mut ptr, ptr::null_mut()) }
                as i64,
            || format!("count {count_hint}"),
        )?;
        Ok(Arc::new(AddressVector { ptr, _domain: domain.clone() }))
    }

    pub fn as_raw(&self) -> *mut sys::fid_av {
        self.ptr
    }

    /// Inserts one endpoint name (as [`Endpoint::name`](super::Endpoint::name) returned it).
    pub fn insert(&self, name: &[u8]) -> Result<FiAddr> {
        if name.is_empty() {
            return Err(FabricError::arg("name", "empty endpoint address"));
        }
        let mut addr: FiAddr = 0;
        // SAFETY: name points at one address of the provider's format; addr receives a handle.
        let ret = unsafe {
            sys::fi_av_insert(self.ptr, name.as_ptr().cast(), 1, &mut addr, 0, ptr::null_mut())
        } as i64;
        if ret != 1 {
            return Err(FabricError::call(
                "fi_av_insert",
                if ret < 0 { ret } else { -(sys::FI_EINVAL as i64) },
                format!("inserted {ret} of 1 address ({} bytes)", name.len()),
            ));
        }
        Ok(addr)
    }
}

impl Drop for AddressVector {
    fn drop(&mut self) {
        // SAFETY: endpoints bound to this AV hold an Arc to it.
        unsafe { close_fid(&mut (*self.ptr).fid, "av") }
    }
}
