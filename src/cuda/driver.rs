//! The thin layer: driver start-up (guarded, never panics) and `CUresult` -> [`CudaError`]
//! naming the call. Raw calls stay in `cudarc::driver::sys`.

use super::{CudaError, CudaResult};
use cudarc::driver::sys;
use std::ffi::{CStr, CString};
use std::sync::OnceLock;

pub use cudarc::driver::sys::{CUcontext, CUdeviceptr, CUfunction, CUresult, CUstream};

/// Turns a `CUresult` into a typed error naming `call`.
pub fn check(call: &'static str, r: CUresult) -> CudaResult<()> {
    if r == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    Err(driver_error(call, r))
}

/// The error for a failed call: code, the driver's name and `cuGetErrorString` text.
pub fn driver_error(call: &'static str, r: CUresult) -> CudaError {
    // SAFETY: only reached after `ensure` loaded libcuda (every caller holds a Device); the
    // driver returns static strings.
    let (name, text) = unsafe {
        let mut p: *const std::ffi::c_char = std::ptr::null();
        let name = if sys::cuGetErrorName(r, &mut p) == CUresult::CUDA_SUCCESS && !p.is_null() {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        } else {
            format!("{r:?}")
        };
        let mut p: *const std::ffi::c_char = std::ptr::null();
        let text = if sys::cuGetErrorString(r, &mut p) == CUresult::CUDA_SUCCESS && !p.is_null() {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        } else {
            "unknown error".to_string()
        };
        (name, text)
    };
    CudaError::Driver { call, code: r as u32, name, text }
}

/// Calls a raw driver function and names it in the error: `call!(cuMemAlloc_v2(&mut p, n))`.
macro_rules! call {
    ($f:ident ( $($arg:expr),* $(,)? )) => {
        $crate::cuda::driver::check(stringify!($f), cudarc::driver::sys::$f($($arg),*))
    };
}
pub(crate) use call;

/// Loads libcuda, runs `cuInit` and counts devices, once per process. Returns the device count.
/// NOTES: this is the only gate in front of cudarc; it dlopens libcuda itself first because
/// cudarc's loader panics when the library is missing.
pub fn ensure() -> CudaResult<i32> {
    static STATE: OnceLock<Result<i32, String>> = OnceLock::new();
    STATE.get_or_init(init_once).clone().map_err(CudaError::NoGpu)
}

fn init_once() -> Result<i32, String> {
    let name = CString::new("libcuda.so.1").expect("static name");
    // SAFETY: plain dlopen/dlclose of the driver library; no symbol is used here.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a thread-local C string or null.
        let why = unsafe {
            let e = libc::dlerror();
            if e.is_null() {
                "unknown".to_string()
            } else {
                CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        };
        return Err(format!("cannot load libcuda.so.1 ({why})"));
    }
    // Keep the handle: cudarc opens the same library and we never unload the driver.
    // SAFETY: libcuda is loadable, so cudarc's lazy loader finds it.
    unsafe {
        let r = sys::cuInit(0);
        if r != CUresult::CUDA_SUCCESS {
            return Err(format!("cuInit failed: {}", driver_error("cuInit", r)));
        }
        let mut n = 0;
        let r = sys::cuDeviceGetCount(&mut n);
        if r != CUresult::CUDA_SUCCESS {
            return Err(format!("{}", driver_error("cuDeviceGetCount", r)));
        }
        if n <= 0 {
            return Err("cuDeviceGetCount reports no devices".into());
        }
        Ok(n)
    }
}
