"""One rank of the torch test: bootstrap over a torch.distributed (gloo) group instead of the
environment, torch CPU tensors in and out (bf16 as torch.bfloat16)."""

import os
import sys

import torch
import torch.distributed as dist

from fabric_ep import Buffer

H, K, L = 128, 2, 2


def main():
    dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    r, n = dist.get_rank(), dist.get_world_size()
    os.environ.pop("FEP_MASTER_PORT", None)  # the group, not fabric-ep's store, bootstraps
    buf = Buffer(dist.group.WORLD, num_experts=L * n, hidden=H, num_topk=K, timeout_s=30.0,
                 explicitly_destroy=True)
    assert (buf.rank, buf.num_ranks) == (r, n)
    g = torch.Generator().manual_seed(100 + r)
    t = 10 + 3 * r
    x = torch.randint(-8, 9, (t, H), generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(L * n, generator=g)[:K] for _ in range(t)]).to(torch.int64)
    w = torch.ones((t, K), dtype=torch.float32)
    n_rank, n_rdma, n_exp, in_rank, _ = buf.get_dispatch_layout(idx, L * n)
    assert isinstance(n_rank, torch.Tensor) and n_rank.dtype == torch.int32
    rx, ri, rw, counts, handle, _ = buf.dispatch(x, num_tokens_per_rank=n_rank,
                                                 is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=n_exp, topk_idx=idx,
                                                 topk_weights=w)
    assert rx.dtype == torch.bfloat16 and ri.dtype == torch.int64
    # Every rank's received count, gathered over the group, must equal what was sent to it.
    sent = torch.zeros(n, dtype=torch.int64)
    dist.all_reduce(sent.add_(n_rank.to(torch.int64)))
    assert rx.shape[0] == int(sent[r]), (rx.shape, sent)
    cx, _, _ = buf.combine(rx, handle)
    dests = in_rank.sum(1, dtype=torch.float32)
    assert torch.equal(cx.float(), x.float() * dests[:, None]), "combine != x * destinations"
    if torch.cuda.is_available():
        try:
            buf.dispatch(x.cuda(), topk_idx=idx, topk_weights=w)
        except ValueError as e:
            assert str(e).startswith("x: tensor is on cuda"), e
        else:
            raise AssertionError("a CUDA tensor was accepted by the host backend")
    buf.destroy()

    # Low-latency mode with torch tensors: bf16 round trip and fp8 output dtypes.
    ll = Buffer(dist.group.WORLD, 0, 0, True, num_experts=L * n, hidden=H, num_topk=K,
                num_max_dispatch_tokens_per_rank=16, timeout_s=30.0, explicitly_destroy=True)
    rx, cnt, lh, _, hook = ll.low_latency_dispatch(x, idx, 16, L * n, use_fp8=False,
                                                   return_recv_hook=True)
    hook()
    assert rx.dtype == torch.bfloat16 and rx.shape == (L, n * 16, H) and cnt.dtype == torch.int32
    y, _, _ = ll.low_latency_combine(rx, idx, w, lh)
    assert torch.equal(y.float(), x.float() * idx.ge(0).sum(1, dtype=torch.float32)[:, None])
    (q, sc), cnt2, _, _, _ = ll.low_latency_dispatch(x, idx, 16, L * n)
    assert q.dtype == getattr(torch, "float8_e4m3fn", torch.uint8) and sc.dtype == torch.float32
    assert torch.equal(cnt, cnt2)
    deq = q.float() * sc.repeat_interleave(128, dim=2)
    assert torch.allclose(deq, rx.float(), rtol=0.07, atol=0.0), "fp8 rows too far off"
    ll.destroy()
    dist.destroy_process_group()
    print(f"rank {r}/{n}: ok (torch {torch.__version__}, cuda={torch.cuda.is_available()})")


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.exit(1)
