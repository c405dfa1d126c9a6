"""The GPU backend of :class:`fabric_ep.Buffer`: torch CUDA tensors over the ``fep_gpu_*`` C ABI.

Streams follow DeepEP: the kernels run on a communication stream the Buffer owns
(``Buffer.get_comm_stream()``), which first waits for the current (compute) stream, or for
``previous_event`` when one is given; afterwards the compute stream waits for it, unless
``async_finish=True``, which returns an :class:`EventOverlap` wrapping a ``torch.cuda.Event``
recorded on the communication stream instead. The stream joins are made inside the native call
(``fabric_ep._core`` builds one ``fep_gpu_order`` per call from the stream handles), not with
torch calls, to keep the Python cost of a call low.

Outputs are allocated with ``Tensor.new_empty_strided`` (of the input, or of a zero-element
tensor of the output's dtype) on the Buffer's device: on the compute stream, or on
the communication stream with ``allocate_on_comm_stream=True`` (which, as in DeepEP, needs
``previous_event`` and ``async_finish=True``).

With ``async_finish=True`` the caching allocator is told, as DeepEP's C++ tells it, which other
stream uses each tensor until the event (``record_stream``): the inputs (allocated on the
compute stream, read on the communication stream) and the outputs allocated on the compute
stream are recorded on the communication stream; outputs allocated on the communication stream
are recorded on the compute stream, so that when the caller drops them after using them there,
the communication stream's pool does not hand their memory to the next call's outputs before
that use is done (an event recorded before that use is not enough). A tensor is recorded on one
stream only: on its own allocation stream ``record_stream`` is a no-op.

NOTES (ranks as threads of one process on one GPU, the tests' mode): a device
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

import os
import threading
import warnings
from typing import Any, Callable, List, Optional, Tuple

from ._ext import FEP_DTYPE_BF16 as _BF16
from ._ext import FEP_DTYPE_FP8_E4M3, core
from .utils import NO_EVENT, EventOverlap

FP8_GROUP = 128
_CU_STREAM_LEGACY = 0x1

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
        self.current_stream = torch.cuda.current_stream
        # The current stream's raw handle without building a Stream object (a few us cheaper).
        self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        # NOTES: the library's own stream, not torch.cuda.Stream(): torch hands out streams from
        # a pool of 32 round-robin, so two ranks' "new" streams can be one stream, which
        # serialises their spinning kernels.
        self.comm = torch.cuda.ExternalStream(comm_ptr, device=torch.device("cuda", device))
        self.comm_ptr = comm_ptr
        # NOTES (allocate_on_comm_stream, async_finish): switching the current stream for an
        # allocation through torch's raw pair (the stream's (id, device, type) triple), and
        # making and recording the event through torch.cuda.Event's base class: the public
        # spellings (``with torch.cuda.stream(s)``, ``torch.cuda.Event()``, ``Event.record``)
        # wrap the same calls in Python (the context manager makes two stream objects and
        # checks their devices; ~15 us against ~2 us measured on the H200 host,
        # scripts/bench_torch_alloc.py). Older torch without them: the public spellings.
        C = torch._C
        self._get_stream = getattr(C, "_cuda_getCurrentStream", None)
        self._set_stream = getattr(C, "_cuda_setStream", None)
        self._get_device = getattr(C, "_cuda_getDevice", None)
        self._comm_ids = (self.comm.stream_id, self.comm.device_index, self.comm.device_type)
        self._Stream = getattr(torch, "Stream", None)
        base = getattr(C, "_CudaEventBase", None)
        if self._get_stream is None or self._set_stream is None or self._Stream is None \
                or self._get_device is None or base is None:
            self._get_stream = None
        else:
            self._event_new, self._event_record = base.__new__, base.record
        self._Event = torch.cuda.Event
        # The last get_dispatch_layout's outputs: passed back to dispatch unchanged (DeepEP's
        # documented call), they are known good and not checked again.
        self._layout_out: Tuple[Any, ...] = ()
        fp8 = getattr(torch, "float8_e4m3fn", None)
        self.bf16 = (torch.bfloat16,)
        self._bf16 = torch.bfloat16
        self.fp8 = (fp8, torch.uint8) if fp8 is not None else (torch.uint8,)
        self.fp8_out = fp8 if fp8 is not None else torch.uint8
        self.i64, self.f32, self.i32 = torch.int64, torch.float32, torch.int32
        # The native calls of this buffer (fabric_ep._core.Calls: its shape constants and this
        # communication stream; each call passes the pointers, row counts and streams).
        self._n = buf._n
        from .buffer import DispatchHandle, LowLatencyHandle, _check_cached_handle, _GpuLowLatencyOp

        self._Handle = DispatchHandle
        self._LLHandle, self._LLOp = LowLatencyHandle, _GpuLowLatencyOp
        self._ll_fp8 = buf.dispatch_dtype == "fp8"
        self._check_cached = _check_cached_handle
        self._buf_id = id(buf)
        self.h, self.k, self.g = buf.hidden, buf.num_topk, buf.hidden // FP8_GROUP
        self.i64s, self.f32s = (self.i64,), (self.f32,)
        if self._raw_stream is None:  # an older torch: the Stream object's handle
            cur = self.current_stream
            self._raw_stream = lambda d: cur(d).cuda_stream
        # Zero-element tensors on this GPU (no device memory), one per output dtype:
        # ``like.new_empty_strided(shape, strides)`` of one allocates an output of its dtype and
        # device without a dtype/device argument to parse (the cheapest allocation from Python;
        # alloc_dispatch's notes).
        self._like_i64 = torch.empty(0, dtype=self.i64, device=device)
        self._like_f32 = torch.empty(0, dtype=self.f32, device=device)
        self._like_i32 = torch.empty(0, dtype=self.i32, device=device)
        self._like_bf16 = torch.empty(0, dtype=torch.bfloat16, device=device)
        self._like_fp8 = torch.empty(0, dtype=self.fp8_out, device=device)
        # Row strides of the [rows, H], [rows, H / 128] and [rows, K] outputs.
        self._st_h, self._st_g, self._st_k = (self.h, 1), (self.g, 1), (self.k, 1)
        # The dispatch's scratch (see _scratch): recv_src_idx always, and the recv_topk_idx /
        # recv_topk_weights of a cached dispatch (which returns only recv_x).
        self._scr: Any = None
        self._scr_cap = 0
        self._src_ptr = self._sidx_ptr = self._sw_ptr = 0
        self._scratch(max(0, reserve_tokens) * buf.num_ranks)
        self._ll_layout: Any = None  # see _make_ll_layout
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
        """The current stream's raw handle; torch's legacy default stream (0) as the driver's
        ``CU_STREAM_LEGACY`` handle (NULL means "no stream" in a ``fep_gpu_order``), refused
        with ranks as threads."""
        s = self._raw_stream(self.dev)
        if s == 0:
            if self.threads:
                raise _legacy_stream_error()
            return _CU_STREAM_LEGACY
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

    def to_comm(self) -> Any:
        """Makes the communication stream current (so allocations come from its pool); returns
        what ``back`` needs to restore the current stream: the previous stream's ids, or
        torch's stream context where the raw pair is missing or the current device is another
        GPU (``_cuda_setStream`` would leave that device switched)."""
        if self._get_stream is None or self._get_device() != self.dev:
            ctx = self.torch.cuda.stream(self.comm)
            ctx.__enter__()
            return ctx
        prev = self._get_stream(self.dev)
        self._set_stream(*self._comm_ids)
        return prev

    def back(self, prev: Any) -> None:
        if type(prev) is tuple:
            self._set_stream(*prev)
        else:
            prev.__exit__(None, None, None)

    def finish(self, on_comm: Tuple[Any, ...], outs: Tuple[Any, ...], prev: Any) -> EventOverlap:
        """``async_finish``: ``on_comm`` (the inputs) and ``outs`` (the outputs) are recorded on
        the communication stream, or ``outs`` on the compute stream when they were allocated on
        the communication stream (``prev``: ``to_comm``'s return; None when they were not), see
        the module notes; then an event on the communication stream."""
        comm = self.comm
        for t in on_comm:
            if t is not None:
                t.record_stream(comm)
        if prev is None:
            s = comm
        elif type(prev) is tuple:
            s = self._Stream(stream_id=prev[0], device_index=prev[1], device_type=prev[2])
        else:  # torch's stream context (to_comm), exited: this GPU's current stream again
            s = self.current_stream(self.dev)
        for t in outs:
            if t is not None:
                t.record_stream(s)
        if self._get_stream is None:
            e = self._Event()
            e.record(comm)
        else:
            e = self._event_new(self._Event)
            self._event_record(e, comm)
        return EventOverlap(e)

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
        with torch.cuda.stream(run):
            self._layout_out = _layout_ops(torch, topk_idx, num_experts, b.num_ranks,
                                           b.ranks_per_node, self.dev)
        return _layout_finish(torch, topk_idx, self._layout_out, run, compute, async_finish)

    # ------------------------------------------------------------------ normal mode

    def dispatch(self, x: Any, handle: Any, topk_idx: Any, topk_weights: Any,
                 expert_alignment: int, num_worst_tokens: int, previous_event: Any,
                 async_finish: bool, allocate_on_comm_stream: bool) -> Tuple[Any, ...]:
        # NOTES (per-call cost): this is the hot path, kept flat on purpose. Per input tensor it
        # makes five accessor calls (dtype, get_device, is_contiguous, shape, data_ptr), inline
        # for the bf16 tokens and the routing (a helper call per tensor costs about as much as
        # two accessors; _t2_slow then names what is wrong); then one raw stream lookup, the
        # outputs' allocation (alloc_dispatch), one data_ptr per output, and two native calls
        # (notify, dispatch) with plain ints: the descriptors and stream orders are built in
        # fabric_ep._core from the buffer's shape constants.
        b = self.buf
        h, k, dev, tensor = self.h, self.k, self.dev, self.Tensor
        if type(x) is tuple:
            if len(x) != 2:
                raise ValueError(f"x: a tuple must be (x, x_scales), got {len(x)} elements")
            xo, so = x
            xp, t = self.t2("x", xo, self.fp8, None, h)
            sp = self.t2n("x_scales", so, self.f32s, t, self.g)
            xc = FEP_DTYPE_FP8_E4M3
        else:
            xo, so, sp, xc = x, None, None, _BF16
            if type(x) is tensor and x.dtype is self._bf16 and x.get_device() == dev \
                    and x.is_contiguous() and len(shp := x.shape) == 2 and shp[1] == h:
                xp, t = x.data_ptr(), shp[0]
            else:
                xp, t = self._t2_slow("x", x, self.bf16, None, h)
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
        compute = self._raw_stream(dev)
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
            tk = (t, k)
            if type(topk_idx) is tensor and topk_idx.dtype is self.i64 \
                    and topk_idx.shape == tk and topk_idx.get_device() == dev \
                    and topk_idx.is_contiguous():
                ip = topk_idx.data_ptr()
            else:
                ip = self._t2_slow("topk_idx", topk_idx, self.i64s, t, k)[0]
            if type(topk_weights) is tensor and topk_weights.dtype is self.f32 \
                    and topk_weights.shape == tk and topk_weights.get_device() == dev \
                    and topk_weights.is_contiguous():
                wp = topk_weights.data_ptr()
            else:
                wp = self._t2_slow("topk_weights", topk_weights, self.f32s, t, k)[0]
            if type(expert_alignment) is not int or not 1 <= expert_alignment < 2**31:
                raise ValueError(f"expert_alignment: {expert_alignment!r} must be an int in [1, 2**31)")
            if type(num_worst_tokens) is not int or not 0 <= num_worst_tokens < 2**31:
                raise ValueError(f"num_worst_tokens: {num_worst_tokens!r} must be an int in [0, 2**31)")
        p = b._ptr
        n = self._n
        if handle is not None:
            hp, rows = handle._ptr, handle.num_recv_tokens
            new_handle = None
        else:
            # Waits for the compute stream (or the event) on the comm stream; the compute stream
            # waits afterwards unless async_finish. The hierarchy moves the tokens in this step
            # (both stages), the dispatch below only places them.
            if self.hier:
                hp, rows, counts = n.gpu_notify(p, ip, t, expert_alignment, num_worst_tokens,
                                                compute, ev, async_finish, xp, sp, wp)
            else:
                hp, rows, counts = n.gpu_notify(p, ip, t, expert_alignment, num_worst_tokens,
                                                compute, ev, async_finish)
            new_handle = self._Handle(hp, self._buf_id, t, rows)  # owns hp from here on
        cached = new_handle is None
        if allocate_on_comm_stream:
            prev = self.to_comm()
            try:
                recv_x, recv_s, recv_idx, recv_w = self.alloc_dispatch(rows, xo, fp8, cached,
                                                                       True)
            finally:
                self.back(prev)
        else:
            prev = None
            recv_x, recv_s, recv_idx, recv_w = self.alloc_dispatch(rows, xo, fp8, cached, False)
        if rows > self._scr_cap:
            self._scratch(rows)
        # A dispatch after its notify adds no wait; a cached one waits as the notify would.
        # recv_topk_idx / recv_topk_weights None: the scratch (a cached dispatch).
        n.gpu_dispatch(p, hp, xp, sp, t, ip, wp, recv_x.data_ptr(),
                       recv_s.data_ptr() if fp8 else None, rows,
                       None if cached else recv_idx.data_ptr(),
                       None if cached else recv_w.data_ptr(), not cached, compute, ev,
                       async_finish)
        out_x = (recv_x, recv_s) if fp8 else recv_x
        if cached:
            event = self.finish((xo, so, idx_t, w_t), (recv_x, recv_s), prev) if async_finish \
                else NO_EVENT
            return out_x, None, None, None, None, event
        new_handle._keep = (topk_idx, topk_weights)
        if num_worst_tokens > 0:
            counts = []
        if async_finish:
            event = self.finish((xo, so, topk_idx, topk_weights),
                                (recv_x, recv_s, recv_idx, recv_w), prev)
        else:
            event = NO_EVENT
        return out_x, recv_idx, recv_w, counts, new_handle, event

    def alloc_dispatch(self, rows: int, like: Any, fp8: bool, cached: bool,
                       on_comm: bool) -> Tuple[Any, ...]:
        """The tensors a dispatch returns: recv_x (``like``'s dtype), recv_x_scales (fp8 only,
        else None), recv_topk_idx, recv_topk_weights (None for a cached dispatch, which returns
        only recv_x: the kernel writes those into the Buffer's scratch); each its own
        allocation, so the caller may keep any of them alone (bench_overhead_gpu.py replaces
        this method to time the rest). On the current stream (the caller makes the
        communication stream current around this call for ``allocate_on_comm_stream``;
        ``on_comm`` says so).

        NOTES: one allocation carved into typed views was considered and not taken: from Python
        every view (a slice, ``.view(dtype)``, ``.view(shape)``) is a dispatcher call about as
        costly as a cached ``new_empty``, a carved output needs one or two of them, and every
        carved output would keep the whole block (recv_x included) alive. The bench measures
        both (``alloc_separate_us`` vs ``alloc_one_block_us``).
        NOTES (spelling): ``Tensor.new_empty_strided(shape, strides)`` of ``like`` (the input
        tokens) or of a zero-element tensor of the output's dtype on this GPU: no dtype or device
        argument to parse. Measured on the H200, the spellings in turns in one process (nine
        benches of bench_overhead_gpu.py): a bf16 dispatch's Python side was faster this way in
        every bench, by a median of 0.28 us, than with ``torch.empty_strided(shape, strides,
        dtype=, device=)`` (the earlier spelling, itself 2.1 against ``new_empty``'s 2.5 us per
        output). The bench keeps both as alternatives."""
        h, k, g = self.h, self.k, self.g
        recv_x = like.new_empty_strided((rows, h), self._st_h)
        recv_s = self._like_f32.new_empty_strided((rows, g), self._st_g) if fp8 else None
        if cached:
            return recv_x, recv_s, None, None
        return (recv_x, recv_s, self._like_i64.new_empty_strided((rows, k), self._st_k),
                self._like_f32.new_empty_strided((rows, k), self._st_k))

    def _scratch(self, rows: int) -> None:
        """(Re)allocates the dispatch's scratch for at least ``rows`` rows: recv_src_idx
        (int32), and a cached dispatch's recv_topk_idx (int64 ``[rows, K]``) and
        recv_topk_weights (f32 ``[rows, K]``), in one allocation.

        NOTES: ``fep_gpu_dispatch`` writes these and nothing reads them afterwards: the native
        handle holds the route that ``fep_gpu_combine`` uses (DeepEP returns recv_src_idx inside
        its handle, ours is opaque), and a cached dispatch returns only recv_x (as DeepEP's).
        So one scratch per Buffer serves every dispatch instead of allocations per call: the
        dispatches all run on this Buffer's communication stream, in order. It is allocated on
        that stream, so dropping it (on growth, or with the Buffer) returns it to that stream's
        pool, reused only after the kernels queued there (no event, no ``record_stream``). The
        first one is sized at construction for ``gpu_reserve_tokens`` per rank, so steps within
        the reservation allocate nothing here. If the combine ever reads recv_src_idx, each
        handle needs its own again."""
        cap = max(rows, 2 * self._scr_cap, 1024)

        def align(n: int) -> int:
            return (n + 255) & ~255

        src_b, idx_b = align(4 * cap), align(8 * cap * self.k)
        with self.torch.cuda.stream(self.comm):
            scr = self._like_i32.new_empty(((src_b + idx_b + align(4 * cap * self.k)) // 4,))
        base = scr.data_ptr()
        self._scr, self._scr_cap = scr, cap
        self._src_ptr, self._sidx_ptr, self._sw_ptr = base, base + src_b, base + src_b + idx_b
        self._n.set_scratch(self._src_ptr, self._sidx_ptr, self._sw_ptr)

    def combine(self, x: Any, handle: Any, topk_weights: Any, previous_event: Any,
                async_finish: bool, allocate_on_comm_stream: bool) -> Tuple[Any, ...]:
        b = self.buf
        h, k, dev, tensor = self.h, self.k, self.dev, self.Tensor
        rows, t = handle.num_recv_tokens, handle.num_tokens
        with_w = topk_weights is not None
        if type(x) is tensor and x.dtype is self._bf16 and x.shape == (rows, h) \
                and x.get_device() == dev and x.is_contiguous():
            xp = x.data_ptr()
        else:
            xp = self._t2_slow("x", x, self.bf16, rows, h)[0]
        wp = self.t2n("topk_weights", topk_weights, self.f32s, rows, k) if with_w else None
        ev = 0
        if previous_event is not None or allocate_on_comm_stream:
            self.check_async(previous_event, async_finish, allocate_on_comm_stream)
            ev = self.event_ptr(previous_event)
        compute = self._raw_stream(dev)
        if compute == 0:
            if self.threads:
                raise _legacy_stream_error()
            compute = _CU_STREAM_LEGACY  # see dispatch
        if allocate_on_comm_stream:
            prev = self.to_comm()
            try:
                out, cw = self.alloc_combine(t, x, with_w, True)
            finally:
                self.back(prev)
        else:
            prev = None
            out, cw = self.alloc_combine(t, x, with_w, False)
        self._n.gpu_combine(b._ptr, handle._ptr, xp, rows, wp, out.data_ptr(), t,
                            cw.data_ptr() if with_w else None, compute, ev, async_finish)
        event = self.finish((x, topk_weights), (out, cw), prev) if async_finish else NO_EVENT
        return out, cw, event

    def alloc_combine(self, t: int, like: Any, with_w: bool, on_comm: bool) -> Tuple[Any, Any]:
        """The tensors a combine returns: combined_x (``like``'s dtype) and, with weights,
        combined_topk_weights (else None); see alloc_dispatch (the spelling and ``on_comm``
        too)."""
        return (like.new_empty_strided((t, self.h), self._st_h),
                self._like_f32.new_empty_strided((t, self.k), self._st_k) if with_w else None)

    # ------------------------------------------------------------------ low latency

    def ll_complete(self, op: int, what: str) -> None:
        """A low-latency hook: the receive of send ``op``, on the current stream (checked first:
        the Buffer still exists; the caller checks that the hook was not called before)."""
        bp = self.buf._ptr
        if not bp:
            raise RuntimeError(f"{what} hook: the Buffer was destroyed")
        # Waits for the current stream, runs on comm, then the current stream waits.
        self._n.gpu_ll_complete(bp, op, self.compute())

    def _make_ll_layout(self) -> Tuple[Any, ...]:
        """The low-latency dispatch's outputs: (shape, strides) of recv_x, of recv_x_scales and
        of the routing block (one int32 allocation holding count, src_rank, src_idx, the
        combine's (rank, slot) pairs and the token positions), the parts' byte offsets in it,
        and the handle's lazy views ((element offset, shape) of src_rank, src_idx, pairs).
        Hands the parts' offsets to the native calls (``fep_gpu_ll_buffers`` is built there)."""
        b = self.buf
        h, k, m = b.hidden, b.num_topk, b.num_max_dispatch_tokens_per_rank
        l, r = b.num_local_experts, b.num_ranks
        s, g = r * m, h // FP8_GROUP
        # The routing outputs share one int32 allocation (count, src_rank, src_idx, pairs,
        # positions; each part 256-byte aligned): from Python a tensor costs about as much to
        # allocate as to view, so the handle makes its views only when they are read.
        def a64(n: int) -> int:
            return (n + 63) & ~63

        offs, end = [], 0
        for n in (l, l * s, l * s, l * r * 2, m * k):
            offs.append(end)
            end += a64(n)
        self._ll_layout = (((l, s, h), (s * h, h, 1)), ((l, s, g), (s * g, g, 1)),
                           ((end,), (1,)), tuple(4 * o for o in offs),
                           ((offs[1], (l, s)), (offs[2], (l, s)), (offs[3], (l, r, 2))))
        self._n.set_ll_layout(*self._ll_layout[3][1:])
        return self._ll_layout

    def _ll_refused(self, use_fp8: bool, round_scale: bool, async_finish: bool,
                    return_recv_hook: bool) -> Exception:
        """What a low-latency dispatch refuses of its options (the caller checked that one is)."""
        b = self.buf
        if round_scale and not use_fp8:
            return ValueError("round_scale=True: needs use_fp8=True (bf16 rows have no scales)")
        if bool(use_fp8) != (b.dispatch_dtype == "fp8"):
            return ValueError(
                f"use_fp8={bool(use_fp8)}: this Buffer's low-latency buffers are sized for "
                f"dispatch_dtype={b.dispatch_dtype!r} on the GPU backend (build it with "
                f"dispatch_dtype={'fp8' if use_fp8 else 'bf16'!r})"
            )
        return ValueError(
            "async_finish=True with return_recv_hook=True: pick one (as in DeepEP: the hook "
            "orders the receive on the current stream)"
        )

    def ll_dispatch(self, x: Any, topk_idx: Any, stats: Any, wait_stats: Any, use_fp8: bool,
                    round_scale: bool, async_finish: bool,
                    return_recv_hook: bool) -> Tuple[Any, ...]:
        # NOTES (per-call cost): flat as the normal dispatch (see there): the options and both
        # tensors checked inline, the refusals and messages in helpers.
        b = self.buf
        p = b._ptr
        h, k, dev, tensor = self.h, self.k, self.dev, self.Tensor
        m, l = b.num_max_dispatch_tokens_per_rank, b.num_local_experts
        if (round_scale and not use_fp8) or bool(use_fp8) is not self._ll_fp8 \
                or (async_finish and return_recv_hook):
            raise self._ll_refused(use_fp8, round_scale, async_finish, return_recv_hook)
        if type(x) is tensor and x.dtype is self._bf16 and x.get_device() == dev \
                and x.is_contiguous() and len(shp := x.shape) == 2 and shp[1] == h:
            xp, t = x.data_ptr(), shp[0]
        else:
            xp, t = self._t2_slow("x", x, self.bf16, None, h)
        if t > m:
            raise ValueError(f"x: {t} tokens, more than num_max_dispatch_tokens_per_rank {m}")
        if type(topk_idx) is tensor and topk_idx.dtype is self.i64 \
                and topk_idx.shape == (t, k) and topk_idx.get_device() == dev \
                and topk_idx.is_contiguous():
            ip = topk_idx.data_ptr()
        else:
            ip = self._t2_slow("topk_idx", topk_idx, self.i64s, t, k)[0]
        if stats is not None:
            self.tn("cumulative_local_expert_recv_stats", stats, (self.i32,), (l,))
        wsp = None
        if wait_stats is not None:
            wsp = self.tn("dispatch_wait_recv_cost_stats", wait_stats, (self.i64,),
                          (b.num_ranks,))
        compute = self._raw_stream(dev) or self.compute()  # 0: the legacy stream (compute())
        # The outputs' shapes and strides are the Buffer's (built once, _ll_layout), allocated
        # as the normal mode's (alloc_dispatch).
        lx, ls, lr, _, views = self._ll_layout or self._make_ll_layout()
        recv_x = (self._like_fp8 if use_fp8 else self._like_bf16).new_empty_strided(*lx)
        recv_s = self._like_f32.new_empty_strided(*ls) if use_fp8 else None
        routing = self._like_i32.new_empty_strided(*lr)
        count = routing[:l]
        # Waits for the compute stream; the compute stream waits afterwards unless async.
        op = self._n.gpu_ll_dispatch(p, xp, t, ip, recv_x.data_ptr(),
                                     recv_s.data_ptr() if use_fp8 else 0, routing.data_ptr(),
                                     bool(use_fp8), bool(round_scale), bool(return_recv_hook),
                                     compute, async_finish, wsp)
        handle = self._LLHandle(op, self._buf_id, t, m, h, b.num_experts, True)
        handle._routing = (routing, views)  # src_rank, src_idx, pairs: views made when read
        handle._keep = (recv_x, recv_s, x, topk_idx, wait_stats)
        out_x = (recv_x, recv_s) if use_fp8 else recv_x
        if return_recv_hook:
            me = self

            def receive() -> None:
                if handle._received:
                    raise RuntimeError("low_latency_dispatch hook: already called")
                me.ll_complete(handle._ptr, "low_latency_dispatch")
                handle._received = True
                if stats is not None:
                    stats.add_(count)

            return out_x, count, handle, NO_EVENT, receive
        handle._received = True
        if stats is not None:
            if async_finish:
                with self.torch.cuda.stream(self.comm):
                    stats.add_(count)
            else:
                stats.add_(count)
        # (stats: updated on the communication stream above with async_finish.)
        event = self.finish((x, topk_idx, stats, wait_stats), (recv_x, recv_s, routing), None) \
            if async_finish else NO_EVENT
        return out_x, count, handle, event, None

    def ll_combine(self, x: Any, topk_idx: Any, topk_weights: Any, handle: Any, out: Any,
                   async_finish: bool, return_recv_hook: bool,
                   wait_stats: Any = None) -> Tuple[Any, ...]:
        b = self.buf
        p = b._ptr
        h, k, t = b.hidden, b.num_topk, handle.num_tokens
        l, s = b.num_local_experts, b.num_ranks * b.num_max_dispatch_tokens_per_rank
        if async_finish and return_recv_hook:
            raise ValueError("async_finish=True with return_recv_hook=True: pick one")
        xp = self.tn("x", x, self.bf16, (l, s, h))
        ip = self.t2("topk_idx", topk_idx, (self.i64,), t, k)[0]
        wp = self.t2("topk_weights", topk_weights, (self.f32,), t, k)[0]
        wsp = None
        if wait_stats is not None:
            wsp = self.tn("combine_wait_recv_cost_stats", wait_stats, (self.i64,), (b.num_ranks,))
        compute = self.compute()
        if out is not None:
            op_ = self.t2("out", out, self.bf16, t, h)[0]
            combined = out
        else:
            combined = self._like_bf16.new_empty_strided((t, h), self._st_h)
            op_ = combined.data_ptr()
        if self._ll_layout is None:
            self._make_ll_layout()
        op = self._n.gpu_ll_combine(p, handle._ptr, xp, ip, wp, t, op_, bool(return_recv_hook),
                                    compute, async_finish, wsp)
        cop = self._LLOp(op, (x, topk_idx, topk_weights, combined, handle, wait_stats))
        if return_recv_hook:
            me = self

            def receive() -> None:
                if cop.done:
                    raise RuntimeError("low_latency_combine hook: already called")
                me.ll_complete(cop.ptr, "low_latency_combine")
                cop.done = True

            return combined, NO_EVENT, receive
        cop.done = True
        event = self.finish((x, topk_idx, topk_weights, wait_stats), (combined,), None) \
            if async_finish else NO_EVENT
        return combined, event, None

    # ------------------------------------------------------------------ lifetime

    def sync(self) -> None:
        core.gpu_sync(self.buf._ptr, self.comm_ptr)

    def quiesce(self) -> None:
        """Waits (on the host) for this rank's compute and communication streams; drops the
        reference to the last layout's outputs (``destroy`` calls this)."""
        self.current_stream(self.dev).synchronize()
        self.comm.synchronize()
        self._layout_out = ()


# The library's layout objects (the layout kernel's workspace) per (thread, device, experts,
# ranks, ranks per node), made on first use and kept for the process. Per thread: ranks as
# threads of one process must not share one, since a shared workspace orders a rank's layout
# after the last one of any rank, which may sit behind that rank's notify waiting for this one.
_LAYOUTS: dict = {}


def _native_layout(dev: int, e: int, r: int, rpn: int) -> int:
    key = (threading.get_ident(), dev, e, r, rpn)
    lay = _LAYOUTS.get(key)
    if lay is None:
        lay = _LAYOUTS[key] = core.gpu_layout_create(dev, e, r, rpn)
    return lay


def _layout_ops(torch: Any, topk_idx: Any, num_experts: int, r: int, rpn: int,
                dev: int) -> Tuple[Any, ...]:
    """DeepEP's layout of ``topk_idx`` (contiguous int64 ``[T, K]`` on ``dev``) on the current
    stream: the library's layout kernel (one launch, no host synchronisation) into outputs
    allocated on that stream."""
    t, k = int(topk_idx.shape[0]), int(topk_idx.shape[1])
    nodes = r // rpn
    per_rank = torch.empty(r, dtype=torch.int32, device=dev)
    per_node = torch.empty(nodes, dtype=torch.int32, device=dev) if nodes > 1 else None
    per_expert = torch.empty(num_experts, dtype=torch.int32, device=dev)
    in_rank = torch.empty((t, r), dtype=torch.bool, device=dev)
    core.gpu_layout_run(_native_layout(dev, num_experts, r, rpn), topk_idx.data_ptr(), t, k, r,
                        nodes, num_experts, per_rank.data_ptr(),
                        0 if per_node is None else per_node.data_ptr(), per_expert.data_ptr(),
                        in_rank.data_ptr(), torch.cuda.current_stream(dev).cuda_stream)
    return per_rank, per_node, per_expert, in_rank


def _layout_finish(torch: Any, topk_idx: Any, outs: Tuple[Any, ...], run: Any, compute: Any,
                   async_finish: bool) -> Tuple[Any, ...]:
    per_rank, per_node, per_expert, in_rank = outs
    if not async_finish:
        return per_rank, per_node, per_expert, in_rank, NO_EVENT
    if run is not compute:
        # As the calls' finish: the input read on the communication stream, the outputs
        # allocated there used on the compute stream.
        topk_idx.record_stream(run)
        for o in outs:
            if o is not None:
                o.record_stream(compute)
    e = torch.cuda.Event()
    e.record(run)
    return per_rank, per_node, per_expert, in_rank, EventOverlap(e)


def layout_gpu(fac: Any, topk_idx: Any, num_experts: int, previous_event: Any,
               async_finish: bool, allocate_on_comm_stream: bool) -> Tuple[Any, ...]:
    """``get_dispatch_layout`` of a :class:`fabric_ep.Buffer` that has no GPU native buffer of
    ``num_experts`` yet (the layout needs none): as :meth:`GpuPath.get_dispatch_layout`, on the
    Buffer's communication stream with ``allocate_on_comm_stream``."""
    import torch

    GpuPath.check_async(previous_event, async_finish, allocate_on_comm_stream)
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 \
            or topk_idx.dtype != torch.int64 or not topk_idx.is_cuda:
        raise ValueError(
            f"topk_idx: expected a [T, K] int64 CUDA tensor, got {type(topk_idx).__name__} "
            f"{getattr(topk_idx, 'dtype', '')} shape {list(getattr(topk_idx, 'shape', []))}")
    if not topk_idx.is_contiguous():
        raise ValueError("topk_idx: must be contiguous (use .contiguous())")
    ev = GpuPath.event_ptr(previous_event) and previous_event.event
    compute = torch.cuda.current_stream()
    run = fac._comm_stream() if allocate_on_comm_stream else compute
    if ev:
        run.wait_event(ev)
    elif run is not compute:
        run.wait_stream(compute)
    with torch.cuda.stream(run):
        outs = _layout_ops(torch, topk_idx, num_experts, fac.num_ranks, fac.ranks_per_node,
                           topk_idx.device.index)
    return _layout_finish(torch, topk_idx, outs, run, compute, async_finish)


class CallbackAllGather:
    """The all-gather ``fep_buffer_create`` runs over any group with ``all_gather_bytes(bytes)
    -> list[bytes]`` (e.g. :class:`fabric_ep.utils.ThreadGroup`): a callable taking this rank's
    bytes and returning every rank's, concatenated in rank order. What it raises is chained to
    the create call's error."""

    def __init__(self, group: Any):
        self.group = group
        self.size = group.size()

    def __call__(self, data: bytes) -> bytes:
        parts: List[bytes] = self.group.all_gather_bytes(data)
        length = len(data)
        if len(parts) != self.size or any(len(x) != length for x in parts):
            raise ValueError(
                f"group.all_gather_bytes returned {len(parts)} parts of lengths "
                f"{[len(x) for x in parts]}, expected {self.size} of {length}"
            )
        return b"".join(bytes(x) for x in parts)


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
