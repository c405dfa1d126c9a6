//! Low-latency mode in the C ABI. A call returns an operation object (`fep_ll_op`): complete
//! at once, or — with `return_recv_hook` — holding the receive half, which
//! `fep_ll_op_complete` runs (DeepEP's hook). Outputs are copied into caller tensors with
//! `fep_ll_dispatch_copy_out` / `fep_ll_combine_copy_out`; `fep_ll_op_destroy` frees the op.
//! The `_ex` forms take DeepEP's `*_wait_recv_cost_stats`; shrink mode's rank mask is
//! `fep_ll_update_mask` / `fep_ll_query_mask` / `fep_ll_clean_mask`.

use std::os::raw::c_void;

use super::buffer::{fep_buffer, fep_tensor, view, view_mut, FEP_DTYPE_BF16, FEP_DTYPE_F32};
use super::buffer::{FEP_DTYPE_FP8_E4M3, FEP_DTYPE_I32, FEP_DTYPE_I64};
use super::guard;
use crate::ep::buffer::{
    Buffer, LlCombineArgs, LlCombineHook, LlCombineOutput, LlDispatchArgs, LlDispatchHook,
    LlDispatchOutput, OwnedTokens,
};
use crate::ep::handle::LlHandle;
use crate::error::Error;

enum State {
    DispatchPending(LlDispatchHook),
    DispatchDone(Box<LlDispatchOutput>),
    CombinePending(LlCombineHook),
    CombineDone(LlCombineOutput),
    /// Outputs were copied out; the dispatch handle stays for the combine.
    Drained,
    /// A completion failed; the op is spent.
    Failed,
}

/// A low-latency dispatch or combine in flight or done (opaque).
pub struct fep_ll_op {
    state: State,
    /// The dispatch's routing, needed by the matching combine (dispatch ops only).
    handle: Option<LlHandle>,
    /// The call's tokens `T` (a combine's output rows).
    num_tokens: i64,
    /// The caller's wait-cost tensor, until the receive has added to it.
    stats: Option<WaitStats>,
}

/// A caller's `[R]` int64 tensor (DeepEP's `dispatch_wait_recv_cost_stats` /
/// `combine_wait_recv_cost_stats`): the receive adds to entry `r` the nanoseconds it waited for
/// rank `r`'s messages.
struct WaitStats {
    data: *mut i64,
    len: usize,
}

impl WaitStats {
    /// `t` checked as `[num_ranks]` int64; NULL: none.
    ///
    /// # Safety
    /// A non-NULL `t` must be valid, its data until the receive has run.
    unsafe fn of(t: *mut fep_tensor, num_ranks: usize) -> Result<Option<Self>, Error> {
        if t.is_null() {
            return Ok(None);
        }
        let v =
            view_mut::<i64>("wait_recv_cost_stats", t, FEP_DTYPE_I64, &[Some(num_ranks as i64)])?;
        Ok(Some(WaitStats { data: v.as_mut_ptr(), len: v.len() }))
    }

    /// Adds `ns[r]` to entry `r` (wrapping, as DeepEP's 64-bit atomic add).
    ///
    /// # Safety
    /// The tensor given to [`Self::of`] is still valid.
    unsafe fn add(&self, ns: &[u64]) {
        for (i, &v) in ns.iter().enumerate().take(self.len) {
            let p = self.data.add(i);
            *p = (*p).wrapping_add(v as i64);
        }
    }
}

/// Moves a finished receive's wait costs into the op's tensor (once).
unsafe fn add_stats(op: &mut fep_ll_op) {
    let ns = match &op.state {
        State::DispatchDone(o) => &o.recv_wait_ns,
        State::CombineDone(o) => &o.recv_wait_ns,
        _ => return,
    };
    if let Some(s) = op.stats.take() {
        s.add(ns);
    }
}

