//! Device buffers, pinned host buffers mapped into the GPU, and sharing device memory with
//! peers: CUDA IPC between processes, direct pointers within one process.

use super::device::Device;
use super::driver::{call, CUdeviceptr};
use super::stream::Stream;
use super::{CudaError, CudaResult};
use bytemuck::Pod;
use cudarc::driver::sys;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

fn bad(arg: &'static str, msg: String) -> CudaError {
    CudaError::InvalidArgument { arg, msg }
}

/// Enqueues a strided copy on `stream`: `height` rows of `width` bytes, row `i` from
/// `src + i * src_pitch` to `dst + i * dst_pitch` (`cuMemcpy2DAsync`). Either side may be device
/// memory or page-locked host memory (unified addressing names both); nothing is enqueued for an
/// empty copy.
///
/// # Safety
/// Both ranges are valid for the copy and stay so until the stream has reached it; a host side
/// is page-locked.
pub unsafe fn copy_2d_async(
    stream: &Stream,
    dst: u64,
    dst_pitch: usize,
    src: u64,
    src_pitch: usize,
    width: usize,
    height: usize,
) -> CudaResult<()> {
    if width == 0 || height == 0 {
        return Ok(());
    }
    if dst_pitch < width || src_pitch < width {
        return Err(bad(
            "pitch",
            format!("rows of {width} bytes with pitches {dst_pitch} (dst) / {src_pitch} (src)"),
        ));
    }
    if height == 1 || (dst_pitch == width && src_pitch == width) {
        // One contiguous range: the plain copy (no pitch limits apply).
        stream.device().bind()?;
        return call!(cuMemcpyAsync(dst, src, width * height, stream.as_raw()));
    }
    let p = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
        srcHost: std::ptr::null(),
        srcDevice: src,
        srcArray: std::ptr::null_mut(),
        srcPitch: src_pitch,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst,
        dstArray: std::ptr::null_mut(),
        dstPitch: dst_pitch,
        WidthInBytes: width,
        Height: height,
    };
    stream.device().bind()?;
    call!(cuMemcpy2DAsync_v2(&p, stream.as_raw()))
}

/// Enqueues `len` bytes at device address `dst` set to `byte` on `stream`.
///
/// # Safety
/// The range is device memory that stays valid until the stream has reached the set.
pub unsafe fn memset_range_async(
    stream: &Stream,
    dst: u64,
    byte: u8,
    len: usize,
) -> CudaResult<()> {
    if len == 0 {
        return Ok(());
    }
    stream.device().bind()?;
    call!(cuMemsetD8Async(dst, byte, len, stream.as_raw()))
}

/// Enqueues `height` rows of `words` 32-bit values `value` at `dst + i * pitch` on `stream`
/// (`cuMemsetD2D32Async`; `dst` and `pitch` 4-byte aligned).
///
/// # Safety
/// Every row lies in device memory that stays valid until the stream has reached the set.
pub unsafe fn memset_2d_u32_async(
    stream: &Stream,
    dst: u64,
    pitch: usize,
    value: u32,
    words: usize,
    height: usize,
) -> CudaResult<()> {
    if words == 0 || height == 0 {
        return Ok(());
    }
    if dst % 4 != 0 || pitch % 4 != 0 || pitch < 4 * words {
        return Err(bad(
            "dst",
            format!("{words} words per row at {dst:#x}, pitch {pitch}: 4-byte aligned rows needed"),
        ));
    }
    stream.device().bind()?;
    call!(cuMemsetD2D32Async(dst, pitch, value, words, height, stream.as_raw()))
}

/// Device memory (`cuMemAlloc`). A zero-length buffer holds no allocation (pointer 0).
/// NOTES: Drop calls `cuMemFree`; keep a buffer alive until the streams that use it have
/// synchronised (the launchers in [`super::launch`] are `unsafe` for exactly this reason).
pub struct DeviceBuffer {
    dev: Device,
    ptr: CUdeviceptr,
    len: usize,
}

