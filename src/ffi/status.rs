//! Status codes, the thread-local last-error message, and the panic boundary.

use std::cell::RefCell;
use std::ffi::CString;
use std::os::raw::c_char;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::error::Error;

/// Every `fep_*` call returns one of these. Errors live in their own range (7000..7100) so they
/// cannot be confused with errno, CUresult or libfabric codes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum fep_status {
    FEP_OK = 0,
    FEP_ERR_INVALID_ARGUMENT = 7001,
    FEP_ERR_TIMEOUT = 7002,
    FEP_ERR_FABRIC = 7003,
    FEP_ERR_CUDA = 7004,
    FEP_ERR_BOOTSTRAP = 7005,
    FEP_ERR_CONFIG_MISMATCH = 7006,
    FEP_ERR_PROTOCOL = 7007,
    FEP_ERR_PROXY = 7008,
    FEP_ERR_PANIC = 7009,
    FEP_ERR_VERSION = 7010,
    FEP_ERR_INTERNAL = 7011,
}

pub use fep_status::*;

impl From<&Error> for fep_status {
    fn from(e: &Error) -> Self {
        match e {
            Error::InvalidArgument { .. } => FEP_ERR_INVALID_ARGUMENT,
            Error::Timeout { .. } => FEP_ERR_TIMEOUT,
            Error::Fabric(_) => FEP_ERR_FABRIC,
            Error::Cuda(_) => FEP_ERR_CUDA,
            Error::Bootstrap(_) => FEP_ERR_BOOTSTRAP,
            Error::ConfigMismatch(_) => FEP_ERR_CONFIG_MISMATCH,
            Error::Protocol { .. } => FEP_ERR_PROTOCOL,
            Error::Proxy(_) => FEP_ERR_PROXY,
            Error::Upstream { source, .. } => fep_status::from(&**source),
            Error::Other(_) => FEP_ERR_INTERNAL,
        }
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

pub(crate) fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

/// Runs `f` inside the panic boundary: errors and panics become a status plus the thread's
/// last-error message; success clears the message.
pub(crate) fn guard(f: impl FnOnce() -> Result<(), Error>) -> fep_status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => {
            set_last_error("");
            FEP_OK
        }
        Ok(Err(e)) => {
            set_last_error(&e.to_string());
            fep_status::from(&e)
        }
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_last_error(&format!("internal panic (a fabric-ep bug): {what}"));
            FEP_ERR_PANIC
        }
    }
}

/// Frees a boxed object handed out to C, inside the panic boundary (a `_destroy` returns
/// nothing, so a panic in a destructor is recorded as the thread's last error and swallowed).
///
/// # Safety
/// `p` must come from `Box::into_raw` and not be used afterwards.
pub(crate) unsafe fn free_boxed<T>(p: *mut T) {
    let p = p as usize;
    if let Err(e) = catch_unwind(move || drop(Box::from_raw(p as *mut T))) {
        let what = e.downcast_ref::<&str>().map_or("unknown panic", |s| s);
        set_last_error(&format!("internal panic (a fabric-ep bug) in a destroy call: {what}"));
    }
}

/// A static, human-readable name for a status (any integer is accepted).
#[no_mangle]
pub extern "C" fn fep_status_string(status: i32) -> *const c_char {
    const ALL: [fep_status; 12] = [
        FEP_OK,
        FEP_ERR_INVALID_ARGUMENT,
        FEP_ERR_TIMEOUT,
        FEP_ERR_FABRIC,
        FEP_ERR_CUDA,
        FEP_ERR_BOOTSTRAP,
        FEP_ERR_CONFIG_MISMATCH,
        FEP_ERR_PROTOCOL,
        FEP_ERR_PROXY,
        FEP_ERR_PANIC,
        FEP_ERR_VERSION,
        FEP_ERR_INTERNAL,
    ];
    let Some(status) = ALL.iter().copied().find(|s| *s as i32 == status) else {
        return c"unknown status".as_ptr();
    };
    let s: &'static [u8] = match status {
        FEP_OK => b"ok\0",
        FEP_ERR_INVALID_ARGUMENT => b"invalid argument\0",
        FEP_ERR_TIMEOUT => b"timed out waiting for a peer\0",
        FEP_ERR_FABRIC => b"libfabric error\0",
        FEP_ERR_CUDA => b"CUDA error\0",
        FEP_ERR_BOOTSTRAP => b"bootstrap error\0",
        FEP_ERR_CONFIG_MISMATCH => b"ranks have different configurations\0",
        FEP_ERR_PROTOCOL => b"protocol error (bad data from a peer)\0",
        FEP_ERR_PROXY => b"proxy error\0",
        FEP_ERR_PANIC => b"internal panic\0",
        FEP_ERR_VERSION => b"ABI version or struct size mismatch\0",
        FEP_ERR_INTERNAL => b"internal error\0",
    };
    s.as_ptr().cast()
}

/// The message of the last failed call on this thread ("" after a success). The pointer stays
/// valid until the next `fep_*` call on this thread.
#[no_mangle]
pub extern "C" fn fep_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}