/// Low-latency dispatch (DeepEP V1 semantics): `x` `[T <= max_tokens_per_rank, H]` bf16,
/// `topk_idx` `[T, K]` i64 (-1 = none). One write per (destination rank, local expert) carrying
/// all its rows, the count in the immediate data. With `return_recv_hook` the call returns after
/// the sends and `fep_ll_op_complete` does the receive. `stream`: NULL on the host backend.
/// Refused: `T > max_tokens_per_rank`, a `topk_idx` value outside -1..num_experts or an expert
/// named twice in one token (each row of an expert is one token), `round_scale` without
/// `use_fp8`, `use_fp8` with a hidden size that is not a multiple of 128.
///
/// # Safety
/// Every non-NULL pointer must be valid for the call.
#[no_mangle]
pub unsafe extern "C" fn fep_low_latency_dispatch(
    buf: *mut fep_buffer,
    x: *const fep_tensor,
    topk_idx: *const fep_tensor,
    use_fp8: bool,
    round_scale: bool,
    return_recv_hook: bool,
    stream: *mut c_void,
    out_op: *mut *mut fep_ll_op,
) -> super::fep_status {
    fep_low_latency_dispatch_ex(
        buf,
        x,
        topk_idx,
        use_fp8,
        round_scale,
        return_recv_hook,
        std::ptr::null_mut(),
        stream,
        out_op,
    )
}

/// `fep_low_latency_dispatch` with DeepEP's `dispatch_wait_recv_cost_stats`:
/// `wait_recv_cost_stats` (NULL: none) is an `[R]` int64 host tensor to which the receive (at
/// once, or in `fep_ll_op_complete`) adds, per source rank, the nanoseconds it waited for that
/// rank's messages (summed over its messages, one per local expert; a rank masked in shrink
/// mode: the time until it was masked). Keep it alive until the receive has run.
///
/// # Safety
/// Every non-NULL pointer must be valid for the call; `wait_recv_cost_stats`' data until the
/// receive has run.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn fep_low_latency_dispatch_ex(
    buf: *mut fep_buffer,
    x: *const fep_tensor,
    topk_idx: *const fep_tensor,
    use_fp8: bool,
    round_scale: bool,
    return_recv_hook: bool,
    wait_recv_cost_stats: *mut fep_tensor,
    stream: *mut c_void,
    out_op: *mut *mut fep_ll_op,
) -> super::fep_status {
    guard(|| {
        let out_op = out_op.as_mut().ok_or_else(|| Error::arg("out_op", "NULL pointer"))?;
        *out_op = std::ptr::null_mut();
        let b = super::buffer::buffer(buf)?;
        super::buffer::no_stream(stream, b)?;
        if round_scale && !use_fp8 {
            return Err(Error::arg("round_scale", "needs use_fp8 (bf16 rows have no scales)"));
        }
        let (h, k) = (b.config().hidden as i64, b.config().num_topk as i64);
        let (xs, shape) = view::<u16>("x", x, FEP_DTYPE_BF16, &[None, Some(h)])?;
        let (idx, _) =
            view::<i64>("topk_idx", topk_idx, FEP_DTYPE_I64, &[Some(shape[0]), Some(k)])?;
        let stats = WaitStats::of(wait_recv_cost_stats, b.config().num_ranks)?;
        let outcome = b.low_latency_dispatch(&LlDispatchArgs {
            x: xs,
            topk_idx: idx,
            use_fp8,
            round_scale,
            return_recv_hook,
        })?;
        let mut op = match outcome {
            crate::ep::buffer::LlDispatchOutcome::Received(o) => fep_ll_op {
                handle: Some(o.handle.clone()),
                state: State::DispatchDone(Box::new(o)),
                num_tokens: shape[0],
                stats,
            },
            crate::ep::buffer::LlDispatchOutcome::Hook(hk) => fep_ll_op {
                handle: None,
                state: State::DispatchPending(hk),
                num_tokens: shape[0],
                stats,
            },
        };
        add_stats(&mut op);
        *out_op = super::live::boxed(op);
        Ok(())
    })
}

/// Completes the receive of a hooked dispatch or combine (a no-op when already complete).
///
/// # Safety
/// `buf` and `op` must be valid.
#[no_mangle]
pub unsafe extern "C" fn fep_ll_op_complete(
    buf: *mut fep_buffer,
    op: *mut fep_ll_op,
) -> super::fep_status {
    guard(|| {
        let b: &mut Buffer = super::buffer::buffer(buf)?;
        let op = super::live::get(op, "op")?;
        match std::mem::replace(&mut op.state, State::Failed) {
            State::DispatchPending(hk) => {
                let o = hk.complete(b).map_err(|e| super::rename_arg(e, "hook", "op"))?;
                op.handle = Some(o.handle.clone());
                op.state = State::DispatchDone(Box::new(o));
                add_stats(op);
            }
            State::CombinePending(hk) => {
                op.state = State::CombineDone(
                    hk.complete(b).map_err(|e| super::rename_arg(e, "hook", "op"))?,
                );
                add_stats(op);
            }
            State::Failed => {
                return Err(Error::arg("op", "a previous completion of this op failed"))
            }
            s => op.state = s,
        }
        Ok(())
    })
}

