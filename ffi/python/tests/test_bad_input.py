"""Bad input through the public API (``fabric_ep.Buffer`` as DeepEP callers use it, host
backend, numpy arrays, a world of one rank over the torchrun variables). Every case must raise
TypeError, ValueError or FabricEPError (RuntimeError for a destroyed Buffer, as DeepEP) with a
message naming the argument; a few valid edge inputs must be accepted, so over-refusal fails too.

Cases that reach the native library with odd values (huge or negative numbers, NaN, strings the
C side reads, a poisoned buffer) run each in a child process (this file run as a script with the
case's name) with a deadline, so a crash or a hang is seen and counted as such. The suite prints
``bad-input (python): N cases, E clean, S silent, C crashes, H hangs``.
"""

import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import fabric_ep  # noqa: E402
from fabric_ep import Buffer, Config, FabricEPError  # noqa: E402
from conftest import free_port, rank_env  # noqa: E402

E, H, K, T = 8, 256, 2, 16
DEADLINE = 30.0
CASES = []


def case(name, names, risky=False, valid=False, destroyed=False):
    """Registers ``fn(ctx)`` as case ``name``: it must raise naming one of ``names`` (or, with
    ``valid``, return normally)."""

    def reg(fn):
        CASES.append(dict(name=name, names=names, risky=risky, valid=valid,
                          destroyed=destroyed, fn=fn))
        return fn

    return reg


class Ctx:
    """What the cases use, made on first need: a normal-mode Buffer, a low-latency one, data."""

    def __init__(self):
        self._buf = self._ll = None
        rng = np.random.default_rng(1)
        self.x = rng.integers(0, 1 << 14, size=(T, H)).astype(np.uint16)
        self.idx = np.stack([np.arange(T) % E, (np.arange(T) + 3) % E], 1).astype(np.int64)
        self.w = np.full((T, K), 0.5, np.float32)

    @staticmethod
    def port():
        os.environ["FEP_MASTER_PORT"] = str(free_port())

    def make(self, *a, **kw):
        """A Buffer from these arguments (a fresh store port); destroyed again if it was made."""
        self.port()
        kw.setdefault("explicitly_destroy", True)
        b = Buffer(*a, **kw)
        b.destroy()
        return b

    @property
    def buf(self):
        if self._buf is None:
            self.port()
            self._buf = Buffer(None, num_experts=E, hidden=H, num_topk=K, explicitly_destroy=True,
                               timeout_s=10.0)
        return self._buf

    @property
    def ll(self):
        if self._ll is None:
            self.port()
            self._ll = Buffer(None, 0, 0, True, num_experts=E, hidden=H, num_topk=K,
                              explicitly_destroy=True, timeout_s=10.0,
                              num_max_dispatch_tokens_per_rank=T)
        return self._ll

    def dispatch(self, **kw):
        a = dict(topk_idx=self.idx, topk_weights=self.w)
        a.update(kw)
        x = a.pop("x", self.x)
        return self.buf.dispatch(x, **a)

    def handle(self):
        rx, _, _, _, h, _ = self.dispatch()
        return rx, h

    def ll_dispatch(self, **kw):
        a = dict(x=self.x, topk_idx=self.idx, num_max_dispatch_tokens_per_rank=T, num_experts=E,
                 use_fp8=False)
        a.update(kw)
        return self.ll.low_latency_dispatch(a.pop("x"), a.pop("topk_idx"),
                                            a.pop("num_max_dispatch_tokens_per_rank"),
                                            a.pop("num_experts"), **a)

    def close(self):
        for b in (self._buf, self._ll):
            if b is not None:
                b.destroy()


# ------------------------------------------------------------------------------ constructor

BAD_INTS = [("neg", -1), ("2e63", 2**63), ("2e64", 2**64), ("bool", True), ("str", "1"),
            ("float", 1.5), ("none", None)]
for _n, _v in BAD_INTS:
    for _arg in ("num_nvl_bytes", "num_rdma_bytes"):
        case(f"ctor/{_arg}/{_n}", [_arg])(
            lambda c, a=_arg, v=_v: c.make(None, **{a: v}))