// SAFETY: a device pointer is plain data; the allocation is freed once, by Drop.
unsafe impl Send for DeviceBuffer {}
// SAFETY: shared access only reads the pointer; data races on device memory are the kernels'.
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// `len` bytes, uninitialised.
    pub fn new(dev: &Device, len: usize) -> CudaResult<DeviceBuffer> {
        dev.bind()?;
        let mut ptr = 0;
        if len > 0 {
            // SAFETY: context bound; out-pointer valid.
            unsafe { call!(cuMemAlloc_v2(&mut ptr, len))? };
        }
        Ok(DeviceBuffer { dev: dev.clone(), ptr, len })
    }

    /// `len` bytes of zeros.
    pub fn zeroed(dev: &Device, len: usize) -> CudaResult<DeviceBuffer> {
        let b = Self::new(dev, len)?;
        b.memset(0)?;
        Ok(b)
    }

    /// A copy of `data`.
    pub fn from_slice<T: Pod>(dev: &Device, data: &[T]) -> CudaResult<DeviceBuffer> {
        let mut b = Self::new(dev, std::mem::size_of_val(data))?;
        b.copy_from_host(data)?;
        Ok(b)
    }

    pub fn device(&self) -> &Device {
        &self.dev
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The device address (what kernel parameter structs carry).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// A non-owning view of `len` bytes of device memory at `ptr` that something else allocated
    /// (a framework's tensor, another rank's buffer in this process): what the launchers take,
    /// never freed by this value (it is wrapped in `ManuallyDrop`).
    ///
    /// # Safety
    /// `ptr..ptr + len` is device memory of `dev`'s context that stays allocated while the view
    /// and every launch made with it are alive; the view must never be taken out of its
    /// `ManuallyDrop` and dropped.
    pub unsafe fn view(dev: &Device, ptr: u64, len: usize) -> std::mem::ManuallyDrop<DeviceBuffer> {
        std::mem::ManuallyDrop::new(DeviceBuffer { dev: dev.clone(), ptr, len })
    }

    /// Copy host -> device of exactly `len` bytes, finished when it returns ([`Device::blocking`]).
    pub fn copy_from_host<T: Pod>(&mut self, src: &[T]) -> CudaResult<()> {
        let bytes: &[u8] = bytemuck::cast_slice(src);
        if bytes.len() != self.len {
            return Err(bad(
                "src",
                format!("{} bytes for a {}-byte buffer", bytes.len(), self.len),
            ));
        }
        if self.len == 0 {
            return Ok(());
        }
        // SAFETY: both ranges are `len` bytes and valid; `bytes` outlives the wait.
        self.dev.blocking(|s| unsafe {
            call!(cuMemcpyHtoDAsync_v2(self.ptr, bytes.as_ptr().cast(), self.len, s))
        })
    }

    /// Copy device -> host of exactly `len` bytes, finished when it returns. Not ordered against
    /// other streams: synchronise the stream that wrote the buffer first.
    pub fn copy_to_host<T: Pod>(&self, dst: &mut [T]) -> CudaResult<()> {
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(dst);
        if bytes.len() != self.len {
            return Err(bad(
                "dst",
                format!("{} bytes for a {}-byte buffer", bytes.len(), self.len),
            ));
        }
        if self.len == 0 {
            return Ok(());
        }
        // SAFETY: both ranges are `len` bytes and valid; `bytes` outlives the wait.
        self.dev.blocking(|s| unsafe {
            call!(cuMemcpyDtoHAsync_v2(bytes.as_mut_ptr().cast(), self.ptr, self.len, s))
        })
    }

    /// Enqueues a copy of all `len` bytes into `dst` at `offset` (page-locked host memory) on
    /// `stream`; the bytes are there once the stream has reached it.
    ///
    /// NOTES: use this, not [`Self::to_vec`], for reads inside a step when ranks are threads of
    /// one process: the driver serialises pageable device-to-host copies across the process's
    /// threads, so a pageable read here waits behind any peer thread's pageable read that is
    /// queued behind a kernel spinning on this rank (measured on the H200: a thread's pageable
    /// copy took 450 ms while another thread's waited for a 500 ms kernel; page-locked copies,
    /// launches and stream syncs were not held up).
    pub fn copy_to_pinned_async(
        &self,
        dst: &HostMapped,
        offset: usize,
        stream: &Stream,
    ) -> CudaResult<()> {
        if offset.checked_add(self.len).is_none_or(|end| end > dst.len()) {
            return Err(bad(
                "dst",
                format!("{} bytes at {offset} into {} bytes", self.len, dst.len()),
            ));
        }
        if self.len == 0 {
            return Ok(());
        }
        self.dev.bind()?;
        // SAFETY: the destination range lies in `dst`'s page-locked allocation (checked above),
        // which outlives the copy by the caller's stream synchronisation; the source is ours.
        unsafe {
            call!(cuMemcpyDtoHAsync_v2(
                dst.as_ptr().add(offset).cast(),
                self.ptr,
                self.len,
                stream.as_raw()
            ))
        }
    }

    /// The contents as `len / size_of::<T>()` values.
    pub fn to_vec<T: Pod>(&self) -> CudaResult<Vec<T>> {
        let n = std::mem::size_of::<T>();
        if n == 0 || self.len % n != 0 {
            return Err(bad("T", format!("{}-byte buffer is not a whole number of {n}", self.len)));
        }
        let mut v = vec![T::zeroed(); self.len / n];
        self.copy_to_host(&mut v)?;
        Ok(v)
    }

    /// Sets every byte; done when it returns ([`Device::blocking`]). Not ordered against work
    /// queued on other streams: call it when no kernel uses the buffer.
    pub fn memset(&self, byte: u8) -> CudaResult<()> {
        if self.len == 0 {
            return Ok(());
        }
        // SAFETY: range inside the allocation.
        self.dev.blocking(|s| unsafe { call!(cuMemsetD8Async(self.ptr, byte, self.len, s)) })
    }

    /// Sets the first `len` bytes (at most the buffer's); done when it returns, as
    /// [`Self::memset`].
    pub fn memset_prefix(&self, byte: u8, len: usize) -> CudaResult<()> {
        let len = len.min(self.len);
        if len == 0 {
            return Ok(());
        }
        // SAFETY: range inside the allocation.
        self.dev.blocking(|s| unsafe { call!(cuMemsetD8Async(self.ptr, byte, len, s)) })
    }

    /// Sets every byte, ordered on `stream`.
    pub fn memset_async(&self, byte: u8, stream: &Stream) -> CudaResult<()> {
        if self.len == 0 {
            return Ok(());
        }
        self.dev.bind()?;
        // SAFETY: range inside the allocation; stream valid.
        unsafe { call!(cuMemsetD8Async(self.ptr, byte, self.len, stream.as_raw())) }
    }

    /// Copies `other` (same length) into this buffer, device to device; finished when it returns.
    pub fn copy_from_device(&mut self, other: &DeviceBuffer) -> CudaResult<()> {
        if other.len != self.len {
            return Err(bad("other", format!("{} bytes into {}", other.len, self.len)));
        }
        if self.len == 0 {
            return Ok(());
        }
        // SAFETY: both ranges valid and `len` long.
        self.dev
            .blocking(|s| unsafe { call!(cuMemcpyDtoDAsync_v2(self.ptr, other.ptr, self.len, s)) })
    }

    /// An IPC handle another process can open with [`IpcMapping::open`].
    pub fn ipc_handle(&self) -> CudaResult<IpcHandle> {
        if self.len == 0 {
            return Err(bad("self", "cannot export an empty buffer".into()));
        }
        self.dev.bind()?;
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: pointer from cuMemAlloc; out-pointer valid.
        unsafe { call!(cuIpcGetMemHandle(&mut h, self.ptr))? };
        Ok(IpcHandle(h.reserved.map(|c| c as u8)))
    }
}