/// Copies a completed dispatch's outputs (`L` local experts, `S = num_ranks *
/// max_tokens_per_rank`): `recv_x` `[L, S, H]` (bf16, or fp8 with `recv_x_scales` `[L, S, H/128]`
/// f32), `recv_count` `[L]` i32, `src_rank` / `src_idx` `[L, S]` i32 (-1 past the counts),
/// `layout_range` `[L, R]` i64 as DeepEP packs it (`begin << 32 | count`). Optional outputs may
/// be NULL. Once per op.
///
/// # Safety
/// Every non-NULL pointer must be valid for the call.
#[no_mangle]
pub unsafe extern "C" fn fep_ll_dispatch_copy_out(
    op: *mut fep_ll_op,
    recv_x: *mut fep_tensor,
    recv_x_scales: *mut fep_tensor,
    recv_count: *mut fep_tensor,
    src_rank: *mut fep_tensor,
    src_idx: *mut fep_tensor,
    layout_range: *mut fep_tensor,
) -> super::fep_status {
    guard(|| {
        let op = super::live::get(op, "op")?;
        let o = match &op.state {
            State::DispatchDone(o) => o,
            State::DispatchPending(_) => {
                return Err(Error::arg("op", "pending: call fep_ll_op_complete first"))
            }
            _ => return Err(Error::arg("op", "not a completed dispatch, or already copied out")),
        };
        let l = o.recv_count.len() as i64;
        let s = if l == 0 { 0 } else { o.recv_src_idx.len() as i64 / l };
        let r = if l == 0 { 0 } else { o.layout_range.len() as i64 / l };
        match &o.recv_x {
            OwnedTokens::Bf16(v) => {
                let h = if l * s == 0 { 0 } else { v.len() as i64 / (l * s) };
                view_mut::<u16>("recv_x", recv_x, FEP_DTYPE_BF16, &[Some(l), Some(s), Some(h)])?
                    .copy_from_slice(v);
            }
            OwnedTokens::Fp8 { x, scales } => {
                let h = if l * s == 0 { 0 } else { x.len() as i64 / (l * s) };
                view_mut::<u8>("recv_x", recv_x, FEP_DTYPE_FP8_E4M3, &[Some(l), Some(s), Some(h)])?
                    .copy_from_slice(x);
                if !recv_x_scales.is_null() {
                    view_mut::<f32>(
                        "recv_x_scales",
                        recv_x_scales,
                        FEP_DTYPE_F32,
                        &[Some(l), Some(s), Some(h / 128)],
                    )?
                    .copy_from_slice(scales);
                }
            }
        }
        if !recv_count.is_null() {
            let d = view_mut::<i32>("recv_count", recv_count, FEP_DTYPE_I32, &[Some(l)])?;
            for (d, c) in d.iter_mut().zip(&o.recv_count) {
                *d = *c as i32;
            }
        }
        if !src_rank.is_null() {
            view_mut::<i32>("src_rank", src_rank, FEP_DTYPE_I32, &[Some(l), Some(s)])?
                .copy_from_slice(&o.recv_src_rank);
        }
        if !src_idx.is_null() {
            view_mut::<i32>("src_idx", src_idx, FEP_DTYPE_I32, &[Some(l), Some(s)])?
                .copy_from_slice(&o.recv_src_idx);
        }
        if !layout_range.is_null() {
            let d =
                view_mut::<i64>("layout_range", layout_range, FEP_DTYPE_I64, &[Some(l), Some(r)])?;
            for (d, &(b, c)) in d.iter_mut().zip(&o.layout_range) {
                *d = ((b as i64) << 32) | c as i64;
            }
        }
        op.state = State::Drained;
        Ok(())
    })
}

