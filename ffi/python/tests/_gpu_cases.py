"""The GPU backend's Python test cases (test_gpu.py runs each in a fresh process of its own):
torch CUDA tensors, ranks as threads of one process on one GPU (world 1, 2, 4), normal mode
(bf16, fp8; two-step, cached, expert_alignment, num_worst_tokens) and low-latency mode (bf16 with
and without the hook, fp8), each output compared with the numpy reference of _rank.py (the same
one the host backend's multi-process tests check against, on the same inputs); DeepEP's stream
options; bad arguments.

Run one case: ``python3 _gpu_cases.py CASE WORLD`` (CASE one of ``CASES``); exit status 0 and a
closing ``CASE ... PASSED`` line when every rank returned what the case expects. The process ends
with ``os._exit``, so rank threads still stuck in CUDA cannot hold it open (the parent's wait is
bounded as well). No pytest needed here."""

import os
import sys
import time
import traceback

# Both before CUDA initialises (before torch creates its context):
# * lazy module loading may synchronise the context on a kernel's first use, which waits for a
#   peer rank's spinning kernel (ranks are threads here);
# * CUDA maps the streams of a context onto CUDA_DEVICE_MAX_CONNECTIONS hardware queues (8 by
#   default). With ranks as threads of one context (world 4 x about 4 streams each) two ranks'
#   streams can share a queue, and one rank's spinning kernel then sits behind another's: a
#   deadlock until the timeout. 32 asks for a queue per stream (the driver may grant fewer, per
#   NVIDIA's MPS docs; the library refuses to connect several ranks of one context with too few).
#   The Rust harness still sees such a stall in about one 4-rank run in five (kernels/ll_notes.md).
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import fabric_ep  # noqa: E402
from fabric_ep import Buffer, EventOverlap, LowLatencyHandle  # noqa: E402
from _gpu_threads import bits, host, run_ranks, to_bf16  # noqa: E402
from plain_runner import raises  # noqa: E402  (pytest.raises without pytest)
from _rank import (  # noqa: E402
    H, K, L, MAX_LL, bf2f, dest_ranks, e4m3_to_f32, f2bf, inputs, ll_combine_want, ll_reference,
    reference_recv,
)


def call_raises(exc, match, fn, *args, **kwargs):
    """`fn(*args, **kwargs)` raises `exc` with a message matching `match`."""
    with raises(exc, match=match):
        fn(*args, **kwargs)


DEV = 0
TIMEOUT_S = 10.0
# Tokens per rank (every rank sends some); test_zero_token_rank uses a rank with none.
TOKENS = [24, 9, 17, 40]


def tdev(a):
    return torch.from_numpy(np.ascontiguousarray(a)).to(DEV)


def make_buffer(group, world, **kw):
    b = Buffer(group, num_experts=L * world, hidden=H, num_topk=K, explicitly_destroy=True,
               timeout_s=TIMEOUT_S, **kw)
    assert b.backend == "gpu" and b.num_ranks == world
    return b


# FEP_CASE_SYNC (a diagnosis switch): after every Buffer call wait for this rank's compute
# stream ("compute"), its communication stream ("comm"), or both ("1"). A failure that vanishes
# with "comm" but not with "compute" is a missing join of the compute stream after the call.
STEP_SYNC = os.environ.get("FEP_CASE_SYNC", "0")


T0 = time.perf_counter()
STEPS = {}  # id(buf) -> [(step, ms since T0)]: printed with a failed comparison


def step(buf, what="call"):
    STEPS.setdefault(id(buf), []).append((what, round((time.perf_counter() - T0) * 1e3, 2)))
    if STEP_SYNC in ("1", "compute"):
        torch.cuda.current_stream().synchronize()
    if STEP_SYNC in ("1", "comm"):
        buf.sync()


