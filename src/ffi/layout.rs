//! `get_dispatch_layout` on the GPU in the C ABI (`fep_gpu_layout_*`): the layout kernel
//! (`kernels/layout.cu`, one launch) writing DeepEP's four outputs into caller tensors (e.g.
//! torch CUDA tensors) on a caller stream, with no buffer and no host synchronisation.
//!
//! A layout object belongs to one GPU and one `(num_experts, num_ranks, ranks_per_node)`; its
//! kernel workspace is shared by its launches, so a launch on a stream other than the previous
//! one's first waits for that launch (an event), and launches on one stream are ordered by it.
//!
//! Expert ids out of `[-1, num_experts)` are skipped by the kernel and recorded; the record is
//! read (without a synchronisation) at the start of the next [`fep_gpu_layout_run`] and by
//! [`fep_gpu_layout_destroy`], which then fail naming `topk_idx`.

use std::sync::Mutex;

use cudarc::driver::sys::CUstream;

use super::buffer::{fep_tensor, FEP_DTYPE_BOOL, FEP_DTYPE_I32, FEP_DTYPE_I64};
use super::gpu::{begin_on, dev, fep_gpu_order};
use super::live;
use super::{fep_status, guard};
use crate::cuda::{DevErrorRecord, Device, Event, Stream};
use crate::ep::layout_gpu::{DispatchLayoutGpu, LayoutTuning};
use crate::error::Error;
use crate::protocol::layout::LayoutShape;

/// An opaque GPU layout object (see the module docs).
pub struct fep_gpu_layout {
    inner: Mutex<LayoutState>,
}

struct LayoutState {
    dev: Device,
    gpu: DispatchLayoutGpu,
    err: DevErrorRecord,
    /// Recorded after every launch; the stream of the last launch.
    done: Event,
    last_stream: Option<CUstream>,
    ev_in: Event,
    ev_out: Event,
}

// SAFETY: the state is only touched under the mutex; the CUDA objects it holds are
// context-bound handles the driver lets any thread use once the context is current
// (`Device::bind`, done by every call below).
unsafe impl Send for LayoutState {}

fn positive(name: &'static str, v: i32) -> Result<usize, Error> {
    if v < 1 {
        return Err(Error::arg(name, format!("{v}: must be at least 1")));
    }
    Ok(v as usize)
}

/// Creates a layout object on CUDA device `device` (an ordinal; the primary context, as torch
/// uses) for `num_experts` experts over `num_ranks` ranks of `ranks_per_node` per node.
///
/// # Safety
/// `out` must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fep_gpu_layout_create(
    device: i32,
    num_experts: i32,
    num_ranks: i32,
    ranks_per_node: i32,
    out: *mut *mut fep_gpu_layout,
) -> fep_status {
    guard(|| {
        let out = out.as_mut().ok_or_else(|| Error::arg("out", "NULL pointer"))?;
        *out = std::ptr::null_mut();
        if device < 0 {
            return Err(Error::arg("device", format!("{device}: must be >= 0")));
        }
        let (e, r, rpn) = (
            positive("num_experts", num_experts)?,
            positive("num_ranks", num_ranks)?,
            positive("ranks_per_node", ranks_per_node)?,
        );
        // The shape's own checks (experts a multiple of ranks, nodes that divide).
        LayoutShape::new(0, 1, e, r, rpn)?;
        let dev = Device::new(device as usize)?;
        let state = LayoutState {
            gpu: DispatchLayoutGpu::new(&dev, e, r, rpn)?,
            err: DevErrorRecord::new(&dev)?,
            done: Event::new_untimed(&dev)?,
            ev_in: Event::new_untimed(&dev)?,
            ev_out: Event::new_untimed(&dev)?,
            last_stream: None,
            dev,
        };
        *out = live::boxed(fep_gpu_layout { inner: Mutex::new(state) });
        Ok(())
    })
}

fn lock(l: &fep_gpu_layout) -> std::sync::MutexGuard<'_, LayoutState> {
    l.inner.lock().unwrap_or_else(|p| p.into_inner())
}

/// An out-of-range expert id seen by an earlier launch, as an argument error (then cleared).
fn earlier_error(st: &LayoutState) -> Result<(), Error> {
    match st.err.check() {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = st.err.reset();
            Err(Error::arg(
                "topk_idx",
                format!("an earlier get_dispatch_layout saw an expert id out of range: {e}"),
            ))
        }
    }
}