/// Low-latency combine: `x` `[L, S, H]` bf16 expert outputs in the dispatch's row order, the
/// dispatch's `topk_idx` `[T, K]` i64 and `topk_weights` `[T, K]` f32, `dispatch_op` the completed
/// dispatch. The weighted sum (fp32) is computed on arrival; copy it out with
/// `fep_ll_combine_copy_out`. With `return_recv_hook`, complete the op first. Refused: a
/// `dispatch_op` that is not a completed dispatch of this buffer, or from before
/// `fep_clean_low_latency_buffer`; a `topk_idx` value other than the dispatch's (or -1, which
/// leaves that expert out); a NaN or infinite weight.
///
/// # Safety
/// Every non-NULL pointer must be valid for the call.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn fep_low_latency_combine(
    buf: *mut fep_buffer,
    dispatch_op: *const fep_ll_op,
    x: *const fep_tensor,
    topk_idx: *const fep_tensor,
    topk_weights: *const fep_tensor,
    return_recv_hook: bool,
    stream: *mut c_void,
    out_op: *mut *mut fep_ll_op,
) -> super::fep_status {
    fep_low_latency_combine_ex(
        buf,
        dispatch_op,
        x,
        topk_idx,
        topk_weights,
        return_recv_hook,
        std::ptr::null_mut(),
        stream,
        out_op,
    )
}

/// `fep_low_latency_combine` with DeepEP's `combine_wait_recv_cost_stats` (NULL: none): an
/// `[R]` int64 host tensor, added to as in `fep_low_latency_dispatch_ex` (per rank, the
/// nanoseconds the combine's receive waited for its answers).
///
/// # Safety
/// As `fep_low_latency_dispatch_ex`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn fep_low_latency_combine_ex(
    buf: *mut fep_buffer,
    dispatch_op: *const fep_ll_op,
    x: *const fep_tensor,
    topk_idx: *const fep_tensor,
    topk_weights: *const fep_tensor,
    return_recv_hook: bool,
    wait_recv_cost_stats: *mut fep_tensor,
    stream: *mut c_void,
    out_op: *mut *mut fep_ll_op,
) -> super::fep_status {
    guard(|| {
        let out_op = out_op.as_mut().ok_or_else(|| Error::arg("out_op", "NULL pointer"))?;
        *out_op = std::ptr::null_mut();
        let b = super::buffer::buffer(buf)?;
        super::buffer::no_stream(stream, b)?;
        let d = super::live::get(dispatch_op, "dispatch_op")?;
        let handle = d.handle.as_ref().ok_or_else(|| {
            Error::arg(
                "dispatch_op",
                "not a completed low-latency dispatch (complete its hook first)",
            )
        })?;
        let c = b.config();
        let (h, k) = (c.hidden as i64, c.num_topk as i64);
        let (l, s) = (c.num_local_experts() as i64, (c.num_ranks * c.max_tokens_per_rank) as i64);
        let t = handle.num_tokens() as i64;
        let (xs, _) = view::<u16>("x", x, FEP_DTYPE_BF16, &[Some(l), Some(s), Some(h)])?;
        let (idx, _) = view::<i64>("topk_idx", topk_idx, FEP_DTYPE_I64, &[Some(t), Some(k)])?;
        let (w, _) = view::<f32>("topk_weights", topk_weights, FEP_DTYPE_F32, &[Some(t), Some(k)])?;
        super::check_finite("topk_weights", w)?;
        let stats = WaitStats::of(wait_recv_cost_stats, c.num_ranks)?;
        let outcome = b
            .low_latency_combine(&LlCombineArgs {
                x: xs,
                topk_idx: idx,
                topk_weights: w,
                handle,
                return_recv_hook,
            })
            .map_err(|e| super::rename_arg(e, "handle", "dispatch_op"))?;
        let state = match outcome {
            crate::ep::buffer::LlCombineOutcome::Received(o) => State::CombineDone(o),
            crate::ep::buffer::LlCombineOutcome::Hook(hk) => State::CombinePending(hk),
        };
        let mut op = fep_ll_op { state, handle: None, num_tokens: t, stats };
        add_stats(&mut op);
        *out_op = super::live::boxed(op);
        Ok(())
    })
}