for _n, _v in [("zero", 0), ("neg", -1), ("2e31", 2**31), ("2e32p1", 2**32 + 1), ("bool", True),
               ("float", 2.0)]:
    case(f"ctor/num_qps_per_rank/{_n}", ["num_qps_per_rank"])(
        lambda c, v=_v: c.make(None, num_qps_per_rank=v))
for _arg in ("low_latency_mode", "allow_nvlink_for_low_latency_mode", "allow_mnnvl", "use_fabric",
             "explicitly_destroy", "internode_hierarchy"):
    for _n, _v in [("int", 1), ("str", "yes"), ("none", None)]:
        case(f"ctor/{_arg}/{_n}", [_arg])(lambda c, a=_arg, v=_v: c.make(None, **{a: v}))
for _n, _v in [("nan", float("nan")), ("inf", float("inf")), ("neg", -1.0),
               ("neg_inf", float("-inf")), ("str", "10"), ("bool", True), ("none", None),
               ("complex", 1j)]:
    case(f"ctor/timeout_s/{_n}", ["timeout_s"])(lambda c, v=_v: c.make(None, timeout_s=v))
# Finite but past what the library's clock holds: refused by name, not by a crash.
case("ctor/timeout_s/1e300", ["timeout_s"], risky=True)(
    lambda c: c.make(None, timeout_s=1e300))
for _n, _v in [("nul", "shm\0tcp"), ("empty", ""), ("int", 5), ("bytes", b"shm"),
               ("surrogate", "shm\udcff"), ("blank", "   ")]:
    case(f"ctor/provider/{_n}", ["provider"])(lambda c, v=_v: c.make(None, provider=v))
case("ctor/provider/oversized", ["provider"], risky=True)(
    lambda c: c.make(None, num_experts=E, hidden=H, num_topk=K, provider="s" * 100000))
case("ctor/provider/unknown", ["provider"], risky=True)(
    lambda c: c.make(None, num_experts=E, hidden=H, num_topk=K, provider="nosuchprovider"))
for _arg in ("num_experts", "hidden", "num_topk"):
    for _n, _v in [("zero", 0), ("neg", -4), ("2e31", 2**31), ("2e32p8", 2**32 + 8),
                   ("bool", True), ("str", "8"), ("float", 8.0)]:
        kw = dict(num_experts=E, hidden=H, num_topk=K)
        kw[_arg] = _v
        case(f"ctor/{_arg}/{_n}", [_arg])(lambda c, kw=kw: c.make(None, **kw))
case("ctor/shape/two_of_three", ["num_experts, hidden and num_topk"])(
    lambda c: c.make(None, num_experts=E, hidden=H))
case("ctor/hidden/not_multiple_of_8", ["hidden"], risky=True)(
    lambda c: c.make(None, num_experts=E, hidden=100, num_topk=K))
case("ctor/num_topk/more_than_experts", ["num_topk"], risky=True)(
    lambda c: c.make(None, num_experts=4, hidden=H, num_topk=6))
for _n, _v in [("fp16", "fp16"), ("none", None), ("int", 1)]:
    case(f"ctor/dispatch_dtype/{_n}", ["dispatch_dtype"])(
        lambda c, v=_v: c.make(None, num_experts=E, hidden=H, num_topk=K, dispatch_dtype=v))
for _n, _v in [("tpu", "tpu"), ("none", None), ("int", 0)]:
    case(f"ctor/backend/{_n}", ["backend"])(lambda c, v=_v: c.make(None, backend=v))
for _n, _v in [("tuple", (1, 2)), ("str", "cfg")]:
    case(f"ctor/config/{_n}", ["config"])(lambda c, v=_v: c.make(None, config=v))
for _n, _v in [("neg", -1), ("2e31", 2**31), ("bool", True), ("str", "16")]:
    case(f"ctor/num_max_dispatch_tokens_per_rank/{_n}", ["num_max_dispatch_tokens_per_rank"])(
        lambda c, v=_v: c.make(None, num_max_dispatch_tokens_per_rank=v))
    case(f"ctor/gpu_reserve_tokens/{_n}", ["gpu_reserve_tokens"])(
        lambda c, v=_v: c.make(None, gpu_reserve_tokens=v))
