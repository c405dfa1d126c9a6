#!/usr/bin/env python3
"""The PyTorch permute / weighted-unpermute sequence on the inputs
ep-bench/examples/gpu_ll_bench.rs dumped.

Dispatch baseline: argsort of the flattened top-k by expert (-1 last), index_select of the token
rows into expert order, then (fp8, as the kernel) a per-128-channel e4m3 cast with fp32 scales.
Combine baseline: the expert-ordered rows times their weights in fp32, index_add_ back into
[tokens, hidden], cast to bf16. Timed with CUDA events (warm-up, median/p99, input sets rotated),
at 1x the tokens (one rank) and 4x (four ranks' worth in one call). Prints TORCH_RESULT lines.

usage: bench_ll_torch.py DUMP_DIR [iters]
"""
import json
import statistics
import sys

import numpy as np
import torch


def load(d):
    m = json.load(open(f"{d}/meta.json"))
    t, h, k = m["tokens"], m["hidden"], m["topk"]
    sets = []
    for i in range(m["sets"]):
        x = np.fromfile(f"{d}/x{i}.bin", dtype=np.uint16).astype(np.int32) << 16
        x = torch.from_numpy(x.view(np.float32)).reshape(t, h).to(torch.bfloat16).cuda()
        topk = torch.from_numpy(np.fromfile(f"{d}/topk{i}.bin", dtype=np.int64)).reshape(t, k).cuda()
        w = torch.from_numpy(np.fromfile(f"{d}/w{i}.bin", dtype=np.float32)).reshape(t, k).cuda()
        sets.append((x, topk, w))
    return m, sets


def permute(x, topk, num_experts, fp8):
    k = topk.shape[1]
    flat = topk.flatten()
    key = torch.where(flat >= 0, flat, num_experts)
    order = torch.argsort(key, stable=True)
    rows = x.index_select(0, order // k)
    if not fp8:
        return order, rows, None
    g = rows.view(rows.shape[0], -1, 128).float()
    amax = g.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    q = (g * (448.0 / amax)).to(torch.float8_e4m3fn)
    return order, q.view(rows.shape[0], -1), amax / 448.0


def unpermute(y_perm, order, w, t):
    k = w.shape[1]
    out = torch.zeros(t, y_perm.shape[1], dtype=torch.float32, device=y_perm.device)
    out.index_add_(0, order // k, y_perm.float() * w.flatten()[order].unsqueeze(1))
    return out.to(torch.bfloat16)


def time_us(fn, n, iters, warmup=20):
    for i in range(warmup):
        fn(i % n)
    s = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    e = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        s[i].record()
        fn(i % n)
        e[i].record()
    torch.cuda.synchronize()
    us = sorted(a.elapsed_time(b) * 1e3 for a, b in zip(s, e))
    return statistics.median(us), us[min(len(us) - 1, round(0.99 * (len(us) - 1)))]


def time_graph_us(fns, iters):
    """Each input set's sequence captured in a CUDA graph; replays timed (no launch gaps)."""
    graphs = []
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for f in fns:
            f()  # warm (allocations)
    torch.cuda.synchronize()
    for f in fns:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            f()
        graphs.append(g)
    return time_us(lambda i: graphs[i].replay(), len(graphs), iters)


def main():
    d = sys.argv[1]
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    m, sets = load(d)
    e = m["experts"]
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    for mult in (1, 4):
        big = [(torch.cat([x] * mult), torch.cat([tk] * mult), torch.cat([w] * mult)) for x, tk, w in sets]
        t = big[0][0].shape[0]
        for fp8 in (True, False):
            med, p99 = time_us(lambda i: permute(big[i][0], big[i][1], e, fp8), len(big), iters)
            print(f"TORCH_RESULT op=dispatch tokens={t} fp8={int(fp8)} median_us={med:.2f} p99_us={p99:.2f}")
        perms = [permute(x, tk, e, False) for x, tk, _ in big]
        med, p99 = time_us(lambda i: unpermute(perms[i][1], perms[i][0], big[i][2], t), len(big), iters)
        print(f"TORCH_RESULT op=combine tokens={t} median_us={med:.2f} p99_us={p99:.2f}")
        try:
            for fp8 in (True, False):
                fns = [lambda b=b, fp8=fp8: permute(b[0], b[1], e, fp8) for b in big]
                med, p99 = time_graph_us(fns, iters)
                print(f"TORCH_RESULT op=dispatch graph=1 tokens={t} fp8={int(fp8)} median_us={med:.2f} p99_us={p99:.2f}")
            fns = [lambda p=p, b=b: unpermute(p[1], p[0], b[2], t) for p, b in zip(perms, big)]
            med, p99 = time_graph_us(fns, iters)
            print(f"TORCH_RESULT op=combine graph=1 tokens={t} median_us={med:.2f} p99_us={p99:.2f}")
        except Exception as ex:  # report, keep the eager numbers
            print(f"TORCH_RESULT graph capture failed: {ex}")


if __name__ == "__main__":
    main()
