//! The GPU backend in the C ABI (`fep_gpu_*`): tensors are device memory of the buffer's GPU
//! (`fep_tensor.data` is a CUDA device address, e.g. a torch CUDA tensor's `data_ptr()`), and
//! every call is ordered on CUDA streams the caller names in a [`fep_gpu_order`] (borrowed, never
//! destroyed by the library).
//!
//! One file: every `fep_gpu_*` entry point goes through the per-buffer `GpuState` defined here (the
//! handle pool, stream ordering in `begin`/`finish`, the device-tensor checks).
//!
//! Normal mode has the two forms DeepEP callers need:
//! - two-step: [`fep_gpu_notify`] (layout + count exchange, one bounded host synchronisation of
//!   the stream) returns the received row count; the caller allocates outputs of that many rows
//!   and calls [`fep_gpu_dispatch`];
//! - `num_worst_tokens > 0`: [`fep_gpu_notify`] returns at once with `rows = num_worst_tokens`
//!   (no host synchronisation); rows past the received ones are padding.
//!
//! Low latency: [`fep_gpu_ll_dispatch`] / [`fep_gpu_ll_combine`] with `return_recv_hook`, the
//! receive launched by [`fep_gpu_ll_complete`]. Outputs are caller tensors
//! ([`fep_gpu_ll_buffers`]) that must outlive the op and the matching combine.
//!
//! NOTES (ranks as threads of one process, as the tests run them): no device memory
//! may be allocated or freed while a peer's kernel spins on this rank. Handles therefore come
//! from a per-buffer pool (`fep_buffer_create` fills it, then waits for every rank, before any
//! step; [`fep_gpu_reserve`] adds more) and
//! `fep_handle_destroy` returns them to it; the pool is freed by `fep_buffer_destroy`.
//! A pooled handle is reused in stream order: issue every call of one buffer on one stream.

use std::mem::ManuallyDrop;
use std::os::raw::c_void;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::sys::{CUevent, CUstream};

use super::buffer::{
    check_tensor, fep_buffer, fep_config, fep_handle, fep_tensor, HandleKind, FEP_DTYPE_BF16,
    FEP_DTYPE_BOOL, FEP_DTYPE_F32, FEP_DTYPE_FP8_E4M3, FEP_DTYPE_I32, FEP_DTYPE_I64,
    FEP_MODE_LOW_LATENCY, FEP_MODE_NORMAL,
};
use super::{fep_status, guard};
use crate::cuda::{Device, DeviceBuffer, Event, Stream};
use crate::ep::buffer::Buffer;
use crate::ep::gpu::{
    DevSlice, GpuCombineArgs, GpuDispatchArgs, GpuDispatchOut, GpuHandle, GpuLlCombineArgs,
    GpuLlDispatchArgs, GpuNotifyArgs, GpuOptions, LlCombineHook, LlDispatchHook,
};
use crate::ep::hier_gpu::{GpuHierBuffer, GpuHierDispatchArgs, GpuHierHandle};
use crate::ep::ll_gpu::LlDispatchOut;
use crate::error::Error;
use crate::protocol::config::DispatchDtype;

/// Stream order of one GPU call. The kernels run on `stream`; before them, `stream` waits for
/// `wait_stream`'s work so far and for `wait_event`; after them, `then_stream` waits for
/// `stream`. NULL members are skipped: name the legacy default stream as a wait or then stream
/// with `CU_STREAM_LEGACY` (`(void *)0x1`); a NULL `stream` runs on it. DeepEP's
/// pattern: `stream` = the buffer's comm stream, `wait_stream` = the compute stream (or
/// `wait_event` = `previous_event`), `then_stream` = the compute stream unless `async_finish`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct fep_gpu_order {
    /// `CUstream` the kernels run on.
    pub stream: *mut c_void,
    /// `CUstream` whose queued work runs first (NULL: none).
    pub wait_stream: *mut c_void,
    /// `CUevent` to wait for (NULL: none), as recorded when the call is made.
    pub wait_event: *mut c_void,
    /// `CUstream` that waits for this call's kernels (NULL: none).
    pub then_stream: *mut c_void,
}

/// Low-latency dispatch outputs (device memory; `L` local experts, `S = num_ranks *
/// max_tokens_per_rank`, `T_max = max_tokens_per_rank`). Pass the same tensors' struct to the
/// hook and keep them alive until the matching combine has finished on its stream.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct fep_gpu_ll_buffers {
    /// `[L, S, H]` bf16, or fp8 e4m3 when the buffer's `dispatch_dtype` is fp8.
    pub recv_x: fep_tensor,
    /// `[L, S, H / 128]` f32 (fp8 only; ignored for bf16).
    pub recv_x_scales: fep_tensor,
    /// `[L]` i32 rows received per local expert.
    pub recv_count: fep_tensor,
    /// `[L, S]` i32 source rank of each row.
    pub src_rank: fep_tensor,
    /// `[L, S]` i32 token index on the source rank of each row.
    pub src_idx: fep_tensor,
    /// `[L, R, 2]` i32 `(begin, count)` of each source rank's rows (the combine's routing).
    pub layout_range: fep_tensor,
    /// `[T_max, K]` i32 scratch of the combine's routing (the row of each `(token, k)`).
    pub pos: fep_tensor,
}

type PoolOf<T> = Arc<Mutex<Vec<(usize, T)>>>;
type Pool = PoolOf<GpuHandle>;

/// The hierarchy's part of a `fep_buffer` (`fep_config.internode_hierarchy`): its buffer (both
/// stages) and its handle pool.
struct HierPart {
    buf: GpuHierBuffer,
    pool: PoolOf<GpuHierHandle>,
}

/// The GPU part of a `fep_buffer`.
pub(crate) struct GpuState {
    dev: Device,
    pool: Pool,
    ev_in: Event,
    ev_out: Event,
    /// A communication stream the buffer owns (`fep_gpu_info`), for callers that follow
    /// DeepEP's comm-stream pattern: a [`Stream::kept`] stream (valid after the buffer is gone,
    /// for the frameworks' allocators that recorded tensors on it; reused by a later buffer).
    comm: Stream,
    /// Normal mode through DeepEP's hierarchy (then the direct buffer has low latency only).
    hier: Option<HierPart>,
}

/// `fep_config.gpu_reserve_tokens` 0: handles for this many input tokens.
pub(crate) const DEFAULT_RESERVE_TOKENS: usize = 4096;
/// Handles reserved by `fep_buffer_create`.
pub(crate) const RESERVED_HANDLES: usize = 4;