for _n, _v in [("zero", 0), ("neg", -1), ("3", 3), ("bool", True), ("2e32p1", 2**32 + 1)]:
    case(f"ctor/ranks_per_node/{_n}", ["ranks_per_node"])(
        lambda c, v=_v: c.make(None, ranks_per_node=v))
case("ctor/enable_shrink_int", ["enable_shrink"])(lambda c: c.make(None, enable_shrink=1))
case("ctor/group_and_comm", ["comm"])(lambda c: c.make(object(), comm=object()))
for _n, _v in [("int", 42), ("str", "world")]:
    case(f"ctor/group/{_n}", ["group"])(lambda c, v=_v: c.make(v))


class _BadGroup:
    """A group whose all-gather hands back the wrong number of contributions."""

    def rank(self):
        return 0

    def size(self):
        return 1

    def all_gather_bytes(self, data):
        return [data, data]


case("ctor/group/bad_all_gather", ["all-gather", "all_gather", "group"], risky=True)(
    lambda c: c.make(_BadGroup(), num_experts=E, hidden=H, num_topk=K))

# ------------------------------------------------------------------------------ static helpers

for _n, _v in [("zero", 0), ("neg", -2), ("odd", 3), ("bool", True), ("str", "20"),
               ("2e32", 2**32)]:
    case(f"set_num_sms/{_n}", ["new_num_sms"])(lambda c, v=_v: Buffer.set_num_sms(v))
for _n, _v in [("zero", 0), ("neg", -1), ("bool", True), ("2e31", 2**31)]:
    case(f"get_dispatch_config/{_n}", ["num_ranks"])(lambda c, v=_v: Buffer.get_dispatch_config(v))
for _i, _arg in enumerate(("num_max_dispatch_tokens_per_rank", "hidden", "num_ranks",
                           "num_experts")):
    for _n, _v in [("zero", 0), ("huge", 2**40)]:
        a = [128, 7168, 16, 256]
        a[_i] = _v
        case(f"get_low_latency_rdma_size_hint/{_arg}/{_n}", [_arg])(
            lambda c, a=a: Buffer.get_low_latency_rdma_size_hint(*a))
for _i, _arg in enumerate(("num_sms", "num_max_nvl_chunked_send_tokens",
                           "num_max_nvl_chunked_recv_tokens", "num_max_rdma_chunked_send_tokens",
                           "num_max_rdma_chunked_recv_tokens")):
    for _n, _v in [("zero", 0), ("bool", True), ("2e32p20", 2**32 + 20)]:
        a = [20, 64, 256, 64, 256]
        a[_i] = _v
        case(f"Config/{_arg}/{_n}", [_arg])(lambda c, a=a: Config(*a))

# ------------------------------------------------------------------------------ dispatch

