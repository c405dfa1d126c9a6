"""The GPU backend's Python hot path (fabric_ep._gpu.GpuPath.dispatch/combine) without torch or a
GPU (runs in CI): a minimal stand-in for the few torch calls it makes and a recording stand-in
for the buffer's native calls (fabric_ep._core.Calls). Checks what each native call is given
(every pointer, row count, stream, event and flag), the returned shapes/dtypes, the
recv_src_idx scratch, and that bad arguments are refused naming the argument. The descriptors
and stream orders the native calls build from those arguments are the crate's unit tests
(ffi/python/native/src/desc.rs); the real kernels and torch are covered by test_gpu.py on the
GPU machine."""

import contextlib
import itertools
import types

import pytest

from fabric_ep import EventOverlap, FabricEPTimeoutError, _gpu
from fabric_ep.buffer import DispatchHandle

H, K, L, R, T = 256, 2, 3, 2, 5
COMM, COMPUTE = 0x9000, 0x5000
BF16, FP8 = 0, 1
_SIZES = {"bfloat16": 2, "float32": 4, "int64": 8, "int32": 4, "uint8": 1, "float8_e4m3fn": 1,
          "bool": 1}


class _Dtype:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return "torch." + self.name


class FakeTorch(types.ModuleType):
    """What GpuPath touches of torch: dtypes, Tensor (dtype, shape, get_device, is_contiguous,
    data_ptr, new_empty, record_stream), torch.empty, torch.empty_strided (contiguous strides
    only), the CUDA stream/event calls. Streams are their raw handles (a stream's id is its
    handle); each tensor remembers the stream current when it was allocated (``_alloc``), and
    ``records`` lists every ``record_stream`` as (tensor, stream handle)."""

    def __init__(self):
        super().__init__("torch")
        for n in ("bfloat16", "float32", "int64", "int32", "uint8", "float8_e4m3fn", "bool"):
            setattr(self, n, _Dtype(n))
        ptrs = itertools.count(1 << 20, 1 << 12)

        def check_contiguous(shape, stride):
            want = tuple(int(__import__("math").prod(shape[i + 1:])) for i in range(len(shape)))
            assert tuple(stride) == want, f"strides {stride} of {shape} are not contiguous"
        self.stream = COMPUTE
        self.records = []
        fake = self

        class Tensor:
            def __init__(t, shape, dtype, dev=0, contiguous=True):
                t.shape, t.dtype, t._dev, t._c, t._p = tuple(shape), dtype, dev, contiguous, next(ptrs)
                t._alloc = fake.stream

            def get_device(t):
                return t._dev

            def is_contiguous(t):
                return t._c

            def data_ptr(t):
                return t._p

            def dim(t):
                return len(t.shape)

            def __getitem__(t, sl):  # a 1-D slice [start:stop]: a view of the same memory
                assert isinstance(sl, slice) and sl.step is None and len(t.shape) == 1, sl
                start, stop = sl.start or 0, t.shape[0] if sl.stop is None else sl.stop
                assert 0 <= start <= stop <= t.shape[0], (sl, t.shape)
                v = Tensor((stop - start,), t.dtype, t._dev)
                v._p = t._p + start * _SIZES[t.dtype.name]
                return v

            def view(t, shape):
                assert __import__("math").prod(shape) == __import__("math").prod(t.shape)
                v = Tensor(shape, t.dtype, t._dev)
                v._p = t._p
                return v

            def new_empty_strided(t, shape, stride):
                check_contiguous(shape, stride)
                return Tensor(shape, t.dtype, t._dev)

            def new_empty(t, shape, dtype=None):
                return Tensor(shape, dtype or t.dtype, t._dev)

            def record_stream(t, s):
                fake.records.append((t, s.cuda_stream))

            def add_(t, other):
                t.added = (other, fake.stream)

            @property
            def device(t):
                return f"cuda:{t._dev}" if t._dev >= 0 else "cpu"

        self.Tensor = Tensor
        self.empty = lambda shape, dtype=None, device=None: Tensor(
            shape if isinstance(shape, tuple) else (shape,), dtype, device)
        self.device = lambda *a: a

        def empty_strided(shape, stride, dtype=None, device=None):
            check_contiguous(shape, stride)
            assert device == ("cuda", 0), device
            return Tensor(shape, dtype, device[1])

        self.empty_strided = empty_strided
        def stream_obj(p):
            return types.SimpleNamespace(cuda_stream=p, stream_id=p, device_index=0, device_type=1,
                                         synchronize=lambda: None)

        class EventBase:
            def record(e, s):
                e.recorded_on = s.cuda_stream

        class Event(EventBase):
            cuda_event = 0x77

        def set_stream(sid, di, dt):
            assert (di, dt) == (0, 1)
            self.stream = sid

        @contextlib.contextmanager
        def stream_ctx(s):  # torch.cuda.stream: only for a current device other than the GPU's
            prev, self.stream = self.stream, s.cuda_stream
            self.contexts += 1
            try:
                yield
            finally:
                self.stream = prev

        self.contexts, self.cur_device = 0, 0
        self.Stream = lambda stream_id, device_index, device_type: stream_obj(stream_id)
        self.cuda = types.SimpleNamespace(
            ExternalStream=lambda p, device=None: stream_obj(p),
            current_stream=lambda d=None: stream_obj(self.stream),
            stream=stream_ctx,
            Event=Event)
        self._C = types.SimpleNamespace(
            _cuda_getCurrentRawStream=lambda d: self.stream,
            _cuda_getCurrentStream=lambda d: (self.stream, d, 1),
            _cuda_setStream=set_stream, _cuda_getDevice=lambda: self.cur_device,
            _CudaEventBase=EventBase)


