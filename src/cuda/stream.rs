//! Streams and events.

use super::device::Device;
use super::driver::{call, driver_error, CUstream};
use super::{CudaError, CudaResult};
use cudarc::driver::sys;
use parking_lot::Mutex;
use std::time::{Duration, Instant};

/// Streams given back by the owners of [`Stream::kept`] streams: (device ordinal, handle).
/// Never destroyed; a later `Stream::kept` of the same device takes one.
static KEPT: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

/// A non-blocking stream (does not synchronise with the legacy default stream), or a borrowed
/// foreign one ([`Stream::borrowed`]: a caller's `CUstream`, e.g. torch's current stream).
pub struct Stream {
    dev: Device,
    raw: CUstream,
    /// Destroyed on drop (false for a borrowed stream).
    owned: bool,
    /// Given back to [`KEPT`] on drop instead ([`Stream::kept`]).
    kept: bool,
}

// SAFETY: stream handles may be used from any thread.
unsafe impl Send for Stream {}
// SAFETY: as above; the driver serialises calls on one stream.
unsafe impl Sync for Stream {}

impl Stream {
    pub fn new(dev: &Device) -> CudaResult<Stream> {
        dev.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: context bound; out-pointer valid.
        unsafe {
            call!(cuStreamCreate(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32))?
        };
        Ok(Stream { dev: dev.clone(), raw, owned: true, kept: false })
    }

    /// A non-blocking stream that stays valid for the life of the process: dropping it gives it
    /// back to a process-wide list, and the next `kept` stream of the same device is that one.
    /// The stream a buffer lends to a framework (`fep_gpu_info`'s comm stream): torch's caching
    /// allocator records an event on a stream that a tensor was `record_stream`-ed on when that
    /// tensor is freed, which may be after the buffer is gone; a destroyed stream there is a
    /// crash in `cuEventRecord` (seen on the H200 before this: benches that freed such tensors
    /// after `destroy` died so). As many streams exist as buffers were ever alive at once, per
    /// device.
    pub fn kept(dev: &Device) -> CudaResult<Stream> {
        let ord = dev.ordinal();
        let reuse = {
            let mut k = KEPT.lock();
            k.iter().position(|&(d, _)| d == ord).map(|i| k.swap_remove(i).1)
        };
        let raw = match reuse {
            Some(raw) => raw as CUstream,
            None => {
                let mut s = Stream::new_high_priority(dev)?;
                s.owned = false;
                s.raw
            }
        };
        Ok(Stream { dev: dev.clone(), raw, owned: false, kept: true })
    }

    /// A non-blocking stream at the context's greatest priority: as SMs free up, the block
    /// scheduler places its kernels' blocks before pending blocks of lower-priority streams.
    /// The communication stream is one (as DeepEP's). It does not preempt: beside a GEMM whose
    /// blocks stay resident until it ends (cuBLAS's persistent Hopper kernels), a dispatch
    /// still waits for that GEMM (docs/PERFORMANCE.md, "Overlap with a GEMM").
    pub fn new_high_priority(dev: &Device) -> CudaResult<Stream> {
        dev.bind()?;
        let (mut least, mut greatest) = (0i32, 0i32);
        let mut raw = std::ptr::null_mut();
        // SAFETY: context bound; out-pointers valid.
        unsafe {
            call!(cuCtxGetStreamPriorityRange(&mut least, &mut greatest))?;
            call!(cuStreamCreateWithPriority(
                &mut raw,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                greatest
            ))?
        };
        Ok(Stream { dev: dev.clone(), raw, owned: true, kept: false })
    }

    /// Wraps a caller's stream without owning it: never destroyed by this object. NULL is the
    /// legacy default stream.
    ///
    /// # Safety
    /// `raw` must be a stream of `dev`'s primary context (or NULL) that outlives this object and
    /// every use of it.
    pub unsafe fn borrowed(dev: &Device, raw: CUstream) -> Stream {
        Stream { dev: dev.clone(), raw, owned: false, kept: false }
    }