impl GpuState {
    /// Adds `n` handles for up to `tokens` input tokens to the pool (device allocations; the
    /// hierarchy's when it is on).
    pub(crate) fn reserve(&mut self, b: &mut Buffer, tokens: usize, n: usize) -> Result<(), Error> {
        let cap = tokens.max(1);
        for _ in 0..n {
            match &mut self.hier {
                Some(hp) => {
                    let h = hp.buf.new_handle(cap)?;
                    hp.pool.lock().unwrap_or_else(PoisonError::into_inner).push((cap, h));
                }
                None => {
                    let h = b.gpu()?.new_handle(cap)?;
                    self.pool.lock().unwrap_or_else(PoisonError::into_inner).push((cap, h));
                }
            }
        }
        Ok(())
    }

    pub(crate) fn new(dev: Device) -> Result<Self, Error> {
        Ok(GpuState {
            ev_in: Event::new_untimed(&dev)?,
            ev_out: Event::new_untimed(&dev)?,
            pool: Arc::new(Mutex::new(Vec::new())),
            comm: Stream::kept(&dev)?,
            dev,
            hier: None,
        })
    }

    /// Normal mode goes through `h` from now on.
    pub(crate) fn set_hier(&mut self, h: GpuHierBuffer) {
        self.hier = Some(HierPart { buf: h, pool: Arc::new(Mutex::new(Vec::new())) });
    }

    /// Makes `shared` (a [`Stream::kept`] stream of this device, which its owner keeps) the
    /// communication stream this buffer reports: the buffers of one `fep_ep` share one. The
    /// buffer's own goes back to the process's list of kept streams.
    pub(crate) fn share_comm(&mut self, shared: &Stream) -> Result<(), Error> {
        if shared.device().ordinal() != self.dev.ordinal() {
            return Err(Error::Other(format!(
                "a communication stream of GPU {} for a buffer on GPU {}",
                shared.device().ordinal(),
                self.dev.ordinal()
            )));
        }
        // SAFETY: a kept stream is never destroyed; it is of this buffer's device.
        self.comm = unsafe { Stream::borrowed(&self.dev, shared.as_raw()) };
        Ok(())
    }

    /// The hierarchy's buffer, for the collective teardown; its pooled handles are freed.
    pub(crate) fn take_hier(&mut self) -> Option<GpuHierBuffer> {
        self.hier.take().map(|hp| hp.buf)
    }
}

/// A handle on loan from its buffer's pool (returned when dropped).
pub(crate) struct Pooled<T> {
    cap: usize,
    h: Option<T>,
    pool: PoolOf<T>,
}

/// A direct-path GPU handle on loan.
pub(crate) type PooledHandle = Pooled<GpuHandle>;
/// A hierarchy handle on loan.
pub(crate) type PooledHierHandle = Pooled<GpuHierHandle>;

impl<T> Pooled<T> {
    pub(crate) fn get(&self) -> Result<&T, Error> {
        self.h.as_ref().ok_or_else(|| Error::arg("handle", "already returned to its pool"))
    }
    fn get_mut(&mut self) -> Result<&mut T, Error> {
        self.h.as_mut().ok_or_else(|| Error::arg("handle", "already returned to its pool"))
    }
}

impl PooledHandle {
    pub(crate) fn num_out_rows(&self) -> Option<usize> {
        self.h.as_ref().and_then(|h| h.num_out_rows())
    }
}

impl<T> Drop for Pooled<T> {
    fn drop(&mut self) {
        if let Some(h) = self.h.take() {
            self.pool.lock().unwrap_or_else(PoisonError::into_inner).push((self.cap, h));
        }
    }
}

/// The smallest pooled handle for `tokens`, else a new one from `make(capacity)`.
fn take_from<T>(
    pool: &PoolOf<T>,
    tokens: usize,
    make: impl FnOnce(usize) -> Result<T, Error>,
) -> Result<Pooled<T>, Error> {
    let mut p = pool.lock().unwrap_or_else(PoisonError::into_inner);
    let best = p
        .iter()
        .enumerate()
        .filter(|(_, (c, _))| *c >= tokens)
        .min_by_key(|(_, (c, _))| *c)
        .map(|(i, _)| i);
    let (cap, h) = match best {
        Some(i) => p.swap_remove(i),
        None => {
            drop(p);
            // NOTES: an allocation inside a step (see the module notes): callers reserve first.
            let cap = tokens.max(1);
            (cap, make(cap)?)
        }
    };
    Ok(Pooled { cap, h: Some(h), pool: pool.clone() })
}

/// GPU options from a config: device (`-1`: `LOCAL_RANK`, else 0), SM budget and chunking
/// (0: the GPU defaults).
pub(crate) fn options(c: &fep_config, local_rank: usize) -> Result<(GpuOptions, Device), Error> {
    let ordinal = if c.device >= 0 {
        c.device as usize
    } else if std::env::var_os("LOCAL_RANK").is_some() {
        local_rank
    } else {
        0
    };
    let dev = Device::new(ordinal)
        .map_err(|e| Error::arg("device", format!("CUDA device {ordinal}: {e}")))?;
    let mut o = GpuOptions::new(dev.clone());
    match c.modes {
        0 => {}
        m if m & !(FEP_MODE_NORMAL | FEP_MODE_LOW_LATENCY) == 0 => {
            o.normal = m & FEP_MODE_NORMAL != 0;
            o.low_latency = m & FEP_MODE_LOW_LATENCY != 0;
        }
        m => {
            return Err(Error::arg(
                "modes",
                format!("{m}: FEP_MODE_NORMAL (1) | FEP_MODE_LOW_LATENCY (2), or 0 for both"),
            ))
        }
    }
    if c.num_sms > 0 {
        o.num_sms = Some(c.num_sms as usize);
    }
    if c.chunk_tokens > 0 {
        o.chunk_tokens = c.chunk_tokens as usize;
    }
    if c.slots_per_peer > 0 {
        o.slots_per_peer = Some(c.slots_per_peer as usize);
    }
    Ok((o, dev))
}

/// [`guard`] for a call on `buf` that may wait on peers: a timeout naming peers is reported to
/// the bootstrap before it is returned (`Buffer::reported`), so the other ranks name the
/// stalled rank rather than this one when it leaves.
///
/// # Safety
/// As [`parts`]: `buf` from `fep_buffer_create` (or NULL, refused).
unsafe fn guard_peers(buf: *mut fep_buffer, f: impl FnOnce() -> Result<(), Error>) -> fep_status {
    guard(|| {
        let r = f();
        // `f`'s borrows of the buffer have ended.
        match (&r, parts(buf)) {
            (Err(_), Ok((b, _))) => b.reported(r),
            _ => r,
        }
    })
}