def same_rows(what, r, got, want, routing=None, again=None):
    """``np.array_equal(got, want)`` for row-major outputs; on a mismatch the AssertionError
    says which rows differ and how (the first few rows' distinct values, and the routing row
    ``routing[t]`` when given), so one failing run tells more than "differs"."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape == want.shape and np.array_equal(got, want):
        return
    lines = [f"rank {r}: {what}: got shape {got.shape}, want {want.shape}"]
    if got.shape == want.shape and got.ndim >= 1:
        g2, w2 = got.reshape(got.shape[0], -1), want.reshape(want.shape[0], -1)
        bad = np.nonzero((g2 != w2).any(axis=1))[0]
        lines.append(f"{bad.size} of {g2.shape[0]} rows differ: {bad[:24].tolist()}")
        for t in bad[:6]:
            diff = np.nonzero(g2[t] != w2[t])[0]
            same = [int(i) for i in np.nonzero((w2 == g2[t]).all(axis=1))[0][:4]]
            lines.append(
                f"  row {t}: {diff.size} of {g2.shape[1]} elements differ (first {diff[:4].tolist()}); "
                f"got distinct {np.unique(g2[t])[:4].tolist()}, want distinct "
                f"{np.unique(w2[t])[:4].tolist()}; got equals want rows {same}"
                + (f"; routing {np.asarray(routing[t]).tolist()}" if routing is not None else ""))
    if again is not None:
        # The same tensor read again after both streams finished: equal now means the first
        # read came too early (an ordering fault), still different means a wrong result.
        buf, read = again
        torch.cuda.current_stream().synchronize()
        try:
            buf.sync()  # also reports what this rank's kernels recorded (timeouts name a peer)
            lines.append("  buf.sync(): no device error")
        except Exception as e:  # noqa: BLE001 - reported in the message
            lines.append(f"  buf.sync(): {e}")
        lines.append(f"  host steps (ms): {STEPS.get(id(buf))}")
        late = np.asarray(read())
        n = int((late.reshape(late.shape[0], -1) != want.reshape(want.shape[0], -1)).any(axis=1).sum()) \
            if late.shape == want.shape else -1
        lines.append(f"  after a device sync the tensor has {n} differing rows")
    raise AssertionError("\n".join(lines))


def normal_bf16(group, r, world, tokens=TOKENS, **buf_kw):
    all_in = [inputs(s, world, tokens=tokens) for s in range(world)]
    x, idx, w = all_in[r]
    xt, it, wt = to_bf16(torch, x, DEV), tdev(idx), tdev(w)
    buf = make_buffer(group, world, **buf_kw)
    try:
        n_rank, n_rdma, n_exp, in_rank, ev = buf.get_dispatch_layout(it, L * world)
        m = dest_ranks(idx, world)
        assert isinstance(ev, EventOverlap) and ev.event is None
        assert n_rank.is_cuda and n_rank.dtype == torch.int32
        assert host(n_rank).tolist() == m.sum(0).tolist(), (n_rank, m.sum(0))
        assert np.array_equal(host(in_rank).numpy(), m)
        want_exp = np.bincount(idx[idx >= 0], minlength=L * world)
        assert host(n_exp).tolist() == want_exp.tolist()

        rx, ri, rw, counts, handle, ev = buf.dispatch(
            xt, num_tokens_per_rank=n_rank, num_tokens_per_rdma_rank=n_rdma,
            is_token_in_rank=in_rank, num_tokens_per_expert=n_exp, topk_idx=it, topk_weights=wt)
        step(buf, "dispatch")
        assert ev.event is None and rx.is_cuda and rx.dtype == torch.bfloat16
        ref_x, ref_i, ref_w, ref_counts = reference_recv(r, world, all_in)
        assert tuple(rx.shape) == ref_x.shape, (rx.shape, ref_x.shape)
        same_rows("recv_x", r, bits(rx), ref_x)
        assert np.array_equal(host(ri).numpy(), ref_i), (ri, ref_i)
        assert np.array_equal(host(rw).numpy(), ref_w)
        assert counts == ref_counts, (counts, ref_counts)

        back = (rx.float() * (r + 1)).to(torch.bfloat16)
        cx, cw, _ = buf.combine(back, handle, topk_weights=rw)
        step(buf, "combine")
        factor = (m * (np.arange(world) + 1)).sum(1).astype(np.float32)
        same_rows("combine", r, bf2f(bits(cx)), bf2f(x) * factor[:, None], m,
                  (buf, lambda: bf2f(bits(cx))))
        assert np.array_equal(host(cw).numpy(), np.where(idx >= 0, w, 0))
        cx1, cw1, _ = buf.combine(rx, handle)
        step(buf, "combine2")
        dests = m.sum(1).astype(np.float32)
        assert cw1 is None
        same_rows("combine without weights", r, bf2f(bits(cx1)), bf2f(x) * dests[:, None], m,
                  (buf, lambda: bf2f(bits(cx1))))

        # Cached dispatch: same routing, new values.
        x2 = f2bf(bf2f(x) + 1)
        out = buf.dispatch(to_bf16(torch, x2, DEV), handle=handle)
        step(buf, "cached")
        assert out[1:5] == (None, None, None, None)
        ref2 = reference_recv(r, world, [(f2bf(bf2f(a[0]) + 1), a[1], a[2]) for a in all_in])[0]
        same_rows("cached dispatch", r, bits(out[0]), ref2, again=(buf, lambda: bits(out[0])))

        *_, counts8, h8, _ = buf.dispatch(xt, topk_idx=it, topk_weights=wt, expert_alignment=8)
        step(buf, "align8")
        assert counts8 == reference_recv(r, world, all_in, alignment=8)[3], counts8
        del h8

        # num_worst_tokens: no host synchronisation, fixed rows; the received rows come first.
        worst = sum(tokens[:world])
        wx, wi, ww, wcounts, wh, _ = buf.dispatch(xt, topk_idx=it, topk_weights=wt,
                                                  num_worst_tokens=worst)
        step(buf, "worst")
        n = ref_x.shape[0]
        assert tuple(wx.shape) == (worst, H) and wcounts == []
        assert np.array_equal(bits(wx)[:n], ref_x) and np.array_equal(host(wi).numpy()[:n], ref_i)
        assert np.array_equal(host(ww).numpy()[:n], ref_w)
        wcx, _, _ = buf.combine(wx, wh)
        step(buf, "worst-combine")
        same_rows("worst combine", r, bf2f(bits(wcx)), bf2f(x) * dests[:, None], m,
                  (buf, lambda: bf2f(bits(wcx))))
        buf.sync()
    finally:
        buf.destroy()
    return "ok"


def normal_fp8(group, r, world, **buf_kw):
    all_in = [inputs(s, world, salt=1, tokens=TOKENS) for s in range(world)]
    fp8 = []
    for s in range(world):
        g = np.random.default_rng(7 * 7 + s)
        t = TOKENS[s]
        fp8.append((g.integers(0, 256, size=(t, H)).astype(np.uint8),
                    g.random((t, H // 128), dtype=np.float32)))
    x, idx, w = all_in[r]
    xq = tdev(fp8[r][0]).view(torch.float8_e4m3fn)
    xs = tdev(fp8[r][1])
    buf = make_buffer(group, world, dispatch_dtype="fp8", **buf_kw)
    try:
        (rxq, rxs), ri, rw, counts, handle, _ = buf.dispatch((xq, xs), topk_idx=tdev(idx),
                                                             topk_weights=tdev(w))
        step(buf, "fp8-dispatch")
        want_q = np.concatenate([fp8[s][0][dest_ranks(all_in[s][1], world)[:, r]]
                                 for s in range(world)])
        want_s = np.concatenate([fp8[s][1][dest_ranks(all_in[s][1], world)[:, r]]
                                 for s in range(world)])
        assert rxq.dtype == torch.float8_e4m3fn and np.array_equal(bits(rxq), want_q)
        assert np.array_equal(host(rxs).numpy(), want_s)
        _, ref_i, ref_w, ref_counts = reference_recv(r, world, all_in)
        assert np.array_equal(host(ri).numpy(), ref_i) and counts == ref_counts
        back = torch.full((rxq.shape[0], H), 0.5, dtype=torch.bfloat16, device=DEV)
        cx, _, _ = buf.combine(back, handle)
        step(buf, "fp8-combine")
        m = dest_ranks(idx, world)
        dests = m.sum(1).astype(np.float32)
        same_rows("fp8 combine", r, bf2f(bits(cx)), np.repeat(0.5 * dests[:, None], H, axis=1), m,
                  (buf, lambda: bf2f(bits(cx))))
        buf.sync()
    finally:
        buf.destroy()
    return "ok"


def low_latency(group, r, world, tokens=TOKENS):
    all_in = [inputs(s, world, salt=2, tokens=tokens) for s in range(world)]
    x, idx, w = all_in[r]
    xt, it, wt = to_bf16(torch, x, DEV), tdev(idx), tdev(w)
    e_all = L * world
    ref_x, ref_cnt, ref_src, ref_rank, ref_range = ll_reference(r, world, all_in)
    buf = make_buffer(group, world, low_latency_mode=True,
                      num_max_dispatch_tokens_per_rank=MAX_LL)
    checked = []
    try:
        stats = torch.zeros(L, dtype=torch.int32, device=DEV)
        # Plain, with the receive hook, plain, asynchronous (an event; the stats updated on the
        # comm stream).
        for hooked, async_ in _LL_MODES:
            rx, cnt, handle, ev, hook = buf.low_latency_dispatch(
                xt, it, MAX_LL, e_all, cumulative_local_expert_recv_stats=stats, use_fp8=False,
                return_recv_hook=hooked, async_finish=async_)
            assert isinstance(handle, LowLatencyHandle) and (hook is not None) == hooked
            assert (ev.event is not None) == async_
            if hooked:
                hook()
            ev.current_stream_wait()
            c = host(cnt).tolist()
            assert c == ref_cnt.tolist(), (c, ref_cnt)
            got = bits(rx)
            for e in range(L):
                n = c[e]
                assert np.array_equal(got[e, :n], ref_x[e, :n]), f"LL recv_x expert {e}"
                assert np.array_equal(host(handle.src_idx[e, :n]).numpy(), ref_src[e, :n])
                assert np.array_equal(host(handle.src_rank[e, :n]).numpy(), ref_rank[e, :n])
            lr = host(handle.layout_range).numpy()
            assert np.array_equal(lr & 0xFFFFFFFF, ref_range & 0xFFFFFFFF), (lr, ref_range)
            has = (ref_range & 0xFFFFFFFF) > 0
            assert np.array_equal((lr >> 32)[has], (ref_range >> 32)[has]), (lr, ref_range)
            mult = torch.arange(1, L + 1, device=DEV, dtype=torch.float32)[:, None, None]
            y = (rx.float() * mult).to(torch.bfloat16)
            out = torch.empty((x.shape[0], H), dtype=torch.bfloat16, device=DEV)
            cx, ev, chook = buf.low_latency_combine(y, it, wt, handle, return_recv_hook=hooked,
                                                    out=out, async_finish=async_)
            assert cx is out and (chook is not None) == hooked
            if hooked:
                chook()
            ev.current_stream_wait()
            assert np.array_equal(bits(cx), ll_combine_want(x, idx, w)), \
                f"LL combine (hook {hooked}, async {async_})"
            checked.append((hooked, async_))
        assert host(stats).tolist() == (4 * ref_cnt).tolist(), (stats, ref_cnt)
        buf.sync()
        buf.clean_low_latency_buffer(MAX_LL, H, e_all)
        rx, cnt, handle, _, _ = buf.low_latency_dispatch(xt, it, MAX_LL, e_all, use_fp8=False)
        assert host(cnt).tolist() == ref_cnt.tolist()
        buf.sync()
    finally:
        buf.destroy()
    return checked


def low_latency_fp8(group, r, world):
    all_in = [inputs(s, world, salt=2, tokens=TOKENS) for s in range(world)]
    x, idx, w = all_in[r]
    ref_x, ref_cnt, *_ = ll_reference(r, world, all_in)
    buf = make_buffer(group, world, low_latency_mode=True, dispatch_dtype="fp8",
                      num_max_dispatch_tokens_per_rank=MAX_LL)
    try:
        (q, sc), cnt, handle, _, _ = buf.low_latency_dispatch(
            to_bf16(torch, x, DEV), tdev(idx), MAX_LL, L * world, use_fp8=True)
        assert q.dtype == torch.float8_e4m3fn and tuple(sc.shape) == (L, world * MAX_LL, H // 128)
        c = host(cnt).tolist()
        assert c == ref_cnt.tolist()
        deq = e4m3_to_f32(bits(q)) * np.repeat(host(sc).numpy(), 128, axis=2)
        ref = bf2f(ref_x)
        amax = np.repeat(np.abs(ref).reshape(L, -1, H // 128, 128).max(3), 128, axis=2)
        for e in range(L):
            n = c[e]
            assert np.all(np.abs(deq[e, :n] - ref[e, :n]) <= amax[e, :n] / 16 + 1e-6), e
        buf.sync()
    finally:
        buf.destroy()
    return "ok"


def streams_and_events(group, r, world):
    """DeepEP's stream options: previous_event, async_finish (an EventOverlap with a
    torch.cuda.Event), allocate_on_comm_stream; results equal the synchronous call's."""
    all_in = [inputs(s, world, tokens=TOKENS) for s in range(world)]
    x, idx, w = all_in[r]
    xt, it, wt = to_bf16(torch, x, DEV), tdev(idx), tdev(w)
    buf = make_buffer(group, world)
    try:
        comm = buf.get_comm_stream()
        assert isinstance(comm, torch.cuda.Stream) and comm.cuda_stream != 0
        assert comm.cuda_stream != torch.cuda.current_stream().cuda_stream
        ref_x = reference_recv(r, world, all_in)[0]
        prev = EventOverlap(torch.cuda.Event())
        prev.event.record()
        # DeepEP's documented training call: the layout on the comm stream after an event, its
        # outputs and its event passed to the dispatch, everything asynchronous.
        per_rank, per_rdma, per_expert, in_rank, lev = buf.get_dispatch_layout(
            it, L * world, previous_event=prev, async_finish=True, allocate_on_comm_stream=True)
        rx, ri, rw, _, handle, ev = buf.dispatch(
            xt, topk_idx=it, topk_weights=wt, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, previous_event=lev, async_finish=True,
            allocate_on_comm_stream=True)
        assert isinstance(ev.event, torch.cuda.Event) and ev.extra_tensors is None
        assert torch.cuda.current_stream().cuda_stream != comm.cuda_stream  # restored
        ev.current_stream_wait()
        assert np.array_equal(bits(rx), ref_x)
        assert np.array_equal(host(per_rank).numpy(), dest_ranks(idx, world).sum(0))
        cx, _, ev2 = buf.combine(rx, handle, async_finish=True, previous_event=ev)
        with ev2:
            pass  # __exit__ makes the current stream wait
        dests = dest_ranks(idx, world).sum(1).astype(np.float32)
        assert np.array_equal(bf2f(bits(cx)), bf2f(x) * dests[:, None])
        with raises(ValueError, match="^allocate_on_comm_stream=True: needs"):
            buf.dispatch(xt, topk_idx=it, topk_weights=wt, allocate_on_comm_stream=True)
        buf.sync()
    finally:
        buf.destroy()
    # Tensors recorded on the comm stream freed after the Buffer is gone: torch's allocator
    # records an event on that stream now, so it must still exist (Stream::kept).
    del rx, ri, rw, cx, xt, it, wt, per_rank, per_expert, in_rank
    torch.cuda.synchronize()
    return "ok"