for _n, _f, _names in [
    ("list", lambda c: c.x.tolist(), ["x"]),
    ("none", lambda c: None, ["x"]),
    ("float32", lambda c: c.x.astype(np.float32), ["x"]),
    ("1d", lambda c: c.x.reshape(-1), ["x"]),
    ("3d", lambda c: c.x.reshape(T, H // 2, 2), ["x"]),
    ("fortran", lambda c: np.asfortranarray(c.x), ["x"]),
    ("strided", lambda c: c.x[:, ::2], ["x"]),
    ("tuple3", lambda c: (c.x, c.x, c.x), ["x"]),
    ("tuple1", lambda c: (c.x,), ["x"]),
    ("scales_dtype", lambda c: (c.x.view(np.uint8)[:, :H].copy(), np.ones((T, 2), np.float64)),
     ["x_scales"]),
    ("scales_shape", lambda c: (c.x.view(np.uint8)[:, :H].copy(), np.ones((T, 3), np.float32)),
     ["x_scales"]),
    ("rows_differ", lambda c: c.x[: T - 1].copy(), ["x", "topk_idx"]),
]:
    case(f"dispatch/x/{_n}", _names)(lambda c, f=_f: c.dispatch(x=f(c)))
case("dispatch/x_scales/nan", ["x_scales"], risky=True)(
    lambda c: c.dispatch(x=(c.x.view(np.uint8)[:, :H].copy(),
                            np.full((T, 2), np.nan, np.float32))))
for _n, _f in [
    ("int32", lambda c: c.idx.astype(np.int32)),
    ("float", lambda c: c.idx.astype(np.float64)),
    ("1d", lambda c: c.idx.reshape(-1)),
    ("rows", lambda c: np.zeros((T + 1, K), np.int64)),
    ("list", lambda c: c.idx.tolist()),
]:
    case(f"dispatch/topk_idx/{_n}", ["topk_idx"])(lambda c, f=_f: c.dispatch(topk_idx=f(c)))
for _n, _v in [("eq_experts", E), ("minus_two", -2), ("2e40", 2**40), ("min", -2**63)]:
    def _bad_idx(c, v=_v):
        i = c.idx.copy()
        i[3, 1] = v
        return c.dispatch(topk_idx=i)

    case(f"dispatch/topk_idx/{_n}", ["topk_idx"], risky=True)(_bad_idx)
for _n, _f in [
    ("float64", lambda c: c.w.astype(np.float64)),
    ("shape", lambda c: np.ones((T, K + 1), np.float32)),
    ("none", lambda c: None),
    ("list", lambda c: c.w.tolist()),
]:
    case(f"dispatch/topk_weights/{_n}", ["topk_weights"])(
        lambda c, f=_f: c.dispatch(topk_weights=f(c)))
for _n, _v in [("nan", np.nan), ("inf", np.inf)]:
    def _bad_w(c, v=_v):
        w = c.w.copy()
        w[2, 0] = v
        return c.dispatch(topk_weights=w)

    case(f"dispatch/topk_weights/{_n}", ["topk_weights"], risky=True)(_bad_w)
for _n, _v in [("zero", 0), ("neg", -1), ("2e31", 2**31), ("bool", True), ("float", 1.0),
               ("str", "1")]:
    case(f"dispatch/expert_alignment/{_n}", ["expert_alignment"])(
        lambda c, v=_v: c.dispatch(expert_alignment=v))
for _n, _v in [("neg", -1), ("2e31", 2**31), ("2e63", 2**63), ("bool", True), ("float", 8.0)]:
    case(f"dispatch/num_worst_tokens/{_n}", ["num_worst_tokens"])(
        lambda c, v=_v: c.dispatch(num_worst_tokens=v))
# Fewer rows than arrive: found after the count exchange (the buffer is then refused).
case("dispatch/num_worst_tokens/too_few", ["num_worst_tokens"], risky=True)(
    lambda c: c.dispatch(num_worst_tokens=3))
case("dispatch/num_tokens_per_rank/shape", ["num_tokens_per_rank"])(
    lambda c: c.dispatch(num_tokens_per_rank=np.zeros(2, np.int32)))
case("dispatch/is_token_in_rank/dtype", ["is_token_in_rank"])(
    lambda c: c.dispatch(is_token_in_rank=np.zeros((T, 1), np.int32)))
case("dispatch/num_tokens_per_expert/2d", ["num_tokens_per_expert"])(
    lambda c: c.dispatch(num_tokens_per_expert=np.zeros((E, 1), np.int32)))
case("dispatch/num_tokens_per_expert/list", ["num_tokens_per_expert"])(
    lambda c: c.dispatch(num_tokens_per_expert=[0] * E))
for _n, _f in [("tuple", lambda c: (1, 2)), ("object", lambda c: object()),
               ("ll_handle", lambda c: c.ll_dispatch()[2])]:
    case(f"dispatch/handle/{_n}", ["handle"])(
        lambda c, f=_f: c.buf.dispatch(c.x, handle=f(c)))
case("dispatch/handle/with_topk", ["topk_idx"])(
    lambda c: c.dispatch(handle=c.handle()[1]))
case("dispatch/handle/other_tokens", ["x"])(
    lambda c: c.buf.dispatch(c.x[:8].copy(), handle=c.handle()[1]))
case("dispatch/config/tuple", ["config"])(lambda c: c.dispatch(config=(1, 2)))
case("dispatch/previous_event/str", ["previous_event"])(lambda c: c.dispatch(previous_event="e"))
case("dispatch/async_finish", ["async_finish"])(lambda c: c.dispatch(async_finish=True))
case("dispatch/allocate_on_comm_stream", ["allocate_on_comm_stream"])(
    lambda c: c.dispatch(allocate_on_comm_stream=True))
# Valid edges.
case("dispatch/valid", [], valid=True)(lambda c: c.dispatch())
# int16 is bf16 bits too (documented: torch and numpy callers hold bf16 as 16-bit words).
case("dispatch/x_int16_bits", [], valid=True)(lambda c: c.dispatch(x=c.x.view(np.int16)))
case("dispatch/zero_tokens", [], valid=True)(
    lambda c: c.dispatch(x=c.x[:0].copy(), topk_idx=c.idx[:0].copy(), topk_weights=c.w[:0].copy()))
case("dispatch/one_token", [], valid=True)(
    lambda c: c.dispatch(x=c.x[:1].copy(), topk_idx=c.idx[:1].copy(), topk_weights=c.w[:1].copy()))
case("dispatch/all_minus_one", [], valid=True)(
    lambda c: c.dispatch(topk_idx=np.full((T, K), -1, np.int64)))

# ------------------------------------------------------------------------------ combine

for _n, _f, _names in [
    ("rows", lambda c, rx: rx[:-1].copy(), ["x"]),
    ("dtype", lambda c, rx: rx.astype(np.float32), ["x"]),
    ("list", lambda c, rx: rx.tolist(), ["x"]),
    ("none", lambda c, rx: None, ["x"]),
]:
    def _comb(c, f=_f):
        rx, h = c.handle()
        return c.buf.combine(f(c, rx), h)

    case(f"combine/x/{_n}", _names)(_comb)
for _n, _f in [("none", lambda c: None), ("tuple", lambda c: (1, 2)),
               ("ll_handle", lambda c: c.ll_dispatch()[2])]:
    case(f"combine/handle/{_n}", ["handle"])(lambda c, f=_f: c.buf.combine(c.handle()[0], f(c)))
for _n, _f in [("shape", lambda w: np.ones((w.shape[0], 1), np.float32)),
               ("dtype", lambda w: w.astype(np.float64))]:
    def _cw(c, f=_f):
        rx, h = c.handle()
        return c.buf.combine(rx, h, topk_weights=f(c.w))

    case(f"combine/topk_weights/{_n}", ["topk_weights"])(_cw)


def _comb_nan(c):
    rx, h = c.handle()
    w = c.w.copy()
    w[0, 1] = np.nan
    return c.buf.combine(rx, h, topk_weights=w)


case("combine/topk_weights/nan", ["topk_weights"], risky=True)(_comb_nan)
case("combine/bias/shape", ["bias"])(
    lambda c: c.buf.combine(c.handle()[0], c.handle()[1], bias=c.x[:1].copy()))
case("combine/bias/triple", ["bias"])(
    lambda c: c.buf.combine(c.handle()[0], c.handle()[1], bias=(c.x, c.x, c.x)))
case("combine/async_finish", ["async_finish"])(
    lambda c: c.buf.combine(*c.handle(), async_finish=True))
case("combine/valid", [], valid=True)(lambda c: c.buf.combine(*c.handle()))

# ------------------------------------------------------------------------------ layout

for _n, _f, _names in [
    ("idx_list", lambda c: (c.idx.tolist(), E), ["topk_idx"]),
    ("idx_int32", lambda c: (c.idx.astype(np.int32), E), ["topk_idx"]),
    ("experts_zero", lambda c: (c.idx, 0), ["num_experts"]),
    ("experts_neg", lambda c: (c.idx, -8), ["num_experts"]),
    ("experts_bool", lambda c: (c.idx, True), ["num_experts"]),
    ("experts_2e32", lambda c: (c.idx, 2**32 + 8), ["num_experts"]),
    ("idx_out_of_range", lambda c: (np.full((T, K), E, np.int64), E), ["topk_idx"]),
]:
    case(f"get_dispatch_layout/{_n}", _names)(
        lambda c, f=_f: c.buf.get_dispatch_layout(*f(c)))
case("get_dispatch_layout/valid", [], valid=True)(lambda c: c.buf.get_dispatch_layout(c.idx, E))

# ------------------------------------------------------------------------------ low latency

for _n, _v in [("zero", 0), ("neg", -1), ("2e31", 2**31), ("bool", True), ("str", "16")]:
    case(f"ll_dispatch/num_max_dispatch_tokens_per_rank/{_n}",
         ["num_max_dispatch_tokens_per_rank"])(
        lambda c, v=_v: c.ll_dispatch(num_max_dispatch_tokens_per_rank=v))
for _n, _v in [("zero", 0), ("neg", -8), ("2e32p8", 2**32 + 8), ("bool", True), ("str", "8")]:
    case(f"ll_dispatch/num_experts/{_n}", ["num_experts"])(
        lambda c, v=_v: c.ll_dispatch(num_experts=v))
for _arg in ("use_fp8", "round_scale", "use_ue8m0", "async_finish", "return_recv_hook"):
    case(f"ll_dispatch/{_arg}/str", [_arg])(lambda c, a=_arg: c.ll_dispatch(**{a: "yes"}))
case("ll_dispatch/round_scale_without_fp8", ["round_scale"])(
    lambda c: c.ll_dispatch(use_fp8=False, round_scale=True))
case("ll_dispatch/ue8m0_without_round", ["use_ue8m0"])(
    lambda c: c.ll_dispatch(use_fp8=True, use_ue8m0=True))
case("ll_dispatch/too_many_tokens", ["x"])(
    lambda c: c.ll_dispatch(x=np.zeros((T + 1, H), np.uint16),
                            topk_idx=np.zeros((T + 1, K), np.int64)))
case("ll_dispatch/x_dtype", ["x"])(lambda c: c.ll_dispatch(x=c.x.astype(np.float32)))
case("ll_dispatch/x_list", ["x"])(lambda c: c.ll_dispatch(x=c.x.tolist()))
case("ll_dispatch/topk_idx_dtype", ["topk_idx"])(
    lambda c: c.ll_dispatch(topk_idx=c.idx.astype(np.int32)))


def _ll_idx(v):
    def f(c):
        i = c.idx.copy()
        i[5] = v
        return c.ll_dispatch(topk_idx=i)

    return f


case("ll_dispatch/topk_idx_duplicate", ["topk_idx"], risky=True)(_ll_idx([3, 3]))
case("ll_dispatch/topk_idx_range", ["topk_idx"], risky=True)(_ll_idx([1, E]))
case("ll_dispatch/cumulative_stats_shape", ["cumulative_local_expert_recv_stats"])(
    lambda c: c.ll_dispatch(cumulative_local_expert_recv_stats=np.zeros(3, np.int32)))
case("ll_dispatch/on_normal_buffer", ["low_latency_mode", "low_latency_dispatch"])(
    lambda c: c.buf.low_latency_dispatch(c.x, c.idx, T, E, use_fp8=False))
case("ll_dispatch/valid", [], valid=True)(lambda c: c.ll_dispatch())
case("ll_dispatch/wait_stats_dtype", ["dispatch_wait_recv_cost_stats"])(
    lambda c: c.ll_dispatch(dispatch_wait_recv_cost_stats=np.zeros(1, np.float32)))
case("ll_dispatch/wait_stats_list", ["dispatch_wait_recv_cost_stats"])(
    lambda c: c.ll_dispatch(dispatch_wait_recv_cost_stats=[0]))
case("ll_dispatch/wait_stats_valid", [], valid=True)(
    lambda c: c.ll_dispatch(dispatch_wait_recv_cost_stats=np.zeros(1, np.int64)))
case("local_buffer/offset_past", ["offset"])(
    lambda c: c.ll.get_local_buffer_tensor(np.uint8, offset=1 << 40))
case("local_buffer/size_past", ["size"])(
    lambda c: c.ll.get_local_buffer_tensor(np.uint8, size=(1 << 40,)))
case("local_buffer/dtype", ["dtype"])(lambda c: c.ll.get_local_buffer_tensor("nope"))
case("local_buffer/valid", [], valid=True)(lambda c: c.ll.get_local_buffer_tensor(np.uint8))
case("shrink/update_without", ["enable_shrink", "low_latency_update_mask_buffer"])(
    lambda c: c.ll.low_latency_update_mask_buffer(0, True))
case("ll_dispatch/zero_tokens", [], valid=True)(
    lambda c: c.ll_dispatch(x=c.x[:0].copy(), topk_idx=c.idx[:0].copy()))
case("ll_dispatch/all_minus_one", [], valid=True)(
    lambda c: c.ll_dispatch(topk_idx=np.full((T, K), -1, np.int64)))


def _llc(mut, names=None):
    def f(c):
        rx, cnt, h, _, _ = c.ll_dispatch()
        a = dict(x=rx, topk_idx=c.idx, topk_weights=c.w, handle=h)
        mut(c, a)
        return c.ll.low_latency_combine(a.pop("x"), a.pop("topk_idx"), a.pop("topk_weights"),
                                        a.pop("handle"), **a)

    return f


case("ll_combine/x_shape", ["x"])(_llc(lambda c, a: a.update(x=c.x)))
case("ll_combine/x_dtype", ["x"])(_llc(lambda c, a: a.update(x=a["x"].astype(np.float32))))
case("ll_combine/topk_weights_shape", ["topk_weights"])(
    _llc(lambda c, a: a.update(topk_weights=np.ones((T, 1), np.float32))))
case("ll_combine/topk_weights_nan", ["topk_weights"], risky=True)(
    _llc(lambda c, a: a.update(topk_weights=np.full((T, K), np.nan, np.float32))))
case("ll_combine/topk_idx_differs", ["topk_idx"], risky=True)(
    _llc(lambda c, a: a.update(topk_idx=np.roll(c.idx, 1, axis=0))))
case("ll_combine/handle_object", ["handle"])(_llc(lambda c, a: a.update(handle=object())))
case("ll_combine/handle_normal", ["handle"])(_llc(lambda c, a: a.update(handle=c.handle()[1])))
case("ll_combine/out_shape", ["out"])(
    _llc(lambda c, a: a.update(out=np.empty((1, H), np.uint16))))
case("ll_combine/zero_copy_without_buffer", ["zero_copy"])(
    _llc(lambda c, a: a.update(zero_copy=True)))
case("ll_combine/use_logfmt_str", ["use_logfmt"])(_llc(lambda c, a: a.update(use_logfmt="1")))
case("ll_combine/use_logfmt", [], valid=True)(_llc(lambda c, a: a.update(use_logfmt=True)))
case("ll_combine/wait_stats_shape", ["combine_wait_recv_cost_stats"])(
    _llc(lambda c, a: a.update(combine_wait_recv_cost_stats=np.zeros(3, np.int64))))
case("ll_combine/wait_stats_valid", [], valid=True)(
    _llc(lambda c, a: a.update(combine_wait_recv_cost_stats=np.zeros(1, np.int64))))
case("ll_combine/valid", [], valid=True)(_llc(lambda c, a: None))


def _stale(c):
    rx, cnt, h, _, _ = c.ll_dispatch()
    c.ll.clean_low_latency_buffer(T, H, E)
    return c.ll.low_latency_combine(rx, c.idx, c.w, h)


case("ll_combine/handle_after_clean", ["handle"], risky=True)(_stale)
for _i, _arg in enumerate(("num_max_dispatch_tokens_per_rank", "hidden", "num_experts")):
    for _n, _v in [("zero", 0), ("neg", -1), ("bool", True), ("str", "8")]:
        a = [T, H, E]
        a[_i] = _v
        case(f"clean_low_latency_buffer/{_arg}/{_n}", [_arg])(
            lambda c, a=a: c.ll.clean_low_latency_buffer(*a))

# ------------------------------------------------------------------------------ after destroy


def _destroyed(c):
    b = Buffer(None, num_experts=E, hidden=H, num_topk=K, explicitly_destroy=True,
               timeout_s=10.0)
    rx, _, _, _, h, _ = b.dispatch(c.x, topk_idx=c.idx, topk_weights=c.w)
    b.destroy()
    return b, rx, h


for _n, _f in [
    ("dispatch", lambda c, b, rx, h: b.dispatch(c.x, topk_idx=c.idx, topk_weights=c.w)),
    ("combine", lambda c, b, rx, h: b.combine(rx, h)),
    ("cached_dispatch", lambda c, b, rx, h: b.dispatch(c.x, handle=h)),
    ("destroy", lambda c, b, rx, h: b.destroy()),
    ("layout", lambda c, b, rx, h: b.get_dispatch_layout(c.idx, E)),
    ("clean", lambda c, b, rx, h: b.clean_low_latency_buffer(T, H, E)),
    ("handle_elsewhere", lambda c, b, rx, h: c.buf.combine(rx, h)),
]:
    def _use(c, f=_f):
        c.port()
        return f(c, *_destroyed(c))

    case(f"destroyed/{_n}", ["destroyed", "handle", "Buffer"], risky=True, destroyed=True)(_use)


# ------------------------------------------------------------------------------ the runner

def _allowed(c):
    ok = (TypeError, ValueError, FabricEPError)
    return ok + (RuntimeError,) if c["destroyed"] else ok


def _judge(c, exc):
    """(verdict, detail) for case ``c`` that raised ``exc`` (None: returned)."""
    if c["valid"]:
        return ("valid", "") if exc is None else ("over-refused", f"{type(exc).__name__}: {exc}")
    if exc is None:
        return "silent", "returned"
    msg = f"{type(exc).__name__}: {exc}"
    if not isinstance(exc, _allowed(c)):
        return "wrong-type", msg
    if not any(n in str(exc) for n in c["names"]):
        return "unnamed", msg
    return "clean", msg


def _run_here(c, ctx):
    try:
        c["fn"](ctx)
    except BaseException as e:  # noqa: BLE001 - every exception is judged
        return _judge(c, e)
    return _judge(c, None)


def _run_child(c):
    env = rank_env(0, 1, free_port(), 1)
    env.setdefault("FABRIC_EP_LIBRARY", os.environ.get("FABRIC_EP_LIBRARY", ""))
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), c["name"]], env=env,
                           capture_output=True, text=True, timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        return "hang", f"no answer within {DEADLINE} s"
    for line in p.stdout.splitlines():
        if line.startswith("@@RESULT "):
            v, d = json.loads(line[len("@@RESULT "):])
            return v, d
    tail = (p.stdout + p.stderr).strip().splitlines()[-4:]
    return "crash", f"exit {p.returncode} after {time.monotonic() - t0:.1f} s: {tail}"