fn parts<'a>(buf: *mut fep_buffer) -> Result<(&'a mut Buffer, &'a mut GpuState), Error> {
    // SAFETY: the caller passes a pointer from fep_buffer_create (checked for NULL).
    let b = unsafe { super::live::get(buf, "buf") }?;
    let st = b.gpu.as_mut().ok_or_else(|| {
        Error::arg(
            "buf",
            "a host backend buffer: use fep_dispatch / fep_combine / fep_low_latency_* (host \
             memory, stream NULL), or create it with backend = FEP_BACKEND_GPU",
        )
    })?;
    let inner = b.inner.as_mut().ok_or_else(|| Error::arg("buf", "destroyed buffer"))?;
    Ok((inner, st))
}

fn elem_bytes(dtype: i32) -> usize {
    match dtype {
        FEP_DTYPE_BF16 => 2,
        FEP_DTYPE_FP8_E4M3 | FEP_DTYPE_BOOL => 1,
        FEP_DTYPE_F32 | FEP_DTYPE_I32 => 4,
        _ => 8,
    }
}

/// A device tensor's range after checking dtype and shape (`None` extents: any).
pub(super) unsafe fn dev(
    name: &'static str,
    t: *const fep_tensor,
    dtype: i32,
    shape: &[Option<i64>],
) -> Result<(DevSlice, [i64; 4]), Error> {
    let t = t.as_ref().ok_or_else(|| Error::arg(name, "NULL tensor"))?;
    dev_ref(name, t, dtype, shape)
}

unsafe fn dev_ref(
    name: &'static str,
    t: &fep_tensor,
    dtype: i32,
    shape: &[Option<i64>],
) -> Result<(DevSlice, [i64; 4]), Error> {
    let n = check_tensor(name, t, dtype, shape)?;
    let bytes =
        n.checked_mul(elem_bytes(dtype)).ok_or_else(|| Error::arg(name, "size overflows"))?;
    if bytes > 0 && t.data.is_null() {
        return Err(Error::arg(name, "NULL data"));
    }
    if (t.data as usize) % elem_bytes(dtype) != 0 {
        return Err(Error::arg(name, "misaligned device pointer"));
    }
    Ok((DevSlice { ptr: t.data as u64, bytes }, t.shape))
}

/// An optional device tensor: NULL is `None`.
unsafe fn dev_opt(
    name: &'static str,
    t: *const fep_tensor,
    dtype: i32,
    shape: &[Option<i64>],
) -> Result<Option<DevSlice>, Error> {
    if t.is_null() {
        return Ok(None);
    }
    Ok(Some(dev(name, t, dtype, shape)?.0))
}

/// Applies the "before" half of `order` and returns the borrowed run stream.
unsafe fn begin(
    st: &GpuState,
    order: *const fep_gpu_order,
) -> Result<(Stream, fep_gpu_order), Error> {
    begin_on(&st.dev, &st.ev_in, order)
}

/// [`begin`] with the state's parts (when the rest of it is borrowed elsewhere).
pub(super) unsafe fn begin_on(
    dev: &Device,
    ev_in: &Event,
    order: *const fep_gpu_order,
) -> Result<(Stream, fep_gpu_order), Error> {
    let o = *order.as_ref().ok_or_else(|| Error::arg("order", "NULL pointer"))?;
    let s = Stream::borrowed(dev, o.stream as CUstream);
    if !o.wait_stream.is_null() && o.wait_stream != o.stream {
        let w = Stream::borrowed(dev, o.wait_stream as CUstream);
        ev_in.record(&w)?;
        s.wait_event(ev_in)?;
    }
    if !o.wait_event.is_null() {
        s.wait_raw_event(o.wait_event as CUevent)?;
    }
    Ok((s, o))
}

/// The "after" half of `order`.
unsafe fn finish(st: &GpuState, o: &fep_gpu_order, s: &Stream) -> Result<(), Error> {
    if !o.then_stream.is_null() && o.then_stream != o.stream {
        st.ev_out.record(s)?;
        Stream::borrowed(&st.dev, o.then_stream as CUstream).wait_event(&st.ev_out)?;
    }
    Ok(())
}

fn take_handle(st: &GpuState, b: &mut Buffer, tokens: usize) -> Result<PooledHandle, Error> {
    take_from(&st.pool, tokens, |cap| b.gpu()?.new_handle(cap))
}

/// Reserves `num_handles` more dispatch handles for up to `max_tokens` input tokens each
/// (device memory), so later steps allocate nothing (`fep_buffer_create` already reserves
/// `fep_config.gpu_reserve_tokens`). Not collective: call it only while no kernel of the group
/// runs, e.g. between two of the caller's barriers (with ranks as threads of one process an
/// allocation waits for a peer's spinning kernel).
///
/// # Safety
/// `buf` must be valid.
#[no_mangle]
pub unsafe extern "C" fn fep_gpu_reserve(
    buf: *mut fep_buffer,
    max_tokens: i64,
    num_handles: i32,
) -> fep_status {
    guard(|| {
        let (b, st) = parts(buf)?;
        let cap = super::usize_arg("max_tokens", max_tokens)?;
        let n = super::usize_arg("num_handles", num_handles as i64)?;
        st.reserve(b, cap, n)
    })
}

/// Normal dispatch, step 1 on the GPU: the layout of `topk_idx` (`[T, K]` int64, device) and
/// the count exchange with every rank, on `order->stream`. Collective.
///
/// Without `num_worst_tokens` (0) it synchronises the stream once (bounded) and writes the
/// received rows to `*num_recv_tokens` and, when not NULL, the per-local-expert counts (rounded
/// up to `expert_alignment`) to `num_recv_tokens_per_expert` (host int32 `[L]`). With
/// `num_worst_tokens > 0` it returns at once with `*num_recv_tokens = num_worst_tokens` and
/// leaves the per-expert counts untouched. `*out_handle` receives the handle for
/// `fep_gpu_dispatch`, `fep_gpu_combine` and cached dispatches (free it with
/// `fep_handle_destroy`). The "then" stream of `order` is not used here. A buffer created with
/// `internode_hierarchy` needs the tokens at this step: call [`fep_gpu_notify_inputs`].
///
/// # Safety
/// Every pointer must be valid; `topk_idx` stays alive until the stream has run the call.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn fep_gpu_notify(
    buf: *mut fep_buffer,
    topk_idx: *const fep_tensor,
    expert_alignment: i32,
    num_worst_tokens: i64,
    order: *const fep_gpu_order,
    out_handle: *mut *mut fep_handle,
    num_recv_tokens: *mut i64,
    num_recv_tokens_per_expert: *mut i32,
) -> fep_status {
    guard_peers(buf, || {
        let step = Step1 { expert_alignment, num_worst_tokens, order };
        let out = Step1Out { out_handle, num_recv_tokens, num_recv_tokens_per_expert };
        notify(buf, None, topk_idx, step, out)
    })
}

