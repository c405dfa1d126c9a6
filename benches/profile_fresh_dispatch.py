"""Where a fresh normal dispatch's time goes through the installed package, at a real shape
(one rank; host wall time around each call, the device synchronised before and after):
``get_dispatch_layout``, ``dispatch`` with the layout's outputs (fresh handle), ``dispatch``
with the cached handle, ``combine``. Medians of ``--iters`` calls, us.

    python3 benches/profile_fresh_dispatch.py [--tokens 4096 --hidden 7168 --topk 8 --experts 256]
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import fabric_ep


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--fp8", action="store_true", help="dispatch (x, scales) instead of bf16")
    a = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    g = torch.Generator(device=dev).manual_seed(1)
    t, h, k, e = a.tokens, a.hidden, a.topk, a.experts
    x = torch.randn((t, h), device=dev, generator=g).to(torch.bfloat16)
    if a.fp8:
        x = (x.to(torch.float8_e4m3fn), torch.ones((t, h // 128), device=dev))
    idx = torch.rand((t, e), device=dev, generator=g).topk(k, dim=1).indices.contiguous()
    w = torch.rand((t, k), device=dev, generator=g)
    nvl = fabric_ep.Buffer.get_dispatch_config(1).get_nvl_buffer_size_hint(h * 2, 1)
    buf = fabric_ep.Buffer(dist.group.WORLD, nvl, 0, explicitly_destroy=True)
    times = {}

    def timed(name, fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.setdefault(name, []).append((time.perf_counter() - t0) * 1e6)
        return out

    for it in range(a.iters + 3):
        lay = timed("get_dispatch_layout", lambda: buf.get_dispatch_layout(idx, e))
        ntr, ntrr, nte, inr, _ = lay
        out = timed("dispatch, fresh (layout given)", lambda: buf.dispatch(
            x, num_tokens_per_rank=ntr, num_tokens_per_rdma_rank=ntrr, is_token_in_rank=inr,
            num_tokens_per_expert=nte, topk_idx=idx, topk_weights=w))
        rx, _, _, _, handle, _ = out
        timed("dispatch, cached", lambda: buf.dispatch(x, handle=handle))
        y = rx if not isinstance(rx, tuple) else rx[0].to(torch.bfloat16)
        timed("combine", lambda: buf.combine(y, handle))
        if it < 3:
            times.clear()
    print(f"fresh-dispatch profile: {t} tokens, hidden {h}, top-{k} of {e}, "
          f"{'fp8' if a.fp8 else 'bf16'}, 1 rank, {torch.cuda.get_device_name()}; host wall with "
          f"the device synchronised around each call, medians of {a.iters}, us")
    for name, v in times.items():
        print(f"  {name:<34} {statistics.median(v):9.1f}  (min {min(v):.1f}, max {max(v):.1f})")
    # The same pair under torch's profiler: which torch calls and kernels the time holds.
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            ntr, ntrr, nte, inr, _ = buf.get_dispatch_layout(idx, e)
            buf.dispatch(x, num_tokens_per_rank=ntr, num_tokens_per_rdma_rank=ntrr,
                         is_token_in_rank=inr, num_tokens_per_expert=nte, topk_idx=idx,
                         topk_weights=w)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
