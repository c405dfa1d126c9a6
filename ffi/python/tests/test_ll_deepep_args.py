"""DeepEP's low-latency arguments beyond the plain call, on the host backend with ranks as
threads of one process (a ThreadGroup stands in for the process group): the per-rank receive
wait costs (``dispatch_wait_recv_cost_stats`` / ``combine_wait_recv_cost_stats``),
``use_logfmt``, ``get_local_buffer_tensor`` and shrink mode (``enable_shrink`` with
``low_latency_update_mask_buffer`` / ``query`` / ``clean``). Data is checked against the numpy
reference of tests/_rank.py."""

import threading
import time

import numpy as np
import pytest

import fabric_ep
from fabric_ep import Buffer

import _rank
from _rank import L, bf2f, f2bf, inputs, ll_combine_want, ll_reference

H, K, M = _rank.H, _rank.K, _rank.MAX_LL


def run_threads(n, body, timeout=120.0):
    """Runs ``body(group, rank)`` on ``n`` rank threads; returns their results (re-raising the
    first failure)."""
    groups = fabric_ep.ThreadGroup.create(n, timeout_s=60.0)
    out = [None] * n

    def one(g):
        try:
            out[g.rank()] = body(g, g.rank())
        except BaseException as e:  # noqa: BLE001 - reported below
            out[g.rank()] = e

    ts = [threading.Thread(target=one, args=(g,)) for g in groups]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    assert not any(t.is_alive() for t in ts), "a rank thread hung"
    bad = [(r, o) for r, o in enumerate(out) if isinstance(o, BaseException)]
    if bad:
        # A rank that fails leaves its peers waiting (they time out): the first failure in
        # time is the cause, so every rank's is reported.
        raise AssertionError("; ".join(f"rank {r} failed: {o!r}" for r, o in bad)) from bad[0][1]
    return out


def make(g, **kw):
    kw.setdefault("timeout_s", 20.0)
    return Buffer(g, 0, 0, True, backend="host", provider="shm", explicitly_destroy=True,
                  num_max_dispatch_tokens_per_rank=M, **kw)


def expert_outputs(rx, r):
    """Rank ``r``'s experts answer their rows times (local expert + 1)."""
    y = np.zeros(rx.shape, np.uint16)
    for e in range(L):
        y[e] = f2bf(bf2f(rx[e]) * (e + 1))
    return y


def without(all_in, masked):
    """The inputs as the ranks in ``masked`` did not send (no tokens)."""
    return [(x[:0], i[:0], w[:0]) if s in masked else (x, i, w)
            for s, (x, i, w) in enumerate(all_in)]