/// [`fep_gpu_notify`] with the dispatch's inputs (`x` `[T, H]`, `x_scales` `[T, H / 128]` f32
/// for fp8 else NULL, `topk_weights` `[T, K]` f32, as [`fep_gpu_dispatch`] takes them): on a
/// buffer created with `internode_hierarchy` this step moves the tokens through both stages
/// (the rows counted at the end of the node stage; the host synchronises with the stream three
/// times, also with `num_worst_tokens`), and [`fep_gpu_dispatch`] with its handle only places
/// them, in the direct path's order, into the outputs. On a direct buffer it is
/// [`fep_gpu_notify`] (the inputs are checked, then used by the dispatch). The inputs stay alive
/// until the stream has run the dispatch.
///
/// # Safety
/// As [`fep_gpu_notify`].
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn fep_gpu_notify_inputs(
    buf: *mut fep_buffer,
    x: *const fep_tensor,
    x_scales: *const fep_tensor,
    topk_idx: *const fep_tensor,
    topk_weights: *const fep_tensor,
    expert_alignment: i32,
    num_worst_tokens: i64,
    order: *const fep_gpu_order,
    out_handle: *mut *mut fep_handle,
    num_recv_tokens: *mut i64,
    num_recv_tokens_per_expert: *mut i32,
) -> fep_status {
    guard_peers(buf, || {
        let step = Step1 { expert_alignment, num_worst_tokens, order };
        let out = Step1Out { out_handle, num_recv_tokens, num_recv_tokens_per_expert };
        notify(buf, Some((x, x_scales, topk_weights)), topk_idx, step, out)
    })
}

/// Step 1's scalar arguments.
#[derive(Clone, Copy)]
struct Step1 {
    expert_alignment: i32,
    num_worst_tokens: i64,
    order: *const fep_gpu_order,
}

/// Step 1's out-pointers.
#[derive(Clone, Copy)]
struct Step1Out {
    out_handle: *mut *mut fep_handle,
    num_recv_tokens: *mut i64,
    num_recv_tokens_per_expert: *mut i32,
}

/// A dispatch's checked inputs.
struct Inputs {
    x: DevSlice,
    x_scales: Option<DevSlice>,
    topk_idx: DevSlice,
    topk_weights: DevSlice,
}

/// `x`, `x_scales`, `topk_idx`, `topk_weights` of `t` tokens (`None`: any) for `b`'s config.
unsafe fn inputs(
    b: &Buffer,
    t: Option<i64>,
    x: *const fep_tensor,
    x_scales: *const fep_tensor,
    topk_idx: *const fep_tensor,
    topk_weights: *const fep_tensor,
) -> Result<Inputs, Error> {
    let c = b.config();
    let (hd, k) = (c.hidden as i64, c.num_topk as i64);
    let fp8 = c.dispatch_dtype == DispatchDtype::Fp8E4m3;
    let xd = if fp8 { FEP_DTYPE_FP8_E4M3 } else { FEP_DTYPE_BF16 };
    let (xs, shape) = dev("x", x, xd, &[t, Some(hd)])?;
    let t = Some(shape[0]);
    Ok(Inputs {
        x: xs,
        x_scales: scales(fp8, hd, "x_scales", x_scales, t)?,
        topk_idx: dev("topk_idx", topk_idx, FEP_DTYPE_I64, &[t, Some(k)])?.0,
        topk_weights: dev("topk_weights", topk_weights, FEP_DTYPE_F32, &[t, Some(k)])?.0,
    })
}

/// An fp8 buffer's scales `[n, H / 128]` f32 (required exactly for fp8).
unsafe fn scales(
    fp8: bool,
    hd: i64,
    name: &'static str,
    p: *const fep_tensor,
    n: Option<i64>,
) -> Result<Option<DevSlice>, Error> {
    match (fp8, p.is_null()) {
        (true, true) => Err(Error::arg(name, "NULL: required for an fp8 buffer")),
        (true, false) => Ok(Some(dev(name, p, FEP_DTYPE_F32, &[n, Some(hd / 128)])?.0)),
        (false, true) => Ok(None),
        (false, false) => Err(Error::arg(name, "given, but the buffer dispatches bf16")),
    }
}

unsafe fn notify(
    buf: *mut fep_buffer,
    with: Option<(*const fep_tensor, *const fep_tensor, *const fep_tensor)>,
    topk_idx: *const fep_tensor,
    a: Step1,
    out: Step1Out,
) -> Result<(), Error> {
    let out_handle =
        out.out_handle.as_mut().ok_or_else(|| Error::arg("out_handle", "NULL pointer"))?;
    *out_handle = std::ptr::null_mut();
    let (b, st) = parts(buf)?;
    let k = b.config().num_topk as i64;
    let (idx, shape) = dev("topk_idx", topk_idx, FEP_DTYPE_I64, &[None, Some(k)])?;
    let t = shape[0] as usize;
    if a.expert_alignment < 1 {
        return Err(Error::arg(
            "expert_alignment",
            format!("{}: must be >= 1", a.expert_alignment),
        ));
    }
    if !(0..=i64::from(i32::MAX)).contains(&a.num_worst_tokens) {
        return Err(Error::arg(
            "num_worst_tokens",
            format!("{}: must be in [0, 2^31 - 1]", a.num_worst_tokens),
        ));
    }
    let inp = match with {
        Some((x, xs, w)) => Some(inputs(b, Some(t as i64), x, xs, topk_idx, w)?),
        None => None,
    };
    let worst = (a.num_worst_tokens > 0).then_some(a.num_worst_tokens as usize);
    let (kind, rows, per_expert) = if let Some(hp) = st.hier.as_mut() {
        let inp = inp.ok_or_else(|| {
            Error::arg(
                "buf",
                "created with internode_hierarchy: its step 1 moves the tokens, call \
                 fep_gpu_notify_inputs",
            )
        })?;
        let HierPart { buf: hb, pool } = hp;
        let mut ph = take_from(pool, t, |cap| hb.new_handle(cap))?;
        let (s, _) = begin_on(&st.dev, &st.ev_in, a.order)?;
        let args = GpuHierDispatchArgs {
            x: inp.x,
            x_scales: inp.x_scales,
            topk_idx: inp.topk_idx,
            topk_weights: inp.topk_weights,
            num_tokens: t,
            expert_alignment: a.expert_alignment as usize,
            num_worst_tokens: worst,
            cached: false,
            stream: &s,
        };
        let rows = hb.prepare(&args, ph.get_mut()?)?;
        let per: Vec<i32> = ph.get()?.num_recv_tokens_per_expert().to_vec();
        (HandleKind::GpuHier(ph), rows, (worst.is_none()).then_some(per))
    } else {
        let mut ph = take_handle(st, b, t)?;
        let (s, _) = begin(st, a.order)?;
        let args = GpuNotifyArgs {
            topk_idx: idx,
            num_tokens: t,
            expert_alignment: a.expert_alignment as usize,
            num_worst_tokens: worst,
            stream: &s,
        };
        let h = ph.h.as_mut().ok_or_else(|| Error::Other("pooled handle missing".into()))?;
        let info = b.gpu()?.notify_gpu(&args, h)?;
        let rows = ph.num_out_rows().ok_or_else(|| Error::Other("notify set no rows".into()))?;
        (HandleKind::Gpu(ph), rows, info.map(|i| i.num_recv_tokens_per_expert))
    };
    if let (Some(per), false) = (per_expert, out.num_recv_tokens_per_expert.is_null()) {
        std::ptr::copy_nonoverlapping(per.as_ptr(), out.num_recv_tokens_per_expert, per.len());
    }
    if let Some(n) = out.num_recv_tokens.as_mut() {
        *n = rows as i64;
    }
    *out_handle = super::live::boxed(fep_handle { kind });
    Ok(())
}

