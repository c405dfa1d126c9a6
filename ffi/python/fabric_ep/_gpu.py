"""The GPU backend of :class:`fabric_ep.Buffer`: torch CUDA tensors over the ``fep_gpu_*`` C ABI.

Streams follow DeepEP: the kernels run on a communication stream the Buffer owns
(``Buffer.get_comm_stream()``), which first waits for the current (compute) stream, or for
``previous_event`` when one is given; afterwards the compute stream waits for it, unless
``async_finish=True``, which returns an :class:`EventOverlap` wrapping a ``torch.cuda.Event``
recorded on the communication stream instead (the tensors involved are ``record_stream``-ed on
it). The stream joins are made inside the C call (one ``fep_gpu_order`` per call), not with
torch calls, to keep the Python cost of a call low.

Outputs are allocated with ``Tensor.new_empty`` on the Buffer's device: on the compute stream, or on
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
a threads group warns once otherwise).
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

    def __init__(self, buf: Any, torch: Any, device: int, threads: bool, comm_ptr: int):
        self.buf = buf
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
        if type(a) is not self.Tensor or a.get_device() != self.dev:
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
        raw = self._raw_stream
        s = raw(self.dev) if raw is not None else self.current_stream(self.dev).cuda_stream
        if self.threads and s == 0:
            raise ValueError(
                "stream: the current stream is the legacy default stream, shared by every thread; "
                "with ranks as threads of one process each rank must run on its own stream "
                "(with torch.cuda.stream(torch.cuda.Stream()): ...)"
            )
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
        from .buffer import DispatchHandle, _check_cached_handle

        b = self.buf
        p = b._ptr
        h, k = b.hidden, b.num_topk
        g = h // FP8_GROUP
        if type(x) is tuple:
            if len(x) != 2:
                raise ValueError(f"x: a tuple must be (x, x_scales), got {len(x)} elements")
            xo, so = x
            xp, t = self.t2("x", xo, self.fp8, None, h)
            sp = self.t2("x_scales", so, (self.f32,), t, g)[0]
            xc = FEP_DTYPE_FP8_E4M3
        else:
            xo, so = x, None
            xp, t = self.t2("x", xo, self.bf16, None, h)
            sp = 0
            xc = FEP_DTYPE_BF16
        if xc != b._dispatch_code:
            raise TypeError(
                f"x: {'fp8' if so is not None else 'bf16'} tokens on a Buffer built with "
                f"dispatch_dtype={b.dispatch_dtype!r} (fabric-ep sizes its buffer for one token "
                "format: build it with the other dispatch_dtype)"
            )
        if previous_event is not None or allocate_on_comm_stream:
            self.check_async(previous_event, async_finish, allocate_on_comm_stream)
        compute = self.compute()
        ev = self.event_ptr(previous_event) if previous_event is not None else 0
        self.orders(compute, ev, async_finish)
        ts = self.slots
        a = ts.addr
        if handle is not None:
            _check_cached_handle(handle, b, topk_idx, topk_weights, t)
            idx_t, w_t = handle._keep[0], handle._keep[1]
            ip, wp = idx_t.data_ptr(), w_t.data_ptr()
            hp, rows, order = handle._ptr, handle.num_recv_tokens, self._order0
            new_handle = None
        else:
            if topk_idx is None:
                raise ValueError("topk_idx: required unless a cached handle is given")
            if topk_weights is None:
                raise ValueError("topk_weights: required when topk_idx is given")
            ip = self.t2("topk_idx", topk_idx, (self.i64,), t, k)[0]
            wp = self.t2("topk_weights", topk_weights, (self.f32,), t, k)[0]
            if type(expert_alignment) is not int or expert_alignment < 1:
                raise ValueError(f"expert_alignment: {expert_alignment!r} must be an int >= 1")
            if type(num_worst_tokens) is not int or num_worst_tokens < 0:
                raise ValueError(f"num_worst_tokens: {num_worst_tokens!r} must be an int >= 0")
            ts.set2(2, ip, FEP_DTYPE_I64, t, k)
            st = lib.fep_gpu_notify(p, a[2], expert_alignment, num_worst_tokens, self._order0,
                                    b._out_handle_addr, b._out_rows_addr, self._per_expert_ptr)
            if st:
                raise _lib.error("fep_gpu_notify", st)
            hp = b._out_handle.value
            rows = b._out_rows.value
            new_handle = DispatchHandle(hp, id(b), t, rows)  # owns hp from here on
            order = self._order1
        if allocate_on_comm_stream:
            with self.torch.cuda.stream(self.comm):
                outs = self._dispatch_outputs(rows, xo, so is not None)
        else:
            outs = self._dispatch_outputs(rows, xo, so is not None)
        recv_x, recv_s, recv_idx, recv_w, src = outs
        ts.pack4(0, xp, xc, 2, t, h, 0, 0, sp, FEP_DTYPE_F32, 2, t, g, 0, 0,
                 ip, FEP_DTYPE_I64, 2, t, k, 0, 0, wp, FEP_DTYPE_F32, 2, t, k, 0, 0)
        ts.pack4(192, recv_x.data_ptr(), xc, 2, rows, h, 0, 0,
                 recv_s.data_ptr() if recv_s is not None else 0, FEP_DTYPE_F32, 2, rows, g, 0, 0,
                 recv_idx.data_ptr(), FEP_DTYPE_I64, 2, rows, k, 0, 0,
                 recv_w.data_ptr(), FEP_DTYPE_F32, 2, rows, k, 0, 0)
        ts.set1(8, src.data_ptr(), FEP_DTYPE_I32, rows)
        fp8 = so is not None
        st = lib.fep_gpu_dispatch(p, hp, a[0], a[1] if fp8 else None, a[2], a[3], a[4],
                                  a[5] if fp8 else None, a[6], a[7], a[8], order)
        if st:
            raise _lib.error("fep_gpu_dispatch", st)
        out_x = recv_x if so is None else (recv_x, recv_s)
        if new_handle is None:
            event = self.finish(async_finish, (xo, so, recv_x, recv_s)) if async_finish else EventOverlap(None)
            return out_x, None, None, None, None, event
        new_handle._keep = (topk_idx, topk_weights, src)
        counts = [] if num_worst_tokens > 0 else self._per_expert.tolist()
        if async_finish:
            event = self.finish(True, (xo, so, topk_idx, topk_weights, recv_x, recv_s, recv_idx,
                                       recv_w, src))
        else:
            event = EventOverlap(None)
        return out_x, recv_idx, recv_w, counts, new_handle, event

    def _dispatch_outputs(self, rows: int, like: Any, fp8: bool) -> Tuple[Any, ...]:
        # NOTES: Tensor.new_empty (device and dtype from ``like``) parses fewer arguments than
        # torch.empty(..., device=...): it is the cheaper allocation from Python.
        h, k, new = self.buf.hidden, self.buf.num_topk, like.new_empty
        return (
            new((rows, h)),
            new((rows, h // FP8_GROUP), dtype=self.f32) if fp8 else None,
            new((rows, k), dtype=self.i64),
            new((rows, k), dtype=self.f32),
            new((rows,), dtype=self.i32),
        )

    def combine(self, x: Any, handle: Any, topk_weights: Any, previous_event: Any,
                async_finish: bool, allocate_on_comm_stream: bool) -> Tuple[Any, ...]:
        b = self.buf
        p = b._ptr
        h, k = b.hidden, b.num_topk
        rows, t = handle.num_recv_tokens, handle.num_tokens
        xp = self.t2("x", x, self.bf16, rows, h)[0]
        if previous_event is not None or allocate_on_comm_stream:
            self.check_async(previous_event, async_finish, allocate_on_comm_stream)
        compute = self.compute()
        ev = self.event_ptr(previous_event) if previous_event is not None else 0
        self.orders(compute, ev, async_finish)
        new = x.new_empty
        if allocate_on_comm_stream:
            with self.torch.cuda.stream(self.comm):
                out = new((t, h))
                cw = new((t, k), dtype=self.f32) if topk_weights is not None else None
        else:
            out = new((t, h))
            cw = new((t, k), dtype=self.f32) if topk_weights is not None else None
        ts = self.slots
        a = ts.addr
        if topk_weights is not None:
            wp = self.t2("topk_weights", topk_weights, (self.f32,), rows, k)[0]
            cwp = cw.data_ptr()
        else:
            wp = cwp = 0
        ts.pack4(0, xp, FEP_DTYPE_BF16, 2, rows, h, 0, 0, wp, FEP_DTYPE_F32, 2, rows, k, 0, 0,
                 out.data_ptr(), FEP_DTYPE_BF16, 2, t, h, 0, 0, cwp, FEP_DTYPE_F32, 2, t, k, 0, 0)
        st = lib.fep_gpu_combine(p, handle._ptr, a[0], None if cw is None else a[1], a[2],
                                 None if cw is None else a[3], self._order0)
        if st:
            raise _lib.error("fep_gpu_combine", st)
        event = self.finish(True, (x, topk_weights, out, cw)) if async_finish else EventOverlap(None)
        return out, cw, event

    # ------------------------------------------------------------------ low latency

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
            bp = b._ptr
            if not bp:
                raise RuntimeError("low_latency_dispatch hook: the Buffer was destroyed")
            if handle._received:
                raise RuntimeError("low_latency_dispatch hook: already called")
            me.orders(me.compute(), 0, False)
            s2 = lib.fep_gpu_ll_complete(bp, handle._ptr, me._order0)
            if s2:
                raise _lib.error("fep_gpu_ll_complete", s2)
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
            bp = b._ptr
            if not bp:
                raise RuntimeError("low_latency_combine hook: the Buffer was destroyed")
            if cop.done:
                raise RuntimeError("low_latency_combine hook: already called")
            me.orders(me.compute(), 0, False)
            s2 = lib.fep_gpu_ll_complete(bp, cop.ptr, me._order0)
            if s2:
                raise _lib.error("fep_gpu_ll_complete", s2)
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
