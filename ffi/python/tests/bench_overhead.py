"""Python call overhead of fabric_ep's dispatch/combine over its native module (1 rank, host
backend, a tiny call: T=4 tokens, H=128, K=1, 2 experts).

Two figures per call, each the best of several loops of N calls, timed with
``time.thread_time`` (CPU time of the calling thread, so a loaded machine's scheduling delays
do not count; the library's own proxy threads are not this thread):

* ``python_side_us``: ``Buffer.dispatch``/``Buffer.combine`` with the native calls (the
  engine's ``fabric_ep._core.Calls``) replaced by no-op Python stubs: all the Python work of a
  call (argument checks, pointer reads, output allocation, handle/event objects), plus the
  stubs' own call cost (a slight over-estimate).
* ``end_to_end_us`` vs ``raw_native_us``: the real calls through ``Buffer`` and the same native
  calls (``Calls.dispatch`` + ``copy_out`` + ``handle_destroy``; ``Calls.combine``: fep_dispatch,
  fep_handle_copy_out, fep_handle_destroy; fep_combine) made directly with their arguments and
  outputs prepared once; ``difference_us`` is their difference, and
  ``paired_median_difference_us`` the median of (real - raw) over back-to-back pairs (wall
  clock), which a busy machine disturbs far less.

Run: ``python3 ffi/python/tests/bench_overhead.py`` (prints JSON). Sets the torchrun variables
for one rank itself.
"""

import json
import os
import socket
import sys
import time

import numpy as np

T, H, K, E = 4, 128, 1, 2


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def best_us(fn, n=5000, reps=7, clock=time.thread_time):
    best = float("inf")
    for _ in range(reps):
        t0 = clock()
        for _ in range(n):
            fn()
        best = min(best, (clock() - t0) / n)
    return best * 1e6


def paired_median_us(real, raw, n, clock=time.perf_counter_ns):
    """Median over ``n`` back-to-back pairs of (real call - raw call), wall clock: a load spike
    or a preemption lands in a few pairs and leaves the median alone, unlike a difference of two
    separately timed loops."""
    d = []
    for _ in range(n):
        t0 = clock()
        real()
        t1 = clock()
        raw()
        t2 = clock()
        d.append((t1 - t0) - (t2 - t1))
    d.sort()
    return d[len(d) // 2] / 1e3


def measure(n=5000, reps=7):
    saved = dict(os.environ)
    try:
        return _measure(n, reps)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _measure(n_calls, reps):
    port = str(_free_port())
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port, FEP_MASTER_PORT=port,
                      FEP_JOB_ID=f"overhead-{os.getpid()}")
    import fabric_ep
    from fabric_ep._ext import core

    buf = fabric_ep.Buffer(None, num_experts=E, hidden=H, num_topk=K, explicitly_destroy=True)
    x = np.ones((T, H), np.uint16)
    idx = np.zeros((T, K), np.int64)
    w = np.ones((T, K), np.float32)
    rx, ri, rw, counts, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w)

    def py_dispatch():
        buf.dispatch(x, topk_idx=idx, topk_weights=w)

    def py_combine():
        buf.combine(rx, handle)

    # Raw: the same native calls, their arguments and outputs prepared once.
    eng = buf._order[0]
    n, p = eng._n, eng._ptr
    keep = [np.empty((T, H), np.uint16), np.empty((T, K), np.int64), np.empty((T, K), np.float32),
            np.empty((T, H), np.uint16)]
    ox, oi, ow, cx = (a.ctypes.data for a in keep)
    xp, ip, wp, rxp = x.ctypes.data, idx.ctypes.data, w.ctypes.data, rx.ctypes.data
    rows = handle.num_recv_tokens

    def raw_dispatch():
        hp, r = n.dispatch(p, xp, T, None, ip, wp, None, 1, 0)
        n.copy_out(hp, r, ox, None, oi, ow)
        core.handle_destroy(hp)

    def raw_combine():
        n.combine(p, handle._ptr, rxp, rows, None, cx, T, None)

    out = {"setting": dict(ranks=1, tokens=T, hidden=H, topk=K, experts=E, calls=n_calls, reps=reps,
                           clock="thread_time")}
    out["end_to_end_us"] = {"dispatch": best_us(py_dispatch, n_calls, reps),
                            "combine": best_us(py_combine, n_calls, reps)}
    out["raw_native_us"] = {"dispatch": best_us(raw_dispatch, n_calls, reps),
                            "combine": best_us(raw_combine, n_calls, reps)}
    out["difference_us"] = {k: out["end_to_end_us"][k] - out["raw_native_us"][k]
                            for k in ("dispatch", "combine")}
    out["paired_median_difference_us"] = {
        "dispatch": paired_median_us(py_dispatch, raw_dispatch, n_calls),
        "combine": paired_median_us(py_combine, raw_combine, n_calls)}

    class Stub:  # no-op native calls: what remains is the Python work
        counts = [0] * E  # one rank: every expert is local

        def dispatch(self, *a):
            return 0, T  # a NULL handle (freed as a no-op) and T rows

        def copy_out(self, *a):
            return self.counts

        def combine(self, *a):
            return None

    eng._n = Stub()
    try:
        out["python_side_us"] = {"dispatch": best_us(py_dispatch, n_calls, reps),
                                 "combine": best_us(py_combine, n_calls, reps)}
    finally:
        eng._n = n
    handle = None  # the native handle freed before the Buffer (the closures are done)
    buf.destroy()
    return out


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    print(json.dumps(measure(), indent=1))
