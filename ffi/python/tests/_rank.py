"""One rank of the multi-process tests (run by test_multiprocess.py with the torchrun variables
set). Every rank builds every rank's inputs from the same seed, so each can compute its own
reference with numpy. Exit status 0 when every check passed; a traceback otherwise."""

import os
import sys

import numpy as np

import fabric_ep
from fabric_ep import Buffer, EventOverlap

H = 256  # a multiple of 128 (fp8 scales)
K = 3
L = 4  # local experts per rank
SEED = int(os.environ.get("FEP_TEST_SEED", "7"))


def f2bf(a):
    """float32 -> bf16 bits (exact for the small integers used here)."""
    return (np.ascontiguousarray(a, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def bf2f(u):
    return (np.asarray(u).astype(np.uint32) << 16).view(np.float32)


def tokens_of(s):
    return [24, 0, 17, 40, 5, 31, 12, 9][s % 8]  # rank 1 sends nothing


def inputs(s, num_ranks, salt=0, tokens=None):
    """Rank ``s``'s x, topk_idx, topk_weights (``tokens``: per-rank token counts instead of
    tokens_of)."""
    rng = np.random.default_rng(SEED * 1000 + s * 10 + salt)
    t = tokens_of(s) if tokens is None else tokens[s]
    e = L * num_ranks
    x = f2bf(rng.integers(-8, 9, size=(t, H)).astype(np.float32))
    # K distinct experts per token, some slots -1 (no expert), a few tokens routed nowhere.
    idx = np.argsort(rng.random((t, e)), axis=1)[:, :K].astype(np.int64)
    idx[rng.random((t, K)) < 0.15] = -1
    if t > 3:
        idx[3] = -1
    w = rng.integers(1, 5, size=(t, K)).astype(np.float32) / 4
    return x, idx, w


def ll_combine_want(x, idx, w):
    """The low-latency combine's expected output (bf16 bits) when expert e's output is its input
    times e + 1: per token, sum over k of x * (local expert + 1) * weight, rounded once."""
    want = np.zeros((x.shape[0], H), np.float32)
    for k in range(K):
        ok = idx[:, k] >= 0
        mult = np.where(ok, (idx[:, k] % L) + 1, 0).astype(np.float32)
        want += bf2f(x) * (mult * w[:, k])[:, None]
    return bf16_rne(want)


def ll_reference(r, world, all_in):
    """Rank r's low-latency dispatch reference: for local expert e, rows from source 0, 1, ...
    in token order (x rows, counts, source token, source rank, packed (begin << 32 | count))."""
    ref_x = np.zeros((L, world * MAX_LL, H), np.uint16)
    ref_cnt = np.zeros(L, np.int64)
    ref_src = np.full((L, world * MAX_LL), -1, np.int32)
    ref_rank = np.full((L, world * MAX_LL), -1, np.int32)
    ref_range = np.zeros((L, world), np.int64)
    for e in range(L):
        g, n = r * L + e, 0
        for s in range(world):
            xs, ids, _ = all_in[s]
            toks = np.nonzero((ids == g).any(1))[0]
            ref_range[e, s] = (n << 32) | len(toks)
            ref_x[e, n:n + len(toks)] = xs[toks]
            ref_src[e, n:n + len(toks)] = toks
            ref_rank[e, n:n + len(toks)] = s
            n += len(toks)
        ref_cnt[e] = n
    return ref_x, ref_cnt, ref_src, ref_rank, ref_range


def dest_ranks(idx, num_ranks):
    """[t, R] bool: token goes to rank r."""
    m = np.zeros((idx.shape[0], num_ranks), dtype=bool)
    for k in range(idx.shape[1]):
        ok = idx[:, k] >= 0
        m[np.nonzero(ok)[0], idx[ok, k] // L] = True
    return m


def reference_recv(r, num_ranks, all_inputs, alignment=1):
    xs, ids, ws = [], [], []
    per_expert = np.zeros(L, dtype=np.int64)
    for s in range(num_ranks):
        x, idx, w = all_inputs[s]
        m = dest_ranks(idx, num_ranks)[:, r]
        local = (idx >= 0) & (idx // L == r)
        xs.append(x[m])
        ids.append(np.where(local, idx - r * L, -1)[m])
        ws.append(np.where(local, w, 0)[m])
        for j in range(L):
            per_expert[j] += int((idx[m] == r * L + j).sum())
    per_expert = ((per_expert + alignment - 1) // alignment) * alignment
    return np.concatenate(xs), np.concatenate(ids), np.concatenate(ws), per_expert.tolist()


def check_layout(buf, r, num_ranks, x, idx, rpn):
    n_rank, n_rdma, n_exp, in_rank, ev = buf.get_dispatch_layout(idx, L * num_ranks)
    m = dest_ranks(idx, num_ranks)
    assert isinstance(ev, EventOverlap) and ev.event is None
    assert n_rank.dtype == np.int32 and n_rank.tolist() == m.sum(0).tolist(), n_rank
    assert in_rank.dtype == np.bool_ and np.array_equal(in_rank, m)
    want_exp = np.bincount(idx[idx >= 0], minlength=L * num_ranks)
    assert n_exp.tolist() == want_exp.tolist(), (n_exp, want_exp)
    nodes = num_ranks // rpn
    if nodes == 1:
        assert n_rdma is None
    else:
        want = [int(m[:, n * rpn:(n + 1) * rpn].any(1).sum()) for n in range(nodes)]
        assert n_rdma.tolist() == want, (n_rdma, want)
    return n_rank, n_rdma, n_exp, in_rank


def run_bf16(r, num_ranks, rpn):
    all_in = [inputs(s, num_ranks) for s in range(num_ranks)]
    x, idx, w = all_in[r]
    buf = Buffer(None, num_experts=L * num_ranks, hidden=H, num_topk=K, explicitly_destroy=True,
                 timeout_s=30.0)
    assert (buf.rank, buf.num_ranks, buf.ranks_per_node) == (r, num_ranks, rpn)
    n_rank, n_rdma, n_exp, in_rank = check_layout(buf, r, num_ranks, x, idx, rpn)

    # Fresh dispatch, with the layout passed as DeepEP callers do.
    rx, ri, rw, counts, handle, ev = buf.dispatch(
        x, num_tokens_per_rank=n_rank, num_tokens_per_rdma_rank=n_rdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=n_exp, topk_idx=idx, topk_weights=w,
        config=Buffer.get_dispatch_config(num_ranks))
    ref_x, ref_i, ref_w, ref_counts = reference_recv(r, num_ranks, all_in)
    assert rx.dtype == np.uint16 and rx.shape == ref_x.shape, (rx.shape, ref_x.shape)
    assert np.array_equal(rx, ref_x), "recv_x differs from the reference (grouped by source rank)"
    assert np.array_equal(ri, ref_i), (ri, ref_i)
    assert np.array_equal(rw, ref_w)
    assert counts == ref_counts, (counts, ref_counts)
    assert handle.num_recv_tokens == rx.shape[0] and handle.num_tokens == x.shape[0]

    # Combine: every rank returns its rows times (rank + 1); the source gets the sum over the
    # ranks each token went to. Weights come back summed too.
    back = f2bf(bf2f(rx) * (r + 1))
    cx, cw, ev = buf.combine(back, handle, topk_weights=rw)
    factor = (dest_ranks(idx, num_ranks) * (np.arange(num_ranks) + 1)).sum(1).astype(np.float32)
    assert cx.dtype == np.uint16 and cx.shape == x.shape
    assert np.array_equal(bf2f(cx), bf2f(x) * factor[:, None]), "combine != sum over destinations"
    assert np.array_equal(cw, np.where(idx >= 0, w, 0)), (cw, w)
    # DeepEP's identity check: combine(dispatch(x)) == x * number of destination ranks.
    cx1, cw1, _ = buf.combine(rx, handle)
    dests = dest_ranks(idx, num_ranks).sum(1).astype(np.float32)
    assert cw1 is None and np.array_equal(bf2f(cx1), bf2f(x) * dests[:, None])

    # Cached dispatch: same routing, new values; only recv_x comes back.
    x2 = f2bf(bf2f(x) + 1)
    out = buf.dispatch(x2, handle=handle)
    assert out[1:5] == (None, None, None, None), out[1:5]
    ref2 = reference_recv(r, num_ranks, [(f2bf(bf2f(a[0]) + 1), a[1], a[2]) for a in all_in])[0]
    assert np.array_equal(out[0], ref2)
    cx2, _, _ = buf.combine(out[0], handle)
    assert np.array_equal(bf2f(cx2), bf2f(x2) * dests[:, None])

    # expert_alignment rounds the per-expert counts up.
    *_, counts8, h8, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, expert_alignment=8)
    assert counts8 == reference_recv(r, num_ranks, all_in, alignment=8)[3], counts8
    del h8

    # num_worst_tokens: fixed rows, padding zero / -1, an empty per-expert list (as DeepEP).
    worst = sum(tokens_of(s) for s in range(num_ranks))
    wx, wi, ww, wcounts, wh, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                              num_worst_tokens=worst)
    n = ref_x.shape[0]
    assert wx.shape == (worst, H) and wi.shape == (worst, K) and ww.shape == (worst, K)
    assert wcounts == []
    assert np.array_equal(wx[:n], ref_x) and not wx[n:].any()
    assert np.array_equal(wi[:n], ref_i) and (wi[n:] == -1).all()
    assert np.array_equal(ww[:n], ref_w) and not ww[n:].any()
    wcx, _, _ = buf.combine(wx, wh)
    assert np.array_equal(bf2f(wcx), bf2f(x) * dests[:, None])

    buf.destroy()


def run_fp8(r, num_ranks):
    rng = np.random.default_rng(SEED + 100 * r)
    all_in = [inputs(s, num_ranks, salt=1) for s in range(num_ranks)]
    fp8 = []
    for s in range(num_ranks):
        g = np.random.default_rng(SEED * 7 + s)
        t = tokens_of(s)
        fp8.append((g.integers(0, 256, size=(t, H)).astype(np.uint8),
                    g.random((t, H // 128), dtype=np.float32)))
    x, idx, w = all_in[r]
    xq, xs = fp8[r]
    buf = Buffer(None, num_experts=L * num_ranks, hidden=H, num_topk=K, explicitly_destroy=True,
                 dispatch_dtype="fp8", timeout_s=30.0)
    (rxq, rxs), ri, rw, counts, handle, _ = buf.dispatch((xq, xs), topk_idx=idx, topk_weights=w)
    # The reference routes the fp8 rows exactly like bf16 rows of the same routing.
    want_q, want_s = [], []
    for s in range(num_ranks):
        m = dest_ranks(all_in[s][1], num_ranks)[:, r]
        want_q.append(fp8[s][0][m])
        want_s.append(fp8[s][1][m])
    assert rxq.dtype == np.uint8 and np.array_equal(rxq, np.concatenate(want_q))
    assert rxs.dtype == np.float32 and np.array_equal(rxs, np.concatenate(want_s))
    _, ref_i, ref_w, ref_counts = reference_recv(r, num_ranks, all_in)
    assert np.array_equal(ri, ref_i) and np.array_equal(rw, ref_w) and counts == ref_counts
    # BF16 combine after an FP8 dispatch (DeepEP's standard pairing).
    rows = rxq.shape[0]
    back = np.full((rows, H), f2bf(np.float32(0.5)), dtype=np.uint16)
    cx, _, _ = buf.combine(back, handle)
    dests = dest_ranks(idx, num_ranks).sum(1).astype(np.float32)
    assert np.array_equal(bf2f(cx), np.repeat(0.5 * dests[:, None], H, axis=1))
    buf.destroy()
    del rng


def bf16_rne(f):
    """float32 -> bf16 bits, round to nearest even (the library rounds its fp32 sum once)."""
    u = np.ascontiguousarray(f, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def e4m3_to_f32(b):
    b = b.astype(np.int32)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e = (b >> 3) & 0xF
    m = b & 0x7
    val = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7))
    return (sign * val).astype(np.float32)


MAX_LL = 48


def run_ll(r, num_ranks):
    from fabric_ep import LowLatencyHandle

    all_in = [inputs(s, num_ranks, salt=2) for s in range(num_ranks)]
    x, idx, w = all_in[r]
    e_all = L * num_ranks
    buf = Buffer(None, 0, 0, True, num_experts=e_all, hidden=H, num_topk=K, timeout_s=30.0,
                 num_max_dispatch_tokens_per_rank=MAX_LL, explicitly_destroy=True)
    S = num_ranks * MAX_LL
    ref_x, ref_cnt, ref_src, ref_rank, ref_range = ll_reference(r, num_ranks, all_in)

    stats = np.zeros(L, np.int32)
    for hooked in (False, True):
        rx, cnt, handle, ev, hook = buf.low_latency_dispatch(
            x, idx, MAX_LL, e_all, cumulative_local_expert_recv_stats=stats, use_fp8=False,
            return_recv_hook=hooked)
        assert isinstance(handle, LowLatencyHandle) and isinstance(ev, EventOverlap)
        assert (hook is not None) == hooked
        if hooked:
            hook()
        assert rx.shape == (L, S, H) and rx.dtype == np.uint16
        assert cnt.dtype == np.int32 and cnt.tolist() == ref_cnt.tolist(), (cnt, ref_cnt)
        assert np.array_equal(rx, ref_x), "LL recv_x differs from the reference"
        assert np.array_equal(handle.src_idx, ref_src) and np.array_equal(handle.src_rank,
                                                                          ref_rank)
        assert np.array_equal(handle.layout_range, ref_range)
        # Combine: expert e of rank r answers x * (e + 1); per token the weighted fp32 sum.
        y = np.zeros((L, S, H), np.uint16)
        for e in range(L):
            y[e] = f2bf(bf2f(rx[e]) * (e + 1))
        out = np.empty((x.shape[0], H), np.uint16)
        cx, ev, chook = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=hooked,
                                                out=out)
        assert cx is out and (chook is not None) == hooked
        if hooked:
            chook()
        assert np.array_equal(cx, ll_combine_want(x, idx, w)), "LL combine differs from the reference"
    assert stats.tolist() == (2 * ref_cnt).tolist(), (stats, ref_cnt)

    # FP8 dispatch: e4m3 with one float32 scale per 128 channels.
    (q, sc), cnt, handle, _, _ = buf.low_latency_dispatch(x, idx, MAX_LL, e_all, use_fp8=True)
    assert q.dtype == np.uint8 and sc.shape == (L, S, H // 128) and sc.dtype == np.float32
    deq = e4m3_to_f32(q) * np.repeat(sc, 128, axis=2)
    ref = bf2f(ref_x)
    amax = np.repeat(np.abs(ref).reshape(L, S, H // 128, 128).max(3), 128, axis=2)
    assert np.all(np.abs(deq - ref) <= amax / 16 + 1e-6), "fp8 dequantised rows too far off"

    # clean_low_latency_buffer: collective; a shape never used has nothing to clean.
    buf.clean_low_latency_buffer(MAX_LL + 1, H, e_all)
    buf.clean_low_latency_buffer(MAX_LL, H, e_all)
    rx, cnt, handle, _, _ = buf.low_latency_dispatch(x, idx, MAX_LL, e_all, use_fp8=False)
    assert np.array_equal(rx, ref_x)
    buf.destroy()


def _shape(h, k):
    """Sets the module's hidden size and top-k (the helpers above read them)."""
    global H, K
    H, K = h, k


def run_deepep(r, num_ranks, rpn):
    """DeepEP's call sequence as frameworks write it: one Buffer sized by byte counts, no model
    shape; bf16 and fp8 on it, two hidden sizes and top-ks, low latency in both formats with and
    without the hook; rank 1 sends nothing and the ranks' token counts differ."""
    h0, k0 = H, K
    e_all = L * num_ranks
    hint = Buffer.get_dispatch_config(num_ranks).get_nvl_buffer_size_hint(h0 * 2, num_ranks)
    ll_bytes = Buffer.get_low_latency_rdma_size_hint(MAX_LL, h0, num_ranks, e_all)
    buf = Buffer(None, hint, ll_bytes, True, explicitly_destroy=True)
    assert (buf.rank, buf.group_size) == (r, num_ranks)
    try:
        for h, k, salt in ((h0, k0, 3), (128, 2, 4), (h0, k0, 5)):
            _shape(h, k)
            all_in = [inputs(s, num_ranks, salt=salt) for s in range(num_ranks)]
            x, idx, w = all_in[r]
            n_rank, n_rdma, n_exp, in_rank = check_layout(buf, r, num_ranks, x, idx, rpn)
            rx, ri, rw, counts, handle, _ = buf.dispatch(
                x, num_tokens_per_rank=n_rank, num_tokens_per_rdma_rank=n_rdma,
                is_token_in_rank=in_rank, num_tokens_per_expert=n_exp, topk_idx=idx,
                topk_weights=w, config=Buffer.get_dispatch_config(num_ranks))
            ref_x, ref_i, ref_w, ref_counts = reference_recv(r, num_ranks, all_in)
            assert np.array_equal(rx, ref_x) and np.array_equal(ri, ref_i)
            assert np.array_equal(rw, ref_w) and counts == ref_counts, (counts, ref_counts)
            back = f2bf(bf2f(rx) * (r + 1))
            cx, cw, _ = buf.combine(back, handle, topk_weights=rw)
            factor = (dest_ranks(idx, num_ranks) * (np.arange(num_ranks) + 1)).sum(1)
            assert np.array_equal(bf2f(cx), bf2f(x) * factor[:, None].astype(np.float32))
            assert np.array_equal(cw, np.where(idx >= 0, w, 0))
            # fp8 with scales on the same Buffer and routing (as SGLang: fp8 dispatch, bf16
            # combine), then the cached form.
            xq = (np.arange(x.shape[0] * h) % 251).astype(np.uint8).reshape(x.shape[0], h)
            xs = np.full((x.shape[0], h // 128), r + 0.25, np.float32)
            (q, sc), qi, _, qcounts, qh, _ = buf.dispatch(
                (xq, xs), topk_idx=idx, topk_weights=w, num_tokens_per_expert=n_exp)
            assert np.array_equal(qi, ref_i) and qcounts == ref_counts
            src = np.concatenate([np.full(int(dest_ranks(all_in[s][1], num_ranks)[:, r].sum()),
                                          s + 0.25, np.float32) for s in range(num_ranks)])
            assert np.array_equal(sc, np.repeat(src[:, None], h // 128, 1))
            cq, _, _ = buf.combine(f2bf(np.ones((q.shape[0], h), np.float32)), qh)
            dests = dest_ranks(idx, num_ranks).sum(1).astype(np.float32)
            assert np.array_equal(bf2f(cq), np.repeat(dests[:, None], h, 1))
            again = buf.dispatch(x, handle=handle)[0]
            assert np.array_equal(again, ref_x)
            # Low latency: bf16 with the hook, then fp8 without, on the same Buffer.
            ref = ll_reference(r, num_ranks, all_in)
            for use_fp8, hooked in ((False, True), (True, False)):
                rx, cnt, lh, _, hook = buf.low_latency_dispatch(
                    x, idx, MAX_LL, e_all, use_fp8=use_fp8, return_recv_hook=hooked)
                if hooked:
                    hook()
                assert cnt.tolist() == ref[1].tolist(), (cnt, ref[1])
                if not use_fp8:
                    assert np.array_equal(rx, ref[0])
                    y = np.zeros(rx.shape, np.uint16)
                    for e in range(L):
                        y[e] = f2bf(bf2f(rx[e]) * (e + 1))
                else:
                    assert rx[0].shape == (L, num_ranks * MAX_LL, h)
                    y = np.zeros((L, num_ranks * MAX_LL, h), np.uint16)
                    for e in range(L):
                        y[e] = f2bf(bf2f(ref[0][e]) * (e + 1))
                cx, _, _ = buf.low_latency_combine(y, idx, w, lh)
                assert np.array_equal(cx, ll_combine_want(x, idx, w))
    finally:
        _shape(h0, k0)
        buf.destroy()


def main():
    r = int(os.environ["RANK"])
    n = int(os.environ["WORLD_SIZE"])
    rpn = int(os.environ.get("LOCAL_WORLD_SIZE", n))
    run_bf16(r, n, rpn)
    # A second Buffer in the same processes: its own store port.
    os.environ["FEP_MASTER_PORT"] = os.environ["FEP_TEST_PORT2"]
    run_fp8(r, n)
    os.environ["FEP_MASTER_PORT"] = os.environ["FEP_TEST_PORT3"]
    run_ll(r, n)
    os.environ["FEP_MASTER_PORT"] = os.environ["FEP_TEST_PORT4"]
    run_deepep(r, n, rpn)
    print(f"rank {r}/{n}: ok ({fabric_ep.__name__})")


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.exit(1)
