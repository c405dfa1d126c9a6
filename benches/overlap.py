"""Dispatch and combine on the communication stream while the caller's stream runs GEMMs,
through the installed package (DeepEP's overlap form: ``previous_event``, ``async_finish=True``,
``allocate_on_comm_stream=True``).

    python3 benches/overlap.py                 # DeepEP's shape, 24-SM budget, 1 rank
    python3 benches/overlap.py --sms 32 --iters 40
    python3 benches/overlap.py --gemm-carveout 24   # the GEMMs leave the library's 24 SMs free

Per op (cached-handle dispatch of fp8 ``(x, scales)``, combine of bf16 rows) it times, with CUDA
events recorded on the communication stream around each call:

* **alone**: the op with nothing else on the GPU;
* **beside GEMMs**: the same op while the compute stream runs a chain of bf16 matmuls
  (``--gemm`` square; the op's ``previous_event`` was recorded before them, so the
  communication stream does not wait for them), in both orders: the GEMMs enqueued first (they
  fill the GPU; the op's blocks get SMs as the GEMM's retire, sooner on a high-priority
  stream) and the op first (it holds its SMs; the GEMM runs on the others).

and the GEMM chain's own time alone and beside the ops. Printed: medians, the ops' slowdown
(beside / alone) and the GEMMs'. Every op's output is checked once against the first run's.
Ranks: the torchrun variables when set (one process per GPU, or sharing one under MPS), else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--sms", type=int, default=24, help="the library's SM budget (default 24)")
    p.add_argument("--gemm", type=int, default=8192, help="GEMM size n (n x n x n, bf16)")
    p.add_argument("--gemm-carveout", type=int, default=0,
                   help="SMs the GEMMs leave free (torch's cuBLAS SM carve-out, as a deployment "
                        "that sizes its GEMMs around the communication kernels does); 0: none")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", help="write the figures here")
    return p.parse_args()


def fp8_cast(x: torch.Tensor):
    t, h = x.shape
    g = x.float().view(t, h // 128, 128)
    scale = (g.abs().amax(-1).clamp(min=1e-4) / 448.0)
    q = (g / scale[..., None]).view(t, h).to(torch.float8_e4m3fn)
    return q, scale.contiguous()


def main() -> int:
    a = parse()
    import fabric_ep
    from fabric_ep import Buffer, EventOverlap

    if "MASTER_ADDR" not in os.environ:  # one rank without a launcher: the store on loopback
        import socket

        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    group = None
    if world > 1:
        dist.init_process_group("gloo")
        group = dist.group.WORLD
    Buffer.set_num_sms(a.sms)
    if a.gemm_carveout:
        setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
        if setter is None:
            print("--gemm-carveout: this torch has no _set_sm_carveout_experimental",
                  file=sys.stderr)
            return 2
        setter(a.gemm_carveout)
        # The carve-out reaches cuBLASLt's matmuls (its SM-count target), not cuBLAS's.
        torch.backends.cuda.preferred_blas_library("cublaslt")
    cfg = Buffer.get_dispatch_config(world)
    nvl = cfg.get_nvl_buffer_size_hint(a.hidden * 2, world)
    buf = Buffer(group, nvl, 0, explicitly_destroy=True)
    gen = torch.Generator(device=dev).manual_seed(1234 + rank)
    x = torch.randn((a.tokens, a.hidden), device=dev, generator=gen).to(torch.bfloat16)
    scores = torch.rand((a.tokens, a.experts), device=dev, generator=gen)
    topk_idx = scores.topk(a.topk, dim=1).indices.to(torch.int64)
    topk_w = torch.rand((a.tokens, a.topk), device=dev, generator=gen)
    xq = fp8_cast(x)
    layout = buf.get_dispatch_layout(topk_idx, a.experts)
    recv, _, _, _, handle, _ = buf.dispatch(xq, num_tokens_per_rank=layout[0],
                                            is_token_in_rank=layout[3],
                                            num_tokens_per_expert=layout[2],
                                            topk_idx=topk_idx, topk_weights=topk_w)
    rows = recv[0].shape[0]
    y = torch.randn((rows, a.hidden), device=dev, generator=gen).to(torch.bfloat16)
    comm = buf.get_comm_stream()
    compute = torch.cuda.current_stream()
    ga = torch.randn((a.gemm, a.gemm), device=dev, dtype=torch.bfloat16)
    gb = torch.randn((a.gemm, a.gemm), device=dev, dtype=torch.bfloat16)
    gout = torch.empty_like(ga)
    chain = 8

    def op(kind: str, prev: EventOverlap):
        if kind == "dispatch":
            out = buf.dispatch(xq, handle=handle, previous_event=prev, async_finish=True,
                               allocate_on_comm_stream=True)
            return out[0][0].view(torch.uint8), out[-1]
        out = buf.combine(y, handle, previous_event=prev, async_finish=True,
                          allocate_on_comm_stream=True)
        return out[0], out[-1]

    def gemms():
        for _ in range(chain):
            torch.matmul(ga, gb, out=gout)

    ref = {}
    res = {}
    for kind in ("dispatch", "combine"):
        # Alternated: drift hits every condition alike.
        for beside in ("alone", "gemm_first", "op_first") * 2:
            times, gemm_times = [], []
            for it in range(a.iters + 3):
                if world > 1:
                    dist.barrier()
                torch.cuda.synchronize()
                e0 = torch.cuda.Event()
                e0.record(compute)
                g0, g1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if beside == "gemm_first":
                    g0.record(compute)
                    gemms()
                    g1.record(compute)
                s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s0.record(comm)
                out, ev = op(kind, EventOverlap(e0))
                s1.record(comm)
                if beside == "op_first":
                    g0.record(compute)
                    gemms()
                    g1.record(compute)
                ev.current_stream_wait()
                torch.cuda.synchronize()
                if it < 3:
                    continue  # warm-up
                if kind not in ref:
                    ref[kind] = out.clone()
                elif not torch.equal(out, ref[kind]):
                    print(f"{kind}: output differs between runs", file=sys.stderr)
                    return 1
                times.append(s0.elapsed_time(s1) * 1e3)
                if beside != "alone":
                    gemm_times.append(g0.elapsed_time(g1) * 1e3)
                    if s1.elapsed_time(g1) < 0:
                        print(f"{kind}: the op outlasted the GEMM chain (not beside it); "
                              "use a larger --gemm", file=sys.stderr)
            res.setdefault(f"{kind}_{beside}", []).extend(times)
            if beside != "alone":
                res.setdefault(f"gemm_{beside}_{kind}", []).extend(gemm_times)
    # The GEMM chain alone.
    g_alone = []
    for _ in range(a.iters):
        g0, g1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g0.record(compute)
        gemms()
        g1.record(compute)
        torch.cuda.synchronize()
        g_alone.append(g0.elapsed_time(g1) * 1e3)
    med = {k: statistics.median(v) for k, v in res.items()}
    med["gemm_alone"] = statistics.median(g_alone)
    if rank == 0:
        print(f"fabric_ep from {os.path.dirname(fabric_ep.__file__)}: ranks {world}, SM budget {a.sms}, {a.tokens} tokens, hidden {a.hidden}, "
              f"top-{a.topk} of {a.experts}; GEMM chain {chain} x {a.gemm}^3 bf16, "
              f"{a.gemm_carveout} SMs carved out of it; "
              f"medians of {a.iters * 2} (us)")
        ga_ = med["gemm_alone"]
        print(f"GEMM chain alone {ga_:.1f}")
        for kind in ("dispatch", "combine"):
            al = med[f"{kind}_alone"]
            for order in ("gemm_first", "op_first"):
                be, gb_ = med[f"{kind}_{order}"], med[f"gemm_{order}_{kind}"]
                print(f"{kind:9s} {order:10s}: op alone {al:8.1f}  beside GEMMs {be:8.1f} "
                      f"({be / al:.3f}x);  GEMM chain beside it {gb_:9.1f} ({gb_ / ga_:.3f}x)")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"settings": vars(a), "ranks": world, "medians_us": med}, f, indent=1)
    buf.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