/// Copies a completed combine's output `combined_x` `[T, H]` bf16, `T` the combine's tokens
/// (another row count is refused). Once per op.
///
/// # Safety
/// `op` and `combined_x` must be valid.
#[no_mangle]
pub unsafe extern "C" fn fep_ll_combine_copy_out(
    op: *mut fep_ll_op,
    combined_x: *mut fep_tensor,
) -> super::fep_status {
    guard(|| {
        let op = super::live::get(op, "op")?;
        let State::CombineDone(o) = &op.state else {
            return Err(Error::arg(
                "op",
                "not a completed combine (complete its hook first), or already copied out",
            ));
        };
        // The rows are the combine's tokens, not whatever the caller's tensor says.
        let t = op.num_tokens;
        let h = if t == 0 { None } else { Some(o.combined_x.len() as i64 / t) };
        view_mut::<u16>("combined_x", combined_x, FEP_DTYPE_BF16, &[Some(t), h])?
            .copy_from_slice(&o.combined_x);
        op.state = State::Drained;
        Ok(())
    })
}

/// Frees an op. NULL is a no-op. A pending hook that is never completed keeps its buffer set
/// reserved until `fep_clean_low_latency_buffer`.
///
/// # Safety
/// `op` must come from a `fep_low_latency_*` call and not be used afterwards.
#[no_mangle]
pub unsafe extern "C" fn fep_ll_op_destroy(op: *mut fep_ll_op) {
    super::live::free(op, "op");
}

/// Makes the low-latency buffers usable again after a failed step (collective: every rank calls
/// it); earlier ops and handles become invalid. On the GPU backend it also resets normal mode
/// after a device error, and no kernel of this buffer's group may be running (synchronise
/// every rank's streams first).
///
/// # Safety
/// `buf` must be valid.
#[no_mangle]
pub unsafe extern "C" fn fep_clean_low_latency_buffer(buf: *mut fep_buffer) -> super::fep_status {
    guard(|| {
        let b = super::buffer::buffer(buf)?;
        match b.gpu() {
            Ok(g) => g.clean_low_latency_gpu(),
            Err(_) => b.clean_low_latency_buffer(),
        }
    })
}

/// Shrink mode (`fep_config.enable_shrink`; DeepEP's `low_latency_update_mask_buffer`): masks
/// (`mask` true) or unmasks `rank` on this rank only. A masked rank gets no low-latency writes
/// from this rank and is not waited for (its messages count as empty, its experts' answers
/// as -1 entries in combine); a rank that stalls for the timeout is masked the same way.
/// Unmasking a masked rank leaves the low-latency buffer refusing calls until
/// `fep_clean_low_latency_buffer` (on every unmasked rank, that one included).
///
/// Refused: a buffer without shrink mode; `rank` outside `0..num_ranks`.
///
/// # Safety
/// `buf` must be valid.
#[no_mangle]
pub unsafe extern "C" fn fep_ll_update_mask(
    buf: *mut fep_buffer,
    rank: i32,
    mask: bool,
) -> super::fep_status {
    guard(|| {
        let b = super::buffer::buffer(buf)?;
        let r = usize::try_from(rank)
            .map_err(|_| Error::arg("rank", format!("{rank}: must be >= 0")))?;
        b.ll_update_mask(r, mask)
    })
}

/// Shrink mode (DeepEP's `low_latency_query_mask_buffer`): writes `mask_status` `[R]` int32
/// (host memory): 1 for each rank this rank has masked, 0 for the others.
///
/// Refused: a buffer without shrink mode; a tensor that is not `[num_ranks]` int32.
///
/// # Safety
/// `buf` and `mask_status` must be valid.
#[no_mangle]
pub unsafe extern "C" fn fep_ll_query_mask(
    buf: *mut fep_buffer,
    mask_status: *mut fep_tensor,
) -> super::fep_status {
    guard(|| {
        let b = super::buffer::buffer(buf)?;
        let r = b.config().num_ranks as i64;
        let m = b.ll_mask()?;
        let out = view_mut::<i32>("mask_status", mask_status, FEP_DTYPE_I32, &[Some(r)])?;
        for (o, &v) in out.iter_mut().zip(&m) {
            *o = i32::from(v);
        }
        Ok(())
    })
}

/// Shrink mode (DeepEP's `low_latency_clean_mask_buffer`): unmasks every rank, as
/// `fep_ll_update_mask` does each.
///
/// # Safety
/// `buf` must be valid.
#[no_mangle]
pub unsafe extern "C" fn fep_ll_clean_mask(buf: *mut fep_buffer) -> super::fep_status {
    guard(|| super::buffer::buffer(buf)?.ll_clean_mask())
}
