//! Completion queue (`FI_CQ_FORMAT_DATA`): batched reads, decoded error entries, and a stash so
//! completions read while driving progress (e.g. on EAGAIN) are never lost.

use std::collections::VecDeque;
use std::ptr;
use std::sync::Arc;

use libfabric_sys as sys;
use parking_lot::Mutex;

use super::domain::{close_fid, Domain};
use super::error::{check, FabricError, Result, EAGAIN, EAVAIL};

/// One decoded completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The cookie passed when the operation was posted (0 for remote writes).
    pub context: u64,
    /// `FI_*` completion flags.
    pub flags: u64,
    pub len: usize,
    /// Immediate data; meaningful when [`Completion::has_data`].
    pub data: u64,
}

impl Completion {
    /// A remote write that carried immediate data (`FI_REMOTE_CQ_DATA`).
    pub fn has_data(&self) -> bool {
        self.flags & sys::FI_REMOTE_CQ_DATA as u64 != 0
    }
    /// The target side of an RMA write.
    pub fn is_remote_write(&self) -> bool {
        self.flags & sys::FI_REMOTE_WRITE as u64 != 0
    }
    /// A received message (`fi_recv` completed).
    pub fn is_recv(&self) -> bool {
        self.flags & sys::FI_RECV as u64 != 0 && !self.is_remote_write()
    }
    /// A local send or write finished (its buffer may be reused).
    pub fn is_local_tx(&self) -> bool {
        self.flags & (sys::FI_SEND as u64 | sys::FI_WRITE as u64) != 0
    }
}

const BATCH: usize = 64;

/// A completion queue bound to endpoints for transmit and receive.
pub struct CompletionQueue {
    ptr: *mut sys::fid_cq,
    stash: Mutex<VecDeque<Completion>>,
    _domain: Arc<Domain>,
}

unsafe impl Send for CompletionQueue {}
unsafe impl Sync for CompletionQueue {}

impl CompletionQueue {
    /// Opens a CQ of at least `size` entries (0 = provider default).
    pub fn open(domain: &Arc<Domain>, size: usize) -> Result<Arc<CompletionQueue>> {
        let mut attr = sys::fi_cq_attr {
            size,
            format: sys::fi_cq_format_FI_CQ_FORMAT_DATA,
            wait_obj: sys::fi_wait_obj_FI_WAIT_NONE,
            ..Default::default()
        };
        let mut ptr = ptr::null_mut();
        // SAFETY: domain is open; attr is fully initialised; ptr receives the new fid.
        check("fi_cq_open", unsafe {
            sys::fi_cq_open(domain.as_raw(), &mut attr, &mut ptr, ptr::null_mut())
        } as i64)?;
        Ok(Arc::new(CompletionQueue {
            ptr,
            stash: Mutex::new(VecDeque::new()),
            _domain: domain.clone(),
        }))
    }

    pub fn as_raw(&self) -> *mut sys::fid_cq {
        self.ptr
    }

    /// Reads up to `out.len()` completions (stashed ones first) and returns how many; 0 when
    /// none are ready. Drives the provider's progress. A completion-error entry is returned as
    /// [`FabricError::Completion`] with libfabric's decoded text.
    pub fn read(&self, out: &mut [Completion]) -> Result<usize> {
        let mut n = 0;
        {
            let mut stash = self.stash.lock();
            while n < out.len() {
                match stash.pop_front() {
                    Some(c) => {
                        out[n] = c;
                        n += 1
                    }
                    None => break,
                }
            }
        }
        if n == out.len() {
            return Ok(n);
        }
        Ok(n + self.read_raw(&mut out[n..])?)
    }

    /// Drives progress, keeping whatever completes for a later [`read`](Self::read).
    /// Used while a post is back-pressured (EAGAIN): work is never dropped.
    pub fn progress(&self) -> Result<()> {
        let mut buf = [Completion { context: 0, flags: 0, len: 0, data: 0 }; BATCH];
        let n = self.read_raw(&mut buf)?;
        if n > 0 {
            self.stash.lock().extend(buf[..n].iter().copied());
        }
        Ok(())
    }

    fn read_raw(&self, out: &mut [Completion]) -> Result<usize> {
        let want = out.len().min(BATCH);
        let mut raw: [sys::fi_cq_data_entry; BATCH] = unsafe { std::mem::zeroed() };
        // SAFETY: raw has room for `want` FI_CQ_FORMAT_DATA entries.
        let ret = unsafe { sys::fi_cq_read(self.ptr, raw.as_mut_ptr().cast(), want) } as i64;
        if ret == EAGAIN {
            return Ok(0);
        }
        if ret == EAVAIL {
            return Err(self.read_error());
        }
        let n = check("fi_cq_read", ret)? as usize;
        for (o, r) in out.iter_mut().zip(&raw[..n]) {
            *o = Completion {
                context: r.op_context as u64,
                flags: r.flags,
                len: r.len,
                data: r.data,
            };
        }
        Ok(n)
    }

    /// Reads one error entry and decodes it with `fi_cq_strerror`.
    fn read_error(&self) -> FabricError {
        let mut e: sys::fi_cq_err_entry = unsafe { std::mem::zeroed() };
        // SAFETY: e is a valid, zeroed error entry (err_data NULL: the provider may point it at
        // its own storage, valid until the next readerr).
        let ret = unsafe { sys::fi_cq_readerr(self.ptr, &mut e, 0) } as i64;
        if ret < 0 {
            return FabricError::call("fi_cq_readerr", ret, "after fi_cq_read returned -FI_EAVAIL");
        }
        let mut text = super::error::strerror(e.err);
        // SAFETY: fi_cq_strerror returns a provider-owned NUL-terminated string (or NULL).
        unsafe {
            let p = sys::fi_cq_strerror(self.ptr, e.prov_errno, e.err_data, ptr::null_mut(), 0);
            if !p.is_null() {
                let prov = std::ffi::CStr::from_ptr(p).to_string_lossy();
                if !prov.is_empty() {
                    text = format!("{text}: {prov}");
                }
            }
        }
        FabricError::Completion {
            err: e.err,
            prov_errno: e.prov_errno,
            text,
            op_context: e.op_context as u64,
            len: e.len,
            flags: e.flags,
        }
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: endpoints bound to this CQ hold an Arc to it, so they are closed already.
        unsafe { close_fid(&mut (*self.ptr).fid, "cq") }
    }
}
