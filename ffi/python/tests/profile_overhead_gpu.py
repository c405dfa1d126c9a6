"""Where the Python side of a GPU ``Buffer.dispatch`` call goes (the native calls stubbed, as
``bench_overhead_gpu.py``'s ``python_side_us``): a cProfile of stubbed dispatches (tottime per
function, builtins included; the profiler's own cost inflates the many small calls) and the
best-of loop time of each piece the call makes, alone.

Run: ``python3 ffi/python/tests/profile_overhead_gpu.py`` on a machine with torch and a GPU.
"""

import cProfile
import io
import json
import os
import pstats
import sys
import time

T, H, K, E = 4, 256, 1, 2


def best_us(fn, n=2000, reps=5):
    best = float("inf")
    for _ in range(reps):
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        best = min(best, (time.thread_time() - t0) / n)
    return round(best * 1e6, 3)


def main():
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    import torch

    import fabric_ep
    from fabric_ep.buffer import DispatchHandle
    from fabric_ep.utils import EventOverlap

    torch.cuda.set_device(0)
    group = fabric_ep.ThreadGroup.create(1)[0]
    buf = fabric_ep.Buffer(group, num_experts=E, hidden=H, num_topk=K, explicitly_destroy=True,
                           backend="gpu")
    x = torch.ones((T, H), dtype=torch.bfloat16, device=0)
    idx = torch.zeros((T, K), dtype=torch.int64, device=0)
    w = torch.ones((T, K), dtype=torch.float32, device=0)
    rx, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w)
    rows = rx.shape[0]
    torch.cuda.synchronize()
    g = buf._g

    class Stub:  # no-op native calls: the notify "returns" a NULL handle and `rows` rows
        def gpu_notify(self, *a):
            return 0, rows, [0] * E

        def gpu_dispatch(self, *a):
            return None

        def gpu_combine(self, *a):
            return None

    real = g._n
    out = {}
    g._n = Stub()
    try:
        def call():
            buf.dispatch(x, topk_idx=idx, topk_weights=w)

        out["dispatch_stubbed_us"] = best_us(call)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(20000):
            call()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
        print(s.getvalue())
    finally:
        g._n = real
    d = torch.device("cuda", 0)
    p = buf._ptr
    xp, ip, wp = x.data_ptr(), idx.data_ptr(), w.data_ptr()
    rxp = rx.data_ptr()

    def native_stub_args():  # a dispatch's two native calls' argument passing, stubbed
        stub = Stub()
        stub.gpu_notify(p, ip, T, 1, 0, 2, 0, False)
        stub.gpu_dispatch(p, 0, xp, None, T, ip, wp, rxp, None, rows, 3, 4, True, 2, 0, False)

    parts = {
        "t2_x": lambda: g.t2("x", x, g.bf16, None, H),
        "t2n_idx": lambda: g.t2n("topk_idx", idx, g.i64s, T, K),
        "raw_stream": lambda: g._raw_stream(0),
        "native_calls_2_stubbed": native_stub_args,
        "handle_new_and_free": lambda: DispatchHandle(0, 1, T, rows),
        "event_overlap_none": lambda: EventOverlap(None),  # what a call returned before the
        #                                                   shared read-only NO_EVENT
        "alloc_dispatch_3": lambda: g.alloc_dispatch(rows, x, False, False, False),
        "empty_strided_1": lambda: torch.empty_strided((rows, H), (H, 1), dtype=torch.bfloat16,
                                                       device=d),
        "empty_like_1": lambda: torch.empty_like(rx),
        "data_ptr": lambda: rx.data_ptr(),
        "shape": lambda: rx.shape,
        "dtype_in": lambda: rx.dtype in g.bf16,
        "get_device": lambda: rx.get_device(),
        "is_contiguous": lambda: rx.is_contiguous(),
        "stride": lambda: rx.stride(),
        "size0": lambda: rx.size(0),
        "type_is": lambda: type(rx) is torch.Tensor,
        "empty_python_call": lambda: None,
    }
    out["parts_us"] = {k: best_us(f) for k, f in parts.items()}
    buf.destroy()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    main()