unsafe fn gpu_handle<'a>(handle: *const fep_handle) -> Result<&'a GpuHandle, Error> {
    match &super::live::get(handle, "handle")?.kind {
        HandleKind::Gpu(p) => p.get(),
        HandleKind::GpuHier(_) => Err(Error::arg(
            "handle",
            "a hierarchy handle (internode_hierarchy) where a direct one was expected",
        )),
        HandleKind::Host { .. } => Err(Error::arg(
            "handle",
            "a host backend handle (from fep_dispatch): GPU calls take fep_gpu_notify's",
        )),
    }
}

/// The hierarchy handle `handle` points to, if it is one.
///
/// # Safety
/// `handle` comes from `fep_gpu_notify_inputs` (a boxed, mutable allocation) and no other
/// reference to it is alive during the call (the C ABI's calls on one handle are sequential).
unsafe fn hier_handle<'a>(
    handle: *const fep_handle,
) -> Result<Option<&'a mut GpuHierHandle>, Error> {
    // NOTES: the ABI passes handles as const pointers; the hierarchy handle records the step it
    // is at, so it is reached mutably through the box it lives in.
    match &mut super::live::get(handle, "handle")?.kind {
        HandleKind::GpuHier(p) => Ok(Some(p.get_mut()?)),
        _ => Ok(None),
    }
}

/// The buffer's hierarchy (an error naming `handle` when it has none).
fn hier_of(st: &mut GpuState) -> Result<&mut GpuHierBuffer, Error> {
    st.hier
        .as_mut()
        .map(|hp| &mut hp.buf)
        .ok_or_else(|| Error::arg("handle", "a hierarchy handle on a buffer without one"))
}

/// Normal dispatch, step 2 on the GPU (also a cached dispatch: any earlier handle of the same
/// routing). Inputs: `x` `[T, H]` (bf16, or fp8 e4m3 with `x_scales` `[T, H/128]` f32, as the
/// buffer's `dispatch_dtype`), `topk_idx` `[T, K]` int64, `topk_weights` `[T, K]` f32, `T` as
/// given to the notify. Outputs, `rows = *num_recv_tokens` of the notify: `recv_x` `[rows, H]`
/// (+ `recv_x_scales` `[rows, H/128]` for fp8), `recv_topk_idx` `[rows, K]` int64 (local expert
/// ids, -1 elsewhere), `recv_topk_weights` `[rows, K]` f32, `recv_src_idx` `[rows]` int32.
/// Asynchronous on `order->stream`; collective. With a hierarchy handle fresh from
/// [`fep_gpu_notify_inputs`] the tokens have moved already (the inputs are checked, not read).
///
/// # Safety
/// Every pointer must be valid; device memory stays alive until the stream has run the call.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn fep_gpu_dispatch(
    buf: *mut fep_buffer,
    handle: *const fep_handle,
    x: *const fep_tensor,
    x_scales: *const fep_tensor,
    topk_idx: *const fep_tensor,
    topk_weights: *const fep_tensor,
    recv_x: *const fep_tensor,
    recv_x_scales: *const fep_tensor,
    recv_topk_idx: *const fep_tensor,
    recv_topk_weights: *const fep_tensor,
    recv_src_idx: *const fep_tensor,
    order: *const fep_gpu_order,
) -> fep_status {
    guard_peers(buf, || {
        let (b, st) = parts(buf)?;
        let hh = hier_handle(handle)?;
        let (t, rows) = match &hh {
            Some(h) => (h.num_tokens(), h.num_out_rows()),
            None => {
                let h = gpu_handle(handle)?;
                let rows = h
                    .num_out_rows()
                    .ok_or_else(|| Error::arg("handle", "no notify has filled it"))?;
                (h.num_tokens(), rows)
            }
        };
        let c = b.config();
        let (hd, k) = (c.hidden as i64, c.num_topk as i64);
        let fp8 = c.dispatch_dtype == DispatchDtype::Fp8E4m3;
        let xd = if fp8 { FEP_DTYPE_FP8_E4M3 } else { FEP_DTYPE_BF16 };
        let inp = inputs(b, Some(t as i64), x, x_scales, topk_idx, topk_weights)?;
        let rows = Some(rows as i64);
        let out = GpuDispatchOut {
            recv_x: dev("recv_x", recv_x, xd, &[rows, Some(hd)])?.0,
            recv_x_scales: scales(fp8, hd, "recv_x_scales", recv_x_scales, rows)?,
            recv_topk_idx: dev("recv_topk_idx", recv_topk_idx, FEP_DTYPE_I64, &[rows, Some(k)])?.0,
            recv_topk_weights: dev(
                "recv_topk_weights",
                recv_topk_weights,
                FEP_DTYPE_F32,
                &[rows, Some(k)],
            )?
            .0,
            recv_src_idx: dev("recv_src_idx", recv_src_idx, FEP_DTYPE_I32, &[rows])?.0,
        };
        let (s, o) = begin(st, order)?;
        match hh {
            Some(h) => {
                let hb = hier_of(st)?;
                if !h.is_prepared() {
                    // A cached dispatch: both stages again with the handle's routing.
                    let args = GpuHierDispatchArgs {
                        x: inp.x,
                        x_scales: inp.x_scales,
                        topk_idx: inp.topk_idx,
                        topk_weights: inp.topk_weights,
                        num_tokens: t,
                        expert_alignment: 1,
                        num_worst_tokens: None,
                        cached: true,
                        stream: &s,
                    };
                    hb.prepare(&args, h)?;
                }
                hb.finish(h, &out, &s)?;
            }
            None => {
                let args = GpuDispatchArgs {
                    x: inp.x,
                    x_scales: inp.x_scales,
                    topk_idx: inp.topk_idx,
                    topk_weights: inp.topk_weights,
                    stream: &s,
                };
                b.gpu()?.dispatch_gpu(&args, gpu_handle(handle)?, &out)?;
            }
        }
        finish(st, &o, &s)
    })
}

