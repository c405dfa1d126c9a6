"""The MoE-layer step through the installed package: dispatch, the experts' grouped GEMM and
combine, forward and backward order, on fabric-ep and on NCCL all-to-all + permute side by side,
timed as a whole and per part.

    python3 benches/moe_step.py                       # DeepEP's shape: 4096 tokens, hidden 7168,
                                                      # top-8 of 256, expert FFN 2048, bf16
    python3 benches/moe_step.py --model-ep 64 --link-gbps 50

Both stacks move the same rows (each token once per destination rank, with its top-k ids and
weights) and run the same expert work on them, so the step-time ratio is the communication's:

* **fabric-ep**: ``Buffer.get_dispatch_layout`` + ``Buffer.dispatch`` (a fresh layout every
  step), the experts, ``Buffer.combine``; backward: the gradient dispatched with the forward's
  handle (the backward of a combine), the experts' backward, the input gradient combined (the
  backward of a dispatch).
* **NCCL + permute**: the permute (which token goes to which rank, gathered rank-major, ids and
  weights packed beside the rows), ``all_to_all_single`` of the counts (the host needs them to
  size the receive: one synchronisation), ``all_to_all_single`` of the packed rows, the unpack;
  back: ``all_to_all_single`` of the expert outputs and the un-permute (``index_add_`` per
  token in fp32). Backward mirrors it.

The experts (identical on both): the received rows expanded per (row, local expert), sorted by
expert with each expert's group padded to 16 rows, ``grouped_mm`` (gate and up fused, SiLU-and-
multiply, down), the outputs weighted and summed per received row in fp32; backward through
torch's autograd (input and weight gradients).

``--model-ep N --link-gbps B`` adds a projection of the communication share to N ranks, each
sending over a link of B GB/s: the bytes each rank would send (from this run's routing: the
distinct destination ranks of each token when the experts are split over N ranks, the remote
ones (N-1)/N of them) divided by B, beside the expert time measured here. It is arithmetic over
the plan's byte counts, not a measurement: no overlap, no congestion, no per-message cost.

Ranks: the torchrun variables when set (every rank on its own GPU for the NCCL stack: NCCL
refuses two ranks on one GPU, so with more ranks than GPUs only fabric-ep runs), else 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

PAD = 16  # rows per expert group are padded to this (grouped_mm's alignment)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank (default 4096)")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size (default 7168)")
    p.add_argument("--ffn", type=int, default=2048, help="expert FFN size (default 2048)")
    p.add_argument("--topk", type=int, default=8, help="experts per token (default 8)")
    p.add_argument("--experts", type=int, default=256, help="experts in all (default 256)")
    p.add_argument("--iters", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--stacks", default="fabric-ep,nccl",
                   help="comma list of fabric-ep, nccl (default both)")
    p.add_argument("--no-backward", action="store_true", help="time the forward order only")
    p.add_argument("--model-ep", type=int, action="append", default=[],
                   help="project the communication share to N ranks (repeatable)")
    p.add_argument("--link-gbps", type=float, default=50.0,
                   help="per-GPU link bandwidth for --model-ep, GB/s (default 50: one P5 GPU's "
                        "4 x 100 Gb/s EFA)")
    p.add_argument("--seed", type=int, default=1, help="routing and data seed (default 1)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    a = p.parse_args()
    for name in ("tokens", "hidden", "ffn", "topk", "experts", "iters"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be at least 1")
    for n in a.model_ep:
        if n < 1 or a.experts % n:
            p.error(f"--model-ep {n}: must divide --experts {a.experts}")
    if a.link_gbps <= 0:
        p.error("--link-gbps must be positive")
    a.stacks = [s.strip() for s in a.stacks.split(",") if s.strip()]
    for s in a.stacks:
        if s not in ("fabric-ep", "nccl"):
            p.error(f"--stacks: unknown stack {s!r} (fabric-ep, nccl)")
    return a


# ---- the experts (the same on both stacks) ----------------------------------------------------

_GMM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def gmm(a: torch.Tensor, w_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``a [M, K]`` times each group's ``w [G, K, N]`` (given as ``w_t [G, N, K]``, which
    grouped_mm takes transposed), rows split by ``offs`` (cumulative ends, the last = M)."""
    return _GMM(a, w_t.transpose(-2, -1), offs=offs)