    pub fn device(&self) -> &Device {
        &self.dev
    }
    pub fn as_raw(&self) -> CUstream {
        self.raw
    }

    /// True when all work queued so far has finished.
    pub fn query(&self) -> CudaResult<bool> {
        self.dev.bind()?;
        // SAFETY: stream valid.
        match unsafe { sys::cuStreamQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => Err(driver_error("cuStreamQuery", r)),
        }
    }

    /// True while the stream is being captured into a CUDA graph (work is recorded, not run).
    pub fn is_capturing(&self) -> CudaResult<bool> {
        self.dev.bind()?;
        let mut st = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: stream valid; out-pointer valid.
        unsafe { call!(cuStreamIsCapturing(self.raw, &mut st))? };
        Ok(st != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Blocks until the stream is idle (unbounded on the host; kernels bound their own waits).
    pub fn synchronize(&self) -> CudaResult<()> {
        self.dev.bind()?;
        // SAFETY: stream valid.
        unsafe { call!(cuStreamSynchronize(self.raw)) }
    }

    /// Polls the stream until idle or `limit` passes (then `CudaError::Timeout`). The bounded
    /// host-side wait for code that must never hang.
    pub fn synchronize_within(&self, limit: Duration) -> CudaResult<()> {
        poll_within(limit, "cuStreamQuery", || self.query())
    }

    /// Makes later work on this stream wait for `event`.
    pub fn wait_event(&self, event: &Event) -> CudaResult<()> {
        self.dev.bind()?;
        // SAFETY: both handles valid.
        unsafe { call!(cuStreamWaitEvent(self.raw, event.raw, 0)) }
    }

    /// Makes later work on this stream wait for a caller's event (e.g. a `torch.cuda.Event`'s
    /// `cuda_event`), as recorded at the time of this call.
    ///
    /// # Safety
    /// `event` must be a valid event of this stream's context.
    pub unsafe fn wait_raw_event(&self, event: sys::CUevent) -> CudaResult<()> {
        self.dev.bind()?;
        call!(cuStreamWaitEvent(self.raw, event, 0))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.kept {
            KEPT.lock().push((self.dev.ordinal(), self.raw as usize));
            return;
        }
        // SAFETY: created by cuStreamCreate; destroy returns at once and the driver frees the
        // stream once its work is done.
        unsafe {
            if self.owned && self.dev.bind().is_ok() {
                let _ = sys::cuStreamDestroy_v2(self.raw);
            }
        }
    }
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stream({:p})", self.as_raw())
    }
}

/// A CUDA event; with timing enabled, [`Event::elapsed_ms`] measures between two of them.
pub struct Event {
    dev: Device,
    raw: sys::CUevent,
}

// SAFETY: event handles may be used from any thread.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    /// A timing event.
    pub fn new(dev: &Device) -> CudaResult<Event> {
        Self::with_flags(dev, sys::CUevent_flags::CU_EVENT_DEFAULT as u32)
    }
    /// An event without timing (cheaper for pure ordering).
    pub fn new_untimed(dev: &Device) -> CudaResult<Event> {
        Self::with_flags(dev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
    }
    fn with_flags(dev: &Device, flags: u32) -> CudaResult<Event> {
        dev.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: context bound; out-pointer valid.
        unsafe { call!(cuEventCreate(&mut raw, flags))? };
        Ok(Event { dev: dev.clone(), raw })
    }

    pub fn record(&self, stream: &Stream) -> CudaResult<()> {
        self.dev.bind()?;
        // SAFETY: both handles valid.
        unsafe { call!(cuEventRecord(self.raw, stream.as_raw())) }
    }

    pub fn synchronize(&self) -> CudaResult<()> {
        self.dev.bind()?;
        // SAFETY: event valid.
        unsafe { call!(cuEventSynchronize(self.raw)) }
    }

    /// True when the work the last `record` captured has finished (or nothing was recorded).
    pub fn query(&self) -> CudaResult<bool> {
        self.dev.bind()?;
        // SAFETY: event valid.
        match unsafe { sys::cuEventQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => Err(driver_error("cuEventQuery", r)),
        }
    }

    /// Polls the event until complete or `limit` passes (then `CudaError::Timeout`).
    pub fn synchronize_within(&self, limit: Duration) -> CudaResult<()> {
        poll_within(limit, "cuEventQuery", || self.query())
    }

    /// Milliseconds from `self` to `end` (both recorded and complete).
    pub fn elapsed_ms(&self, end: &Event) -> CudaResult<f32> {
        self.dev.bind()?;
        let mut ms = 0f32;
        // SAFETY: both events valid; out-pointer valid.
        unsafe { call!(cuEventElapsedTime_v2(&mut ms, self.raw, end.raw))? };
        Ok(ms)
    }

    pub fn as_raw(&self) -> sys::CUevent {
        self.raw
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by cuEventCreate.
        unsafe {
            if self.dev.bind().is_ok() {
                let _ = sys::cuEventDestroy_v2(self.raw);
            }
        }
    }
}

/// How long [`poll_within`] polls back to back, then with a yield between polls, before it
/// sleeps between them.
const POLL_SPIN: Duration = Duration::from_micros(300);
const POLL_YIELD: Duration = Duration::from_millis(5);
/// The sleep between polls after [`POLL_YIELD`].
const POLL_SLEEP: Duration = Duration::from_micros(50);

/// Calls `done` until it says true or `limit` passes (then `CudaError::Timeout` naming `call`):
/// polls back to back for [`POLL_SPIN`], then yields the core between polls until
/// [`POLL_YIELD`], then sleeps [`POLL_SLEEP`] between polls.
///
/// NOTES (why spin first): a fresh normal dispatch waits here once for the counts its notify
/// kernel produces, typically 10-100 us after the launch. A sleep overshoots by its own length
/// plus the timer's slack (one 50 us sleep was most of a 1-rank step's overhead), so the
/// first stretch is spent polling; a wait that lasts milliseconds is a slow peer, and there a
/// core is worth more to the peer (ranks may share few cores) than a few microseconds of
/// latency.
pub(crate) fn poll_within(
    limit: Duration,
    call: &'static str,
    mut done: impl FnMut() -> CudaResult<bool>,
) -> CudaResult<()> {
    let start = Instant::now();
    loop {
        if done()? {
            return Ok(());
        }
        let waited = start.elapsed();
        if waited >= limit {
            return Err(CudaError::Timeout { call, waited });
        }
        if waited < POLL_SPIN {
            std::hint::spin_loop();
        } else if waited < POLL_YIELD {
            std::thread::yield_now();
        } else {
            std::thread::sleep(POLL_SLEEP);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[test]
    fn poll_within_returns_once_done_and_times_out_naming_the_call() {
        // Done only after 8 ms: through the spinning and yielding phases into the sleeping one.
        let (n, t0) = (Cell::new(0u32), Instant::now());
        poll_within(Duration::from_secs(5), "probe", || {
            n.set(n.get() + 1);
            Ok(t0.elapsed() >= Duration::from_millis(8))
        })
        .unwrap();
        assert!(n.get() > 1);
        let t = Instant::now();
        match poll_within(Duration::from_millis(20), "probe", || Ok(false)) {
            Err(CudaError::Timeout { call, waited }) => {
                assert_eq!(call, "probe");
                assert!(waited >= Duration::from_millis(20), "{waited:?}");
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(t.elapsed() < Duration::from_secs(5));
        // An error from the query ends the wait at once, unchanged.
        let e = poll_within(Duration::from_secs(5), "probe", || {
            Err(CudaError::Timeout { call: "inner", waited: Duration::ZERO })
        });
        assert!(matches!(e, Err(CudaError::Timeout { call: "inner", .. })), "{e:?}");
    }
}