/// Normal combine on the GPU: `x` `[rows, H]` bf16 (rows as the dispatch's outputs), optional
/// `topk_weights` `[rows, K]` f32; writes `combined_x` `[T, H]` bf16 (per token, the fp32 sum
/// over the ranks it went to; with the hierarchy, the sum of each node's bf16 partial) and,
/// exactly when `topk_weights` is given, `combined_topk_weights` `[T, K]` f32. Asynchronous on
/// `order->stream`; collective.
///
/// # Safety
/// As `fep_gpu_dispatch`.
#[no_mangle]
pub unsafe extern "C" fn fep_gpu_combine(
    buf: *mut fep_buffer,
    handle: *const fep_handle,
    x: *const fep_tensor,
    topk_weights: *const fep_tensor,
    combined_x: *const fep_tensor,
    combined_topk_weights: *const fep_tensor,
    order: *const fep_gpu_order,
) -> fep_status {
    guard_peers(buf, || {
        let (b, st) = parts(buf)?;
        let hh = hier_handle(handle)?;
        let (t, rows) = match &hh {
            Some(h) if h.is_filled() && !h.is_prepared() => (h.num_tokens(), h.num_out_rows()),
            Some(_) => {
                return Err(Error::arg(
                    "handle",
                    "its dispatch has not finished (fep_gpu_dispatch)",
                ))
            }
            None => {
                let h = gpu_handle(handle)?;
                let rows = h
                    .num_out_rows()
                    .ok_or_else(|| Error::arg("handle", "no notify has filled it"))?;
                (h.num_tokens(), rows)
            }
        };
        let c = b.config();
        let (hd, k) = (c.hidden as i64, c.num_topk as i64);
        let (t, rows) = (Some(t as i64), Some(rows as i64));
        if topk_weights.is_null() != combined_topk_weights.is_null() {
            return Err(Error::arg(
                "combined_topk_weights",
                "give it exactly when topk_weights is given",
            ));
        }
        let xs = dev("x", x, FEP_DTYPE_BF16, &[rows, Some(hd)])?.0;
        let w = dev_opt("topk_weights", topk_weights, FEP_DTYPE_F32, &[rows, Some(k)])?;
        let cx = dev("combined_x", combined_x, FEP_DTYPE_BF16, &[t, Some(hd)])?.0;
        let cw =
            dev_opt("combined_topk_weights", combined_topk_weights, FEP_DTYPE_F32, &[t, Some(k)])?;
        let (s, o) = begin(st, order)?;
        let args = GpuCombineArgs {
            x: xs,
            topk_weights: w,
            combined_x: cx,
            combined_topk_weights: cw,
            stream: &s,
        };
        match hh {
            Some(h) => hier_of(st)?.combine_gpu(&args, h)?,
            None => b.gpu()?.combine_gpu(&args, gpu_handle(handle)?)?,
        }
        finish(st, &o, &s)
    })
}

/// Device ranges of a [`fep_gpu_ll_buffers`], in its field order.
#[derive(Clone, Copy, Debug)]
struct LlSlices([DevSlice; 7]);

unsafe fn ll_slices(b: &Buffer, o: *const fep_gpu_ll_buffers) -> Result<LlSlices, Error> {
    let o = o.as_ref().ok_or_else(|| Error::arg("outputs", "NULL pointer"))?;
    let c = b.config();
    let (l, r) = (c.num_local_experts() as i64, c.num_ranks as i64);
    let (m, k, h) = (c.max_tokens_per_rank as i64, c.num_topk as i64, c.hidden as i64);
    let s = r * m;
    let fp8 = c.dispatch_dtype == DispatchDtype::Fp8E4m3;
    let xd = if fp8 { FEP_DTYPE_FP8_E4M3 } else { FEP_DTYPE_BF16 };
    let scales = if fp8 {
        dev_ref(
            "recv_x_scales",
            &o.recv_x_scales,
            FEP_DTYPE_F32,
            &[Some(l), Some(s), Some(h / 128)],
        )?
        .0
    } else {
        DevSlice::default()
    };
    Ok(LlSlices([
        dev_ref("recv_x", &o.recv_x, xd, &[Some(l), Some(s), Some(h)])?.0,
        scales,
        dev_ref("recv_count", &o.recv_count, FEP_DTYPE_I32, &[Some(l)])?.0,
        dev_ref("src_rank", &o.src_rank, FEP_DTYPE_I32, &[Some(l), Some(s)])?.0,
        dev_ref("src_idx", &o.src_idx, FEP_DTYPE_I32, &[Some(l), Some(s)])?.0,
        dev_ref("layout_range", &o.layout_range, FEP_DTYPE_I32, &[Some(l), Some(r), Some(2)])?.0,
        dev_ref("pos", &o.pos, FEP_DTYPE_I32, &[Some(m), Some(k)])?.0,
    ]))
}

/// The caller's tensors as an [`LlDispatchOut`] that is never dropped (it owns nothing).
unsafe fn ll_view(dev: &Device, s: &LlSlices) -> ManuallyDrop<LlDispatchOut> {
    let v = |d: DevSlice| ManuallyDrop::into_inner(DeviceBuffer::view(dev, d.ptr, d.bytes));
    let [x, sc, cnt, sr, si, lr, pos] = s.0;
    ManuallyDrop::new(LlDispatchOut {
        recv_x: v(x),
        recv_scales: v(sc),
        recv_count: v(cnt),
        recv_src_rank: v(sr),
        recv_src_idx: v(si),
        layout_range: v(lr),
        pos: v(pos),
    })
}

enum GpuLl {
    Dispatch {
        out: LlSlices,
        num_tokens: usize,
        hook: Option<LlDispatchHook>,
    },
    Combine {
        hook: Option<LlCombineHook>,
        x: DevSlice,
        topk_idx: DevSlice,
        topk_weights: DevSlice,
        out: DevSlice,
        num_tokens: usize,
        handle: LlSlices,
    },
}