# Each native call's argument names (fabric_ep._core.Calls), for the recorded calls.
_ARGS = {
    "gpu_notify": ("p", "idx", "t", "align", "worst", "compute", "event", "async_", "x", "xs",
                   "w"),
    "gpu_dispatch": ("p", "hp", "x", "xs", "t", "idx", "w", "rx", "rxs", "rows", "ri", "rw",
                     "after_notify", "compute", "event", "async_"),
    "gpu_combine": ("p", "hp", "x", "rows", "w", "out", "t", "cw", "compute", "event", "async_"),
    "gpu_ll_dispatch": ("p", "x", "t", "idx", "rx", "rxs", "routing", "fp8", "round_scale",
                        "hook", "compute", "async_", "ws"),
    "gpu_ll_complete": ("p", "op", "compute"),
    "gpu_ll_combine": ("p", "hp", "x", "idx", "w", "t", "out", "hook", "compute", "async_", "ws"),
}


class RecordingCalls:
    """The buffer's native calls: each records its arguments by name (``calls``: (name, dict));
    the notify reports ``rows`` rows, a NULL handle and per-expert counts ``counts``; the
    low-latency calls a NULL op. ``results[name]`` replaces a call's result (an exception
    instance is raised)."""

    def __init__(self, rows):
        self.rows, self.calls, self.counts, self.results = rows, [], [1, 2, 3], {}
        self.scratch = self.ll_layout = None

    def set_scratch(self, *a):
        self.scratch = a

    def set_ll_layout(self, *a):
        self.ll_layout = a

    def __getattr__(self, name):
        names = _ARGS[name]

        def call(*a):
            assert len(a) <= len(names), (name, a)
            self.calls.append((name, dict(zip(names, a))))
            r = self.results.get(name)
            if isinstance(r, BaseException):
                raise r
            if r is not None:
                return r
            if name == "gpu_notify":
                return 0, self.rows, list(self.counts)  # a NULL handle: nothing to free
            return 0 if name in ("gpu_ll_dispatch", "gpu_ll_combine") else None
        return call


