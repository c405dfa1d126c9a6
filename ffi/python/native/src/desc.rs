//! The descriptors (`fep_tensor`) and stream orders (`fep_gpu_order`) the calls pass, built from
//! plain integers. Kept free of Python so that the unit tests below check them directly.

use std::os::raw::c_void;

use fabric_ep::ffi::{fep_gpu_ll_buffers, fep_gpu_order, fep_tensor};

pub(crate) const BF16: i32 = fabric_ep::ffi::FEP_DTYPE_BF16;
pub(crate) const FP8: i32 = fabric_ep::ffi::FEP_DTYPE_FP8_E4M3;
pub(crate) const F32: i32 = fabric_ep::ffi::FEP_DTYPE_F32;
pub(crate) const I64: i32 = fabric_ep::ffi::FEP_DTYPE_I64;
pub(crate) const I32: i32 = fabric_ep::ffi::FEP_DTYPE_I32;

pub(crate) const NULL_TENSOR_PTR: *mut fep_tensor = std::ptr::null_mut();

pub(crate) fn dtype_name(code: i32) -> &'static str {
    match code {
        BF16 => "bf16",
        FP8 => "fp8 e4m3",
        F32 => "float32",
        I64 => "int64",
        I32 => "int32",
        _ => "unknown",
    }
}

#[inline]
fn tensor(data: usize, dtype: i32, shape: &[i64]) -> fep_tensor {
    let mut s = [0i64; 4];
    s[..shape.len()].copy_from_slice(shape);
    fep_tensor { data: data as *mut c_void, dtype, ndim: shape.len() as i32, shape: s }
}

#[inline]
pub(crate) fn t1(data: usize, dtype: i32, d0: i64) -> fep_tensor {
    tensor(data, dtype, &[d0])
}

#[inline]
pub(crate) fn t2(data: usize, dtype: i32, d0: i64, d1: i64) -> fep_tensor {
    tensor(data, dtype, &[d0, d1])
}

#[inline]
pub(crate) fn t3(data: usize, dtype: i32, d0: i64, d1: i64, d2: i64) -> fep_tensor {
    tensor(data, dtype, &[d0, d1, d2])
}

/// A GPU call's stream order as integers: run on `stream` after `wait_stream` / `wait_event`,
/// then `then_stream` waits (0: none).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Order {
    pub stream: usize,
    pub wait_stream: usize,
    pub wait_event: usize,
    pub then_stream: usize,
}

impl Order {
    /// DeepEP's pattern: on `comm` after the compute stream (or after `event` instead, when
    /// one is given); the compute stream waits afterwards unless `async_finish`.
    pub(crate) fn before_after(
        comm: usize,
        compute: usize,
        event: usize,
        async_finish: bool,
    ) -> Self {
        Order {
            stream: comm,
            wait_stream: if event != 0 { 0 } else { compute },
            wait_event: event,
            then_stream: if async_finish { 0 } else { compute },
        }
    }

    /// A call right after one on the same stream that waited already: no wait before.
    pub(crate) fn after_only(comm: usize, compute: usize, async_finish: bool) -> Self {
        Order {
            stream: comm,
            wait_stream: 0,
            wait_event: 0,
            then_stream: if async_finish { 0 } else { compute },
        }
    }

    pub(crate) fn raw(self) -> fep_gpu_order {
        fep_gpu_order {
            stream: self.stream as *mut c_void,
            wait_stream: self.wait_stream as *mut c_void,
            wait_event: self.wait_event as *mut c_void,
            then_stream: self.then_stream as *mut c_void,
        }
    }
}

/// `fep_gpu_dispatch`'s nine descriptors: the inputs `[t, ...]` (x, x_scales, topk_idx,
/// topk_weights) and the outputs `[rows, ...]` (recv_x, recv_x_scales, recv_topk_idx,
/// recv_topk_weights, recv_src_idx `[rows]` int32).
pub(crate) fn gpu_dispatch(
    xc: i32,
    h: i64,
    k: i64,
    inputs: [usize; 4],
    t: i64,
    outputs: [usize; 5],
    rows: i64,
) -> [fep_tensor; 9] {
    let g = h / 128;
    [
        t2(inputs[0], xc, t, h),
        t2(inputs[1], F32, t, g),
        t2(inputs[2], I64, t, k),
        t2(inputs[3], F32, t, k),
        t2(outputs[0], xc, rows, h),
        t2(outputs[1], F32, rows, g),
        t2(outputs[2], I64, rows, k),
        t2(outputs[3], F32, rows, k),
        t1(outputs[4], I32, rows),
    ]
}

