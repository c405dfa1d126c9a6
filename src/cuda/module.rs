//! The kernels' fatbin, built by build.rs and embedded here, loaded once per context.

use super::driver::{call, CUfunction};
use super::CudaResult;
use cudarc::driver::sys;

#[repr(C, align(64))]
struct Aligned<T: ?Sized>(T);

// NOTES: the driver reads the image in place and wants it 8-byte aligned at least; include_bytes!
// gives alignment 1, hence the wrapper.
static FATBIN_ALIGNED: &Aligned<[u8]> =
    &Aligned(*include_bytes!(concat!(env!("OUT_DIR"), "/fep_kernels.fatbin")));

/// The embedded fatbin (sm_90 SASS + PTX by default; see build.rs).
pub static FATBIN: &[u8] = &FATBIN_ALIGNED.0;

/// Every kernel in the fatbin. Each has a typed launcher in [`super::launch`]. The test kernels
/// and the bench's baselines exist only with the `bench-kernels` feature (build.rs compiles
/// their kernels/*.cu only then).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    DispatchLayout,
    DispatchLayoutCluster,
    #[cfg(feature = "bench-kernels")]
    WaitTest,
    #[cfg(feature = "bench-kernels")]
    WaitPackedTest,
    #[cfg(feature = "bench-kernels")]
    RingPushTest,
    #[cfg(feature = "bench-kernels")]
    ProxyExchangeTest,
    #[cfg(feature = "bench-kernels")]
    ProxyPingpong,
    LlDispatchSend,
    LlDispatchRecv,
    LlCombineSend,
    LlCombineRecv,
    NormalNotify,
    NormalDispatch,
    NormalCombine,
    /// `fep_normal_combine` built for at most 2 ranks (more loads in flight per lane).
    NormalCombine2,
    /// `fep_normal_combine` built for 1 rank.
    NormalCombine1,
    #[cfg(feature = "bench-kernels")]
    GatherRows,
    #[cfg(feature = "bench-kernels")]
    SegmentSum,
    TraceClock,
    #[cfg(feature = "bench-kernels")]
    CopyBytes,
}

impl Kernel {
    pub const ALL: &'static [Kernel] = &[
        Kernel::DispatchLayout,
        Kernel::DispatchLayoutCluster,
        #[cfg(feature = "bench-kernels")]
        Kernel::WaitTest,
        #[cfg(feature = "bench-kernels")]
        Kernel::WaitPackedTest,
        #[cfg(feature = "bench-kernels")]
        Kernel::RingPushTest,
        #[cfg(feature = "bench-kernels")]
        Kernel::ProxyExchangeTest,
        #[cfg(feature = "bench-kernels")]
        Kernel::ProxyPingpong,
        Kernel::LlDispatchSend,
        Kernel::LlDispatchRecv,
        Kernel::LlCombineSend,
        Kernel::LlCombineRecv,
        Kernel::NormalNotify,
        Kernel::NormalDispatch,
        Kernel::NormalCombine,
        Kernel::NormalCombine2,
        Kernel::NormalCombine1,
        #[cfg(feature = "bench-kernels")]
        Kernel::GatherRows,
        #[cfg(feature = "bench-kernels")]
        Kernel::SegmentSum,
        Kernel::TraceClock,
        #[cfg(feature = "bench-kernels")]
        Kernel::CopyBytes,
    ];

    /// The `extern "C"` symbol in kernels/*.cu.
    pub const fn symbol(self) -> &'static str {
        match self {
            Kernel::DispatchLayout => "fep_dispatch_layout",
            Kernel::DispatchLayoutCluster => "fep_dispatch_layout_cluster",
            #[cfg(feature = "bench-kernels")]
            Kernel::WaitTest => "fep_wait_test",
            #[cfg(feature = "bench-kernels")]
            Kernel::WaitPackedTest => "fep_wait_packed_test",
            #[cfg(feature = "bench-kernels")]
            Kernel::RingPushTest => "fep_ring_push_test",
            #[cfg(feature = "bench-kernels")]
            Kernel::ProxyExchangeTest => "fep_proxy_exchange_test",
            #[cfg(feature = "bench-kernels")]
            Kernel::ProxyPingpong => "fep_proxy_pingpong",
            Kernel::LlDispatchSend => "fep_ll_dispatch_send",
            Kernel::LlDispatchRecv => "fep_ll_dispatch_recv",
            Kernel::LlCombineSend => "fep_ll_combine_send",
            Kernel::LlCombineRecv => "fep_ll_combine_recv",
            Kernel::NormalNotify => "fep_normal_notify",
            Kernel::NormalDispatch => "fep_normal_dispatch",
            Kernel::NormalCombine => "fep_normal_combine",
            Kernel::NormalCombine2 => "fep_normal_combine_2",
            Kernel::NormalCombine1 => "fep_normal_combine_1",
            #[cfg(feature = "bench-kernels")]
            Kernel::GatherRows => "fep_gather_rows",
            #[cfg(feature = "bench-kernels")]
            Kernel::SegmentSum => "fep_segment_sum",
            Kernel::TraceClock => "fep_trace_clock",
            #[cfg(feature = "bench-kernels")]
            Kernel::CopyBytes => "fep_copy_bytes",
        }
    }
}

