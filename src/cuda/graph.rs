//! CUDA graphs: capture what a closure enqueues on a stream, instantiate it once, replay it.
//! The low-latency steps are built to be captured (no host synchronisation, device-side epochs
//! and proxy state), so a replay runs a whole step with one launch.

use super::device::Device;
use super::driver::call;
use super::stream::Stream;
use super::{CudaError, CudaResult};
use cudarc::driver::sys;

/// An instantiated graph (and the graph it came from), destroyed on drop.
pub struct GraphExec {
    dev: Device,
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

// SAFETY: graph handles may be used from any thread; launches are ordered by their stream.
unsafe impl Send for GraphExec {}

impl GraphExec {
    /// Captures everything `f` enqueues on `stream` (and on streams it joins through events)
    /// into a graph, instantiates it and returns it with `f`'s value. Thread-local capture mode:
    /// CUDA calls of other threads (other ranks of this process) are not affected. When `f`
    /// fails, the capture is ended and discarded, and `f`'s error is returned.
    pub fn capture<T, E: From<CudaError>>(
        stream: &Stream,
        f: impl FnOnce() -> Result<T, E>,
    ) -> Result<(GraphExec, T), E> {
        let dev = stream.device().clone();
        dev.bind()?;
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // SAFETY: a valid stream of the bound context.
        unsafe { call!(cuStreamBeginCapture_v2(stream.as_raw(), mode)) }?;
        let res = f();
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: the capture began on this stream above; `graph` is an out-pointer.
        let end = unsafe { call!(cuStreamEndCapture(stream.as_raw(), &mut graph)) };
        let value = match (res, end) {
            (Ok(v), Ok(())) => v,
            (res, end) => {
                if !graph.is_null() {
                    // SAFETY: a graph the capture returned, not used elsewhere.
                    unsafe { sys::cuGraphDestroy(graph) };
                }
                return Err(match (res, end) {
                    (Err(e), _) => e,
                    (Ok(_), Err(e)) => e.into(),
                    (Ok(_), Ok(())) => CudaError::InvalidArgument {
                        arg: "capture",
                        msg: "stream capture failed".into(),
                    }
                    .into(),
                });
            }
        };
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: `graph` is a complete captured graph; `exec` is an out-pointer.
        if let Err(e) = unsafe { call!(cuGraphInstantiateWithFlags(&mut exec, graph, 0)) } {
            // SAFETY: as above.
            unsafe { sys::cuGraphDestroy(graph) };
            return Err(e.into());
        }
        Ok((GraphExec { dev, graph, exec }, value))
    }

    /// Launches the whole graph on `stream` (asynchronous).
    pub fn launch(&self, stream: &Stream) -> CudaResult<()> {
        self.dev.bind()?;
        // SAFETY: an instantiated graph of this context and a valid stream.
        unsafe { call!(cuGraphLaunch(self.exec, stream.as_raw())) }
    }
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        // SAFETY: both handles were created by `capture` and are destroyed once; a launch in
        // flight keeps its own reference in the driver.
        unsafe {
            sys::cuGraphExecDestroy(self.exec);
            sys::cuGraphDestroy(self.graph);
        }
    }
}