def bad_arguments(group, r, world):
    all_in = [inputs(s, world, tokens=TOKENS) for s in range(world)]
    x, idx, w = all_in[r]
    xt, it, wt = to_bf16(torch, x, DEV), tdev(idx), tdev(w)
    buf = make_buffer(group, world, low_latency_mode=True, num_max_dispatch_tokens_per_rank=MAX_LL)
    try:
        def refused(exc, match, fn, *a, **kw):
            with raises(exc, match=match):
                fn(*a, **kw)

        refused(ValueError, "^x: tensor is on cpu", buf.dispatch, xt.cpu(), topk_idx=it,
                topk_weights=wt)
        refused(TypeError, "^x: expected a torch CUDA tensor", buf.dispatch, x, topk_idx=it,
                topk_weights=wt)
        refused(TypeError, "^topk_idx: dtype torch.int32", buf.dispatch, xt,
                topk_idx=it.to(torch.int32), topk_weights=wt)
        refused(ValueError, r"^topk_weights: shape \[", buf.dispatch, xt, topk_idx=it,
                topk_weights=wt[:, :1].contiguous())
        wide = torch.zeros((x.shape[0], 2 * H), dtype=torch.bfloat16, device=DEV)
        refused(ValueError, "^x: must be contiguous", buf.dispatch, wide[:, ::2], topk_idx=it,
                topk_weights=wt)
        refused(TypeError, "^x: fp8 tokens on a Buffer built with dispatch_dtype='bf16'",
                buf.dispatch, (xt.view(torch.uint8)[:, :H].contiguous().view(torch.float8_e4m3fn),
                               torch.ones((x.shape[0], H // 128), device=DEV)), topk_idx=it,
                topk_weights=wt)
        refused(ValueError, "^use_fp8=True: ", buf.low_latency_dispatch, xt, it, MAX_LL, L * world)
        refused(ValueError, "^round_scale=True", buf.low_latency_dispatch, xt, it, MAX_LL,
                L * world, use_fp8=False, round_scale=True)
        refused(TypeError, "^previous_event: expected an EventOverlap", buf.dispatch, xt,
                topk_idx=it, topk_weights=wt, previous_event=torch.cuda.Event())
        # The buffer still works after every refusal (nothing reached the library).
        rx, *_ = buf.dispatch(xt, topk_idx=it, topk_weights=wt)
        assert np.array_equal(bits(rx), reference_recv(r, world, all_in)[0])
        buf.sync()
    finally:
        buf.destroy()
    return "ok"


def legacy_stream_refused(group, r, world):
    buf = make_buffer(group, world)
    try:
        x, idx, w = inputs(r, world, tokens=TOKENS)
        with torch.cuda.stream(torch.cuda.default_stream()):
            with raises(ValueError, match="^stream: the current stream is the legacy"):
                buf.dispatch(to_bf16(torch, x, DEV), topk_idx=tdev(idx), topk_weights=tdev(w))
    finally:
        buf.destroy()
    return "ok"


def auto_backend(group, r, world):
    b = Buffer(group, num_experts=L, hidden=H, num_topk=K, explicitly_destroy=True)
    try:
        got = (b.backend, isinstance(b.get_comm_stream(), torch.cuda.Stream))
    finally:
        b.destroy()
    assert fabric_ep.ThreadGroup.create(1)[0].all_gather_bytes(b"ab") == [b"ab"]
    return got


def zero_token_rank(group, r, world):
    """A rank with no tokens (DeepEP allows it): rank 1 of world 2 sends nothing."""
    tokens = [24, 0]
    normal_bf16(group, r, world, tokens=tokens)
    return low_latency(group, r, world, tokens=tokens)


def normal_bf16_equal_tokens(group, r, world):
    """normal_bf16 with the same token count on every rank (the Rust tests' shape), beside the
    default uneven counts."""
    return normal_bf16(group, r, world, tokens=[24] * 4)


# DeepEP's internode hierarchy (2 simulated nodes of world / 2 ranks; the rail stage between them
# through the proxy lane over shm): the same checks as the direct path (the test values make the
# node-grouped combine exact).
HIER = dict(ranks_per_node=None, internode_hierarchy=True, provider="shm")


def normal_hier_bf16(group, r, world):
    return normal_bf16(group, r, world, **dict(HIER, ranks_per_node=world // 2))


def normal_hier_fp8(group, r, world):
    return normal_fp8(group, r, world, **dict(HIER, ranks_per_node=world // 2))


def ll_deepep_args(group, r, world):
    """DeepEP's further low-latency arguments on the GPU backend: the receive wait costs
    (``[R]`` int64 on the device, ns; a rank that launches late shows up in the others'), the
    hook adding them only when it runs, ``use_logfmt`` (accepted: bf16, the same result),
    ``get_local_buffer_tensor`` (torch CUDA views of the normal comm buffer and the
    low-latency buffer, holding the rows that arrived)."""
    late, delay = 1, 0.3
    all_in = [inputs(s, world, salt=6, tokens=TOKENS) for s in range(world)]
    x, idx, w = all_in[r]
    xt, it, wt = to_bf16(torch, x, DEV), tdev(idx), tdev(w)
    e_all = L * world
    ref_x, ref_cnt, *_ = ll_reference(r, world, all_in)
    buf = make_buffer(group, world, low_latency_mode=True,
                      num_max_dispatch_tokens_per_rank=MAX_LL)
    try:
        i64 = dict(dtype=torch.int64, device=DEV)
        mult = torch.arange(1, L + 1, device=DEV, dtype=torch.float32)[:, None, None]
        # Warm-up (first launches), then timed.
        rx, _, handle, _, _ = buf.low_latency_dispatch(xt, it, MAX_LL, e_all, use_fp8=False)
        buf.low_latency_combine((rx.float() * mult).to(torch.bfloat16), it, wt, handle)
        buf.sync()
        ds, cs = torch.zeros(world, **i64), torch.zeros(world, **i64)
        call_raises(ValueError, "^dispatch_wait_recv_cost_stats: shape", buf.low_latency_dispatch, xt,
                    it, MAX_LL, e_all, use_fp8=False,
                    dispatch_wait_recv_cost_stats=torch.zeros(world + 1, **i64))
        call_raises(TypeError, "^dispatch_wait_recv_cost_stats: dtype", buf.low_latency_dispatch, xt,
                    it, MAX_LL, e_all, use_fp8=False,
                    dispatch_wait_recv_cost_stats=torch.zeros(world, dtype=torch.int32, device=DEV))
        if r == late:
            time.sleep(delay)
        rx, cnt, handle, _, hook = buf.low_latency_dispatch(
            xt, it, MAX_LL, e_all, use_fp8=False, dispatch_wait_recv_cost_stats=ds,
            return_recv_hook=True)
        torch.cuda.current_stream().synchronize()
        before = host(ds).tolist()
        hook()
        assert host(cnt).tolist() == ref_cnt.tolist()
        got = bits(rx)
        for e in range(L):
            assert np.array_equal(got[e, :ref_cnt[e]], ref_x[e, :ref_cnt[e]]), e
        y = (rx.float() * mult).to(torch.bfloat16)
        if r == late:
            time.sleep(delay)
        cx, _, _ = buf.low_latency_combine(y, it, wt, handle, combine_wait_recv_cost_stats=cs)
        assert np.array_equal(bits(cx), ll_combine_want(x, idx, w))
        d, c = host(ds).tolist(), host(cs).tolist()
        assert before == [0] * world, before  # added by the receive, which the hook launched
        assert all(v >= 0 for v in d + c) and sum(d) > 0 and sum(c) > 0, (d, c)
        if world > 1 and r != late:
            floor = L * 0.5 * delay * 1e9
            for what, v in (("dispatch", d), ("combine", c)):
                assert v[late] >= floor and all(v[late] > 2 * v[o] for o in range(world)
                                                 if o != late), (what, v)
        # use_logfmt: accepted, bf16 on the wire: the same result.
        rx, _, handle, _, _ = buf.low_latency_dispatch(xt, it, MAX_LL, e_all, use_fp8=False)
        lx, _, _ = buf.low_latency_combine((rx.float() * mult).to(torch.bfloat16), it, wt,
                                           handle, use_logfmt=True)
        assert np.array_equal(bits(lx), ll_combine_want(x, idx, w))
        # get_local_buffer_tensor(use_rdma_buffer=True): the low-latency buffer, on the device,
        # with this dispatch's received rows in it.
        region = buf.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True)
        assert region.is_cuda and region.get_device() == DEV and region.dim() == 1
        blob = host(region).numpy().tobytes()
        got = bits(rx)
        rows = [got[e, i] for e in range(L) for i in range(int(ref_cnt[e]))]
        assert all(blob.find(row.tobytes()) >= 0 for row in rows), "rows not in the LL buffer"
        words = buf.get_local_buffer_tensor(torch.int32, size=(2, 3), offset=64,
                                            use_rdma_buffer=True)
        assert tuple(words.shape) == (2, 3) and words.data_ptr() == region.data_ptr() + 64
        call_raises(ValueError, "^size: ", buf.get_local_buffer_tensor, torch.uint8,
                    (region.numel() + 1,), 0, True)
        call_raises(ValueError, "^offset: ", buf.get_local_buffer_tensor, torch.int32, None, 2, True)
        call_raises(TypeError, "^dtype: ", buf.get_local_buffer_tensor, np.uint8, None, 0, True)
        buf.sync()
    finally:
        buf.destroy()
    # The normal comm buffer: a dispatch's rows land there.
    nb = make_buffer(group, world)
    try:
        rx, _, _, _, h, _ = nb.dispatch(xt, topk_idx=it, topk_weights=wt)
        comm = nb.get_local_buffer_tensor(torch.uint8)
        assert comm.is_cuda and comm.numel() > 0
        blob = host(comm).numpy().tobytes()
        got = bits(rx)
        # (Rows from peers are written there as chunks by their senders; at least those must be
        # found. A rank's own rows skip the buffer: copied from x into recv_x directly.)
        found = sum(blob.find(row.tobytes()) >= 0 for row in got)
        # Before any rank combines (its chunks reuse the slots); no kernel runs here.
        group.all_gather_bytes(b"")
        assert world == 1 or got.shape[0] == 0 or found > 0, "no received row in the comm buffer"
        nb.combine(rx, h)
        nb.sync()
    finally:
        nb.destroy()
    return "ok"


# The low-latency cases' iterations, (hooked, async_finish) each (low_latency).
_LL_MODES = [(False, False), (True, False), (False, False), (False, True)]

# name -> (per-rank function, what each rank must return)
CASES = {
    "normal_bf16": (normal_bf16, "ok"),
    "normal_bf16_equal_tokens": (normal_bf16_equal_tokens, "ok"),
    "normal_fp8": (normal_fp8, "ok"),
    "normal_hier_bf16": (normal_hier_bf16, "ok"),
    "normal_hier_fp8": (normal_hier_fp8, "ok"),
    "low_latency": (low_latency, _LL_MODES),
    "low_latency_fp8": (low_latency_fp8, "ok"),
    "streams_and_events": (streams_and_events, "ok"),
    "bad_arguments": (bad_arguments, "ok"),
    "legacy_stream_refused": (legacy_stream_refused, "ok"),
    "auto_backend": (auto_backend, ("gpu", True)),
    "zero_token_rank": (zero_token_rank, _LL_MODES),
    "ll_deepep_args": (ll_deepep_args, "ok"),
}


def main(argv):
    case, world = argv[0], int(argv[1])
    fn, want = CASES[case]
    try:
        got = run_ranks(world, fn)
        assert got == [want] * world, f"ranks returned {got}, expected {[want] * world}"
    except BaseException:  # noqa: BLE001 - reported, then the exit status says it
        print(f"CASE {case} world {world} FAILED\n{traceback.format_exc()}", flush=True)
        return 1
    print(f"CASE {case} world {world} PASSED (torch helper: {fabric_ep.native_status()})",
          flush=True)
    return 0


if __name__ == "__main__":
    rc = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