/// What a peer process needs to reach device address `ptr` of `dev`'s context (a framework's
/// tensor or one of our buffers, anywhere inside a `cuMemAlloc` allocation): the allocation's IPC
/// handle, `ptr`'s offset from the allocation's base, and the allocation's size.
pub fn ipc_export(dev: &Device, ptr: u64) -> CudaResult<(IpcHandle, u64, usize)> {
    if ptr == 0 {
        return Err(bad("ptr", "cannot export a null device pointer".into()));
    }
    dev.bind()?;
    let (mut base, mut size) = (0, 0usize);
    let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: context bound; out-pointers valid; the driver checks that `ptr` is its memory.
    unsafe {
        call!(cuMemGetAddressRange_v2(&mut base, &mut size, ptr))?;
        call!(cuIpcGetMemHandle(&mut h, base))?;
    }
    Ok((IpcHandle(h.reserved.map(|c| c as u8)), ptr - base, size))
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ptr != 0 && self.dev.bind().is_ok() {
            // SAFETY: allocated by cuMemAlloc, freed once.
            unsafe {
                let _ = sys::cuMemFree_v2(self.ptr);
            }
        }
    }
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer({:#x}, {} bytes)", self.ptr, self.len)
    }
}

/// Pinned host memory mapped into the GPU's address space (`cuMemHostAlloc` with DEVICEMAP |
/// PORTABLE): kernels read and write it over PCIe through [`HostMapped::device_ptr`], the CPU
/// through [`HostMapped::as_ptr`]. Zeroed at allocation. Where the proxy's rings, arrival
/// counters and the device error record live.
/// NOTES: the GPU may write it at any time, so it is never exposed as a Rust slice reference;
/// reads and writes are volatile or atomic.
pub struct HostMapped {
    dev: Device,
    host: *mut u8,
    dptr: CUdeviceptr,
    len: usize,
}

