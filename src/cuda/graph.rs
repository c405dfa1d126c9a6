//! CUDA graph capture and replay of a stream's work (the low-latency step is built to be
//! captured: no host synchronisation, device-side epochs).
//!
//! ```no_run
//! # use fabric_ep::cuda::{Device, Stream, Graph};
//! # fn f(dev: &Device, s: &Stream) -> fabric_ep::cuda::CudaResult<()> {
//! let capture = Graph::begin_capture(s)?;
//! // ... launches on `s` (and on streams joined to it through events) ...
//! let graph = capture.end()?;
//! graph.launch(s)?; // replays every captured launch, in the captured order
//! # Ok(()) }
//! ```

use super::device::Device;
use super::driver::call;
use super::stream::Stream;
use super::CudaResult;
use cudarc::driver::sys;

/// An open capture on a stream: launches on it are recorded, not run. End it with
/// [`Capture::end`]; dropping it ends the capture and discards what was recorded.
#[must_use = "a capture records nothing useful until ended"]
pub struct Capture<'a> {
    stream: &'a Stream,
    open: bool,
}

/// An instantiated graph: replay with [`Graph::launch`].
pub struct Graph {
    dev: Device,
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

// SAFETY: graph handles may be used from any thread (launches on one stream are serialised by
// the driver).
unsafe impl Send for Graph {}

impl Graph {
    /// Starts capturing `stream` in thread-local mode: other threads (peer ranks that are
    /// threads of this process) may keep making ordinary CUDA calls meanwhile.
    pub fn begin_capture(stream: &Stream) -> CudaResult<Capture<'_>> {
        stream.device().bind()?;
        // SAFETY: stream valid, context bound.
        unsafe {
            call!(cuStreamBeginCapture_v2(
                stream.as_raw(),
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
            ))?
        };
        Ok(Capture { stream, open: true })
    }

    /// Replays the graph on `stream` (asynchronous, like any launch).
    pub fn launch(&self, stream: &Stream) -> CudaResult<()> {
        self.dev.bind()?;
        // SAFETY: exec and stream valid in this context.
        unsafe { call!(cuGraphLaunch(self.exec, stream.as_raw())) }
    }
}

impl Capture<'_> {
    /// Ends the capture and instantiates the graph.
    pub fn end(mut self) -> CudaResult<Graph> {
        self.open = false;
        let dev = self.stream.device().clone();
        dev.bind()?;
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: the stream is capturing (begin_capture); out-pointer valid.
        unsafe { call!(cuStreamEndCapture(self.stream.as_raw(), &mut graph))? };
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: graph valid (just captured); out-pointer valid.
        if let Err(e) = unsafe { call!(cuGraphInstantiateWithFlags(&mut exec, graph, 0)) } {
            // SAFETY: graph came from cuStreamEndCapture and is not used again.
            unsafe {
                let _ = sys::cuGraphDestroy(graph);
            }
            return Err(e);
        }
        Ok(Graph { dev, graph, exec })
    }
}

impl Drop for Capture<'_> {
    fn drop(&mut self) {
        if !self.open {
            return;
        }
        // SAFETY: the stream is capturing; whatever was recorded is destroyed at once.
        unsafe {
            if self.stream.device().bind().is_ok() {
                let mut g: sys::CUgraph = std::ptr::null_mut();
                if sys::cuStreamEndCapture(self.stream.as_raw(), &mut g)
                    == sys::CUresult::CUDA_SUCCESS
                    && !g.is_null()
                {
                    let _ = sys::cuGraphDestroy(g);
                }
            }
        }
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: both made by `Capture::end`; a launched graph may be destroyed while it runs
        // (the driver keeps what the launch needs).
        unsafe {
            if self.dev.bind().is_ok() {
                let _ = sys::cuGraphExecDestroy(self.exec);
                let _ = sys::cuGraphDestroy(self.graph);
            }
        }
    }
}