def test_bad_input_suite():
    names = [c["name"] for c in CASES]
    assert len(set(names)) == len(names), "duplicate case names"
    only = os.environ.get("FEP_BAD_INPUT_ONLY", "")
    sel = [c for c in CASES if only in c["name"]]
    results = {}
    saved = dict(os.environ)
    os.environ.update(rank_env(0, 1, free_port(), 1))
    ctx = Ctx()
    start = time.monotonic()
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            futs = {c["name"]: pool.submit(_run_child, c) for c in sel if c["risky"]}
            for c in sel:
                if not c["risky"]:
                    results[c["name"]] = _run_here(c, ctx)
            for n, f in futs.items():
                results[n] = f.result()
    finally:
        try:
            ctx.close()
        finally:
            os.environ.clear()
            os.environ.update(saved)
    count = {}
    for v, _ in results.values():
        count[v] = count.get(v, 0) + 1
    bad = {n: r for n, r in sorted(results.items()) if r[0] not in ("clean", "valid")}
    for n, (v, d) in bad.items():
        print(f"FAULT {v} {n}: {d}")
    print(f"bad-input (python): {len(results)} cases, {count.get('clean', 0)} clean, "
          f"{count.get('silent', 0)} silent, {count.get('crash', 0)} crashes, "
          f"{count.get('hang', 0)} hangs; {count.get('unnamed', 0)} unnamed, "
          f"{count.get('wrong-type', 0)} wrong exception types, {count.get('valid', 0)} valid "
          f"accepted, {count.get('over-refused', 0)} valid refused "
          f"({sum(1 for c in sel if c['risky'])} in child processes, "
          f"{time.monotonic() - start:.1f} s)")
    if not only:
        assert len(results) >= 100, len(results)
    assert not bad, f"{len(bad)} of {len(results)} cases did not end cleanly: {sorted(bad)}"


if __name__ == "__main__":
    # One case in this process (the parent's child-process mode): prints its verdict.
    (c,) = [c for c in CASES if c["name"] == sys.argv[1]]
    ctx = Ctx()
    verdict = _run_here(c, ctx)
    print("@@RESULT " + json.dumps(verdict), flush=True)
    # No collective teardown: the verdict is in; a poisoned buffer's barrier is not the case.
    os._exit(0)
