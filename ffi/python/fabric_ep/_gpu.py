"""The GPU backend of :class:`fabric_ep.Buffer`: torch CUDA tensors over the ``fep_gpu_*`` C ABI.

Streams follow DeepEP: the kernels run on a communication stream the Buffer owns
(``Buffer.get_comm_stream()``), which first waits for the current (compute) stream, or for
``previous_event`` when one is given; afterwards the compute stream waits for it, unless
``async_finish=True``, which returns an :class:`EventOverlap` wrapping a ``torch.cuda.Event``
recorded on the communication stream instead (the tensors involved are ``record_stream``-ed on
it). The stream joins are made inside the C call (one ``fep_gpu_order`` per call), not with
torch calls, to keep the Python cost of a call low.

Normal-mode outputs are allocated with ``torch.empty_strided`` (low-latency ones with
``Tensor.new_empty``) on the Buffer's device: on the compute stream, or on
the communication stream with ``allocate_on_comm_stream=True`` (which, as in DeepEP, needs
``previous_event`` and ``async_finish=True``).

NOTES (ranks as threads of one process on one GPU, this version's only GPU mode): a device
allocation or free while a peer's kernel spins on this rank can deadlock (it waits for the whole
device). The library reserves its dispatch handles up front (``gpu_reserve_tokens``) and never
frees one before ``destroy``; torch's caching allocator serves ``torch.empty`` from its cache
once warm, so such callers warm it (on each rank's stream) before the first step, as the tests
do (``warm_allocator``). Every rank must also run on its own stream: the legacy default stream
is shared by all threads and would serialise the ranks' spinning kernels, so a Buffer of a group
with more than one thread refuses it with a message. And CUDA's lazy module loading may
synchronise the context when a kernel is first used, which waits for a peer's spinning kernel:
run such processes with ``CUDA_MODULE_LOADING=EAGER`` (set before CUDA initialises; a Buffer of
a threads group warns once otherwise). Likewise ``CUDA_DEVICE_MAX_CONNECTIONS=32``: the context
maps all the ranks' streams onto that many hardware work queues (8 by default), and a rank's
spinning kernel queued in front of a peer's launch waits for it until the timeout; the library
refuses to connect several ranks of one context when it is too low. And read results on the
host after ``torch.cuda.current_stream().synchronize()``: the driver serialises pageable
device-to-host copies across a process's threads, so one rank's ``.cpu()`` that waits for a
collective kernel holds up a peer thread's ``.cpu()``, and the peer never launches its part
(a stall until the timeout; tests/_gpu_threads.py ``host``). Thread mode is for tests; real jobs
run one process per GPU.
"""

from __future__ import annotations

import ctypes
import os
import struct
import warnings
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

from . import _lib
from ._arrays import TensorSlots
from ._lib import (
    FEP_DTYPE_BF16,
    FEP_DTYPE_F32,
    FEP_DTYPE_FP8_E4M3,
    FEP_DTYPE_I32,
    FEP_DTYPE_I64,
    lib,
)
from .utils import EventOverlap

FP8_GROUP = 128
_ORDER = struct.Struct("<4Q")
_CU_STREAM_LEGACY = 0x1
_addr = ctypes.addressof

# NOTES: the normal-mode calls fill their stream orders and ``fep_tensor`` descriptors with one
# ``struct.pack_into`` each (a single C call; the descriptors live in a per-Buffer block whose
# addresses are computed once), instead of building ctypes objects or packing slot by slot.
# A descriptor is ``fep_tensor``: data, dtype, ndim, shape[4] (48 bytes).
_DESC = "qii4q"
_DESC_SIZE = struct.calcsize("<" + _DESC)
# dispatch, before the notify: order [0] (before-and-after) and [1] (after only), then x,
# x_scales, topk_idx, topk_weights.
_DISPATCH_IN = struct.Struct("<8Q" + _DESC * 4)
# dispatch, after the allocation: recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights,
# recv_src_idx.
_DISPATCH_OUT = struct.Struct("<" + _DESC * 5)
# combine: order [0], then x, topk_weights, combined_x, combined_topk_weights.
_COMBINE = struct.Struct("<4Q" + _DESC * 4)
assert _DESC_SIZE == 48 and _DISPATCH_IN.size == 64 + 4 * 48 and _COMBINE.size == 32 + 4 * 48


def _legacy_stream_error() -> ValueError:
    return ValueError(
        "stream: the current stream is the legacy default stream, shared by every thread; "
        "with ranks as threads of one process each rank must run on its own stream "
        "(with torch.cuda.stream(torch.cuda.Stream()): ...)"
    )


def warm_allocator(torch: Any, device: int, large_bytes: int = 256 << 20,
                   small_blocks: int = 32) -> None:
    """Fills torch's caching allocator on the current stream of ``device``: one large segment
    (split for any allocation over 1 MiB) and ``small_blocks`` blocks of the small pool, freed
    again, so later ``torch.empty`` calls of that stream need no ``cudaMalloc``."""
    big = torch.empty(large_bytes, dtype=torch.uint8, device=device)
    small = [torch.empty(512 << 10, dtype=torch.uint8, device=device) for _ in range(small_blocks)]
    del big, small