/// A GPU low-latency dispatch or combine (opaque): its receive pending (hook) or launched.
pub struct fep_gpu_ll_op {
    state: GpuLl,
}

/// Low-latency dispatch on the GPU (DeepEP V1): `x` `[T <= max_tokens_per_rank, H]` bf16,
/// `topk_idx` `[T, K]` int64 (-1 = none), outputs in `outputs`. `use_fp8` must match the
/// buffer's `dispatch_dtype` (its buffers are sized for it); `round_scale` (fp8 only) makes the
/// scales powers of two. With
/// `return_recv_hook` only the send is launched and `fep_gpu_ll_complete` launches the receive.
/// No host synchronisation; collective. `*out_op` is freed with `fep_gpu_ll_op_destroy`.
///
/// # Safety
/// Every pointer must be valid; device memory stays alive until the stream has run the
/// receive (and, for the outputs, the matching combine).
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn fep_gpu_ll_dispatch(
    buf: *mut fep_buffer,
    x: *const fep_tensor,
    topk_idx: *const fep_tensor,
    use_fp8: bool,
    round_scale: bool,
    return_recv_hook: bool,
    outputs: *const fep_gpu_ll_buffers,
    order: *const fep_gpu_order,
    out_op: *mut *mut fep_gpu_ll_op,
) -> fep_status {
    fep_gpu_ll_dispatch_ex(
        buf,
        x,
        topk_idx,
        use_fp8,
        round_scale,
        return_recv_hook,
        outputs,
        std::ptr::null(),
        order,
        out_op,
    )
}

/// The wait-cost tensor of a `_ex` call: device `int64 [num_ranks]`, NULL: none.
unsafe fn wait_stats_arg(b: &mut Buffer, t: *const fep_tensor) -> Result<(), Error> {
    let r = Some(b.config().num_ranks as i64);
    let ws = dev_opt("wait_recv_cost_stats", t, FEP_DTYPE_I64, &[r])?.map_or(0, |d| d.ptr);
    b.gpu()?.set_ll_wait_stats(ws)
}

/// `fep_gpu_ll_dispatch` with DeepEP's `dispatch_wait_recv_cost_stats`:
/// `wait_recv_cost_stats` (NULL: none) is a device `int64 [num_ranks]` tensor to which the
/// receive kernel (launched now, or by `fep_gpu_ll_complete`) atomically adds, per source rank,
/// the nanoseconds (%globaltimer) from the start of its wait until each of that rank's flags
/// (one per local expert) was seen. Keep it alive until the receive has run on its stream.
///
/// # Safety
/// As `fep_gpu_ll_dispatch`; `wait_recv_cost_stats`' memory until the receive has run.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn fep_gpu_ll_dispatch_ex(
    buf: *mut fep_buffer,
    x: *const fep_tensor,
    topk_idx: *const fep_tensor,
    use_fp8: bool,
    round_scale: bool,
    return_recv_hook: bool,
    outputs: *const fep_gpu_ll_buffers,
    wait_recv_cost_stats: *const fep_tensor,
    order: *const fep_gpu_order,
    out_op: *mut *mut fep_gpu_ll_op,
) -> fep_status {
    guard_peers(buf, || {
        let out_op = out_op.as_mut().ok_or_else(|| Error::arg("out_op", "NULL pointer"))?;
        *out_op = std::ptr::null_mut();
        let (b, st) = parts(buf)?;
        if round_scale && !use_fp8 {
            return Err(Error::arg(
                "round_scale",
                "true needs use_fp8 (bf16 rows carry no scales)",
            ));
        }
        b.gpu()?.set_ll_round_scale(round_scale)?;
        let c = b.config();
        let (h, k, m) = (c.hidden as i64, c.num_topk as i64, c.max_tokens_per_rank);
        let (xs, shape) = dev("x", x, FEP_DTYPE_BF16, &[None, Some(h)])?;
        let t = shape[0] as usize;
        if t > m {
            return Err(Error::arg("x", format!("{t} tokens, more than max_tokens_per_rank {m}")));
        }
        let (idx, _) = dev("topk_idx", topk_idx, FEP_DTYPE_I64, &[Some(t as i64), Some(k)])?;
        let out = ll_slices(b, outputs)?;
        let view = ll_view(&st.dev, &out);
        wait_stats_arg(b, wait_recv_cost_stats)?;
        let (s, o) = begin(st, order)?;
        let args = GpuLlDispatchArgs {
            x: xs,
            topk_idx: idx,
            num_tokens: t,
            use_fp8,
            return_recv_hook,
            stream: &s,
        };
        let hook = b.gpu()?.low_latency_dispatch_gpu(&args, &view)?;
        finish(st, &o, &s)?;
        *out_op = super::live::boxed(fep_gpu_ll_op {
            state: GpuLl::Dispatch { out, num_tokens: t, hook },
        });
        Ok(())
    })
}

/// Launches the receive of a hooked GPU low-latency dispatch or combine on `order->stream`
/// (DeepEP's hook); a no-op when there is none pending.
///
/// # Safety
/// `buf`, `op` and `order` must be valid.
#[no_mangle]
pub unsafe extern "C" fn fep_gpu_ll_complete(
    buf: *mut fep_buffer,
    op: *mut fep_gpu_ll_op,
    order: *const fep_gpu_order,
) -> fep_status {
    guard_peers(buf, || {
        let (b, st) = parts(buf)?;
        let op = super::live::get(op, "op")?;
        match &mut op.state {
            GpuLl::Dispatch { out, hook, .. } => {
                let Some(hk) = hook.take() else { return Ok(()) };
                let view = ll_view(&st.dev, out);
                let (s, o) = begin(st, order)?;
                b.gpu()?.low_latency_dispatch_recv_gpu(hk, &view, &s)?;
                finish(st, &o, &s)
            }
            GpuLl::Combine { hook, x, topk_idx, topk_weights, out, num_tokens, handle } => {
                let Some(hk) = hook.take() else { return Ok(()) };
                let view = ll_view(&st.dev, handle);
                let (s, o) = begin(st, order)?;
                let args = GpuLlCombineArgs {
                    x: *x,
                    topk_idx: *topk_idx,
                    topk_weights: *topk_weights,
                    num_tokens: *num_tokens,
                    handle: &view,
                    out: *out,
                    return_recv_hook: false,
                    stream: &s,
                };
                b.gpu()?.low_latency_combine_recv_gpu(hk, &args)?;
                finish(st, &o, &s)
            }
        }
    })
}