def owners_masked(idx, masked):
    """``idx`` with the entries of experts on ``masked`` ranks set to -1 (DeepEP's combine)."""
    out = idx.copy()
    for s in masked:
        out[(idx >= 0) & (idx // L == s)] = -1
    return out


# ---------------------------------------------------------------- wait costs

def test_wait_recv_cost_stats_localise_the_rank_that_is_late():
    n, late, delay = 3, 1, 0.5
    all_in = [inputs(s, n, salt=11, tokens=[9, 12, 7]) for s in range(n)]

    def body(g, r):
        buf = make(g)
        e_all = L * n
        x, idx, w = all_in[r]
        try:
            # The first call connects the lane (a collective); the timed calls come after it.
            rx, _, h, _, _ = buf.low_latency_dispatch(x, idx, M, e_all, use_fp8=False)
            buf.low_latency_combine(expert_outputs(rx, r), idx, w, h)
            ds = np.zeros(n, np.int64)
            if r == late:
                time.sleep(delay)
            rx, cnt, h, _, hook = buf.low_latency_dispatch(
                x, idx, M, e_all, use_fp8=False, dispatch_wait_recv_cost_stats=ds,
                return_recv_hook=True)
            before = ds.copy()
            hook()
            ref = ll_reference(r, n, all_in)
            assert np.array_equal(rx, ref[0]) and cnt.tolist() == ref[1].tolist()
            cs = np.zeros(n, np.int64)
            y = expert_outputs(rx, r)
            if r == late:
                time.sleep(delay)
            cx, _, _ = buf.low_latency_combine(y, idx, w, h, combine_wait_recv_cost_stats=cs)
            assert np.array_equal(cx, ll_combine_want(x, idx, w))
            again = ds.copy()
            rx, _, h, _, _ = buf.low_latency_dispatch(x, idx, M, e_all, use_fp8=False,
                                                      dispatch_wait_recv_cost_stats=ds)
            return before, again, ds.copy(), cs
        finally:
            buf.destroy()

    for r, (before, first, accumulated, cs) in enumerate(run_threads(n, body)):
        # Added by the receive (the hook), not by the send.
        assert before.tolist() == [0] * n, (r, before)
        assert (accumulated >= first).all() and (accumulated > first).any(), (r, first,
                                                                             accumulated)
        if r == late:
            continue
        # One wait per (local expert, source): the late rank's L messages each came about
        # `delay` after this rank started waiting; the others' well before.
        for what, s in (("dispatch", first), ("combine", cs)):
            assert s[late] >= L * 0.6 * delay * 1e9, (r, what, s)
            assert all(s[late] > 2 * s[o] for o in range(n) if o != late), (r, what, s)


def test_wait_recv_cost_stats_are_checked_naming_the_argument():
    def body(g, r):
        buf = make(g)
        x, idx, w = inputs(r, 2, salt=12, tokens=[4, 4])
        try:
            for name, bad, exc in (
                    ("dispatch_wait_recv_cost_stats", np.zeros(3, np.int64), ValueError),
                    ("dispatch_wait_recv_cost_stats", np.zeros(2, np.int32), TypeError),
                    ("dispatch_wait_recv_cost_stats", np.zeros((2, 2), np.int64), ValueError),
                    ("dispatch_wait_recv_cost_stats", [0, 0], TypeError)):
                with pytest.raises(exc, match=f"^{name}: "):
                    buf.low_latency_dispatch(x, idx, M, L * 2, use_fp8=False, **{name: bad})
            ro = np.zeros(2, np.int64)
            ro.flags.writeable = False
            with pytest.raises(ValueError, match="^dispatch_wait_recv_cost_stats: a read-only"):
                buf.low_latency_dispatch(x, idx, M, L * 2, use_fp8=False,
                                         dispatch_wait_recv_cost_stats=ro)
            rx, _, h, _, _ = buf.low_latency_dispatch(x, idx, M, L * 2, use_fp8=False)
            with pytest.raises(ValueError, match="^combine_wait_recv_cost_stats: "):
                buf.low_latency_combine(rx, idx, w, h,
                                        combine_wait_recv_cost_stats=np.zeros(1, np.int64))
            buf.low_latency_combine(rx, idx, w, h)
        finally:
            buf.destroy()

    run_threads(2, body)


# ---------------------------------------------------------------- use_logfmt

def test_use_logfmt_is_accepted_and_combines_in_bf16():
    n = 2
    all_in = [inputs(s, n, salt=13, tokens=[10, 6]) for s in range(n)]

    def body(g, r):
        buf = make(g)
        x, idx, w = all_in[r]
        try:
            outs = []
            for logfmt in (False, True):
                rx, _, h, _, _ = buf.low_latency_dispatch(x, idx, M, L * n, use_fp8=False)
                cx, _, _ = buf.low_latency_combine(expert_outputs(rx, r), idx, w, h,
                                                   use_logfmt=logfmt)
                outs.append(cx)
            return outs, ll_combine_want(x, idx, w)
        finally:
            buf.destroy()

    for plain, logfmt, want in (o[0] + [o[1]] for o in run_threads(n, body)):
        assert np.array_equal(plain, want) and np.array_equal(logfmt, want)


# ---------------------------------------------------------------- get_local_buffer_tensor

def test_get_local_buffer_tensor_views_the_registered_memory():
    n = 2
    all_in = [inputs(s, n, salt=14, tokens=[5, 8]) for s in range(n)]

    def body(g, r):
        buf = make(g, num_experts=L * n, hidden=H, num_topk=K)
        x, idx, w = all_in[r]
        try:
            with pytest.raises(RuntimeError, match="low-latency buffer on the first"):
                buf.get_local_buffer_tensor(np.uint8, use_rdma_buffer=True)
            nvl = buf.get_local_buffer_tensor(np.uint8)
            assert nvl.dtype == np.uint8 and nvl.ndim == 1 and nvl.size > 0
            # Normal mode: the rows peers sent this rank land in the region.
            rx, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                                  num_tokens_per_expert=np.zeros(L * n, np.int32))
            region = nvl.tobytes()
            assert rx.shape[0] > 0
            missing = [i for i, row in enumerate(rx) if region.find(row.tobytes()) < 0]
            # Before any rank combines: its chunks go to the same slots (DeepEP's contract too:
            # the next call overwrites the region).
            g.all_gather_bytes(b"")
            assert not missing, f"rows {missing} of {rx.shape[0]} not in the region"
            buf.combine(rx, handle)
            # Low latency: its own buffer (both sets), with the dispatched rows in it.
            lrx, cnt, lh, _, _ = buf.low_latency_dispatch(x, idx, M, L * n, use_fp8=False)
            rdma = buf.get_local_buffer_tensor(np.uint8, use_rdma_buffer=True)
            assert not np.shares_memory(rdma, nvl)
            blob = rdma.tobytes()
            rows = [lrx[e, i] for e in range(L) for i in range(int(cnt[e]))]
            assert rows and all(blob.find(row.tobytes()) >= 0 for row in rows)
            # Typed, shaped and offset views of the same memory.
            words = buf.get_local_buffer_tensor(np.int32, size=(3, 4), offset=16,
                                                use_rdma_buffer=True)
            assert words.shape == (3, 4)
            assert np.array_equal(words.reshape(-1).view(np.uint8), rdma[16:16 + 48])
            words[0, 0] = 0x01020304  # a real view: the bytes change underneath
            assert rdma[16:20].tolist() == [4, 3, 2, 1]
            whole = buf.get_local_buffer_tensor(np.uint16, use_rdma_buffer=True)
            assert whole.size == rdma.size // 2
            for kw, exc, name in (
                    (dict(offset=rdma.size + 2), ValueError, "offset"),
                    (dict(offset=-2), ValueError, "offset"),
                    (dict(offset=1), ValueError, "offset"),
                    (dict(size=(rdma.size,)), ValueError, "size"),
                    (dict(size="x"), TypeError, "size"),
                    (dict(offset=1.5), TypeError, "offset")):
                with pytest.raises(exc, match=f"^{name}: "):
                    buf.get_local_buffer_tensor(np.uint16, use_rdma_buffer=True, **kw)
            with pytest.raises(TypeError, match="^dtype: "):
                buf.get_local_buffer_tensor("not-a-dtype", use_rdma_buffer=True)
            with pytest.raises(TypeError, match="^use_rdma_buffer: "):
                buf.get_local_buffer_tensor(np.uint8, use_rdma_buffer=1)
            buf.low_latency_combine(expert_outputs(lrx, r), idx, w, lh)
            buf.clean_low_latency_buffer(M, H, L * n)
            return nvl.size, rdma.size
        finally:
            buf.destroy()

    sizes = run_threads(n, body)
    assert sizes[0] == sizes[1]


def test_get_local_buffer_tensor_before_any_native_buffer():
    def body(g, r):
        buf = make(g)
        try:
            with pytest.raises(RuntimeError, match="no normal-mode native buffer yet"):
                buf.get_local_buffer_tensor(np.uint8)
        finally:
            buf.destroy()

    run_threads(2, body)


# ---------------------------------------------------------------- shrink mode

def test_shrink_masks_a_rank_that_stops_and_skips_it_afterwards():
    n, gone, timeout = 4, 2, 2.0
    all_in = [inputs(s, n, salt=15, tokens=[11, 9, 13, 6]) for s in range(n)]
    left = threading.Event()

    def body(g, r):
        buf = make(g, enable_shrink=True, timeout_s=timeout)
        e_all = L * n
        x, idx, w = all_in[r]
        mask = np.zeros(n, np.int32)
        try:
            # Everybody, once: nothing masked.
            rx, cnt, h, _, _ = buf.low_latency_dispatch(x, idx, M, e_all, use_fp8=False)
            assert np.array_equal(rx, ll_reference(r, n, all_in)[0])
            cx, _, _ = buf.low_latency_combine(expert_outputs(rx, r), idx, w, h)
            assert np.array_equal(cx, ll_combine_want(x, idx, w))
            if r == gone:
                left.wait(60)  # stops taking part, as a rank that failed
                return None
            # Rank `gone` sends nothing: the dispatch waits the timeout for it, masks it and
            # returns what the others sent.
            ds = np.zeros(n, np.int64)
            t0 = time.monotonic()
            rx, cnt, h, _, _ = buf.low_latency_dispatch(x, idx, M, e_all, use_fp8=False,
                                                        dispatch_wait_recv_cost_stats=ds)
            first = time.monotonic() - t0
            ref = ll_reference(r, n, without(all_in, {gone}))
            assert cnt.tolist() == ref[1].tolist() and np.array_equal(rx, ref[0])
            assert np.array_equal(h.layout_range, ref[4])
            assert ds[gone] >= L * 0.8 * timeout * 1e9, ds
            buf.low_latency_query_mask_buffer(mask)
            assert mask.tolist() == [int(s == gone) for s in range(n)]
            # The combine leaves the masked rank's experts out of the sum.
            cx, _, _ = buf.low_latency_combine(expert_outputs(rx, r), idx, w, h)
            assert np.array_equal(cx, ll_combine_want(x, owners_masked(idx, {gone}), w))
            # Later calls skip it without waiting.
            t0 = time.monotonic()
            rx, cnt, h, _, hook = buf.low_latency_dispatch(x, idx, M, e_all, use_fp8=False,
                                                           return_recv_hook=True)
            hook()
            cx, _, _ = buf.low_latency_combine(expert_outputs(rx, r), idx, w, h)
            assert time.monotonic() - t0 < timeout / 2
            assert np.array_equal(cx, ll_combine_want(x, owners_masked(idx, {gone}), w))
            # clean among the unmasked ranks (the masked one does not take part), then on.
            buf.clean_low_latency_buffer(M, H, e_all)
            rx, cnt, h, _, _ = buf.low_latency_dispatch(x, idx, M, e_all, use_fp8=False)
            assert np.array_equal(rx, ref[0])
            buf.low_latency_combine(expert_outputs(rx, r), idx, w, h)
            # Unmasking it: refused until clean, which masks it again (it does not answer).
            buf.low_latency_update_mask_buffer(gone, False)
            buf.low_latency_query_mask_buffer(mask)
            assert mask.tolist() == [0] * n
            with pytest.raises(fabric_ep.FabricEPError, match="unmasked"):
                buf.low_latency_dispatch(x, idx, M, e_all, use_fp8=False)
            buf.clean_low_latency_buffer(M, H, e_all)
            buf.low_latency_query_mask_buffer(mask)
            assert mask.tolist() == [int(s == gone) for s in range(n)]
            rx, cnt, h, _, _ = buf.low_latency_dispatch(x, idx, M, e_all, use_fp8=False)
            assert np.array_equal(rx, ref[0]) and first >= 0.8 * timeout
            return True
        finally:
            if r != gone:
                survivors.wait(60)  # every survivor is done before `gone` comes back
                left.set()
            buf.destroy()  # collective: `gone` too

    survivors = threading.Barrier(n - 1)
    out = run_threads(n, body, timeout=180)
    assert out[gone] is None and all(out[r] for r in range(n) if r != gone)


def test_shrink_masked_ranks_get_no_sends_and_are_not_waited_for():
    """Ranks 0, 1, 2 mask rank 3 and rank 3 masks them: two groups that go on apart, each
    getting exactly its own group's rows, with no timeout."""
    n = 4
    all_in = [inputs(s, n, salt=16, tokens=[7, 10, 5, 12]) for s in range(n)]

    def body(g, r):
        buf = make(g, enable_shrink=True, timeout_s=30.0)
        e_all = L * n
        x, idx, w = all_in[r]
        try:
            others = {3} if r != 3 else {0, 1, 2}
            for s in others:
                buf.low_latency_update_mask_buffer(s, True)
            mask = np.zeros(n, np.int32)
            buf.low_latency_query_mask_buffer(mask)
            assert mask.tolist() == [int(s in others) for s in range(n)]
            t0 = time.monotonic()
            for hooked in (False, True):
                rx, cnt, h, _, hook = buf.low_latency_dispatch(x, idx, M, e_all, use_fp8=False,
                                                               return_recv_hook=hooked)
                if hooked:
                    hook()
                ref = ll_reference(r, n, without(all_in, others))
                assert cnt.tolist() == ref[1].tolist() and np.array_equal(rx, ref[0])
                cx, _, _ = buf.low_latency_combine(expert_outputs(rx, r), idx, w, h)
                assert np.array_equal(cx, ll_combine_want(x, owners_masked(idx, others), w))
            buf.clean_low_latency_buffer(M, H, e_all)
            rx, cnt, h, _, _ = buf.low_latency_dispatch(x, idx, M, e_all, use_fp8=False)
            assert np.array_equal(rx, ll_reference(r, n, without(all_in, others))[0])
            buf.low_latency_combine(expert_outputs(rx, r), idx, w, h)
            assert time.monotonic() - t0 < 20.0
            # Everybody unmasks everybody: one group again after a clean of all ranks.
            buf.low_latency_clean_mask_buffer()
            buf.clean_low_latency_buffer(M, H, e_all)
            buf.low_latency_query_mask_buffer(mask)
            assert mask.tolist() == [0] * n
            rx, cnt, h, _, _ = buf.low_latency_dispatch(x, idx, M, e_all, use_fp8=False)
            assert np.array_equal(rx, ll_reference(r, n, all_in)[0])
            cx, _, _ = buf.low_latency_combine(expert_outputs(rx, r), idx, w, h)
            assert np.array_equal(cx, ll_combine_want(x, idx, w))
            return True
        finally:
            buf.destroy()

    assert all(run_threads(n, body))


def test_shrink_calls_need_enable_shrink_and_check_their_arguments():
    def body(g, r):
        buf = make(g)
        sh = make(g, enable_shrink=True)
        try:
            m = np.zeros(2, np.int32)
            for call, args in (("low_latency_update_mask_buffer", (1, True)),
                               ("low_latency_query_mask_buffer", (m,)),
                               ("low_latency_clean_mask_buffer", ())):
                with pytest.raises(ValueError, match=f"^{call}: needs Buffer"):
                    getattr(buf, call)(*args)
            with pytest.raises(ValueError, match="^rank_to_mask: "):
                sh.low_latency_update_mask_buffer(2, True)
            with pytest.raises(TypeError, match="^mask: "):
                sh.low_latency_update_mask_buffer(1, 1)
            with pytest.raises(ValueError, match="^mask_status: shape"):
                sh.low_latency_query_mask_buffer(np.zeros(3, np.int32))
            with pytest.raises(TypeError, match="^mask_status: dtype"):
                sh.low_latency_query_mask_buffer(np.zeros(2, np.int64))
            # Before any low-latency native buffer: kept, and given to the first one.
            sh.low_latency_update_mask_buffer(1 - r, True)
            sh.low_latency_query_mask_buffer(m)
            assert m.tolist() == [int(s != r) for s in range(2)]
            x, idx, w = inputs(r, 2, salt=17, tokens=[6, 6])
            rx, cnt, h, _, _ = sh.low_latency_dispatch(x, idx, M, L * 2, use_fp8=False)
            alone = [(x, idx, w) if s == r else (x[:0], idx[:0], w[:0]) for s in range(2)]
            assert np.array_equal(rx, ll_reference(r, 2, alone)[0])
            sh.low_latency_combine(expert_outputs(rx, r), idx, w, h)
        finally:
            buf.destroy()
            sh.destroy()

    run_threads(2, body)


# NOTES: shm only. Over tcp;ofi_rxm a peer's death sometimes surfaces as a completion error
# of a write to another, live rank (seen once in five runs: "Broken pipe" writing to rank 1
# after rank 2 exited), which stops the proxy worker: a transport-level limit of shrink mode
# (ffi/python/README.md).
@pytest.mark.parametrize("provider", ["shm"])
def test_shrink_masks_a_rank_process_that_died(provider, tmp_path):
    """Ranks as processes over the torchrun store: rank 2 exits after one step; the others mask
    it as soon as the store reports it gone (no timeout) and run dispatch, combine and clean
    without it (tests/_shrink_rank.py)."""
    from conftest import HERE, run_ranks

    n = 4
    res = run_ranks(HERE / "_shrink_rank.py", n, timeout=90,
                    extra_env={"FI_PROVIDER": provider, "FEP_TEST_SYNC_DIR": str(tmp_path)})
    for r, (rc, out) in enumerate(res):
        if r == 2:
            assert rc == 0, out
            continue
        assert rc == 0 and f"rank {r}: ok" in out, f"rank {r} rc={rc}\n{out}"
