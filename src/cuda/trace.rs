//! The kernels' side of the event trace ([`crate::trace`]): a device buffer installed as the
//! module global `fep_trace_words` (kernels/include/fep_trace.cuh), read back as host-clock
//! records.

use std::time::{Duration, Instant};

use super::{CudaResult, Device, DeviceBuffer, HostMapped, Stream};
use crate::abi;
use crate::trace::{now_ns, TraceRecord};

/// Whether this build's normal-mode kernels carry their proxy-lane trace points (a diagnosis
/// build: `FEP_TRACE_NORMAL=1`, build.rs). The low-latency kernels always do.
pub const NORMAL_TRACE_POINTS: bool = cfg!(fep_trace_normal);

/// An installed device trace. Dropping it uninstalls the buffer (synchronous copy): drop it only
/// when no traced kernel runs.
pub struct DeviceTrace {
    dev: Device,
    words: DeviceBuffer,
    capacity: u32,
    /// Host clock minus `%globaltimer`, ns ([`DeviceTrace::calibrate`]).
    offset_ns: i64,
}

fn set_global<T: bytemuck::Pod>(dev: &Device, name: &str, v: T) -> CudaResult<()> {
    let (ptr, bytes) = dev.module_global(name)?;
    if bytes != std::mem::size_of::<T>() {
        return Err(super::CudaError::InvalidArgument {
            arg: "name",
            msg: format!("module global {name} has {bytes} bytes"),
        });
    }
    // SAFETY: the module global lives as long as the loaded module (the device's).
    let mut view = unsafe { DeviceBuffer::view(dev, ptr, bytes) };
    view.copy_from_host(&[v])
}

impl DeviceTrace {
    /// Installs a trace of up to `capacity` records and measures the clock offset.
    pub fn install(dev: &Device, capacity: u32) -> CudaResult<Self> {
        let words = DeviceBuffer::zeroed(dev, (1 + 2 * capacity as usize) * 8)?;
        let offset_ns = Self::calibrate(dev)?;
        set_global(dev, "fep_trace_capacity", capacity)?;
        set_global(dev, "fep_trace_words", words.device_ptr())?;
        Ok(DeviceTrace { dev: dev.clone(), words, capacity, offset_ns })
    }

    /// Host clock minus `%globaltimer` in ns: a kernel stores the timer into mapped host memory
    /// again and again while this thread spins on it; each new value `g` seen at host time `h`
    /// was stored before `h`, so `h - g` bounds the offset from above, and the smallest such
    /// bound (within the store's visibility latency, about a microsecond) is taken.
    pub fn calibrate(dev: &Device) -> CudaResult<i64> {
        let m = HostMapped::new(dev, 16)?;
        let words = m.as_ptr() as *const u64;
        let stream = Stream::new(dev)?;
        let p = abi::fep_trace_clock_params { out: m.device_ptr(), iters: 20_000, _pad: 0 };
        // SAFETY: `m` outlives the kernel (synchronised below).
        unsafe { super::launch::trace_clock(&stream, p)? };
        let mut best = i64::MAX;
        let mut last = 0u64;
        let start = Instant::now();
        // SAFETY: `words` points at 16 bytes of mapped memory the kernel writes; volatile reads.
        while unsafe { std::ptr::read_volatile(words.add(1)) } == 0
            && start.elapsed() < Duration::from_secs(5)
        {
            let g = unsafe { std::ptr::read_volatile(words) };
            let h = now_ns();
            if g != 0 && g != last {
                best = best.min(h - g as i64);
                last = g;
            }
        }
        stream.synchronize_within(Duration::from_secs(10))?;
        if best == i64::MAX {
            return Err(super::CudaError::InvalidArgument {
                arg: "trace",
                msg: "clock calibration saw no timer value".into(),
            });
        }
        Ok(best)
    }

    /// Host clock minus device clock, ns.
    pub fn offset_ns(&self) -> i64 {
        self.offset_ns
    }

    /// Forgets the records taken so far (synchronous; no traced kernel may run).
    pub fn clear(&self) -> CudaResult<()> {
        // SAFETY: the first word of our own buffer.
        let mut view = unsafe { DeviceBuffer::view(&self.dev, self.words.device_ptr(), 8) };
        view.copy_from_host(&[0u64])
    }

    /// The records so far, on the host clock, in the order they were taken (synchronous copy;
    /// call after the traced work has finished).
    pub fn read(&self) -> CudaResult<Vec<TraceRecord>> {
        let w: Vec<u64> = self.words.to_vec()?;
        let n = (w[0] as usize).min(self.capacity as usize);
        Ok((0..n)
            .map(|i| TraceRecord::from_word(w[1 + 2 * i] as i64 + self.offset_ns, w[2 + 2 * i]))
            .collect())
    }
}

impl Drop for DeviceTrace {
    fn drop(&mut self) {
        let _ = set_global(&self.dev, "fep_trace_words", 0u64);
    }
}