class Experts:
    def __init__(self, local: int, hidden: int, ffn: int, dev: torch.device, seed: int):
        g = torch.Generator(device=dev).manual_seed(seed)
        s1, s2 = 1.0 / math.sqrt(hidden), 1.0 / math.sqrt(ffn)
        # Stored [G, N, K] (grouped_mm's transposed operand), gate and up fused.
        self.w1 = (torch.randn(local, 2 * ffn, hidden, device=dev, generator=g) * s1).to(
            torch.bfloat16).requires_grad_(True)
        self.w2 = (torch.randn(local, hidden, ffn, device=dev, generator=g) * s2).to(
            torch.bfloat16).requires_grad_(True)
        self.local, self.ffn = local, ffn

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Received rows ``x [R, H]`` with local expert ids ``idx [R, K]`` (-1: not here) and
        weights ``w [R, K]`` -> ``[R, H]`` bf16: per row the weighted sum of its experts'
        outputs (fp32 accumulation). No host synchronisation."""
        rows, k = idx.shape
        flat = idx.reshape(-1)
        valid = flat >= 0
        e = torch.where(valid, flat, torch.full_like(flat, self.local))  # invalid: a spare group
        counts = torch.bincount(e, minlength=self.local + 1)[: self.local]
        padded = (counts + PAD - 1) // PAD * PAD
        starts = torch.cumsum(padded, 0) - padded
        cap = rows * k + PAD * self.local
        order = torch.argsort(e, stable=True)
        e_sorted = e[order]
        first = torch.cumsum(counts, 0) - counts
        n_valid = counts.sum()
        pos = torch.arange(rows * k, device=x.device)
        keep = pos < n_valid
        e_keep = torch.where(keep, e_sorted, torch.zeros_like(e_sorted))
        dest = torch.where(keep, starts[e_keep] + (pos - first[e_keep]), torch.full_like(pos, cap))
        src_row = order // k
        # Padding rows gather row 0 (finite values; their output is never read, so their
        # gradients are zero).
        gather = torch.zeros(cap + 1, dtype=torch.int64, device=x.device)
        gather.scatter_(0, dest, src_row)
        gather = gather[:cap]
        offs = torch.cumsum(padded, 0).to(torch.int32)
        offs[-1] = cap  # the tail rows join the last group
        xp = x.index_select(0, gather) if rows else x.new_zeros((cap, x.shape[1]))
        h = gmm(xp, self.w1, offs)
        a = F.silu(h[:, : self.ffn]) * h[:, self.ffn:]
        y = gmm(a, self.w2, offs)
        wk = w.reshape(-1)[order]
        yk = y.index_select(0, torch.where(keep, dest, torch.zeros_like(dest))).float()
        yk = yk * torch.where(keep, wk, torch.zeros_like(wk))[:, None]
        out = torch.zeros((rows, x.shape[1]), dtype=torch.float32, device=x.device)
        out = out.index_add(0, src_row, yk)
        return out.to(torch.bfloat16)


# ---- the stacks ---------------------------------------------------------------------------------

class Ours:
    name = "fabric-ep"

    def __init__(self, group, args, rank: int, world: int):
        import fabric_ep

        nvl = fabric_ep.Buffer.get_dispatch_config(world).get_nvl_buffer_size_hint(
            args.hidden * 2, world)
        self.buf = fabric_ep.Buffer(group, nvl, 0, explicitly_destroy=True)
        self.experts_n = args.experts
        self.handle = None

    def dispatch(self, x, idx, w):
        ntr, ntrr, nte, inr, _ = self.buf.get_dispatch_layout(idx, self.experts_n)
        rx, ridx, rw, _, self.handle, _ = self.buf.dispatch(
            x, num_tokens_per_rank=ntr, num_tokens_per_rdma_rank=ntrr, is_token_in_rank=inr,
            num_tokens_per_expert=nte, topk_idx=idx, topk_weights=w)
        return rx, ridx, rw

    def combine(self, y):
        return self.buf.combine(y, self.handle)[0]

    def dispatch_back(self, g):
        return self.buf.dispatch(g, handle=self.handle)[0]

    def combine_back(self, g):
        return self.buf.combine(g, self.handle)[0]

    def close(self):
        self.buf.destroy()


class Nccl:
    name = "nccl+permute"

    def __init__(self, group, args, rank: int, world: int):
        self.group, self.rank, self.world = group, rank, world
        self.local = args.experts // world
        self.h, self.k = args.hidden, args.topk

    def _a2a_counts(self, send_counts: torch.Tensor) -> list:
        recv = torch.empty_like(send_counts)
        dist.all_to_all_single(recv, send_counts, group=self.group)
        return recv.tolist()

    def dispatch(self, x, idx, w):
        t, k = idx.shape
        rank_of = torch.where(idx >= 0, idx // self.local, torch.full_like(idx, self.world))
        inr = torch.zeros((t, self.world + 1), dtype=torch.bool, device=x.device)
        inr.scatter_(1, rank_of, True)
        inr = inr[:, : self.world]
        dst, tok = inr.t().nonzero(as_tuple=True)  # rank-major: each token once per rank
        self.tok = tok
        send_counts = inr.sum(0)
        self.in_splits = send_counts.tolist()
        self.out_splits = self._a2a_counts(send_counts)
        # One packed row per (token, rank): the bf16 row, the top-k ids, the weights.
        row_b = self.h * 2 + k * 8 + k * 4
        packed = torch.empty((tok.numel(), row_b), dtype=torch.uint8, device=x.device)
        packed[:, : self.h * 2] = x[tok].view(torch.uint8)
        packed[:, self.h * 2: self.h * 2 + k * 8] = idx[tok].view(torch.uint8)
        packed[:, self.h * 2 + k * 8:] = w[tok].view(torch.uint8)
        recv = torch.empty((sum(self.out_splits), row_b), dtype=torch.uint8, device=x.device)
        dist.all_to_all_single(recv, packed, self.out_splits, self.in_splits, group=self.group)
        rx = recv[:, : self.h * 2].contiguous().view(torch.bfloat16)
        gidx = recv[:, self.h * 2: self.h * 2 + k * 8].contiguous().view(torch.int64)
        rw = recv[:, self.h * 2 + k * 8:].contiguous().view(torch.float32)
        mine = (gidx >= 0) & (gidx // self.local == self.rank)
        ridx = torch.where(mine, gidx - self.rank * self.local, torch.full_like(gidx, -1))
        return rx, ridx, rw

    def _back(self, y):
        back = torch.empty((sum(self.in_splits), self.h), dtype=y.dtype, device=y.device)
        dist.all_to_all_single(back, y.contiguous(), self.in_splits, self.out_splits,
                               group=self.group)
        return back

    def combine(self, y):
        t = self.tok_count
        out = torch.zeros((t, self.h), dtype=torch.float32, device=y.device)
        out.index_add_(0, self.tok, self._back(y).float())
        return out.to(torch.bfloat16)

    def dispatch_back(self, g):
        send = g[self.tok]
        recv = torch.empty((sum(self.out_splits), self.h), dtype=g.dtype, device=g.device)
        dist.all_to_all_single(recv, send, self.out_splits, self.in_splits, group=self.group)
        return recv

    def combine_back(self, g):
        return self.combine(g)

    def close(self):
        pass


# ---- timing -------------------------------------------------------------------------------------

PARTS_F = ("dispatch", "experts", "combine")
PARTS_B = ("bwd dispatch", "bwd experts", "bwd combine")


def one_step(stack, experts: Experts, x, idx, w, gout, backward: bool):
    """One step; returns the CUDA events around each part."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(7 if backward else 4)]
    if isinstance(stack, Nccl):
        stack.tok_count = x.shape[0]
    ev[0].record()
    rx, ridx, rw = stack.dispatch(x, idx, w)
    ev[1].record()
    rx = rx.detach().requires_grad_(backward)
    with torch.set_grad_enabled(backward):
        y = experts.forward(rx, ridx, rw)
    ev[2].record()
    out = stack.combine(y.detach())
    ev[3].record()
    if backward:
        gy = stack.dispatch_back(gout)
        ev[4].record()
        grx, _, _ = torch.autograd.grad(y, (rx, experts.w1, experts.w2), gy)
        ev[5].record()
        stack.combine_back(grx)
        ev[6].record()
    del out
    return ev