pub(crate) struct Module {
    raw: sys::CUmodule,
    functions: [CUfunction; Kernel::ALL.len()],
}

// SAFETY: module and function handles are usable from any thread with the context current.
unsafe impl Send for Module {}

impl Module {
    /// Loads the fatbin into the current context, looks every kernel up, and lets the kernels
    /// with large dynamic shared memory use up to `max_dynamic_smem` bytes.
    pub(crate) fn load(max_dynamic_smem: u32) -> CudaResult<Module> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: a context is current (caller); the image is a valid, aligned fatbin.
        unsafe { call!(cuModuleLoadData(&mut raw, FATBIN.as_ptr().cast()))? };
        let mut m = Module { raw, functions: [std::ptr::null_mut(); Kernel::ALL.len()] };
        for (i, k) in Kernel::ALL.iter().enumerate() {
            let name = std::ffi::CString::new(k.symbol()).expect("no NUL in symbol");
            let mut f = std::ptr::null_mut();
            // SAFETY: module loaded; out-pointer valid.
            if let Err(e) = unsafe { call!(cuModuleGetFunction(&mut f, m.raw, name.as_ptr())) } {
                m.unload();
                return Err(e);
            }
            m.functions[i] = f;
            if matches!(
                k,
                Kernel::DispatchLayout | Kernel::DispatchLayoutCluster | Kernel::NormalDispatch
            ) {
                let a = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
                // SAFETY: valid function handle.
                if let Err(e) = unsafe { call!(cuFuncSetAttribute(f, a, max_dynamic_smem as i32)) }
                {
                    m.unload();
                    return Err(e);
                }
            }
        }
        Ok(m)
    }

    /// Address and size of the module global `name` (an `extern "C" __device__` variable).
    pub(crate) fn global(&self, name: &str) -> CudaResult<(u64, usize)> {
        let c = std::ffi::CString::new(name).expect("no NUL in a symbol");
        let (mut ptr, mut bytes) = (0, 0usize);
        // SAFETY: module loaded; out-pointers valid.
        unsafe { call!(cuModuleGetGlobal_v2(&mut ptr, &mut bytes, self.raw, c.as_ptr()))? };
        Ok((ptr, bytes))
    }

    pub(crate) fn function(&self, k: Kernel) -> CUfunction {
        let i = Kernel::ALL.iter().position(|x| *x == k).expect("every kernel is listed in ALL");
        self.functions[i]
    }

    /// Unloads (the owning context must be current).
    pub(crate) fn unload(mut self) {
        if !self.raw.is_null() {
            // SAFETY: loaded by `load` in the current context; never used again.
            unsafe {
                let _ = sys::cuModuleUnload(self.raw);
            }
            self.raw = std::ptr::null_mut();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs in CI: the fatbin is embedded, is a fatbin, and names every kernel.
    #[test]
    fn fatbin_is_embedded_and_names_every_kernel() {
        assert!(FATBIN.len() > 1024, "fatbin is {} bytes", FATBIN.len());
        assert_eq!(&FATBIN[..4], &0xBA55_ED50u32.to_le_bytes(), "fatbin magic");
        assert_eq!(FATBIN.as_ptr() as usize % 64, 0, "aligned for the driver");
        for k in Kernel::ALL {
            let sym = k.symbol().as_bytes();
            assert!(FATBIN.windows(sym.len()).any(|w| w == sym), "{} missing", k.symbol());
        }
    }
}
