"""One rank of the GPU process tests (test_gpu_procs.py): a torchrun-style process (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set) that runs DeepEP's call sequence through
``fabric_ep.Buffer`` on CUDA tensors, every output compared with a torch reference built from
every rank's inputs (each rank makes all ranks' inputs from one seed).

``FEP_TEST_GROUP``: ``gloo`` (a gloo process group bootstraps the Buffer; the tensors choose the
GPU backend), ``nccl`` (an NCCL process group: its all-gather runs on CUDA tensors) or ``env``
(``group=None``: the torchrun variables). ``FEP_TEST_CASE``: ``deepep`` (the sequence),
``dead_peer`` (the last rank exits after the first step; the others must raise naming it) or
``stalled_peer`` (the last rank stops itself, SIGSTOP, after the first step: alive to the
store, silent on the data path; the others must raise naming it within their timeout). Shrink
mode (``Buffer(..., enable_shrink=True)``, low latency): ``shrink_masked`` (ranks 0..N-2 mask
the last rank and it masks them: two groups that go on apart, then one again after
``low_latency_clean_mask_buffer`` and a clean), ``shrink_dead`` (the last rank exits after one
step; the others mask it, the store having seen it leave, and go on without waiting) and
``shrink_stall`` (the last rank stops itself: the others' receive waits run out, mask it and
return the rest). Prints ``rank R/N: ok`` at the end; a traceback and exit status 1
otherwise."""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import fabric_ep
from fabric_ep import Buffer, EventOverlap

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
SEED = int(os.environ.get("FEP_TEST_SEED", "11"))
MAX_LL = 64
L = 4  # local experts per rank (normal-mode shapes vary it below)
# FEP_TEST_DEVICE=cpu runs the same sequence on CPU tensors (the host backend).
ON_GPU = os.environ.get("FEP_TEST_DEVICE", "cuda") == "cuda"
if ON_GPU:
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(dev)
else:
    dev = torch.device("cpu")


def sync():
    if ON_GPU:
        torch.cuda.synchronize()


def log(*a):
    print(f"[rank {RANK}]", *a, flush=True)


def tokens_of(s, case):
    """Per-rank token counts: unequal, rank 1 sends nothing."""
    base = [57, 0, 130, 9, 77, 3, 200, 41][s % 8]
    return (base * (case + 1)) % 257 if s != 1 else 0


def inputs(s, t, h, k, experts, case, hot=False):
    g = torch.Generator().manual_seed(SEED * 7919 + s * 131 + case)
    x = torch.randint(-8, 9, (t, h), generator=g).to(torch.bfloat16)
    scores = torch.rand((t, experts), generator=g)
    if hot:  # skew: experts 0 and 1 attract most tokens
        scores[:, :2] += 0.7
    idx = scores.argsort(dim=1, descending=True)[:, :k].to(torch.int64).contiguous()
    idx[torch.rand((t, k), generator=g) < 0.2] = -1
    if t > 5:
        idx[5] = -1  # a token routed nowhere
    w = torch.randint(1, 5, (t, k), generator=g).to(torch.float32) / 4
    return x.to(dev), idx.to(dev), w.to(dev)