def make_path(torch, rec, dispatch_dtype="bf16"):
    buf = types.SimpleNamespace(
        hidden=H, num_topk=K, num_local_experts=L, num_ranks=R,
        _dispatch_code=FP8 if dispatch_dtype == "fp8" else BF16, dispatch_dtype=dispatch_dtype,
        _ptr=0xABC, _n=rec)
    g = _gpu.GpuPath(buf, torch, 0, True, COMM, reserve_tokens=1000)
    return g, buf


@pytest.fixture
def path():
    torch = FakeTorch()
    rec = RecordingCalls(rows=7)
    g, buf = make_path(torch, rec)
    return g, torch, rec, buf


def inputs(torch):
    return (torch.Tensor((T, H), torch.bfloat16), torch.Tensor((T, K), torch.int64),
            torch.Tensor((T, K), torch.float32))


def test_dispatch_passes_every_pointer_and_stream(path):
    g, torch, rec, _ = path
    assert g._scr_cap == 1000 * R  # the scratch is reserved at construction
    assert rec.scratch == (g._src_ptr, g._sidx_ptr, g._sw_ptr)  # handed to the native side
    x, idx, w = inputs(torch)
    rx, ri, rw, counts, handle, ev = g.dispatch(x, None, idx, w, 1, 0, None, False, False)
    assert (rx.shape, rx.dtype) == ((7, H), torch.bfloat16)
    assert (ri.shape, ri.dtype, rw.shape, rw.dtype) == ((7, K), torch.int64, (7, K), torch.float32)
    assert len({rx.data_ptr(), ri.data_ptr(), rw.data_ptr()}) == 3  # independent tensors
    assert counts == [1, 2, 3] and isinstance(handle, DispatchHandle) and ev.event is None
    with pytest.raises(AttributeError, match="^event: .* shared and read-only"):
        ev.event = object()  # the shared EventOverlap(None) cannot be changed
    assert handle._keep == (idx, w) and (handle.num_tokens, handle.num_recv_tokens) == (T, 7)
    (_, nt), (_, d) = rec.calls
    # The notify waits for the compute stream, which waits for it (not async).
    assert nt == dict(p=0xABC, idx=idx.data_ptr(), t=T, align=1, worst=0, compute=COMPUTE,
                      event=0, async_=False)
    # The dispatch right after it: no second wait; the compute stream waits afterwards.
    assert d == dict(p=0xABC, hp=0, x=x.data_ptr(), xs=None, t=T, idx=idx.data_ptr(),
                     w=w.data_ptr(), rx=rx.data_ptr(), rxs=None, rows=7, ri=ri.data_ptr(),
                     rw=rw.data_ptr(), after_notify=True, compute=COMPUTE, event=0, async_=False)


