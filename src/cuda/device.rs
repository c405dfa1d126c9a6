//! A GPU: its retained primary context, a few attributes, and the embedded kernel module
//! (loaded once per context, on first use).

use super::driver::{call, ensure, CUcontext, CUfunction, CUstream};
use super::module::{Kernel, Module};
use super::{CudaError, CudaResult};
use cudarc::driver::sys;
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Duration;

/// One CUDA device (cheap to clone: an `Arc`). Owns a retained primary context, released when
/// the last clone and every object made from it are gone.
#[derive(Clone)]
pub struct Device {
    inner: Arc<DeviceInner>,
}

/// How long [`Device::blocking`] waits for its copy or fill: generous for gigabytes through
/// pageable memory, and a bound where a stuck device would otherwise hang the caller.
pub const BLOCKING_LIMIT: Duration = Duration::from_secs(120);

struct DeviceInner {
    ordinal: usize,
    dev: sys::CUdevice,
    ctx: CUcontext,
    name: String,
    sm_count: u32,
    cc: (u32, u32),
    max_dynamic_smem: u32,
    module: Mutex<Option<Module>>,
    /// A private non-blocking stream for the "synchronous" copies and fills of
    /// [`super::DeviceBuffer`] (made on first use): see [`Device::blocking`].
    sync_stream: Mutex<Option<SyncStream>>,
}

/// The raw handle of [`DeviceInner::sync_stream`].
struct SyncStream(CUstream);
// SAFETY: a stream handle may be used from any thread; the driver serialises calls on it.
unsafe impl Send for SyncStream {}

// SAFETY: a CUcontext may be made current on any thread; the driver is thread-safe.
unsafe impl Send for DeviceInner {}
// SAFETY: as above; the module is behind a mutex.
unsafe impl Sync for DeviceInner {}

impl Device {
    /// Opens device `ordinal` (retains its primary context).
    pub fn new(ordinal: usize) -> CudaResult<Device> {
        let count = ensure()? as usize;
        if ordinal >= count {
            return Err(CudaError::InvalidArgument {
                arg: "ordinal",
                msg: format!("device {ordinal} requested, {count} visible"),
            });
        }
        // SAFETY: the driver is initialised (`ensure`); out-pointers are valid locals.
        unsafe {
            let mut dev = 0;
            call!(cuDeviceGet(&mut dev, ordinal as i32))?;
            let mut ctx = std::ptr::null_mut();
            call!(cuDevicePrimaryCtxRetain(&mut ctx, dev))?;
            let inner = DeviceInner {
                ordinal,
                dev,
                ctx,
                name: String::new(),
                sm_count: 0,
                cc: (0, 0),
                max_dynamic_smem: 0,
                module: Mutex::new(None),
                sync_stream: Mutex::new(None),
            };
            // From here on Drop releases the context, also on the error paths below.
            let mut inner = inner;
            let mut buf = [0 as std::ffi::c_char; 256];
            call!(cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, dev))?;
            inner.name = std::ffi::CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned();
            inner.sm_count =
                attribute(dev, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
            inner.cc = (
                attribute(
                    dev,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                )?,
                attribute(
                    dev,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                )?,
            );
            // NOTES: kernels declare at most 1 KiB of static shared memory; the rest of the
            // opt-in limit is what launchers may ask for dynamically.
            let optin = attribute(
                dev,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )?;
            inner.max_dynamic_smem = optin.saturating_sub(1024).max(47 * 1024);
            Ok(Device { inner: Arc::new(inner) })
        }
    }