/// DeepEP's `get_dispatch_layout` of `topk_idx` (`[T, K]` i64, device; -1 = no expert) into
/// `num_tokens_per_rank` (`[R]` i32), `num_tokens_per_rdma_rank` (`[R / ranks_per_node]` i32;
/// NULL allowed, and ignored, on one node), `num_tokens_per_expert` (`[E]` i32) and
/// `is_token_in_rank` (`[T, R]` bool), on `order->stream` (after `order`'s waits; its
/// `then_stream` waits for the launch). Asynchronous: no host synchronisation.
///
/// # Safety
/// `layout` must come from [`fep_gpu_layout_create`]; every tensor must be device memory of the
/// layout's GPU, alive until the stream has run the launch; `order` must be valid.
#[no_mangle]
pub unsafe extern "C" fn fep_gpu_layout_run(
    layout: *mut fep_gpu_layout,
    topk_idx: *const fep_tensor,
    num_tokens_per_rank: *const fep_tensor,
    num_tokens_per_rdma_rank: *const fep_tensor,
    num_tokens_per_expert: *const fep_tensor,
    is_token_in_rank: *const fep_tensor,
    order: *const fep_gpu_order,
) -> fep_status {
    guard(|| {
        let l = live::get(layout, "layout")?;
        let mut st = lock(l);
        let (e, r, rpn) = (st.gpu.num_experts(), st.gpu.num_ranks(), st.gpu.ranks_per_node());
        let nodes = r / rpn;
        let (idx, shape) = dev("topk_idx", topk_idx, FEP_DTYPE_I64, &[None, None])?;
        let (t, k) = (shape[0], shape[1]);
        if k < 1 {
            return Err(Error::arg("topk_idx", format!("shape [{t}, {k}]: needs K >= 1")));
        }
        LayoutShape::new(t as usize, k as usize, e, r, rpn)?;
        let per_rank =
            dev("num_tokens_per_rank", num_tokens_per_rank, FEP_DTYPE_I32, &[Some(r as i64)])?.0;
        let per_node = if nodes > 1 {
            Some(
                dev(
                    "num_tokens_per_rdma_rank",
                    num_tokens_per_rdma_rank,
                    FEP_DTYPE_I32,
                    &[Some(nodes as i64)],
                )?
                .0,
            )
        } else {
            None
        };
        let per_expert =
            dev("num_tokens_per_expert", num_tokens_per_expert, FEP_DTYPE_I32, &[Some(e as i64)])?
                .0;
        let in_rank =
            dev("is_token_in_rank", is_token_in_rank, FEP_DTYPE_BOOL, &[Some(t), Some(r as i64)])?
                .0;
        earlier_error(&st)?;
        st.dev.bind()?;
        let (s, o) = begin_on(&st.dev, &st.ev_in, order)?;
        // One workspace: a launch on another stream waits for the last one.
        if st.last_stream.is_some_and(|p| p != o.stream as CUstream) {
            s.wait_event(&st.done)?;
        }
        let p = crate::abi::fep_layout_params {
            topk_idx: idx.ptr,
            num_tokens_per_rank: per_rank.ptr,
            num_tokens_per_node: per_node.map_or(0, |d| d.ptr),
            num_tokens_per_expert: per_expert.ptr,
            is_token_in_rank: in_rank.ptr,
            dev_error: st.err.as_abi(),
            num_tokens: t as i32,
            num_topk: k as i32,
            rank: 0,
            ..Default::default()
        };
        st.gpu.launch_raw(&s, p, LayoutTuning::default())?;
        st.done.record(&s)?;
        st.last_stream = Some(o.stream as CUstream);
        if !o.then_stream.is_null() && o.then_stream != o.stream {
            st.ev_out.record(&s)?;
            Stream::borrowed(&st.dev, o.then_stream as CUstream).wait_event(&st.ev_out)?;
        }
        Ok(())
    })
}

/// Frees a layout object after its last launch has finished (a bounded wait); reports an
/// out-of-range expert id its launches recorded and not yet reported. A second destroy, or a
/// pointer not from [`fep_gpu_layout_create`], is `FEP_ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// `layout` must come from [`fep_gpu_layout_create`]; no call may use it afterwards.
#[no_mangle]
pub unsafe extern "C" fn fep_gpu_layout_destroy(layout: *mut fep_gpu_layout) -> fep_status {
    guard(|| {
        let b = live::take(layout, "layout")?;
        let st = b.inner.into_inner().unwrap_or_else(|p| p.into_inner());
        let waited = st.done.synchronize().map_err(Error::from);
        let reported = earlier_error(&st);
        drop(st);
        waited?;
        reported
    })
}