// SAFETY: the allocation is plain memory owned by this value.
unsafe impl Send for HostMapped {}
// SAFETY: shared access is volatile/atomic only.
unsafe impl Sync for HostMapped {}

impl HostMapped {
    pub fn new(dev: &Device, len: usize) -> CudaResult<HostMapped> {
        if len == 0 {
            return Err(bad("len", "mapped host buffers must not be empty".into()));
        }
        dev.bind()?;
        let mut p = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: context bound; out-pointer valid.
        unsafe { call!(cuMemHostAlloc(&mut p, len, flags))? };
        let mut m = HostMapped { dev: dev.clone(), host: p.cast(), dptr: 0, len };
        // SAFETY: fresh allocation of `len` bytes; then the device alias of it.
        unsafe {
            std::ptr::write_bytes(m.host, 0, len);
            call!(cuMemHostGetDevicePointer_v2(&mut m.dptr, p, 0))?;
        }
        Ok(m)
    }

    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The CPU address.
    pub fn as_ptr(&self) -> *mut u8 {
        self.host
    }
    /// The GPU address of the same memory.
    pub fn device_ptr(&self) -> u64 {
        self.dptr
    }
    pub fn device(&self) -> &Device {
        &self.dev
    }

    fn check_range<T>(&self, offset: usize) -> CudaResult<()> {
        let n = std::mem::size_of::<T>();
        let align = std::mem::align_of::<T>();
        if offset.checked_add(n).is_none_or(|end| end > self.len) || offset % align != 0 {
            return Err(bad(
                "offset",
                format!("{n} bytes at {offset} (align {align}) in a {}-byte buffer", self.len),
            ));
        }
        Ok(())
    }

    /// Volatile read of a `T` at `offset` (aligned for `T`).
    pub fn read<T: Pod>(&self, offset: usize) -> CudaResult<T> {
        self.check_range::<T>(offset)?;
        // SAFETY: in range and aligned (checked); Pod accepts any bits.
        Ok(unsafe { std::ptr::read_volatile(self.host.add(offset).cast::<T>()) })
    }

    /// Volatile write of a `T` at `offset` (aligned for `T`).
    pub fn write<T: Pod>(&self, offset: usize, v: T) -> CudaResult<()> {
        self.check_range::<T>(offset)?;
        // SAFETY: in range and aligned (checked).
        unsafe { std::ptr::write_volatile(self.host.add(offset).cast::<T>(), v) };
        Ok(())
    }

    /// An atomic view of the u64 at `offset` (8-aligned): for counters and ring indices that
    /// the CPU and the GPU (system-scope loads/stores) share.
    pub fn atomic_u64(&self, offset: usize) -> CudaResult<&AtomicU64> {
        self.check_range::<u64>(offset)?;
        // SAFETY: in range, 8-aligned, lives as long as `self`; all CPU access is atomic.
        Ok(unsafe { &*self.host.add(offset).cast::<AtomicU64>() })
    }

    /// Copies the whole buffer out (volatile byte reads are slow; this is for tests/debug).
    pub fn snapshot(&self) -> Vec<u8> {
        // SAFETY: `len` bytes valid; a racing GPU write gives some mix of old and new bytes.
        (0..self.len).map(|i| unsafe { std::ptr::read_volatile(self.host.add(i)) }).collect()
    }
}

impl Drop for HostMapped {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: allocated by cuMemHostAlloc, freed once.
            unsafe {
                let _ = sys::cuMemFreeHost(self.host.cast());
            }
        }
    }
}

/// A CUDA IPC handle for a device buffer: 64 opaque bytes to send to a peer process (over the
/// bootstrap) that opens it with [`IpcMapping::open`].
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IpcHandle(pub [u8; 64]);

impl IpcHandle {
    pub fn as_bytes(&self) -> &[u8; 64] {
        &self.0
    }
    pub fn from_bytes(b: &[u8]) -> CudaResult<IpcHandle> {
        let a: [u8; 64] = b
            .try_into()
            .map_err(|_| bad("b", format!("{} bytes, an IPC handle is 64", b.len())))?;
        Ok(IpcHandle(a))
    }
    /// Lower-case hex (128 chars), e.g. for an environment variable.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
    pub fn from_hex(s: &str) -> CudaResult<IpcHandle> {
        if s.len() != 128 || !s.is_ascii() {
            return Err(bad("s", format!("{} chars, expected 128 hex digits", s.len())));
        }
        let mut a = [0u8; 64];
        for (i, b) in a.iter_mut().enumerate() {
            *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16)
                .map_err(|e| bad("s", format!("not hex at {}: {e}", 2 * i)))?;
        }
        Ok(IpcHandle(a))
    }
}