def dest_mask(idx, num_ranks, lx):
    m = torch.zeros((idx.shape[0], num_ranks + 1), dtype=torch.bool, device=idx.device)
    rank_of = torch.where(idx >= 0, idx // lx, torch.full_like(idx, num_ranks))
    m.scatter_(1, rank_of, True)
    return m[:, :num_ranks]


def ref_recv(r, all_in, lx, align=1):
    xs, ids, ws = [], [], []
    per_expert = torch.zeros(lx, dtype=torch.int64)
    for x, idx, w in all_in:
        m = dest_mask(idx, WORLD, lx)[:, r]
        local = (idx >= 0) & (idx // lx == r)
        xs.append(x[m])
        ids.append(torch.where(local, idx - r * lx, torch.full_like(idx, -1))[m])
        ws.append(torch.where(local, w, torch.zeros_like(w))[m])
        for j in range(lx):
            per_expert[j] += int((idx[m] == r * lx + j).sum())
    per_expert = ((per_expert + align - 1) // align) * align
    return torch.cat(xs), torch.cat(ids), torch.cat(ws), per_expert.tolist()


def eq(a, b, what):
    if a.shape != b.shape or not torch.equal(a, b):
        bad = "shape" if a.shape != b.shape else int((a != b).sum())
        raise AssertionError(f"{what}: differs from the reference ({bad}; {list(a.shape)} vs "
                             f"{list(b.shape)})")


def normal_case(buf, case, h, k, lx):
    lx = max(lx, -(-k // WORLD))  # at least top-k experts in all (one rank: all local)
    experts = lx * WORLD
    t = tokens_of(RANK, case)
    all_in = [inputs(s, tokens_of(s, case), h, k, experts, case, hot=case % 2 == 1)
              for s in range(WORLD)]
    x, idx, w = all_in[RANK]
    per_rank, per_rdma, per_expert, in_rank, ev = buf.get_dispatch_layout(idx, experts)
    m = dest_mask(idx, WORLD, lx)
    eq(per_rank, m.sum(0).to(torch.int32), "num_tokens_per_rank")
    eq(in_rank, m, "is_token_in_rank")
    eq(per_expert, torch.bincount(idx[idx >= 0], minlength=experts).to(torch.int32),
       "num_tokens_per_expert")
    assert per_rdma is None
    rx, ri, rw, counts, handle, ev = buf.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
        topk_weights=w, config=Buffer.get_dispatch_config(WORLD))
    want_x, want_i, want_w, want_c = ref_recv(RANK, all_in, lx)
    eq(rx, want_x, f"case {case} recv_x")
    eq(ri, want_i, f"case {case} recv_topk_idx")
    eq(rw, want_w, f"case {case} recv_topk_weights")
    assert counts == want_c, (counts, want_c)
    # Combine with weights: every rank answers its rows times (rank + 1).
    back = (rx.float() * (RANK + 1)).to(torch.bfloat16)
    cx, cw, _ = buf.combine(back, handle, topk_weights=rw)
    factor = (m * (torch.arange(WORLD, device=dev) + 1)).sum(1).float()
    eq(cx, (x.float() * factor[:, None]).to(torch.bfloat16), f"case {case} combine")
    eq(cw, torch.where(idx >= 0, w, torch.zeros_like(w)), f"case {case} combined weights")
    # Without weights (DeepEP's identity: x times the number of destination ranks).
    cx1, cw1, _ = buf.combine(rx, handle)
    dests = m.sum(1).float()
    assert cw1 is None
    eq(cx1, (x.float() * dests[:, None]).to(torch.bfloat16), f"case {case} combine, no weights")
    # Cached handle: new values, the same routing.
    x2 = (x.float() + 1).to(torch.bfloat16)
    out = buf.dispatch(x2, handle=handle)
    assert out[1:5] == (None, None, None, None)
    eq(out[0], ref_recv(RANK, [((a[0].float() + 1).to(torch.bfloat16), a[1], a[2])
                               for a in all_in], lx)[0], f"case {case} cached recv_x")
    # fp8 (x, scales) on the same Buffer; bf16 combine after it.
    xq = torch.randint(0, 126, (t, h), dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
    xs = torch.full((t, h // 128), RANK + 0.5, device=dev)
    (q, qs), qi, qw, qc, qh, _ = buf.dispatch((xq, xs), topk_idx=idx, topk_weights=w,
                                              num_tokens_per_expert=per_expert,
                                              expert_alignment=4)
    eq(qi, want_i, f"case {case} fp8 recv_topk_idx")
    assert qc == ref_recv(RANK, all_in, lx, align=4)[3]
    assert q.dtype == torch.float8_e4m3fn and qs.dtype == torch.float32
    src_scale = torch.cat([torch.full((int(dest_mask(a[1], WORLD, lx)[:, RANK].sum()),), s + 0.5,
                                      device=dev) for s, a in enumerate(all_in)])
    eq(qs, src_scale[:, None].expand(-1, h // 128).contiguous(), f"case {case} fp8 scales")
    mine = dest_mask(idx, WORLD, lx)[:, RANK]
    n_before = sum(int(dest_mask(all_in[s][1], WORLD, lx)[:, RANK].sum()) for s in range(RANK))
    eq(q[n_before:n_before + int(mine.sum())].view(torch.uint8), xq[mine].view(torch.uint8),
       f"case {case} fp8 rows of this rank")
    cq, _, _ = buf.combine(torch.ones((q.shape[0], h), dtype=torch.bfloat16, device=dev), qh)
    eq(cq, dests[:, None].expand(-1, h).to(torch.bfloat16).contiguous(), f"case {case} fp8 combine")
    # num_worst_tokens: fixed rows, no host synchronisation; padding topk ids -1.
    worst = sum(tokens_of(s, case) for s in range(WORLD))
    wx, wi, ww, wc, wh, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                         num_tokens_per_expert=per_expert,
                                         num_worst_tokens=worst)
    n = want_x.shape[0]
    assert wx.shape == (worst, h) and wc == []
    eq(wx[:n], want_x, f"case {case} num_worst_tokens recv_x")
    assert bool((wi[n:] == -1).all()), "padding rows' recv_topk_idx are not -1"
    wcx, _, _ = buf.combine(wx, wh)
    eq(wcx, (x.float() * dests[:, None]).to(torch.bfloat16), f"case {case} worst combine")
    if not ON_GPU:
        return
    # async_finish / previous_event on the communication stream.
    prev = EventOverlap(torch.cuda.Event())
    prev.event.record()
    ax, ai, aw, ac, ah, aev = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                           num_tokens_per_expert=per_expert,
                                           previous_event=prev, async_finish=True,
                                           allocate_on_comm_stream=True)
    aev.current_stream_wait()
    eq(ax, want_x, f"case {case} async recv_x")
    acx, _, cev = buf.combine(ax, ah, async_finish=True)
    cev.current_stream_wait()
    eq(acx, (x.float() * dests[:, None]).to(torch.bfloat16), f"case {case} async combine")
    sync()


def ll_case(buf, case, h, k, experts, use_fp8, hooked, round_scale=False, ue8m0=False):
    lx = experts // WORLD
    all_in = [inputs(s, min(tokens_of(s, case), MAX_LL), h, k, experts, 100 + case)
              for s in range(WORLD)]
    x, idx, w = all_in[RANK]
    stats = torch.zeros(lx, dtype=torch.int32, device=dev)
    rx, cnt, handle, ev, hook = buf.low_latency_dispatch(
        x, idx, MAX_LL, experts, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8,
        round_scale=round_scale, use_ue8m0=ue8m0, return_recv_hook=hooked)
    if hooked:
        hook()
    sync()
    want_cnt = [sum(int((a[1] == RANK * lx + e).any(1).sum()) for a in all_in) for e in range(lx)]
    assert cnt.tolist() == want_cnt, (cnt.tolist(), want_cnt)
    assert stats.tolist() == want_cnt
    rows = (rx[0] if use_fp8 else rx).cpu()
    scales = rx[1].cpu() if use_fp8 else None
    if ue8m0:  # exponent bytes, four per int32
        assert scales.dtype == torch.int32 and scales.shape[-1] == h // 512
        scales = torch.pow(2.0, scales.view(torch.uint8).view(lx, -1, h // 128).float() - 127)
    src_rank, src_idx = handle.src_rank.cpu(), handle.src_idx.cpu()
    host_in = [(a[0].cpu(), a[1].cpu()) for a in all_in]
    y = torch.zeros((lx, WORLD * MAX_LL, h), dtype=torch.bfloat16)
    for e in range(lx):
        c = want_cnt[e]
        got = set()
        for i in range(c):
            s, j = int(src_rank[e, i]), int(src_idx[e, i])
            got.add((s, j))
            want = host_in[s][0][j]
            if use_fp8:
                scale = scales[e, i].repeat_interleave(128)
                deq = rows[e, i].float() * scale
                amax = want.float().abs().view(-1, 128).amax(1).repeat_interleave(128)
                if not bool(((deq - want.float()).abs() <= amax / 16 + 1e-6).all()):
                    raise AssertionError(f"LL fp8 row {e},{i} dequantised too far off")
                if round_scale:
                    sc = scales[e, i]
                    assert bool((torch.frexp(sc).mantissa == 0.5).all()), "scales not 2^n"
            else:
                eq(rows[e, i], want, f"LL recv_x[{e}, {i}]")
            y[e, i] = (want.float() * (e + 1)).to(torch.bfloat16)
        want_set = {(s, int(j)) for s, a in enumerate(host_in)
                    for j in torch.nonzero((a[1] == RANK * lx + e).any(1)).flatten().tolist()}
        assert got == want_set, f"LL expert {e}: received tokens differ from the routing"
    cx, _, chook = buf.low_latency_combine(y.to(dev), idx, w, handle, return_recv_hook=hooked)
    if hooked:
        chook()
    sync()
    want = torch.zeros((x.shape[0], h), dtype=torch.float32, device=dev)
    for kk in range(k):
        ok = idx[:, kk] >= 0
        mult = torch.where(ok, (idx[:, kk] % lx) + 1, torch.zeros_like(idx[:, kk])).float()
        want += x.float() * (mult * w[:, kk])[:, None]
    eq(cx, want.to(torch.bfloat16), f"LL combine (fp8={use_fp8}, hook={hooked})")


def ll_shrink_step(buf, case, masked, hooked, use_fp8=False):
    """One low-latency dispatch + combine in shrink mode with ``masked`` ranks left out: the
    rows of every other rank arrive as without shrink, and the combine sums only the experts of
    unmasked ranks (DeepEP: masked ranks' experts count as -1)."""
    h, k, lx = 512, 4, 3
    experts = lx * WORLD
    all_in = [inputs(s, min(tokens_of(s, case) + 3, MAX_LL), h, k, experts, 300 + case)
              for s in range(WORLD)]
    x, idx, w = all_in[RANK]
    rx, cnt, handle, _, hook = buf.low_latency_dispatch(x, idx, MAX_LL, experts, use_fp8=use_fp8,
                                                        return_recv_hook=hooked)
    if hooked:
        hook()
    sync()
    live = [a if s not in masked else (a[0][:0], a[1][:0], a[2][:0]) for s, a in enumerate(all_in)]
    want_cnt = [sum(int((a[1] == RANK * lx + e).any(1).sum()) for a in live) for e in range(lx)]
    assert cnt.tolist() == want_cnt, (cnt.tolist(), want_cnt, masked)
    rows = (rx[0] if use_fp8 else rx).cpu()
    src_rank, src_idx = handle.src_rank.cpu(), handle.src_idx.cpu()
    host_in = [a[0].cpu() for a in live]
    y = torch.zeros((lx, WORLD * MAX_LL, h), dtype=torch.bfloat16)
    for e in range(lx):
        for i in range(want_cnt[e]):
            s, j = int(src_rank[e, i]), int(src_idx[e, i])
            assert s not in masked, f"a row from masked rank {s}"
            if not use_fp8:
                eq(rows[e, i], host_in[s][j], f"shrink recv_x[{e}, {i}]")
            y[e, i] = (host_in[s][j].float() * (e + 1)).to(torch.bfloat16)
    cx, _, chook = buf.low_latency_combine(y.to(dev), idx, w, handle, return_recv_hook=hooked)
    if hooked:
        chook()
    sync()
    owner = torch.where(idx >= 0, idx // lx, torch.full_like(idx, -1))
    keep = (idx >= 0) & ~torch.isin(owner, torch.tensor(sorted(masked), device=dev,
                                                         dtype=torch.int64))
    want = torch.zeros((x.shape[0], h), dtype=torch.float32, device=dev)
    for kk in range(k):
        mult = torch.where(keep[:, kk], (idx[:, kk] % lx) + 1, torch.zeros_like(idx[:, kk])).float()
        want += x.float() * (mult * w[:, kk])[:, None]
    if not use_fp8:
        eq(cx, want.to(torch.bfloat16), f"shrink combine (masked {sorted(masked)}, hook {hooked})")


def query_mask(buf):
    m = torch.zeros(WORLD, dtype=torch.int32, device=dev)
    buf.low_latency_query_mask_buffer(m)
    return m.tolist()


def run_shrink(group, case):
    last = WORLD - 1
    buf = Buffer(group, 0, 0, low_latency_mode=True, enable_shrink=True, explicitly_destroy=True,
                 timeout_s=3.0, num_max_dispatch_tokens_per_rank=MAX_LL)
    # Both token formats' native buffers are made while every rank is alive (making one is
    # collective over the group).
    ll_shrink_step(buf, 0, set(), False)
    ll_shrink_step(buf, 0, set(), True, use_fp8=True)
    if case == "shrink_masked":
        others = {last} if RANK != last else set(range(last))
        for s in others:
            buf.low_latency_update_mask_buffer(s, True)
        assert query_mask(buf) == [int(s in others) for s in range(WORLD)]
        t0 = time.time()
        for c, hooked in ((0, False), (1, True)):
            ll_shrink_step(buf, c, others, hooked)
        ll_shrink_step(buf, 1, others, False, use_fp8=True)
        buf.clean_low_latency_buffer(MAX_LL, 512, 3 * WORLD)
        ll_shrink_step(buf, 2, others, False)
        assert time.time() - t0 < 2.5, f"a masked rank was waited for ({time.time() - t0:.1f} s)"
        log("two groups apart: ok")
        buf.low_latency_clean_mask_buffer()
        buf.clean_low_latency_buffer(MAX_LL, 512, 3 * WORLD)
        assert query_mask(buf) == [0] * WORLD
        ll_shrink_step(buf, 3, set(), True)
        log("one group again: ok")
        buf.destroy()
        return
    if RANK == last:
        if case == "shrink_stall":
            log("stopping itself (SIGSTOP)")
            os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(600)
        time.sleep(0.5)  # the others finished the first step (their syncs came back)
        log("exiting without warning")
        os._exit(0)
    if case == "shrink_dead":
        time.sleep(1.5)  # the store sees it leave: masked before the next call's writes
    t0 = time.time()
    ll_shrink_step(buf, 1, {last}, False)
    took = time.time() - t0
    if case == "shrink_dead":
        assert took < 2.5, f"the dead rank was waited for ({took:.1f} s)"
    else:
        assert took >= 2.0, f"the stalled rank was not waited for its timeout ({took:.1f} s)"
    assert query_mask(buf) == [int(s == last) for s in range(WORLD)], query_mask(buf)
    log(f"masked rank {last} after {took:.1f} s")
    t0 = time.time()
    ll_shrink_step(buf, 2, {last}, True)
    buf.clean_low_latency_buffer(MAX_LL, 512, 3 * WORLD)
    ll_shrink_step(buf, 3, {last}, False)
    ll_shrink_step(buf, 4, {last}, True, use_fp8=True)
    assert time.time() - t0 < 2.5, f"later calls waited ({time.time() - t0:.1f} s)"
    log("went on without it: ok")


def run_deepep(group):
    # DeepEP's construction: byte counts from the size hints, no model shape.
    hidden_max = 7168
    cfg = Buffer.get_dispatch_config(WORLD)
    nvl = cfg.get_nvl_buffer_size_hint(hidden_max * 2, WORLD)
    rdma = Buffer.get_low_latency_rdma_size_hint(MAX_LL, hidden_max, WORLD, 8 * WORLD)
    buf = Buffer(group, nvl, rdma, low_latency_mode=True, num_qps_per_rank=8,
                 explicitly_destroy=True)
    t0 = time.time()
    for case, (h, k, lx) in enumerate([(7168, 8, 8), (2560, 6, 4), (128, 1, 2), (5120, 9, 6),
                                       (7168, 8, 8)]):
        normal_case(buf, case, h, k, lx)
        log(f"normal case {case} (hidden {h}, top-{k}, {lx * WORLD} experts) ok")
    for case, (h, k, e, fp8, hooked, rs) in enumerate([
            (7168, 8, 8 * WORLD, True, False, False), (7168, 8, 8 * WORLD, False, True, False),
            (2560, 4, 4 * WORLD, True, True, True), (7168, 8, 8 * WORLD, True, True, False)]):
        ll_case(buf, case, h, k, e, fp8, hooked, rs)
        log(f"low-latency case {case} (hidden {h}, top-{k}, fp8 {fp8}, hook {hooked}) ok")
    for case, hooked in ((4, False), (5, True)):
        ll_case(buf, case, 7168, 8, 8 * WORLD, True, hooked, True, True)
        log(f"low-latency case {case} (use_ue8m0, hook {hooked}) ok")
    buf.clean_low_latency_buffer(MAX_LL, 7168, 8 * WORLD)
    ll_case(buf, 9, 7168, 8, 8 * WORLD, True, False)
    log(f"sequence took {time.time() - t0:.1f} s")
    buf.destroy()


def run_dead_peer(group, stall=False):
    buf = Buffer(group, 0, 0, explicitly_destroy=True, timeout_s=10.0)
    normal_case(buf, 0, 256, 2, 2)
    if RANK == WORLD - 1:
        if stall:
            log("stopping itself (SIGSTOP)")
            os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(600)
        log("exiting without warning")
        os._exit(0)
    t0 = time.time()
    try:
        normal_case(buf, 1, 256, 2, 2)
        sync()
        buf.sync()
    except Exception as e:  # noqa: BLE001 - the expected failure
        took = time.time() - t0
        log(f"raised after {took:.1f} s: {type(e).__name__}: {e}")
        assert took < 60, took
        assert str(WORLD - 1) in str(e), f"the error does not name rank {WORLD - 1}: {e}"
        return
    raise AssertionError("a step with a dead peer succeeded")


def main():
    mode = os.environ.get("FEP_TEST_GROUP", "gloo")
    group = None
    if mode in ("gloo", "nccl"):
        dist.init_process_group(mode)
        group = dist.group.WORLD
    case = os.environ.get("FEP_TEST_CASE", "deepep")
    log(f"fabric_ep from {os.path.dirname(fabric_ep.__file__)}, group {mode}, case {case}")
    if case == "deepep":
        run_deepep(group)
    elif case.startswith("shrink_"):
        run_shrink(group, case)
    else:
        run_dead_peer(group, stall=case == "stalled_peer")
    print(f"rank {RANK}/{WORLD}: ok", flush=True)
    os._exit(0)  # skip the process group's teardown (a dead peer cannot join it)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