def time_stack(stack, experts, x, idx, w, gout, args):
    rows = []
    walls = []
    for it in range(args.warmup + args.iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ev = one_step(stack, experts, x, idx, w, gout, not args.no_backward)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e6
        if it >= args.warmup:
            walls.append(wall)
            rows.append([ev[i].elapsed_time(ev[i + 1]) * 1e3 for i in range(len(ev) - 1)])
    med = [statistics.median(c) for c in zip(*rows)]
    names = PARTS_F + (() if args.no_backward else PARTS_B)
    parts = dict(zip(names, med))
    comm = sum(v for n, v in parts.items() if "experts" not in n)
    step = statistics.median(walls)
    return {"stack": stack.name, "parts_us": parts, "comm_us": comm,
            "experts_us": sum(v for n, v in parts.items() if "experts" in n),
            "step_us": step, "step_min_us": min(walls), "step_max_us": max(walls),
            "comm_share": comm / sum(med)}


def projection(idx: torch.Tensor, args, experts_us: float, n: int) -> dict:
    """Bytes one rank would send per step with the experts split over ``n`` ranks (this run's
    routing), and the share of the step they would take at ``--link-gbps``: arithmetic."""
    per = args.experts // n
    rank_of = torch.where(idx >= 0, idx // per, torch.full_like(idx, n))
    inr = torch.zeros((idx.shape[0], n + 1), dtype=torch.bool, device=idx.device)
    inr.scatter_(1, rank_of, True)
    distinct = float(inr[:, :n].sum())
    remote_rows = distinct * (n - 1) / n
    row = args.hidden * 2  # bf16 both ways
    one_way = remote_rows * row
    phases = 2 if args.no_backward else 4
    total = one_way * phases
    comm_us = total / (args.link_gbps * 1e9) * 1e6
    return {"ranks": n, "link_gbps": args.link_gbps, "bytes_per_rank": total,
            "comm_us": comm_us, "experts_us": experts_us,
            "comm_share": comm_us / (comm_us + experts_us)}


def main() -> int:
    args = parse()
    if not torch.cuda.is_available():
        print("moe_step: needs a CUDA device", file=sys.stderr)
        return 2
    if _GMM is None:
        print("moe_step: this torch has no grouped_mm (torch >= 2.8 on Hopper)", file=sys.stderr)
        return 2
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", rank))
    if args.experts % world:
        print(f"moe_step: --experts {args.experts} is not a multiple of {world} ranks",
              file=sys.stderr)
        return 2
    dev = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    own_gpus = torch.cuda.device_count() >= world
    stacks = [s for s in args.stacks if s != "nccl" or own_gpus]
    if "nccl" in args.stacks and not own_gpus and rank == 0:
        print(f"moe_step: NCCL needs a GPU per rank ({world} ranks, "
              f"{torch.cuda.device_count()} GPUs): fabric-ep alone", file=sys.stderr)
    if "MASTER_ADDR" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT",
                                                                             "29531"))
    dist.init_process_group("nccl" if own_gpus else "gloo", rank=rank, world_size=world)
    group = dist.group.WORLD

    g = torch.Generator(device=dev).manual_seed(args.seed * 1009 + rank)
    t, h, k = args.tokens, args.hidden, args.topk
    x = torch.randn((t, h), device=dev, generator=g).to(torch.bfloat16)
    scores = torch.rand((t, args.experts), device=dev, generator=g)
    idx = scores.topk(k, dim=1).indices.to(torch.int64).contiguous()
    w = torch.softmax(torch.rand((t, k), device=dev, generator=g), dim=1)
    gout = torch.randn((t, h), device=dev, generator=g).to(torch.bfloat16)
    experts = Experts(args.experts // world, h, args.ffn, dev, args.seed)

    if not args.no_backward:
        try:  # the experts' backward needs grouped_mm's autograd (torch >= 2.8)
            xr = x[:64].detach().requires_grad_(True)
            yr = experts.forward(xr, idx[:64] % experts.local, w[:64])
            torch.autograd.grad(yr, (xr, experts.w1, experts.w2), torch.ones_like(yr))
        except RuntimeError as e:
            print(f"moe_step: no backward through grouped_mm here ({e}); forward order only",
                  file=sys.stderr)
            args.no_backward = True

    results = []
    outs = {}
    for name in stacks:
        stack = (Ours if name == "fabric-ep" else Nccl)(group, args, rank, world)
        # Both stacks must agree on the forward output (the same rows, the same experts).
        if isinstance(stack, Nccl):
            stack.tok_count = t
        rx, ridx, rw = stack.dispatch(x, idx, w)
        outs[name] = stack.combine(experts.forward(rx, ridx, rw).detach())
        results.append(time_stack(stack, experts, x, idx, w, gout, args))
        stack.close()
    if len(outs) == 2:
        a, b = outs["fabric-ep"].float(), outs["nccl"].float()
        diff = (a - b).abs().max().item()
        scale = b.abs().max().item() or 1.0
        if diff > 1e-2 * scale:
            print(f"moe_step: the stacks' forward outputs differ (max abs diff {diff:.4g}, "
                  f"output max {scale:.4g})", file=sys.stderr)
            return 1
    if rank == 0:
        report(args, world, results, idx)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def report(args, world, results, idx) -> None:
    import fabric_ep

    names = PARTS_F + (() if args.no_backward else PARTS_B)
    print(f"MoE step: {args.tokens} tokens/rank, hidden {args.hidden}, expert FFN {args.ffn}, "
          f"top-{args.topk} of {args.experts}, bf16, {world} rank(s), "
          f"{torch.cuda.get_device_name()}; fabric-ep SM budget {fabric_ep.Buffer.num_sms} "
          f"(NCCL: its own); medians of {args.iters} steps, us")
    head = f"{'stack':<14}" + "".join(f"{n:>14}" for n in names) + f"{'step':>12}{'comm share':>12}"
    print(head)
    for r in results:
        print(f"{r['stack']:<14}" + "".join(f"{r['parts_us'][n]:>14.1f}" for n in names)
              + f"{r['step_us']:>12.1f}{r['comm_share'] * 100:>11.1f}%")
    by = {r["stack"]: r for r in results}
    if len(by) == 2:
        ratio = by["nccl+permute"]["step_us"] / by["fabric-ep"]["step_us"]
        cratio = by["nccl+permute"]["comm_us"] / by["fabric-ep"]["comm_us"]
        print(f"step-time ratio nccl+permute / fabric-ep: {ratio:.3f} "
              f"(communication alone: {cratio:.3f})")
    proj = []
    experts_us = results[0]["experts_us"] if results else 0.0
    for n in args.model_ep:
        p = projection(idx, args, experts_us, n)
        proj.append(p)
        print(f"projection (arithmetic, not a measurement): {n} ranks at {args.link_gbps:g} GB/s "
              f"per GPU: {p['bytes_per_rank'] / 1e6:.1f} MB sent per rank per step -> "
              f"{p['comm_us']:.0f} us of communication beside {p['experts_us']:.0f} us of experts: "
              f"{p['comm_share'] * 100:.1f}% of the step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args) | {"ranks": world}, "results": results,
                       "projections": proj}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