    /// The device for this process: `LOCAL_RANK` (default 0) modulo the number of visible
    /// devices, so several ranks may share one GPU (how the GPU tests run on one-GPU machines).
    pub fn from_env() -> CudaResult<Device> {
        let count = ensure()? as usize;
        let local_rank = match std::env::var("LOCAL_RANK") {
            Ok(v) => v.trim().parse::<usize>().map_err(|_| CudaError::InvalidArgument {
                arg: "LOCAL_RANK",
                msg: format!("{v:?} is not a non-negative integer"),
            })?,
            Err(_) => 0,
        };
        Device::new(local_rank % count)
    }

    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }
    pub fn name(&self) -> &str {
        &self.inner.name
    }
    pub fn sm_count(&self) -> u32 {
        self.inner.sm_count
    }
    /// Compute capability (major, minor), e.g. (9, 0) on an H100/H200.
    pub fn compute_capability(&self) -> (u32, u32) {
        self.inner.cc
    }
    /// Dynamic shared memory a block of the large-shared-memory kernels may ask for (bytes).
    pub fn max_dynamic_smem(&self) -> u32 {
        self.inner.max_dynamic_smem
    }
    /// The raw primary context (escape hatch).
    pub fn as_raw(&self) -> CUcontext {
        self.inner.ctx
    }

    /// Makes this device's context current on the calling thread. Every call in this module
    /// that needs a context does this first, so callers need not.
    pub fn bind(&self) -> CudaResult<()> {
        // SAFETY: the context is retained for the life of `inner`.
        unsafe { call!(cuCtxSetCurrent(self.inner.ctx)) }
    }

    /// Waits for all work on the device. Unbounded on the host side: kernels here bound their
    /// own waits, so this returns; prefer [`super::Stream::synchronize_within`].
    pub fn synchronize(&self) -> CudaResult<()> {
        self.bind()?;
        // SAFETY: context bound above.
        unsafe { call!(cuCtxSynchronize()) }
    }

    /// Runs `enqueue` with this device's private non-blocking stream, then waits for that stream
    /// (bounded by [`BLOCKING_LIMIT`], then `CudaError::Timeout` naming it):
    /// what the "synchronous" copies and fills of device memory use, so that they have really
    /// finished when they return.
    ///
    /// NOTES: the plain driver calls are not enough. `cuMemcpyHtoD` from pageable memory returns
    /// once the bytes are staged, "but the DMA to final destination may not have completed", and
    /// `cuMemsetD8` on device memory is asynchronous to the host (CUDA driver API, "API
    /// synchronization behavior"); both run on the legacy stream, which does not order against
    /// the non-blocking streams the kernels use. A test's input copy then raced the next step's
    /// kernels on the H200 (a dispatch read the last iteration's top-k). A private stream also
    /// keeps these calls out of the legacy stream's implicit joins with a framework's blocking
    /// streams.
    pub fn blocking<F>(&self, enqueue: F) -> CudaResult<()>
    where
        F: FnOnce(CUstream) -> CudaResult<()>,
    {
        self.bind()?;
        let raw = {
            let mut g = self.inner.sync_stream.lock();
            match &*g {
                Some(s) => s.0,
                None => {
                    let mut raw = std::ptr::null_mut();
                    // SAFETY: context bound; out-pointer valid.
                    unsafe {
                        call!(cuStreamCreate(
                            &mut raw,
                            sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32
                        ))?
                    };
                    *g = Some(SyncStream(raw));
                    raw
                }
            }
        };
        enqueue(raw)?;
        // SAFETY: the stream lives until the device's context is released (Drop below); the
        // borrowed wrapper never destroys it.
        let s = unsafe { super::Stream::borrowed(self, raw) };
        super::stream::poll_within(
            BLOCKING_LIMIT,
            "a synchronous copy or fill (Device::blocking)",
            || s.query(),
        )
    }

    /// Free and total device memory in bytes.
    pub fn mem_info(&self) -> CudaResult<(usize, usize)> {
        self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: context bound; out-pointers valid.
        unsafe { call!(cuMemGetInfo_v2(&mut free, &mut total))? };
        Ok((free, total))
    }

    /// Whether this device can map `peer`'s memory directly (same process, two GPUs).
    pub fn can_access_peer(&self, peer: &Device) -> CudaResult<bool> {
        if peer.inner.dev == self.inner.dev {
            return Ok(true);
        }
        let mut ok = 0;
        // SAFETY: both handles valid; out-pointer valid.
        unsafe { call!(cuDeviceCanAccessPeer(&mut ok, self.inner.dev, peer.inner.dev))? };
        Ok(ok != 0)
    }

    /// The GPU's UUID (`cuDeviceGetUuid_v2`): the same in every process and context of one
    /// machine, whatever `CUDA_VISIBLE_DEVICES` numbered it (a MIG instance has its own).
    pub fn uuid(&self) -> CudaResult<[u8; 16]> {
        uuid_of(self.inner.dev)
    }

    /// The GPU's PCI address as the driver writes it (`0000:53:00.0`), for choosing the NICs
    /// nearest to it.
    pub fn pci_bus_id(&self) -> CudaResult<String> {
        let mut buf = [0 as std::ffi::c_char; 32];
        // SAFETY: the handle is valid; the driver writes a NUL-terminated string into `buf`.
        unsafe {
            call!(cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, self.inner.dev))?;
            Ok(std::ffi::CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned())
        }
    }

    /// The ordinal, in this process, of the GPU with `uuid` (`None`: not visible here).
    pub fn ordinal_of_uuid(uuid: &[u8; 16]) -> CudaResult<Option<usize>> {
        let count = ensure()?;
        for i in 0..count {
            let mut d = 0;
            // SAFETY: driver initialised; `i` is below the device count; out-pointer valid.
            unsafe { call!(cuDeviceGet(&mut d, i))? };
            if uuid_of(d)? == *uuid {
                return Ok(Some(i as usize));
            }
        }
        Ok(None)
    }

    /// Whether this device can map the memory of the GPU with `uuid` (`cuDeviceCanAccessPeer`;
    /// true for the same GPU); `None` when that GPU is not visible in this process.
    pub fn can_access_uuid(&self, uuid: &[u8; 16]) -> CudaResult<Option<bool>> {
        if self.uuid()? == *uuid {
            return Ok(Some(true));
        }
        let Some(ord) = Self::ordinal_of_uuid(uuid)? else { return Ok(None) };
        let mut d = 0;
        let mut ok = 0;
        // SAFETY: valid ordinal (found above); out-pointers valid.
        unsafe {
            call!(cuDeviceGet(&mut d, ord as i32))?;
            call!(cuDeviceCanAccessPeer(&mut ok, self.inner.dev, d))?;
        }
        Ok(Some(ok != 0))
    }

    /// Lets kernels on this device dereference `peer`'s device pointers (same process). Enabling
    /// twice is not an error.
    pub fn enable_peer_access(&self, peer: &Device) -> CudaResult<()> {
        if peer.inner.dev == self.inner.dev {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: context bound; peer context retained.
        let r = unsafe { sys::cuCtxEnablePeerAccess(peer.inner.ctx, 0) };
        if r == sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            return Ok(());
        }
        super::driver::check("cuCtxEnablePeerAccess", r)
    }

    /// The kernel's function handle, loading the embedded module on first use.
    pub(crate) fn function(&self, kernel: Kernel) -> CudaResult<CUfunction> {
        self.with_module(|m| Ok(m.function(kernel)))
    }

    /// Loads the kernel module now if it is not loaded yet (it is otherwise loaded at the first
    /// launch). See `GpuBuffer::connect` for why a rank must not load it in the middle of a step.
    pub fn load_module(&self) -> CudaResult<()> {
        self.with_module(|_| Ok(()))
    }

    /// Device address and size of a module global (`extern "C" __device__`), loading the module
    /// on first use.
    pub(crate) fn module_global(&self, name: &str) -> CudaResult<(u64, usize)> {
        self.with_module(|m| m.global(name))
    }

    fn with_module<T>(&self, f: impl FnOnce(&Module) -> CudaResult<T>) -> CudaResult<T> {
        let mut m = self.inner.module.lock();
        if m.is_none() {
            self.bind()?;
            *m = Some(Module::load(self.inner.max_dynamic_smem)?);
        }
        f(m.as_ref().expect("loaded above"))
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("ordinal", &self.inner.ordinal)
            .field("name", &self.inner.name)
            .field("sm_count", &self.inner.sm_count)
            .finish()
    }
}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        // SAFETY: the context is still retained; unload the module inside it, then release.
        unsafe {
            if sys::cuCtxSetCurrent(self.ctx) == sys::CUresult::CUDA_SUCCESS {
                if let Some(s) = self.sync_stream.get_mut().take() {
                    let _ = sys::cuStreamDestroy_v2(s.0);
                }
                if let Some(m) = self.module.get_mut().take() {
                    m.unload();
                }
            }
            let _ = sys::cuDevicePrimaryCtxRelease_v2(self.dev);
        }
    }
}

fn attribute(dev: sys::CUdevice, a: sys::CUdevice_attribute) -> CudaResult<u32> {
    let mut v = 0;
    // SAFETY: valid device handle and out-pointer.
    unsafe { call!(cuDeviceGetAttribute(&mut v, a, dev))? };
    Ok(v.max(0) as u32)
}

fn uuid_of(dev: sys::CUdevice) -> CudaResult<[u8; 16]> {
    let mut u = sys::CUuuid_st { bytes: [0; 16] };
    // SAFETY: valid device handle and out-pointer.
    unsafe { call!(cuDeviceGetUuid_v2(&mut u, dev))? };
    Ok(u.bytes.map(|c| c as u8))
}