impl std::fmt::Debug for IpcHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IpcHandle({}..)", &self.to_hex()[..16])
    }
}

/// A peer process's device buffer opened in this process (`cuIpcOpenMemHandle`); closed on Drop.
/// NOTES: CUDA refuses to open a handle in the process that exported it: for a peer in the same
/// process use [`PeerMemory::Direct`].
pub struct IpcMapping {
    dev: Device,
    ptr: CUdeviceptr,
    len: usize,
}

// SAFETY: plain device address, closed once.
unsafe impl Send for IpcMapping {}
// SAFETY: shared access only reads the address.
unsafe impl Sync for IpcMapping {}

impl IpcMapping {
    /// Opens `handle`; `len` is the exported buffer's length (sent alongside the handle).
    pub fn open(dev: &Device, handle: &IpcHandle, len: usize) -> CudaResult<IpcMapping> {
        dev.bind()?;
        let h = sys::CUipcMemHandle { reserved: handle.0.map(|b| b as std::ffi::c_char) };
        let mut ptr = 0;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: context bound; out-pointer valid.
        unsafe { call!(cuIpcOpenMemHandle_v2(&mut ptr, h, flags))? };
        Ok(IpcMapping { dev: dev.clone(), ptr, len })
    }
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Synchronous copy out of the peer's buffer (tests, debugging).
    pub fn copy_to_host(&self, dst: &mut [u8]) -> CudaResult<()> {
        if dst.len() > self.len {
            return Err(bad(
                "dst",
                format!("{} bytes from a {}-byte mapping", dst.len(), self.len),
            ));
        }
        // SAFETY: range inside the mapping; `dst` outlives the wait.
        self.dev.blocking(|s| unsafe {
            call!(cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), self.ptr, dst.len(), s))
        })
    }

    /// Synchronous copy into the peer's buffer (tests, debugging).
    pub fn copy_from_host(&self, src: &[u8]) -> CudaResult<()> {
        if src.len() > self.len {
            return Err(bad(
                "src",
                format!("{} bytes into a {}-byte mapping", src.len(), self.len),
            ));
        }
        // SAFETY: range inside the mapping; `src` outlives the wait.
        self.dev.blocking(|s| unsafe {
            call!(cuMemcpyHtoDAsync_v2(self.ptr, src.as_ptr().cast(), src.len(), s))
        })
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: opened by cuIpcOpenMemHandle, closed once.
            unsafe {
                let _ = sys::cuIpcCloseMemHandle(self.ptr);
            }
        }
    }
}

/// A peer rank's buffer as this rank's kernels address it: the buffer itself when the peer
/// lives in this process (after [`Device::enable_peer_access`] if on another GPU), or an IPC
/// mapping of another process's buffer.
pub enum PeerMemory {
    Direct(Arc<DeviceBuffer>),
    Ipc(IpcMapping),
}

impl PeerMemory {
    /// A same-process peer's buffer, usable from `dev`'s kernels (enables peer access when the
    /// buffer lives on another GPU).
    pub fn direct(dev: &Device, buf: Arc<DeviceBuffer>) -> CudaResult<PeerMemory> {
        if !dev.can_access_peer(buf.device())? {
            return Err(bad(
                "buf",
                format!(
                    "device {} cannot access device {}'s memory",
                    dev.ordinal(),
                    buf.device().ordinal()
                ),
            ));
        }
        dev.enable_peer_access(buf.device())?;
        Ok(PeerMemory::Direct(buf))
    }

    pub fn device_ptr(&self) -> u64 {
        match self {
            PeerMemory::Direct(b) => b.device_ptr(),
            PeerMemory::Ipc(m) => m.device_ptr(),
        }
    }
    pub fn len(&self) -> usize {
        match self {
            PeerMemory::Direct(b) => b.len(),
            PeerMemory::Ipc(m) => m.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipc_handle_hex_round_trip() {
        let mut a = [0u8; 64];
        for (i, b) in a.iter_mut().enumerate() {
            *b = (i * 37 + 5) as u8;
        }
        let h = IpcHandle(a);
        let s = h.to_hex();
        assert_eq!(s.len(), 128);
        assert_eq!(IpcHandle::from_hex(&s).unwrap(), h);
        assert!(IpcHandle::from_hex(&s[..126]).is_err());
        assert!(IpcHandle::from_hex(&"zz".repeat(64)).is_err());
        assert!(IpcHandle::from_bytes(&a[..63]).is_err());
        assert_eq!(IpcHandle::from_bytes(&a).unwrap(), h);
    }
}