/// Low-latency combine on the GPU: `x` `[L, S, H]` bf16 expert outputs in the dispatch's row
/// order, the dispatch's `topk_idx` `[T, K]` int64 and `topk_weights` `[T, K]` f32,
/// `dispatch_op` the dispatch (its hook completed); writes `out` `[T, H]` bf16 (per token the
/// fp32 weighted sum, rounded once). Hook as in dispatch. Collective.
///
/// # Safety
/// As `fep_gpu_ll_dispatch`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn fep_gpu_ll_combine(
    buf: *mut fep_buffer,
    dispatch_op: *const fep_gpu_ll_op,
    x: *const fep_tensor,
    topk_idx: *const fep_tensor,
    topk_weights: *const fep_tensor,
    out: *const fep_tensor,
    return_recv_hook: bool,
    order: *const fep_gpu_order,
    out_op: *mut *mut fep_gpu_ll_op,
) -> fep_status {
    fep_gpu_ll_combine_ex(
        buf,
        dispatch_op,
        x,
        topk_idx,
        topk_weights,
        out,
        return_recv_hook,
        std::ptr::null(),
        order,
        out_op,
    )
}

/// `fep_gpu_ll_combine` with DeepEP's `combine_wait_recv_cost_stats` (NULL: none): a device
/// `int64 [num_ranks]` tensor, added to as in `fep_gpu_ll_dispatch_ex` (per rank whose experts
/// answer, the nanoseconds the combine's receive waited for its flags).
///
/// # Safety
/// As `fep_gpu_ll_dispatch_ex`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn fep_gpu_ll_combine_ex(
    buf: *mut fep_buffer,
    dispatch_op: *const fep_gpu_ll_op,
    x: *const fep_tensor,
    topk_idx: *const fep_tensor,
    topk_weights: *const fep_tensor,
    out: *const fep_tensor,
    return_recv_hook: bool,
    wait_recv_cost_stats: *const fep_tensor,
    order: *const fep_gpu_order,
    out_op: *mut *mut fep_gpu_ll_op,
) -> fep_status {
    guard_peers(buf, || {
        let out_op = out_op.as_mut().ok_or_else(|| Error::arg("out_op", "NULL pointer"))?;
        *out_op = std::ptr::null_mut();
        let (b, st) = parts(buf)?;
        let d = super::live::get(dispatch_op, "dispatch_op")?;
        let (handle, t) = match &d.state {
            GpuLl::Dispatch { out, num_tokens, hook: None } => (*out, *num_tokens),
            GpuLl::Dispatch { hook: Some(_), .. } => {
                return Err(Error::arg(
                    "dispatch_op",
                    "its receive hook has not been completed (fep_gpu_ll_complete)",
                ))
            }
            GpuLl::Combine { .. } => {
                return Err(Error::arg("dispatch_op", "a combine op, not a dispatch"))
            }
        };
        let c = b.config();
        let (l, s) = (c.num_local_experts() as i64, (c.num_ranks * c.max_tokens_per_rank) as i64);
        let (h, k, ti) = (c.hidden as i64, c.num_topk as i64, Some(t as i64));
        let xs = dev("x", x, FEP_DTYPE_BF16, &[Some(l), Some(s), Some(h)])?.0;
        let idx = dev("topk_idx", topk_idx, FEP_DTYPE_I64, &[ti, Some(k)])?.0;
        let w = dev("topk_weights", topk_weights, FEP_DTYPE_F32, &[ti, Some(k)])?.0;
        let o_out = dev("out", out, FEP_DTYPE_BF16, &[ti, Some(h)])?.0;
        let view = ll_view(&st.dev, &handle);
        wait_stats_arg(b, wait_recv_cost_stats)?;
        let (stream, o) = begin(st, order)?;
        let args = GpuLlCombineArgs {
            x: xs,
            topk_idx: idx,
            topk_weights: w,
            num_tokens: t,
            handle: &view,
            out: o_out,
            return_recv_hook,
            stream: &stream,
        };
        let hook = b.gpu()?.low_latency_combine_gpu(&args)?;
        finish(st, &o, &stream)?;
        *out_op = super::live::boxed(fep_gpu_ll_op {
            state: GpuLl::Combine {
                hook,
                x: xs,
                topk_idx: idx,
                topk_weights: w,
                out: o_out,
                num_tokens: t,
                handle,
            },
        });
        Ok(())
    })
}

/// Frees a GPU low-latency op. NULL is a no-op. A dispatch's outputs stay the caller's.
///
/// # Safety
/// `op` must come from `fep_gpu_ll_dispatch` / `fep_gpu_ll_combine` and not be used afterwards.
#[no_mangle]
pub unsafe extern "C" fn fep_gpu_ll_op_destroy(op: *mut fep_gpu_ll_op) {
    super::live::free(op, "op");
}

/// Waits (bounded: twice the config's timeout plus 5 s) until `stream` has run its work, then
/// reports any error this rank's kernels recorded (a timeout names the phase and peer). A
/// device error makes the buffer unusable until `fep_clean_low_latency_buffer` on every rank.
///
/// # Safety
/// `buf` must be valid; `stream` a stream of the buffer's device (NULL: the legacy default).
#[no_mangle]
pub unsafe extern "C" fn fep_gpu_sync(buf: *mut fep_buffer, stream: *mut c_void) -> fep_status {
    guard_peers(buf, || {
        let (b, st) = parts(buf)?;
        let s = Stream::borrowed(&st.dev, stream as CUstream);
        if let Some(hp) = st.hier.as_mut() {
            hp.buf.sync_gpu(&s)?;
        }
        b.gpu()?.sync_gpu(&s)
    })
}

/// The buffer's CUDA device ordinal, SM budget (blocks per kernel) and its own communication
/// stream (a non-blocking `CUstream`; a distinct stream per live buffer, unlike streams drawn
/// from a framework's pool, which may be shared). The stream stays valid after
/// `fep_buffer_destroy`, for the rest of the process: a framework's allocator may still use
/// it then (torch records an event on it when a tensor `record_stream`-ed on it is freed). A
/// buffer created later on the device may be given the same stream.
///
/// # Safety
/// `buf` must be valid; the outputs may be NULL.
#[no_mangle]
pub unsafe extern "C" fn fep_gpu_info(
    buf: *mut fep_buffer,
    device: *mut i32,
    num_sms: *mut i32,
    comm_stream: *mut *mut c_void,
) -> fep_status {
    guard(|| {
        let (b, st) = parts(buf)?;
        if let Some(c) = comm_stream.as_mut() {
            *c = st.comm.as_raw() as *mut c_void;
        }
        if let Some(d) = device.as_mut() {
            *d = st.dev.ordinal() as i32;
        }
        if let Some(n) = num_sms.as_mut() {
            *n = b.gpu()?.num_sms() as i32;
        }
        Ok(())
    })
}