/// `fep_gpu_ll_buffers` of one dispatch: recv_x `[L, S, H]` (the buffer's token dtype) and its
/// scales `[L, S, H / 128]`, then the parts of the int32 routing allocation at `routing`:
/// count `[L]` at its start, src_rank and src_idx `[L, S]`, pairs `[L, R, 2]`, positions
/// `[M, K]` at the byte offsets `offs`.
pub(crate) fn gpu_ll_buffers(
    xc: i32,
    h: i64,
    k: i64,
    l: i64,
    r: i64,
    m: i64,
    recv_x: usize,
    recv_x_scales: usize,
    routing: usize,
    offs: [usize; 4],
) -> fep_gpu_ll_buffers {
    let s = r * m;
    fep_gpu_ll_buffers {
        recv_x: t3(recv_x, xc, l, s, h),
        recv_x_scales: t3(recv_x_scales, F32, l, s, h / 128),
        recv_count: t1(routing, I32, l),
        src_rank: t2(routing + offs[0], I32, l, s),
        src_idx: t2(routing + offs[1], I32, l, s),
        layout_range: t3(routing + offs[2], I32, l, r, 2),
        pos: t2(routing + offs[3], I32, m, k),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(t: &fep_tensor) -> (usize, i32, i32, [i64; 4]) {
        (t.data as usize, t.dtype, t.ndim, t.shape)
    }

    #[test]
    fn orders_follow_deepep_stream_pattern() {
        let (comm, compute, ev) = (0x9000, 0x5000, 0x66);
        assert_eq!(
            Order::before_after(comm, compute, 0, false),
            Order { stream: comm, wait_stream: compute, wait_event: 0, then_stream: compute }
        );
        // An event replaces the wait for the compute stream; async: nobody waits afterwards.
        assert_eq!(
            Order::before_after(comm, compute, ev, true),
            Order { stream: comm, wait_stream: 0, wait_event: ev, then_stream: 0 }
        );
        assert_eq!(
            Order::after_only(comm, compute, false),
            Order { stream: comm, wait_stream: 0, wait_event: 0, then_stream: compute }
        );
        // The legacy default stream: the driver's CU_STREAM_LEGACY handle, 0x1.
        let raw = Order::before_after(comm, 0x1, 0, false).raw();
        assert_eq!(
            (
                raw.stream as usize,
                raw.wait_stream as usize,
                raw.wait_event as usize,
                raw.then_stream as usize
            ),
            (comm, 1, 0, 1)
        );
    }

    #[test]
    fn dispatch_descriptors_carry_each_shape() {
        let d = gpu_dispatch(FP8, 256, 2, [10, 20, 30, 40], 5, [50, 60, 70, 80, 90], 7);
        let got: Vec<_> = d.iter().map(parts).collect();
        assert_eq!(
            got,
            vec![
                (10, FP8, 2, [5, 256, 0, 0]),
                (20, F32, 2, [5, 2, 0, 0]),
                (30, I64, 2, [5, 2, 0, 0]),
                (40, F32, 2, [5, 2, 0, 0]),
                (50, FP8, 2, [7, 256, 0, 0]),
                (60, F32, 2, [7, 2, 0, 0]),
                (70, I64, 2, [7, 2, 0, 0]),
                (80, F32, 2, [7, 2, 0, 0]),
                (90, I32, 1, [7, 0, 0, 0]),
            ]
        );
    }

    #[test]
    fn ll_buffers_place_the_routing_parts_at_their_offsets() {
        let (l, r, m, h, k) = (3, 2, 6, 256, 2);
        let b = gpu_ll_buffers(BF16, h, k, l, r, m, 0x1000, 0, 0x8000, [256, 512, 768, 1024]);
        let s = r * m;
        assert_eq!(parts(&b.recv_x), (0x1000, BF16, 3, [l, s, h, 0]));
        assert_eq!(parts(&b.recv_x_scales), (0, F32, 3, [l, s, 2, 0]));
        assert_eq!(parts(&b.recv_count), (0x8000, I32, 1, [l, 0, 0, 0]));
        assert_eq!(parts(&b.src_rank), (0x8100, I32, 2, [l, s, 0, 0]));
        assert_eq!(parts(&b.src_idx), (0x8200, I32, 2, [l, s, 0, 0]));
        assert_eq!(parts(&b.layout_range), (0x8300, I32, 3, [l, r, 2, 0]));
        assert_eq!(parts(&b.pos), (0x8400, I32, 2, [m, k, 0, 0]));
    }

    #[test]
    fn tensors_zero_the_unused_dims() {
        assert_eq!(parts(&t1(8, I32, 4)), (8, I32, 1, [4, 0, 0, 0]));
        assert_eq!(parts(&t3(8, BF16, 1, 2, 3)), (8, BF16, 3, [1, 2, 3, 0]));
        assert_eq!(dtype_name(FP8), "fp8 e4m3");
    }
}
