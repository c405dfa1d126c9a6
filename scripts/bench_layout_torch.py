#!/usr/bin/env python3
"""get_dispatch_layout with PyTorch ops, on the inputs ep-bench/examples/gpu_layout_bench.rs dumped.

Checks that torch gives exactly the kernel's outputs (set 0), then times torch with CUDA events
(warm-up, median/p99 over launches rotating through the same input sets), eagerly and replayed
from a CUDA graph, and prints the ratio to the kernel's median.

usage: bench_layout_torch.py DUMP_DIR
"""
import json
import statistics
import sys

import numpy as np
import torch


def torch_layout(topk_idx, num_experts, num_ranks, rpn):
    """Vectorised, no host synchronisation: what a user would write with torch ops."""
    t, _ = topk_idx.shape
    valid = topk_idx >= 0
    e = torch.where(valid, topk_idx, num_experts).flatten()
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=topk_idx.device)
    per_expert.scatter_add_(0, e, torch.ones_like(e, dtype=torch.int32))
    r = torch.where(valid, topk_idx // (num_experts // num_ranks), num_ranks)
    in_rank = torch.zeros(t, num_ranks + 1, dtype=torch.int32, device=topk_idx.device)
    in_rank.scatter_(1, r, 1)
    in_rank = in_rank[:, :num_ranks] > 0
    per_rank = in_rank.sum(0, dtype=torch.int32)
    per_node = in_rank.view(t, num_ranks // rpn, rpn).any(2).sum(0, dtype=torch.int32)
    return per_rank, per_node, per_expert[:num_experts], in_rank


def time_us(fn, inputs, iters, warmup):
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn(inputs[i % len(inputs)])
        ends[i].record()
    torch.cuda.synchronize()
    us = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
    return statistics.median(us), us[min(len(us) - 1, round((len(us) - 1) * 0.99))]


def main():
    d = sys.argv[1]
    m = json.load(open(f"{d}/meta.json"))
    tok, k, ne, nr, rpn, sets = m["tokens"], m["topk"], m["experts"], m["ranks"], m["rpn"], m["sets"]
    dev = torch.device("cuda")
    raw = np.fromfile(f"{d}/inputs.bin", dtype=np.int64).reshape(sets, tok, k)
    inputs = [torch.from_numpy(raw[i].copy()).to(dev) for i in range(sets)]

    pr, pn, pe, ir = torch_layout(inputs[0], ne, nr, rpn)
    ours = {
        "per_rank": np.fromfile(f"{d}/per_rank.bin", dtype=np.int32),
        "per_node": np.fromfile(f"{d}/per_node.bin", dtype=np.int32),
        "per_expert": np.fromfile(f"{d}/per_expert.bin", dtype=np.int32),
        "in_rank": np.fromfile(f"{d}/in_rank.bin", dtype=np.uint8).reshape(tok, nr),
    }
    checks = {
        "per_rank": np.array_equal(pr.cpu().numpy(), ours["per_rank"]),
        "per_node": np.array_equal(pn.cpu().numpy(), ours["per_node"]),
        "per_expert": np.array_equal(pe.cpu().numpy(), ours["per_expert"]),
        "in_rank": np.array_equal(ir.cpu().numpy().astype(np.uint8), ours["in_rank"]),
    }
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}: outputs equal to the kernel's: {checks}")
    if not all(checks.values()):
        print("TORCH_RESULT MISMATCH")
        sys.exit(1)

    iters, warmup = m["iters"], m["warmup"]
    fn = lambda x: torch_layout(x, ne, nr, rpn)
    med, p99 = time_us(fn, inputs, iters, warmup)

    # CUDA graph replay of the same ops (launch overheads removed), one graph per input set.
    graphs = []
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(inputs[0])
    torch.cuda.current_stream().wait_stream(s)
    for x in inputs:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(x)
        graphs.append(g)
    gmed, gp99 = time_us(lambda g: g.replay(), graphs, iters, warmup)

    k_med = m["kernel_median_us"]
    print(f"torch eager: median {med:.2f} us p99 {p99:.2f} us; cuda-graph replay: median {gmed:.2f} us p99 {gp99:.2f} us")
    print(
        f"TORCH_RESULT torch_eager_median_us={med:.2f} torch_eager_p99_us={p99:.2f} "
        f"torch_graph_median_us={gmed:.2f} torch_graph_p99_us={gp99:.2f} kernel_median_us={k_med:.2f} "
        f"speedup_vs_eager={med / k_med:.1f}x speedup_vs_graph={gmed / k_med:.1f}x"
    )


if __name__ == "__main__":
    main()
