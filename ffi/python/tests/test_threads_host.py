"""Host-backend ranks as threads of one process over a ThreadGroup (runs in CI): the native
buffers are created and destroyed over the group's all-gather, which the library calls back
from each rank's thread (with the GIL released around the native call, so the peer thread runs
its part), during the connect and again in the destroy's barrier; a dispatch/combine between
them checks the data."""

import threading

import numpy as np

import fabric_ep

E, H, K, T = 4, 128, 2, 3


def _rank(group, out):
    r = group.rank()
    try:
        buf = fabric_ep.Buffer(group, num_experts=E, hidden=H, num_topk=K, backend="host",
                               explicitly_destroy=True, timeout_s=20.0, provider="shm")
        x = np.full((T, H), r + 1, np.uint16)
        idx = np.array([[0, 3]] * T, np.int64)  # experts 0 (rank 0) and 3 (rank 1)
        w = np.ones((T, K), np.float32)
        rx, ri, rw, counts, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                                     num_tokens_per_expert=np.zeros(E, np.int32))
        cx, _, _ = buf.combine(rx, handle)
        out[r] = (rx.shape[0], sorted(set(rx[:, 0].tolist())), counts)
        del handle
        buf.destroy()
        out[r] += (True,)
    except BaseException as e:  # noqa: BLE001 - reported by the test
        out[r] = e


def test_two_thread_ranks_create_dispatch_and_destroy_over_the_group():
    groups = fabric_ep.ThreadGroup.create(2, timeout_s=30.0)
    out = [None, None]
    threads = [threading.Thread(target=_rank, args=(g, out)) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank thread hung"
    for r in (0, 1):
        assert not isinstance(out[r], BaseException), out[r]
        rows, values, counts, destroyed = out[r]
        # Every token of both ranks reaches both ranks (one of its experts on each): rank 0
        # holds experts 0 and 1, rank 1 experts 2 and 3.
        assert (rows, values) == (2 * T, [1, 2]), out[r]
        assert counts == ([2 * T, 0] if r == 0 else [0, 2 * T]), out[r]
        assert destroyed
