//! `Fabric` and `Domain`: the top of the ownership chain (fabric <- domain <- cq/av/ep/mr).

use std::ptr;
use std::sync::Arc;

use libfabric_sys as sys;

use super::error::{check, Result};
use super::info::Info;

/// Close a fid, logging (not panicking) on failure: used from `Drop` only.
pub(crate) unsafe fn close_fid(fid: *mut sys::fid, what: &str) {
    if fid.is_null() {
        return;
    }
    let ret = sys::fi_close(fid);
    if ret != 0 {
        eprintln!("fabric-ep: fi_close({what}) failed: {}", super::error::strerror(ret));
    }
}

/// An open fabric (`fi_fabric`).
pub struct Fabric {
    ptr: *mut sys::fid_fabric,
    info: Info,
}

// SAFETY: endpoints are opened FI_THREAD_SAFE; the fid is only closed in Drop.
unsafe impl Send for Fabric {}
unsafe impl Sync for Fabric {}

impl Fabric {
    pub fn open(info: &Info) -> Result<Arc<Fabric>> {
        let mut ptr = ptr::null_mut();
        // SAFETY: fabric_attr comes from fi_getinfo; ptr receives the new fid.
        check("fi_fabric", unsafe {
            sys::fi_fabric((*info.as_raw()).fabric_attr, &mut ptr, ptr::null_mut())
        } as i64)?;
        Ok(Arc::new(Fabric { ptr, info: info.clone() }))
    }
    pub fn as_raw(&self) -> *mut sys::fid_fabric {
        self.ptr
    }
    pub fn info(&self) -> &Info {
        &self.info
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        // SAFETY: every child holds an Arc<Fabric> (via Domain), so none outlives this close.
        unsafe { close_fid(&mut (*self.ptr).fid, "fabric") }
    }
}

/// An open access domain (`fi_domain`): one per NIC.
pub struct Domain {
    ptr: *mut sys::fid_domain,
    info: Info,
    _fabric: Arc<Fabric>,
}

unsafe impl Send for Domain {}
unsafe impl Sync for Domain {}

impl Domain {
    /// Opens the domain `info` describes (one NIC). Several domains may be open at once.
    pub fn open(fabric: &Arc<Fabric>, info: &Info) -> Result<Arc<Domain>> {
        let mut ptr = ptr::null_mut();
        // SAFETY: fabric is open; info is a valid entry; ptr receives the new fid.
        check("fi_domain", unsafe {
            sys::fi_domain(fabric.ptr, info.as_raw(), &mut ptr, ptr::null_mut())
        } as i64)?;
        Ok(Arc::new(Domain { ptr, info: info.clone(), _fabric: fabric.clone() }))
    }
    pub fn as_raw(&self) -> *mut sys::fid_domain {
        self.ptr
    }
    pub fn info(&self) -> &Info {
        &self.info
    }
    /// `mr_mode` bits the provider asked for.
    pub fn mr_mode(&self) -> u32 {
        self.info.mr_mode()
    }
    pub fn requires(&self, bit: u32) -> bool {
        self.mr_mode() & bit != 0
    }
}

impl Drop for Domain {
    fn drop(&mut self) {
        // SAFETY: every CQ/AV/EP/MR holds an Arc<Domain>, so they are all closed already.
        unsafe { close_fid(&mut (*self.ptr).fid, "domain") }
    }
}
