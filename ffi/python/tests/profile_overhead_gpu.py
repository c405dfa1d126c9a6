"""Where the Python side of a GPU ``Buffer.dispatch`` call goes (the C entry points stubbed, as
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
    from fabric_ep import _gpu
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

    class Stub:
        def fep_gpu_notify(self, *a):
            return 0

        def fep_gpu_dispatch(self, *a):
            return 0

        def fep_gpu_combine(self, *a):
            return 0

    real = _gpu.lib
    buf._out_rows.value = rows
    buf._out_handle.value = 0
    out = {}
    _gpu.lib = Stub()
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
        _gpu.lib = real
    d = torch.device("cuda", 0)
    w_ = g._nb.w

    def stores_in():  # what a dispatch writes into its block before the notify (bf16)
        w_[1] = 2
        w_[2] = 0
        w_[3] = w_[7] = 2
        w_[8] = 5
        w_[10] = w_[22] = w_[28] = T
        w_[20] = 6
        w_[26] = 7

    def stores_out():  # and after allocating its outputs
        w_[32] = 1
        w_[34] = w_[46] = w_[52] = w_[58] = rows
        w_[44] = 3
        w_[50] = 4
        w_[56] = 5

    parts = {
        "t2_x": lambda: g.t2("x", x, g.bf16, None, H),
        "t2n_idx": lambda: g.t2n("topk_idx", idx, g.i64s, T, K),
        "raw_stream": lambda: g._raw_stream(0),
        "stores_in_11": stores_in,
        "stores_out_9": stores_out,
        "handle_new_and_free": lambda: DispatchHandle(0, 1, T, rows),
        "per_expert_tolist": lambda: g._per_expert.tolist(),
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
