#!/usr/bin/env python3
"""A normal-mode dispatch and combine on the host backend through the Python package: two ranks
as threads of this process (``fabric_ep.ThreadGroup``; a real job passes its
``torch.distributed`` group, or None to join the torchrun variables), numpy arrays, libfabric's
``shm`` provider. No GPU and no torch needed.

Each rank sends its tokens to the ranks that hold their top-k experts, returns what it received
unchanged, and checks the combine: a token comes back as the sum over the distinct ranks it went
to, so ``combined = x * destination ranks``.

    PYTHONPATH=ffi/python python3 ffi/python/examples/host_roundtrip.py
"""

import threading

import numpy as np

import fabric_ep

RANKS, EXPERTS, HIDDEN, TOPK, TOKENS = 2, 8, 256, 2, 6


def bf16(v: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16); exact for the small integers used here."""
    return (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def rank_main(group: fabric_ep.ThreadGroup, errors: list) -> None:
    r = group.rank()
    try:
        buf = fabric_ep.Buffer(group, num_experts=EXPERTS, hidden=HIDDEN, num_topk=TOPK,
                               backend="host", provider="shm", timeout_s=30.0,
                               explicitly_destroy=True)
        # Token t of rank r: every channel r * TOKENS + t + 1; experts spread over both ranks.
        values = np.arange(TOKENS, dtype=np.float32) + r * TOKENS + 1
        x = bf16(np.repeat(values[:, None], HIDDEN, axis=1))
        topk_idx = np.array([[(t + r) % EXPERTS, (3 * t + 1 + r) % EXPERTS]
                             for t in range(TOKENS)], np.int64)
        topk_weights = np.ones((TOKENS, TOPK), np.float32)
        n_rank, n_rdma, n_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, EXPERTS)
        recv_x, _, _, per_expert, handle, _ = buf.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=n_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=n_expert)
        # The experts would run here; this rank returns its rows as they came.
        combined_x, _, _ = buf.combine(recv_x, handle)
        dest_ranks = np.array([len({int(e) // (EXPERTS // RANKS) for e in row})
                               for row in topk_idx])
        want = values * dest_ranks
        assert (f32(combined_x) == want[:, None]).all(), f"rank {r}: combine differs"
        print(f"rank {r}: dispatched {TOKENS} tokens, received {recv_x.shape[0]} rows "
              f"({per_expert} per local expert), combine matches")
        del handle
        buf.destroy()  # a collective: every rank destroys its buffer
    except BaseException as e:  # noqa: BLE001 - reported by the main thread
        errors.append(f"rank {r}: {e!r}")


def main() -> None:
    errors: list = []
    threads = [threading.Thread(target=rank_main, args=(g, errors))
               for g in fabric_ep.ThreadGroup.create(RANKS, timeout_s=30.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors or any(t.is_alive() for t in threads):
        raise SystemExit("\n".join(errors) or "a rank thread hung")
    print(f"{RANKS} ranks over shm: every combine matches its input")


if __name__ == "__main__":
    main()