def test_cached_worst_async_and_fp8_dispatch(path):
    g, torch, rec, buf = path
    x, idx, w = inputs(torch)
    *_, handle, _ = g.dispatch(x, None, idx, w, 1, 0, None, False, False)
    rec.calls.clear()
    handle._ptr = 0x1234  # as if the notify had returned one (reset before it is freed)
    allocated = []
    real_new = torch.Tensor.new_empty_strided
    torch.Tensor.new_empty_strided = lambda t, *a: allocated.append(a[0]) or real_new(t, *a)
    try:
        out = g.dispatch(x, handle, None, None, 1, 0, None, False, False)
    finally:
        handle._ptr = 0
        torch.Tensor.new_empty_strided = real_new
    assert out[1:5] == (None, None, None, None) and out[0].shape == (7, H)
    assert allocated == [(7, H)]  # only recv_x: the routing outputs go to the scratch
    (name, d), = rec.calls  # no notify: the handle's routing
    assert name == "gpu_dispatch" and d["hp"] == 0x1234 and d["after_notify"] is False
    assert (d["compute"], d["event"], d["async_"]) == (COMPUTE, 0, False)  # waits itself
    assert (d["idx"], d["w"], d["rows"]) == (idx.data_ptr(), w.data_ptr(), 7)
    assert d["ri"] is None and d["rw"] is None  # the scratch (the native side has it)
    scr = g._scr.data_ptr()
    assert scr == g._src_ptr < g._sidx_ptr < g._sw_ptr  # one allocation, 256-byte aligned parts
    assert g._sidx_ptr - scr >= 4 * g._scr_cap and g._sw_ptr - g._sidx_ptr >= 8 * K * g._scr_cap
    assert (g._sidx_ptr - scr) % 256 == 0 and (g._sw_ptr - scr) % 256 == 0

    rec.calls.clear()
    prev = EventOverlap(types.SimpleNamespace(cuda_event=0x66))
    out = g.dispatch(x, None, idx, w, 1, 9, prev, True, True)
    assert out[3] == [] and out[5].event is not None  # num_worst_tokens: no counts
    nt = rec.calls[0][1]
    assert (nt["worst"], nt["compute"], nt["event"], nt["async_"]) == (9, COMPUTE, 0x66, True)

    rec.rows = 5000  # more rows than the scratch holds: it grows
    g, buf = make_path(torch, rec, "fp8")
    rec.calls.clear()
    xq, xs = torch.Tensor((T, H), torch.float8_e4m3fn), torch.Tensor((T, H // 128), torch.float32)
    (q, s), *_ = g.dispatch((xq, xs), None, idx, w, 1, 0, None, False, False)
    assert q.dtype is torch.float8_e4m3fn and (s.shape, s.dtype) == ((5000, 2), torch.float32)
    d = rec.calls[1][1]
    assert (d["x"], d["xs"], d["rx"], d["rxs"], d["rows"]) == \
        (xq.data_ptr(), xs.data_ptr(), q.data_ptr(), s.data_ptr(), 5000)
    assert g._scr_cap >= 5000 and rec.scratch == (g._src_ptr, g._sidx_ptr, g._sw_ptr)


def test_combine_passes_every_pointer_and_stream(path):
    g, torch, rec, buf = path
    handle = DispatchHandle(0x4444, id(buf), T, 7)
    try:
        rx, rw = torch.Tensor((7, H), torch.bfloat16), torch.Tensor((7, K), torch.float32)
        cx, cw, ev = g.combine(rx, handle, rw, None, False, False)
        assert (cx.shape, cx.dtype, cw.shape, cw.dtype) == ((T, H), torch.bfloat16, (T, K),
                                                            torch.float32)
        name, d = rec.calls[0]
        assert name == "gpu_combine" and d == dict(
            p=0xABC, hp=0x4444, x=rx.data_ptr(), rows=7, w=rw.data_ptr(), out=cx.data_ptr(),
            t=T, cw=cw.data_ptr(), compute=COMPUTE, event=0, async_=False)
        rec.calls.clear()
        cx, cw, ev = g.combine(rx, handle, None, None, True, False)
        d = rec.calls[0][1]
        assert cw is None and d["w"] is None and d["cw"] is None and ev.event is not None
        assert (d["compute"], d["event"], d["async_"]) == (COMPUTE, 0, True)
        with pytest.raises(ValueError, match=r"^x: shape \[6, 256\], expected \[7, 256\]$"):
            g.combine(torch.Tensor((6, H), torch.bfloat16), handle, None, None, False, False)
        with pytest.raises(TypeError, match="^topk_weights: dtype torch.int64"):
            g.combine(rx, handle, torch.Tensor((7, K), torch.int64), None, False, False)
    finally:
        handle._ptr = 0


def test_bad_dispatch_arguments_are_named(path):
    g, torch, rec, _ = path
    x, idx, w = inputs(torch)
    T_ = torch.Tensor

    def refused(exc, match, *args):
        with pytest.raises(exc, match=match):
            g.dispatch(*args, 1, 0, None, False, False)

    refused(TypeError, "^x: expected a torch CUDA tensor", "x", None, idx, w)
    refused(ValueError, "^x: tensor is on cpu", T_((T, H), torch.bfloat16, dev=-1), None, idx, w)
    refused(TypeError, "^x: dtype torch.float32", T_((T, H), torch.float32), None, idx, w)
    refused(ValueError, r"^x: shape \[5, 128\], expected \[\*, 256\]",
            T_((T, 128), torch.bfloat16), None, idx, w)
    refused(ValueError, "^x: must be contiguous", T_((T, H), torch.bfloat16, contiguous=False),
            None, idx, w)
    refused(TypeError, "^x: fp8 tokens on a Buffer built with dispatch_dtype='bf16'",
            (T_((T, H), torch.float8_e4m3fn), T_((T, 2), torch.float32)), None, idx, w)
    refused(TypeError, "^topk_idx: dtype torch.int32", x, None, T_((T, K), torch.int32), w)
    refused(ValueError, r"^topk_weights: shape \[5, 1\], expected \[5, 2\]", x, None, idx,
            T_((T, 1), torch.float32))
    refused(ValueError, "^topk_idx: required", x, None, None, w)
    with pytest.raises(ValueError, match="^expert_alignment: "):
        g.dispatch(x, None, idx, w, 0, 0, None, False, False)
    with pytest.raises(ValueError, match="^allocate_on_comm_stream=True: needs"):
        g.dispatch(x, None, idx, w, 1, 0, None, False, True)
    with pytest.raises(TypeError, match="^previous_event: expected an EventOverlap"):
        g.dispatch(x, None, idx, w, 1, 0, object(), False, False)
    torch.stream = 0  # the legacy default stream: refused with ranks as threads
    with pytest.raises(ValueError, match="^stream: the current stream is the legacy"):
        g.dispatch(x, None, idx, w, 1, 0, None, False, False)
    assert rec.calls == []  # nothing reached the library
    g.threads = False  # one rank per process: the legacy stream is CU_STREAM_LEGACY (1)
    g.dispatch(x, None, idx, w, 1, 0, None, False, False)
    assert rec.calls[0][1]["compute"] == 1 and rec.calls[1][1]["compute"] == 1


def test_ll_hook_completion_orders_streams_and_refuses_a_destroyed_buffer(path):
    """GpuPath.ll_complete, the receive both low-latency hooks run: one fep_gpu_ll_complete on
    the comm stream after the current stream, the current stream waiting for it afterwards; a
    destroyed Buffer is refused, naming the hook, before any C call."""
    g, torch, rec, buf = path
    g.ll_complete(0x55, "low_latency_dispatch")
    assert rec.calls == [("gpu_ll_complete", dict(p=0xABC, op=0x55, compute=COMPUTE))]
    rec.results["gpu_ll_complete"] = FabricEPTimeoutError("fep_gpu_ll_complete", 7002, "t", "m")
    with pytest.raises(FabricEPTimeoutError, match="^fep_gpu_ll_complete"):
        g.ll_complete(0x55, "low_latency_combine")
    rec.calls.clear()
    buf._ptr = 0
    with pytest.raises(RuntimeError, match="^low_latency_combine hook: the Buffer was destroyed"):
        g.ll_complete(0x55, "low_latency_combine")


def test_ll_dispatch_and_combine_pass_every_pointer_and_stream(path):
    """The low-latency calls: the inputs' pointers and T, the outputs (recv_x and one int32
    routing allocation whose parts' offsets the native side gets once, 256-byte aligned) and
    the streams."""
    g, torch, rec, buf = path
    M = 6
    buf.num_max_dispatch_tokens_per_rank, buf.num_experts = M, L * R
    S = R * M
    x = torch.Tensor((T, H), torch.bfloat16)
    idx = torch.Tensor((T, K), torch.int64)
    rx, count, handle, ev, hook = g.ll_dispatch(x, idx, None, None, False, False, False, False)
    assert (rx.shape, rx.dtype, count.shape) == ((L, S, H), torch.bfloat16, (L,))
    name, d = rec.calls[0]
    base = count.data_ptr()
    assert name == "gpu_ll_dispatch" and d == dict(
        p=0xABC, x=x.data_ptr(), t=T, idx=idx.data_ptr(), rx=rx.data_ptr(), rxs=0,
        routing=base, fp8=False, round_scale=False, hook=False, compute=COMPUTE, async_=False,
        ws=None)
    assert hook is None
    # count, src_rank, src_idx, pairs and positions: parts of one int32 allocation, 256-byte
    # aligned, the handle's views made when read; their offsets as the native side has them
    o_sr, o_si, o_pairs, o_pos = rec.ll_layout
    assert g._ll_layout[3] == (0, o_sr, o_si, o_pairs, o_pos)
    assert handle.src_rank.data_ptr() == base + o_sr and handle.src_rank.shape == (L, S)
    assert handle.src_idx.data_ptr() == base + o_si
    assert handle._pairs.data_ptr() == base + o_pairs and handle._pairs.shape == (L, R, 2)
    ends = [base, base + o_sr, base + o_si, base + o_pairs, base + o_pos]
    sizes = [4 * L, 4 * L * S, 4 * L * S, 4 * L * R * 2, 4 * M * K]
    assert all((e - base) % 256 == 0 for e in ends)
    assert all(ends[i] + sizes[i] <= ends[i + 1] for i in range(4))  # no overlap
    assert ends[4] + sizes[4] <= base + 4 * handle._routing[0].shape[0]
    handle._ptr = 0x4321  # as if the dispatch had returned an op (reset before it is freed)
    try:
        w = torch.Tensor((T, K), torch.float32)
        cx, ev, hook = g.ll_combine(rx, idx, w, handle, None, True, False)
        name, d = rec.calls[1]
        assert (cx.shape, cx.dtype) == ((T, H), torch.bfloat16)
        assert name == "gpu_ll_combine" and d == dict(
            p=0xABC, hp=0x4321, x=rx.data_ptr(), idx=idx.data_ptr(), w=w.data_ptr(), t=T,
            out=cx.data_ptr(), hook=False, compute=COMPUTE, async_=True, ws=None)
        assert ev.event is not None  # async_finish
    finally:
        handle._ptr = 0


def test_bad_ll_dispatch_arguments_are_named(path):
    g, torch, rec, buf = path
    buf.num_max_dispatch_tokens_per_rank, buf.num_experts = 4, L * R
    x, idx = torch.Tensor((T, H), torch.bfloat16), torch.Tensor((T, K), torch.int64)
    x4 = torch.Tensor((4, H), torch.bfloat16)
    for args, exc, match in [
        ((x4, torch.Tensor((4, K), torch.int64), None, None, False, True, False, False), ValueError,
         "^round_scale=True"),
        ((x4, torch.Tensor((4, K), torch.int64), None, None, True, False, False, False), ValueError,
         "^use_fp8=True: this Buffer's low-latency buffers are sized for dispatch_dtype='bf16'"),
        ((x4, torch.Tensor((4, K), torch.int64), None, None, False, False, True, True), ValueError,
         "^async_finish=True with return_recv_hook=True"),
        ((x, idx, None, None, False, False, False, False), ValueError,
         "^x: 5 tokens, more than num_max_dispatch_tokens_per_rank 4"),
        ((torch.Tensor((4, H), torch.float32), idx, None, None, False, False, False, False), TypeError,
         "^x: dtype torch.float32"),
        ((x4, torch.Tensor((4, K), torch.int32), None, None, False, False, False, False), TypeError,
         "^topk_idx: dtype torch.int32"),
        ((x4, torch.Tensor((3, K), torch.int64), None, None, False, False, False, False), ValueError,
         r"^topk_idx: shape \[3, 2\], expected \[4, 2\]"),
    ]:
        with pytest.raises(exc, match=match):
            g.ll_dispatch(*args)
    assert rec.calls == []  # nothing reached the library


def test_async_calls_record_each_tensor_on_the_stream_that_shares_it(path):
    """async_finish (DeepEP's record_stream rule, see _gpu's module notes): the inputs and the
    outputs allocated on the compute stream are recorded on the comm stream; with
    allocate_on_comm_stream the outputs are allocated on the comm stream (the current stream
    restored afterwards) and recorded on the compute stream; the event is recorded on comm."""
    g, torch, rec, _ = path
    x, idx, w = inputs(torch)
    prev = EventOverlap(types.SimpleNamespace(cuda_event=0x66))
    for on_comm in (False, True):
        torch.records.clear()
        rx, ri, rw, _, handle, ev = g.dispatch(x, None, idx, w, 1, 0, prev, True, on_comm)
        assert torch.stream == COMPUTE  # restored
        outs = (rx, ri, rw)
        assert {t._alloc for t in outs} == {COMM if on_comm else COMPUTE}
        want = [(t, COMM) for t in (x, idx, w)] + [(t, COMPUTE if on_comm else COMM) for t in outs]
        assert torch.records == want
        assert isinstance(ev.event, torch.cuda.Event) and ev.event.recorded_on == COMM
        torch.records.clear()
        cx, cw, ev = g.combine(rx, handle, rw, prev, True, on_comm)
        assert torch.stream == COMPUTE and {cx._alloc, cw._alloc} == {COMM if on_comm else COMPUTE}
        assert torch.records == [(rx, COMM), (rw, COMM)] + \
            [(t, COMPUTE if on_comm else COMM) for t in (cx, cw)]
        torch.records.clear()
        handle._ptr = 0x1234  # a cached dispatch reads the handle's routing tensors too
        try:
            (rx2, *_, ev) = g.dispatch(x, handle, None, None, 1, 0, prev, True, on_comm)
        finally:
            handle._ptr = 0
        assert torch.records == [(x, COMM), (idx, COMM), (w, COMM),
                                 (rx2, COMPUTE if on_comm else COMM)]
    # Another current device: torch's stream context instead of the raw pair (which would leave
    # the device switched), with the same result (the helper switches no stream).
    torch.cur_device, torch.records, torch.contexts = 1, [], 0
    rx, ri, rw, _, handle, ev = g.dispatch(x, None, idx, w, 1, 0, prev, True, True)
    assert torch.contexts == 1
    assert torch.stream == COMPUTE and rx._alloc == COMM
    assert torch.records[-3:] == [(t, COMPUTE) for t in (rx, ri, rw)]
    torch.cur_device = 0
    # The stream is restored when an allocation fails.
    torch.Tensor.new_empty_strided, real = None, torch.Tensor.new_empty_strided
    try:
        with pytest.raises(TypeError):
            g.dispatch(x, None, idx, w, 1, 0, prev, True, True)
    finally:
        torch.Tensor.new_empty_strided = real
    assert torch.stream == COMPUTE
    # Synchronous calls record nothing.
    torch.records.clear()
    g.dispatch(x, None, idx, w, 1, 0, None, False, False)
    assert torch.records == []


def test_dispatch_checks_layout_tensors_unless_they_are_the_last_layout(path):
    """Buffer.dispatch: get_dispatch_layout's last outputs passed back unchanged are not checked
    again; any other layout tensor is (Buffer._layout_args)."""
    from fabric_ep.buffer import _Engine as Buffer

    g, torch, rec, _ = path
    x, idx, w = inputs(torch)
    checked = []
    me = types.SimpleNamespace(_ptr=0xABC, _g=g, _layout_args=lambda *a: checked.append(a))
    lay = (torch.Tensor((R,), torch.int32), None, torch.Tensor((L * R,), torch.int32),
           torch.Tensor((T, R), torch.bool))
    g._layout_out = lay

    def call(per_rank, per_expert, in_rank):
        Buffer.dispatch(me, x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
                        num_tokens_per_rdma_rank=None, is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert)

    call(lay[0], lay[2], lay[3])
    assert checked == []
    other = torch.Tensor((R,), torch.int32)
    call(other, lay[2], lay[3])
    call(lay[0], lay[2], None)
    assert [c[1] for c in checked] == [other, lay[0]] and checked[1][3] is None
    g.quiesce()  # (destroy): the layout's outputs are let go, and checked again if passed
    assert g._layout_out == ()
    call(lay[0], lay[2], lay[3])
    assert len(checked) == 3


def test_ll_async_dispatch_records_its_tensors_and_the_stats_on_comm(path):
    """An asynchronous low-latency dispatch: its outputs are allocated on the compute stream and
    written on comm, its inputs and cumulative_local_expert_recv_stats (updated on comm) are
    read there: all recorded on the comm stream."""
    g, torch, rec, buf = path
    buf.num_max_dispatch_tokens_per_rank, buf.num_experts = 6, L * R
    x, idx = torch.Tensor((T, H), torch.bfloat16), torch.Tensor((T, K), torch.int64)
    stats = torch.Tensor((L,), torch.int32)
    torch.records.clear()
    rx, count, handle, ev, hook = g.ll_dispatch(x, idx, stats, None, False, False, True, False)
    assert hook is None and ev.event.recorded_on == COMM
    assert stats.added[1] == COMM and stats.added[0].data_ptr() == count.data_ptr()
    routing = handle._routing[0]
    assert torch.records == [(x, COMM), (idx, COMM), (stats, COMM), (rx, COMM), (routing, COMM)]


def test_ll_wait_recv_cost_stats_reach_the_kernels_and_are_recorded_on_comm(path):
    """DeepEP's dispatch/combine_wait_recv_cost_stats on the GPU path: an ``[R]`` int64 CUDA
    tensor, checked by name, whose address the native call gets (the receive kernels add to it),
    recorded on the comm stream when the call is asynchronous."""
    g, torch, rec, buf = path
    buf.num_max_dispatch_tokens_per_rank, buf.num_experts = 6, L * R
    x, idx = torch.Tensor((T, H), torch.bfloat16), torch.Tensor((T, K), torch.int64)
    for bad, exc, match in ((torch.Tensor((R + 1,), torch.int64), ValueError, "shape"),
                            (torch.Tensor((R,), torch.int32), TypeError, "dtype")):
        with pytest.raises(exc, match=f"^dispatch_wait_recv_cost_stats: {match}"):
            g.ll_dispatch(x, idx, None, bad, False, False, False, False)
    assert rec.calls == []
    ds = torch.Tensor((R,), torch.int64)
    torch.records.clear()
    rx, count, handle, ev, hook = g.ll_dispatch(x, idx, None, ds, False, False, True, False)
    name, d = rec.calls[0]
    assert name == "gpu_ll_dispatch" and d["ws"] == ds.data_ptr() and d["async_"] is True
    assert (ds, COMM) in torch.records and handle._keep[-1] is ds
    cs = torch.Tensor((R,), torch.int64)
    with pytest.raises(ValueError, match="^combine_wait_recv_cost_stats: shape"):
        g.ll_combine(rx, idx, torch.Tensor((T, K), torch.float32), handle, None, False, False,
                     torch.Tensor((1,), torch.int64))
    handle._ptr = 0x4321
    try:
        torch.records.clear()
        w = torch.Tensor((T, K), torch.float32)
        g.ll_combine(rx, idx, w, handle, None, True, False, cs)
        name, d = rec.calls[1]
        assert name == "gpu_ll_combine" and d["ws"] == cs.data_ptr()
        assert (cs, COMM) in torch.records
    finally:
        handle._ptr = 0