class GpuPath:
    """The GPU half of one Buffer (created by ``Buffer.__init__`` for ``backend="gpu"``)."""

    def __init__(self, buf: Any, torch: Any, device: int, threads: bool, comm_ptr: int,
                 reserve_tokens: int = 0):
        self.buf = buf
        self.hier = bool(getattr(buf, "internode_hierarchy", False))
        self.torch = torch
        self.dev = device
        self.threads = threads
        self.Tensor = torch.Tensor
        self.empty = torch.empty
        self.current_stream = torch.cuda.current_stream
        # The current stream's raw handle without building a Stream object (a few us cheaper).
        self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        # NOTES: the library's own stream, not torch.cuda.Stream(): torch hands out streams from
        # a pool of 32 round-robin, so two ranks' "new" streams can be one stream, which
        # serialises their spinning kernels.
        self.comm = torch.cuda.ExternalStream(comm_ptr, device=torch.device("cuda", device))
        self.comm_ptr = comm_ptr
        fp8 = getattr(torch, "float8_e4m3fn", None)
        self.bf16 = (torch.bfloat16,)
        self.fp8 = (fp8, torch.uint8) if fp8 is not None else (torch.uint8,)
        self.fp8_out = fp8 if fp8 is not None else torch.uint8
        self.i64, self.f32, self.i32 = torch.int64, torch.float32, torch.int32
        # Two stream orders per call at most: [0] before-and-after, [1] after only.
        self._orders = ctypes.create_string_buffer(_ORDER.size * 2)
        self._order0 = _addr(self._orders)
        self._order1 = self._order0 + _ORDER.size
        self._pack = _ORDER.pack_into
        self.slots = TensorSlots(12)
        self._ll_slots = TensorSlots(8)  # 7 fep_tensors of fep_gpu_ll_buffers (+1: pack4)
        self._per_expert = np.zeros(buf.num_local_experts, dtype=np.int32)
        self._per_expert_ptr = self._per_expert.ctypes.data
        from .buffer import DispatchHandle, _check_cached_handle

        self._Handle = DispatchHandle
        self._check_cached = _check_cached_handle
        self._buf_id = id(buf)
        self.h, self.k, self.g = buf.hidden, buf.num_topk, buf.hidden // FP8_GROUP
        self.i64s, self.f32s = (self.i64,), (self.f32,)
        if self._raw_stream is None:  # an older torch: the Stream object's handle
            cur = self.current_stream
            self._raw_stream = lambda d: cur(d).cuda_stream
        # Zero-element tensors on this GPU (no device memory): ``like.new_empty(shape)`` of one of
        # them allocates an output of its dtype and device without a dtype/device argument to
        # parse (the cheapest allocation from Python).
        self._like_i64 = torch.empty(0, dtype=self.i64, device=device)
        self._like_f32 = torch.empty(0, dtype=self.f32, device=device)
        self._like_i32 = torch.empty(0, dtype=self.i32, device=device)
        self._empty_strided = torch.empty_strided
        self._device = torch.device("cuda", device)
        # Normal-mode descriptor blocks (see _DISPATCH_IN/_DISPATCH_OUT/_COMBINE).
        self._nblock = ctypes.create_string_buffer(_DISPATCH_IN.size + _DISPATCH_OUT.size)
        self._cblock = ctypes.create_string_buffer(_COMBINE.size)
        nb, cb = _addr(self._nblock), _addr(self._cblock)
        d = _DESC_SIZE
        # (order0, order1, x, x_scales, topk_idx, topk_weights, recv_x, recv_x_scales,
        #  recv_topk_idx, recv_topk_weights, recv_src_idx)
        self._naddr = (nb, nb + 32) + tuple(nb + 64 + d * i for i in range(9))
        self._nout_off = _DISPATCH_IN.size
        # (order0, x, topk_weights, combined_x, combined_topk_weights)
        self._caddr = (cb,) + tuple(cb + 32 + d * i for i in range(4))
        self._pack_in = _DISPATCH_IN.pack_into
        self._pack_out = _DISPATCH_OUT.pack_into
        self._pack_comb = _COMBINE.pack_into
        # recv_src_idx scratch (see _src_scratch).
        self._src: Any = None
        self._src_cap = 0
        self._src_ptr = 0
        self._src_scratch(max(0, reserve_tokens) * buf.num_ranks)
        if threads and os.environ.get("CUDA_MODULE_LOADING", "").upper() != "EAGER":
            warnings.warn(
                "fabric_ep: ranks as threads of one process with lazy CUDA module loading: the "
                "first use of a kernel may synchronise the context while a peer's kernel spins "
                "(a deadlock until the timeout); set CUDA_MODULE_LOADING=EAGER before CUDA "
                "initialises", RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------------ checks

    def _bad(self, name: str, a: Any, what: str) -> Exception:
        torch = self.torch
        if not isinstance(a, torch.Tensor):
            return TypeError(
                f"{name}: expected a torch CUDA tensor (this Buffer uses the GPU backend), got "
                f"{type(a).__name__}"
            )
        if a.get_device() != self.dev:
            return ValueError(
                f"{name}: tensor is on {a.device}, this Buffer's GPU is cuda:{self.dev} (GPU "
                f"backend): move it with .to('cuda:{self.dev}')"
            )
        return ValueError(f"{name}: {what}")

    def t2(self, name: str, a: Any, dts: Tuple[Any, ...], d0: Optional[int], d1: int) -> Tuple[int, int]:
        """A 2-D CUDA tensor ``[d0 (None: any), d1]`` of one of ``dts``: (data_ptr, rows)."""
        # NOTES: the common case is one conjunction (each accessor is one C call); the checks
        # are made again one by one, in order, only to name what is wrong (_t2_slow), which
        # also accepts Tensor subclasses.
        if type(a) is self.Tensor and a.dtype in dts and a.get_device() == self.dev \
                and a.is_contiguous():
            shp = a.shape
            if len(shp) == 2 and shp[1] == d1 and (d0 is None or shp[0] == d0):
                return a.data_ptr(), shp[0]
        return self._t2_slow(name, a, dts, d0, d1)

    def t2n(self, name: str, a: Any, dts: Tuple[Any, ...], d0: int, d1: int) -> int:
        """A 2-D CUDA tensor of exactly ``[d0, d1]`` of one of ``dts``: its data_ptr."""
        if type(a) is self.Tensor and a.dtype in dts and a.shape == (d0, d1) \
                and a.get_device() == self.dev and a.is_contiguous():
            return a.data_ptr()
        return self._t2_slow(name, a, dts, d0, d1)[0]

    def _t2_slow(self, name: str, a: Any, dts: Tuple[Any, ...], d0: Optional[int],
                 d1: int) -> Tuple[int, int]:
        if not isinstance(a, self.Tensor) or a.get_device() != self.dev:
            raise self._bad(name, a, "")
        if a.dtype not in dts:
            raise TypeError(f"{name}: dtype {a.dtype}, expected {' or '.join(map(str, dts))}")
        shp = a.shape
        if len(shp) != 2 or shp[1] != d1 or (d0 is not None and shp[0] != d0):
            w = "*" if d0 is None else d0
            raise ValueError(f"{name}: shape {list(shp)}, expected [{w}, {d1}]")
        if not a.is_contiguous():
            raise ValueError(f"{name}: must be contiguous (use .contiguous())")
        return a.data_ptr(), shp[0]

    def tn(self, name: str, a: Any, dts: Tuple[Any, ...], shape: Tuple[int, ...]) -> int:
        """An n-D CUDA tensor of exactly ``shape``: its data_ptr."""
        if not isinstance(a, self.Tensor) or a.get_device() != self.dev:
            raise self._bad(name, a, "")
        if a.dtype not in dts:
            raise TypeError(f"{name}: dtype {a.dtype}, expected {' or '.join(map(str, dts))}")
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"{name}: shape {list(a.shape)}, expected {list(shape)}")
        if not a.is_contiguous():
            raise ValueError(f"{name}: must be contiguous (use .contiguous())")
        return a.data_ptr()

    # ------------------------------------------------------------------ streams

    def compute(self) -> int:
        """The current stream's raw handle (0: the legacy default stream)."""
        s = self._raw_stream(self.dev)
        if self.threads and s == 0:
            raise _legacy_stream_error()
        return s

    @staticmethod
    def event_ptr(previous_event: Any) -> int:
        if previous_event is None:
            return 0
        if not isinstance(previous_event, EventOverlap):
            raise TypeError(
                f"previous_event: expected an EventOverlap (or None), got {type(previous_event).__name__}"
            )
        ev = previous_event.event
        if ev is None:
            return 0
        p = getattr(ev, "cuda_event", None)
        if not isinstance(p, int):
            raise TypeError("previous_event: its event is not a torch.cuda.Event")
        return p

    def orders(self, compute: int, ev: int, async_finish: bool) -> None:
        """[0]: wait for compute (or the event), run on comm, then compute waits (unless async);
        [1]: the same without the wait (the second call of a two-step dispatch)."""
        # NOTES: NULL means "no stream" in a fep_gpu_order; torch's legacy default stream (0) is
        # named by the driver's CU_STREAM_LEGACY handle.
        compute = compute or _CU_STREAM_LEGACY
        then = 0 if async_finish else compute
        self._pack(self._orders, 0, self.comm_ptr, 0 if ev else compute, ev, then)
        self._pack(self._orders, _ORDER.size, self.comm_ptr, 0, 0, then)

    def finish(self, async_finish: bool, tensors: Tuple[Any, ...]) -> EventOverlap:
        if not async_finish:
            return EventOverlap(None)
        comm = self.comm
        for t in tensors:
            if t is not None:
                t.record_stream(comm)
        e = self.torch.cuda.Event()
        e.record(comm)
        return EventOverlap(e, tuple(t for t in tensors if t is not None))

    @staticmethod
    def check_async(previous_event: Any, async_finish: bool, allocate_on_comm_stream: bool) -> None:
        if allocate_on_comm_stream and (previous_event is None or not async_finish):
            raise ValueError(
                "allocate_on_comm_stream=True: needs previous_event and async_finish=True (as in "
                "DeepEP: the outputs then belong to the communication stream)"
            )

    # ------------------------------------------------------------------ layout

    def get_dispatch_layout(self, topk_idx: Any, num_experts: int, previous_event: Any,
                            async_finish: bool, allocate_on_comm_stream: bool) -> Tuple[Any, ...]:
        """DeepEP's layout with torch ops: on the current stream (after ``previous_event`` when
        given), or on the communication stream with ``allocate_on_comm_stream``.

        NOTES: the outputs are allocated on the stream the ops run on; the current stream's
        pool is the one callers warm (see the module notes)."""
        torch = self.torch
        b = self.buf
        self.check_async(previous_event, async_finish, allocate_on_comm_stream)
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
            raise self._bad("topk_idx", topk_idx,
                            f"shape {list(getattr(topk_idx, 'shape', []))}, expected [T, K]")
        self.t2("topk_idx", topk_idx, (self.i64,), None, topk_idx.shape[1])
        ev = self.event_ptr(previous_event) and previous_event.event
        self.compute()  # the legacy-stream check
        compute = self.current_stream(self.dev)
        run = self.comm if allocate_on_comm_stream else compute
        if ev:
            run.wait_event(ev)
        elif run is not compute:
            run.wait_stream(compute)
        r, rpn, lx = b.num_ranks, b.ranks_per_node, b.num_local_experts
        with torch.cuda.stream(run):
            t = topk_idx.shape[0]
            valid = topk_idx >= 0
            rank_of = torch.where(valid, topk_idx // lx, torch.full_like(topk_idx, r))
            hit = torch.zeros((t, r + 1), dtype=torch.bool, device=self.dev)
            hit.scatter_(1, rank_of, True)
            in_rank = hit[:, :r].contiguous()
            per_rank = in_rank.sum(0, dtype=torch.int32)
            per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
            nodes = r // rpn
            per_node = (in_rank.view(t, nodes, rpn).any(2).sum(0, dtype=torch.int32)
                        if nodes > 1 else None)
        outs = (per_rank, per_node, per_expert, in_rank)
        if not async_finish:
            return per_rank, per_node, per_expert, in_rank, EventOverlap(None)
        tensors = tuple(o for o in (topk_idx,) + outs if o is not None)
        if run is not compute:
            for o in tensors:
                o.record_stream(run)
        e = torch.cuda.Event()
        e.record(run)
        return per_rank, per_node, per_expert, in_rank, EventOverlap(e, tensors)

    # ------------------------------------------------------------------ normal mode

    def dispatch(self, x: Any, handle: Any, topk_idx: Any, topk_weights: Any,
                 expert_alignment: int, num_worst_tokens: int, previous_event: Any,
                 async_finish: bool, allocate_on_comm_stream: bool) -> Tuple[Any, ...]:
        # NOTES (per-call cost): this is the hot path, kept flat on purpose. Per call it makes
        # 5 accessor calls per input tensor (dtype, get_device, is_contiguous, shape, data_ptr),
        # one raw stream lookup, one allocation per returned tensor (alloc_dispatch), one
        # data_ptr per output, and two struct packs that fill every descriptor and stream order.
        b = self.buf
        h, k, g = self.h, self.k, self.g
        if type(x) is tuple:
            if len(x) != 2:
                raise ValueError(f"x: a tuple must be (x, x_scales), got {len(x)} elements")
            xo, so = x
            xp, t = self.t2("x", xo, self.fp8, None, h)
            sp = self.t2n("x_scales", so, self.f32s, t, g)
            xc = FEP_DTYPE_FP8_E4M3
        else:
            xo, so = x, None
            xp, t = self.t2("x", xo, self.bf16, None, h)
            sp = 0
            xc = FEP_DTYPE_BF16
        fp8 = so is not None
        if xc != b._dispatch_code:
            raise TypeError(
                f"x: {'fp8' if fp8 else 'bf16'} tokens on a Buffer built with "
                f"dispatch_dtype={b.dispatch_dtype!r} (fabric-ep sizes its buffer for one token "
                "format: build it with the other dispatch_dtype)"
            )
        ev = 0
        if previous_event is not None or allocate_on_comm_stream:
            self.check_async(previous_event, async_finish, allocate_on_comm_stream)
            ev = self.event_ptr(previous_event)
        compute = self._raw_stream(self.dev)
        if compute == 0:
            if self.threads:
                raise _legacy_stream_error()
            # NOTES: NULL means "no stream" in a fep_gpu_order; torch's legacy default stream
            # is named by the driver's CU_STREAM_LEGACY handle.
            compute = _CU_STREAM_LEGACY
        if handle is not None:
            self._check_cached(handle, b, topk_idx, topk_weights, t)
            idx_t, w_t = handle._keep
            ip, wp = idx_t.data_ptr(), w_t.data_ptr()
        else:
            if topk_idx is None:
                raise ValueError("topk_idx: required unless a cached handle is given")
            if topk_weights is None:
                raise ValueError("topk_weights: required when topk_idx is given")
            ip = self.t2n("topk_idx", topk_idx, self.i64s, t, k)
            wp = self.t2n("topk_weights", topk_weights, self.f32s, t, k)
            if type(expert_alignment) is not int or expert_alignment < 1:
                raise ValueError(f"expert_alignment: {expert_alignment!r} must be an int >= 1")
            if type(num_worst_tokens) is not int or num_worst_tokens < 0:
                raise ValueError(f"num_worst_tokens: {num_worst_tokens!r} must be an int >= 0")
        a_o0, a_o1, a_x, a_xs, a_i, a_w, a_rx, a_rxs, a_ri, a_rw, a_src = self._naddr
        comm = self.comm_ptr
        then = 0 if async_finish else compute
        # Orders: [0] waits for the compute stream (or the event), [1] (the dispatch after a
        # notify) does not; both make the compute stream wait afterwards unless async_finish.
        self._pack_in(self._nblock, 0, comm, 0 if ev else compute, ev, then, comm, 0, 0, then,
                      xp, xc, 2, t, h, 0, 0, sp, FEP_DTYPE_F32, 2, t, g, 0, 0,
                      ip, FEP_DTYPE_I64, 2, t, k, 0, 0, wp, FEP_DTYPE_F32, 2, t, k, 0, 0)
        p = b._ptr
        if handle is not None:
            hp, rows, order = handle._ptr, handle.num_recv_tokens, a_o0
            new_handle = None
        else:
            if self.hier:
                # The hierarchy moves the tokens in this step (both stages), the dispatch below
                # only places them.
                st = lib.fep_gpu_notify_inputs(p, a_x, a_xs if fp8 else None, a_i, a_w,
                                               expert_alignment, num_worst_tokens, a_o0,
                                               b._out_handle_addr, b._out_rows_addr,
                                               self._per_expert_ptr)
            else:
                st = lib.fep_gpu_notify(p, a_i, expert_alignment, num_worst_tokens, a_o0,
                                        b._out_handle_addr, b._out_rows_addr,
                                        self._per_expert_ptr)
            if st:
                raise _lib.error("fep_gpu_notify_inputs" if self.hier else "fep_gpu_notify", st)
            hp = b._out_handle.value
            rows = b._out_rows.value
            new_handle = self._Handle(hp, self._buf_id, t, rows)  # owns hp from here on
            order = a_o1
        if allocate_on_comm_stream:
            with self.torch.cuda.stream(self.comm):
                recv_x, recv_s, recv_idx, recv_w = self.alloc_dispatch(rows, xo, fp8)
        else:
            recv_x, recv_s, recv_idx, recv_w = self.alloc_dispatch(rows, xo, fp8)
        if rows > self._src_cap:
            self._src_scratch(rows)
        self._pack_out(self._nblock, self._nout_off,
                       recv_x.data_ptr(), xc, 2, rows, h, 0, 0,
                       recv_s.data_ptr() if fp8 else 0, FEP_DTYPE_F32, 2, rows, g, 0, 0,
                       recv_idx.data_ptr(), FEP_DTYPE_I64, 2, rows, k, 0, 0,
                       recv_w.data_ptr(), FEP_DTYPE_F32, 2, rows, k, 0, 0,
                       self._src_ptr, FEP_DTYPE_I32, 1, rows, 0, 0, 0)
        st = lib.fep_gpu_dispatch(p, hp, a_x, a_xs if fp8 else None, a_i, a_w, a_rx,
                                  a_rxs if fp8 else None, a_ri, a_rw, a_src, order)
        if st:
            raise _lib.error("fep_gpu_dispatch", st)
        out_x = (recv_x, recv_s) if fp8 else recv_x
        if new_handle is None:
            event = self.finish(True, (xo, so, recv_x, recv_s)) if async_finish else EventOverlap(None)
            return out_x, None, None, None, None, event
        new_handle._keep = (topk_idx, topk_weights)
        counts = [] if num_worst_tokens > 0 else self._per_expert.tolist()
        if async_finish:
            event = self.finish(True, (xo, so, topk_idx, topk_weights, recv_x, recv_s, recv_idx,
                                       recv_w))
        else:
            event = EventOverlap(None)
        return out_x, recv_idx, recv_w, counts, new_handle, event

    def alloc_dispatch(self, rows: int, like: Any, fp8: bool) -> Tuple[Any, ...]:
        """The tensors a dispatch returns: recv_x (``like``'s dtype), recv_x_scales (fp8 only,
        else None), recv_topk_idx, recv_topk_weights; each its own allocation, so the caller may
        keep any of them alone (bench_overhead_gpu.py replaces this method to time the rest).

        NOTES: one allocation carved into typed views was considered and not taken: from Python
        every view (a slice, ``.view(dtype)``, ``.view(shape)``) is a dispatcher call about as
        costly as a cached ``new_empty``, a carved output needs one or two of them, and every
        carved output would keep the whole block (recv_x included) alive. The bench measures
        both (``alloc_separate_us`` vs ``alloc_one_block_us``).
        NOTES (spelling): ``torch.empty_strided(shape, strides, dtype=, device=)`` and not
        ``like.new_empty(shape)``: measured on the H200 (docs/results/2026-11-29-h200-g run 4,
        scripts/bench_torch_alloc.py), the four outputs of an fp8 dispatch cost 8.1 us that way
        against 10.5 us (one output: 2.1 against 2.5 us)."""
        h, k, g = self.h, self.k, self.g
        es, d, f32 = self._empty_strided, self._device, self.f32
        return (es((rows, h), (h, 1), dtype=like.dtype, device=d),
                es((rows, g), (g, 1), dtype=f32, device=d) if fp8 else None,
                es((rows, k), (k, 1), dtype=self.i64, device=d),
                es((rows, k), (k, 1), dtype=f32, device=d))

    def _src_scratch(self, rows: int) -> None:
        """(Re)allocates the recv_src_idx scratch for at least ``rows`` int32.

        NOTES: ``fep_gpu_dispatch`` writes recv_src_idx and nothing reads it afterwards (the
        native handle holds the route that ``fep_gpu_combine`` uses; DeepEP returns it inside
        its handle, ours is opaque), so one scratch per Buffer serves every dispatch instead of
        one allocation per call: the dispatches all run on this Buffer's communication stream,
        in order. It is allocated on that stream, so dropping it (on growth, or with the Buffer)
        returns it to that stream's pool, reused only after the kernels queued there (no event,
        no ``record_stream``). The first one is sized at construction for ``gpu_reserve_tokens``
        per rank, so steps within the reservation allocate nothing here. If the combine ever
        reads recv_src_idx, each handle needs its own again."""
        cap = max(rows, 2 * self._src_cap, 1024)
        with self.torch.cuda.stream(self.comm):
            src = self._like_i32.new_empty((cap,))
        self._src, self._src_cap, self._src_ptr = src, cap, src.data_ptr()

    def combine(self, x: Any, handle: Any, topk_weights: Any, previous_event: Any,
                async_finish: bool, allocate_on_comm_stream: bool) -> Tuple[Any, ...]:
        b = self.buf
        h, k = self.h, self.k
        rows, t = handle.num_recv_tokens, handle.num_tokens
        xp = self.t2n("x", x, self.bf16, rows, h)
        with_w = topk_weights is not None
        wp = self.t2n("topk_weights", topk_weights, self.f32s, rows, k) if with_w else 0
        ev = 0
        if previous_event is not None or allocate_on_comm_stream:
            self.check_async(previous_event, async_finish, allocate_on_comm_stream)
            ev = self.event_ptr(previous_event)
        compute = self._raw_stream(self.dev)
        if compute == 0:
            if self.threads:
                raise _legacy_stream_error()
            compute = _CU_STREAM_LEGACY  # see dispatch
        if allocate_on_comm_stream:
            with self.torch.cuda.stream(self.comm):
                out, cw = self.alloc_combine(t, x, with_w)
        else:
            out, cw = self.alloc_combine(t, x, with_w)
        a_o, a_x, a_w, a_out, a_cw = self._caddr
        comm = self.comm_ptr
        self._pack_comb(self._cblock, 0, comm, 0 if ev else compute, ev,
                        0 if async_finish else compute,
                        xp, FEP_DTYPE_BF16, 2, rows, h, 0, 0, wp, FEP_DTYPE_F32, 2, rows, k, 0, 0,
                        out.data_ptr(), FEP_DTYPE_BF16, 2, t, h, 0, 0,
                        cw.data_ptr() if with_w else 0, FEP_DTYPE_F32, 2, t, k, 0, 0)
        st = lib.fep_gpu_combine(b._ptr, handle._ptr, a_x, a_w if with_w else None, a_out,
                                 a_cw if with_w else None, a_o)
        if st:
            raise _lib.error("fep_gpu_combine", st)
        event = self.finish(True, (x, topk_weights, out, cw)) if async_finish else EventOverlap(None)
        return out, cw, event

    def alloc_combine(self, t: int, like: Any, with_w: bool) -> Tuple[Any, Any]:
        """The tensors a combine returns: combined_x (``like``'s dtype) and, with weights,
        combined_topk_weights (else None); see alloc_dispatch (the spelling too)."""
        h, k = self.h, self.k
        es, d = self._empty_strided, self._device
        return (es((t, h), (h, 1), dtype=like.dtype, device=d),
                es((t, k), (k, 1), dtype=self.f32, device=d) if with_w else None)

    # ------------------------------------------------------------------ low latency

    def ll_complete(self, op: int, what: str) -> None:
        """A low-latency hook: the receive of send ``op``, on the current stream (checked first:
        the Buffer still exists; the caller checks that the hook was not called before)."""
        bp = self.buf._ptr
        if not bp:
            raise RuntimeError(f"{what} hook: the Buffer was destroyed")
        self.orders(self.compute(), 0, False)
        st = lib.fep_gpu_ll_complete(bp, op, self._order0)
        if st:
            raise _lib.error("fep_gpu_ll_complete", st)

    def ll_dispatch(self, x: Any, topk_idx: Any, stats: Any, use_fp8: bool, round_scale: bool,
                    async_finish: bool, return_recv_hook: bool) -> Tuple[Any, ...]:
        from .buffer import LowLatencyHandle

        b = self.buf
        p = b._ptr
        h, k, m = b.hidden, b.num_topk, b.num_max_dispatch_tokens_per_rank
        l, r = b.num_local_experts, b.num_ranks
        s = r * m
        if round_scale:
            raise ValueError(
                "round_scale=True: the GPU backend's fp8 scales are plain float32 (not rounded to "
                "powers of two); pass False"
            )
        if bool(use_fp8) != (b.dispatch_dtype == "fp8"):
            raise ValueError(
                f"use_fp8={bool(use_fp8)}: this Buffer's low-latency buffers are sized for "
                f"dispatch_dtype={b.dispatch_dtype!r} on the GPU backend (build it with "
                f"dispatch_dtype={'fp8' if use_fp8 else 'bf16'!r})"
            )
        if async_finish and return_recv_hook:
            raise ValueError(
                "async_finish=True with return_recv_hook=True: pick one (as in DeepEP: the hook "
                "orders the receive on the current stream)"
            )
        xp, t = self.t2("x", x, self.bf16, None, h)
        if t > m:
            raise ValueError(f"x: {t} tokens, more than num_max_dispatch_tokens_per_rank {m}")
        ip = self.t2("topk_idx", topk_idx, (self.i64,), t, k)[0]
        if stats is not None:
            self.tn("cumulative_local_expert_recv_stats", stats, (self.i32,), (l,))
        compute = self.compute()
        self.orders(compute, 0, async_finish)
        new = x.new_empty
        recv_x = new((l, s, h), dtype=self.fp8_out) if use_fp8 else new((l, s, h))
        recv_s = new((l, s, h // FP8_GROUP), dtype=self.f32) if use_fp8 else None
        count = new((l,), dtype=self.i32)
        src_rank = new((l, s), dtype=self.i32)
        src_idx = new((l, s), dtype=self.i32)
        pairs = new((l, r, 2), dtype=self.i32)
        pos = new((m, k), dtype=self.i32)
        ts = self.slots
        ts.set2(0, xp, FEP_DTYPE_BF16, t, h)
        ts.set2(1, ip, FEP_DTYPE_I64, t, k)
        o = self._ll_slots
        o.pack4(0, recv_x.data_ptr(), FEP_DTYPE_FP8_E4M3 if use_fp8 else FEP_DTYPE_BF16, 3, l, s, h, 0,
                recv_s.data_ptr() if recv_s is not None else 0, FEP_DTYPE_F32, 3, l, s, h // FP8_GROUP, 0,
                count.data_ptr(), FEP_DTYPE_I32, 1, l, 0, 0, 0,
                src_rank.data_ptr(), FEP_DTYPE_I32, 2, l, s, 0, 0)
        o.pack4(192, src_idx.data_ptr(), FEP_DTYPE_I32, 2, l, s, 0, 0,
                pairs.data_ptr(), FEP_DTYPE_I32, 3, l, r, 2, 0,
                pos.data_ptr(), FEP_DTYPE_I32, 2, m, k, 0, 0,
                0, FEP_DTYPE_I32, 1, 0, 0, 0, 0)
        op = ctypes.c_void_p()
        st = lib.fep_gpu_ll_dispatch(p, ts.addr[0], ts.addr[1], bool(use_fp8), False,
                                     bool(return_recv_hook), o.addr[0], self._order0,
                                     ctypes.byref(op))
        if st:
            raise _lib.error("fep_gpu_ll_dispatch", st)
        handle = LowLatencyHandle(op.value or 0, id(b), t, m, h, b.num_experts, gpu=True)
        handle.src_rank = src_rank
        handle.src_idx = src_idx
        handle._pairs = pairs
        handle._keep = (recv_x, recv_s, count, pos, x, topk_idx)
        out_x = (recv_x, recv_s) if use_fp8 else recv_x
        me = self

        def receive() -> None:
            if handle._received:
                raise RuntimeError("low_latency_dispatch hook: already called")
            me.ll_complete(handle._ptr, "low_latency_dispatch")
            handle._received = True
            if stats is not None:
                stats.add_(count)

        if return_recv_hook:
            return out_x, count, handle, EventOverlap(None), receive
        handle._received = True
        if stats is not None:
            if async_finish:
                with self.torch.cuda.stream(self.comm):
                    stats.add_(count)
            else:
                stats.add_(count)
        event = self.finish(async_finish, (x, topk_idx, recv_x, recv_s, count, src_rank, src_idx,
                                           pairs, pos)) if async_finish else EventOverlap(None)
        return out_x, count, handle, event, None

    def ll_combine(self, x: Any, topk_idx: Any, topk_weights: Any, handle: Any, out: Any,
                   async_finish: bool, return_recv_hook: bool) -> Tuple[Any, ...]:
        b = self.buf
        p = b._ptr
        h, k, t = b.hidden, b.num_topk, handle.num_tokens
        l, s = b.num_local_experts, b.num_ranks * b.num_max_dispatch_tokens_per_rank
        if async_finish and return_recv_hook:
            raise ValueError("async_finish=True with return_recv_hook=True: pick one")
        xp = self.tn("x", x, self.bf16, (l, s, h))
        ip = self.t2("topk_idx", topk_idx, (self.i64,), t, k)[0]
        wp = self.t2("topk_weights", topk_weights, (self.f32,), t, k)[0]
        compute = self.compute()
        if out is not None:
            op_ = self.t2("out", out, self.bf16, t, h)[0]
            combined = out
        else:
            combined = x.new_empty((t, h))
            op_ = combined.data_ptr()
        self.orders(compute, 0, async_finish)
        ts = self.slots
        a = ts.addr
        ts.pack4(0, xp, FEP_DTYPE_BF16, 3, l, s, h, 0, ip, FEP_DTYPE_I64, 2, t, k, 0, 0,
                 wp, FEP_DTYPE_F32, 2, t, k, 0, 0, op_, FEP_DTYPE_BF16, 2, t, h, 0, 0)
        op = ctypes.c_void_p()
        st = lib.fep_gpu_ll_combine(p, handle._ptr, a[0], a[1], a[2], a[3], bool(return_recv_hook),
                                    self._order0, ctypes.byref(op))
        if st:
            raise _lib.error("fep_gpu_ll_combine", st)
        from .buffer import _GpuLowLatencyOp

        cop = _GpuLowLatencyOp(op.value or 0, (x, topk_idx, topk_weights, combined, handle))
        me = self

        def receive() -> None:
            if cop.done:
                raise RuntimeError("low_latency_combine hook: already called")
            me.ll_complete(cop.ptr, "low_latency_combine")
            cop.done = True

        if return_recv_hook:
            return combined, EventOverlap(None), receive
        cop.done = True
        event = self.finish(async_finish, (x, topk_idx, topk_weights, combined)) if async_finish else EventOverlap(None)
        return combined, event, None

    # ------------------------------------------------------------------ lifetime

    def sync(self) -> None:
        st = lib.fep_gpu_sync(self.buf._ptr, self.comm_ptr)
        if st:
            raise _lib.error("fep_gpu_sync", st)

    def quiesce(self) -> None:
        """Waits (on the host) for this rank's compute and communication streams."""
        self.current_stream(self.dev).synchronize()
        self.comm.synchronize()


class CallbackAllGather:
    """The ``fep_allgather_fn`` over any group with ``all_gather_bytes(bytes) -> list[bytes]``
    (e.g. :class:`fabric_ep.utils.ThreadGroup`). Exceptions are kept for the caller."""

    def __init__(self, group: Any):
        self.group = group
        self.size = group.size()
        self.error: Optional[BaseException] = None
        self.fn = _lib.ALLGATHER_FN(self._call)

    def _call(self, send: int, length: int, recv: int, user: int) -> int:
        try:
            data = ctypes.string_at(send, length) if length else b""
            parts: List[bytes] = self.group.all_gather_bytes(data)
            if len(parts) != self.size or any(len(x) != length for x in parts):
                raise ValueError(
                    f"group.all_gather_bytes returned {len(parts)} parts of lengths "
                    f"{[len(x) for x in parts]}, expected {self.size} of {length}"
                )
            for i, part in enumerate(parts):
                ctypes.memmove(recv + i * length, part, length)
            return 0
        except BaseException as e:  # noqa: BLE001 - reported after the C call returns
            self.error = e
            return 1


def group_barrier(group: Any) -> None:
    """A barrier over the Buffer's group (ThreadGroup, torch.distributed, or all-gather)."""
    if group is None:
        return
    if hasattr(group, "barrier") and hasattr(group, "all_gather_bytes"):
        group.barrier()
        return
    if hasattr(group, "all_gather_bytes"):
        group.all_gather_bytes(b"")
        return
    import torch.distributed as dist

    dist.barrier(group=group)


Hook = Callable[[], None]
