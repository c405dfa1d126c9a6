"""Python call overhead of fabric_ep's GPU backend over the C ABI (1 rank on the current GPU, a
tiny call: T=4 tokens, H=256, K=1, 2 experts; torch CUDA tensors, the Buffer's comm stream).

Per call (best of several loops of N calls):

* ``python_side_us``: ``Buffer.dispatch``/``combine`` with the C entry points replaced by no-op
  Python stubs: all the Python work of a call (argument checks, stream lookup, order packing,
  allocating the outputs, handle/event objects, and freeing the previous call's outputs),
  timed as CPU time of this thread.
* ``python_side_prealloc_us``: the same stubbed calls with the output allocation
  (``GpuPath.alloc_dispatch``/``alloc_combine``) replaced by a function returning tensors
  allocated once: the Python work of a call apart from allocating (and freeing) its outputs.
  ``python_side_alloc_us`` = ``python_side_us`` - ``python_side_prealloc_us``: the part spent
  allocating and freeing the ``tensors_allocated_per_call`` outputs (each returned tensor is
  its own allocation, so the caller may keep any of them alone).
* ``python_side_new_empty_us``: ``python_side_us`` of the dispatches with the outputs spelled
  ``Tensor.new_empty`` (the package's spelling until the seventh session) instead of
  ``torch.empty_strided`` (the package's now).
* ``alloc_separate_us`` vs ``alloc_one_block_us``: a bf16 dispatch's three returned tensors as
  three allocations (what the package does) vs one uint8 ``new_empty`` carved into the same
  three typed tensors (``view(dtype)`` + ``as_strided`` each, 256-byte aligned): whether one
  allocation per call would pay from Python.
* ``end_to_end_us`` vs ``raw_ctypes_us``: the real calls through ``Buffer`` and the same C calls
  through ctypes with descriptors and outputs prepared once (wall clock, ``perf_counter``;
  the two-step dispatch includes its host synchronisation on the GPU, so the GPU's time is in
  both); ``difference_us`` is their difference, ``paired_median_difference_us`` the median of
  (real - raw) over back-to-back pairs.

Three calls: ``dispatch`` (two-step: notify with a host synchronisation, allocate, dispatch),
``dispatch_worst`` (``num_worst_tokens``: no host synchronisation) and ``combine``.

Run: ``python3 ffi/python/tests/bench_overhead_gpu.py`` on a machine with torch and a GPU
(prints JSON).
"""

import ctypes
import json
import os
import sys
import time

T, H, K, E = 4, 256, 1, 2


def best_us(fn, n, reps, clock):
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


def measure(n=2000, reps=5):
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    import torch

    import fabric_ep
    from fabric_ep import _gpu, _lib
    from fabric_ep._arrays import tensor

    torch.cuda.set_device(0)
    dev = 0
    group = fabric_ep.ThreadGroup.create(1)[0]
    buf = fabric_ep.Buffer(group, num_experts=E, hidden=H, num_topk=K, explicitly_destroy=True,
                           backend="gpu")
    x = torch.ones((T, H), dtype=torch.bfloat16, device=dev)
    idx = torch.zeros((T, K), dtype=torch.int64, device=dev)
    w = torch.ones((T, K), dtype=torch.float32, device=dev)
    rx, ri, rw, counts, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w)
    rows = rx.shape[0]
    torch.cuda.synchronize()

    def py_dispatch():
        buf.dispatch(x, topk_idx=idx, topk_weights=w)

    def py_dispatch_worst():
        buf.dispatch(x, topk_idx=idx, topk_weights=w, num_worst_tokens=rows)

    def py_combine():
        buf.combine(rx, handle)

    lib = _lib.lib
    A = ctypes.addressof
    keep = []

    def t(a, code):
        d = tensor(a.data_ptr(), code, tuple(a.shape))
        keep.append((a, d))
        return A(d)

    xt, it, wt = t(x, 0), t(idx, 3), t(w, 2)
    oxt = t(torch.empty((rows, H), dtype=torch.bfloat16, device=dev), 0)
    oit = t(torch.empty((rows, K), dtype=torch.int64, device=dev), 3)
    owt = t(torch.empty((rows, K), dtype=torch.float32, device=dev), 2)
    ost = t(torch.empty((rows,), dtype=torch.int32, device=dev), 4)
    rxt = t(rx, 0)
    cxt = t(torch.empty((T, H), dtype=torch.bfloat16, device=dev), 0)
    comm = buf.get_comm_stream().cuda_stream
    compute = torch.cuda.current_stream().cuda_stream or 1  # 1: CU_STREAM_LEGACY
    order = _lib.fep_gpu_order(comm, compute, None, compute)
    order_after = _lib.fep_gpu_order(comm, None, None, compute)
    per_expert = (ctypes.c_int32 * 1)()
    hp, nrows = ctypes.c_void_p(), ctypes.c_int64()
    p = buf._ptr

    def raw(worst):
        def call():
            assert lib.fep_gpu_notify(p, it, 1, rows if worst else 0, A(order), A(hp), A(nrows),
                                      A(per_expert)) == 0
            assert lib.fep_gpu_dispatch(p, hp.value, xt, None, it, wt, oxt, None, oit, owt, ost,
                                        A(order_after)) == 0
            lib.fep_handle_destroy(hp.value)
        return call

    def raw_combine():
        assert lib.fep_gpu_combine(p, handle._ptr, rxt, None, cxt, None, A(order)) == 0

    calls = {"dispatch": (py_dispatch, raw(False)), "dispatch_worst": (py_dispatch_worst, raw(True)),
             "combine": (py_combine, raw_combine)}
    out = {"setting": dict(ranks=1, tokens=T, hidden=H, topk=K, experts=E, calls=n, reps=reps,
                           gpu=torch.cuda.get_device_name(dev), torch=torch.__version__)}
    for name in ("end_to_end_us", "raw_ctypes_us"):
        out[name] = {}
    for c, (py, rw_) in calls.items():
        out["end_to_end_us"][c] = best_us(py, n, reps, time.perf_counter)
        torch.cuda.synchronize()
        out["raw_ctypes_us"][c] = best_us(rw_, n, reps, time.perf_counter)
        torch.cuda.synchronize()
    out["difference_us"] = {c: out["end_to_end_us"][c] - out["raw_ctypes_us"][c] for c in calls}
    out["paired_median_difference_us"] = {c: paired_median_us(py, rw_, n)
                                          for c, (py, rw_) in calls.items()}
    torch.cuda.synchronize()

    class Stub:  # no-op C entry points: what remains is the Python work
        def fep_gpu_notify(self, *a):
            return 0

        def fep_gpu_dispatch(self, *a):
            return 0

        def fep_gpu_combine(self, *a):
            return 0

    real = _gpu.lib
    g = buf._g
    buf._out_rows.value = rows
    buf._out_handle.value = 0  # the stubbed notify "returns" a NULL handle (freed as a no-op)
    pre_d = g.alloc_dispatch(rows, x, False)
    pre_c = g.alloc_combine(T, rx, False)
    _gpu.lib = Stub()
    try:
        out["python_side_us"] = {c: best_us(py, n, reps, time.thread_time)
                                 for c, (py, _) in calls.items()}
        # Instance attributes shadow the methods: the call sites are unchanged.
        g.alloc_dispatch = lambda rows_, like, fp8: pre_d
        g.alloc_combine = lambda t_, like, with_w: pre_c
        try:
            out["python_side_prealloc_us"] = {c: best_us(py, n, reps, time.thread_time)
                                              for c, (py, _) in calls.items()}
        finally:
            del g.alloc_dispatch, g.alloc_combine
        # The same outputs spelled Tensor.new_empty (the spelling before the seventh session)
        # instead of torch.empty_strided: which a dispatch pays less for, inside the real call.
        li64, lf32 = g._like_i64, g._like_f32

        def alloc_new_empty(rows_, like, fp8):
            return (like.new_empty((rows_, H)), None, li64.new_empty((rows_, K)),
                    lf32.new_empty((rows_, K)))

        g.alloc_dispatch = alloc_new_empty
        try:
            out["python_side_new_empty_us"] = {
                c: best_us(py, n, reps, time.thread_time)
                for c, (py, _) in calls.items() if c != "combine"}
        finally:
            del g.alloc_dispatch
    finally:
        _gpu.lib = real
    out["python_side_alloc_us"] = {c: out["python_side_us"][c] - out["python_side_prealloc_us"][c]
                                   for c in calls}
    n_d = sum(a is not None for a in pre_d)
    out["tensors_allocated_per_call"] = {"dispatch": n_d, "dispatch_worst": n_d,
                                         "combine": sum(a is not None for a in pre_c)}

    # One allocation carved into the typed outputs vs one allocation each (bf16 dispatch).
    def align(b, a=256):
        return (b + a - 1) // a * a

    parts = [((rows, H), torch.bfloat16, 2), ((rows, K), torch.int64, 8),
             ((rows, K), torch.float32, 4)]
    offs, total = [], 0
    for shape, _, size in parts:
        offs.append(total)
        total += align(shape[0] * shape[1] * size)
    u8 = torch.empty(0, dtype=torch.uint8, device=dev)

    def carved():
        blk = u8.new_empty((total,))
        return tuple(blk.view(dt).as_strided(shape, (shape[1], 1), off // size)
                     for (shape, dt, size), off in zip(parts, offs))

    def separate():
        return g.alloc_dispatch(rows, x, False)

    out["alloc_separate_us"] = best_us(separate, n, reps, time.thread_time)
    out["alloc_one_block_us"] = best_us(carved, n, reps, time.thread_time)
    # For scale: one torch.empty on the GPU and one torch.cuda.current_stream() (both per call).
    out["torch_empty_us"] = best_us(lambda: torch.empty((rows, H), dtype=torch.bfloat16,
                                                        device=dev), n, reps, time.thread_time)
    out["current_stream_us"] = best_us(lambda: torch.cuda.current_stream(dev), n, reps,
                                       time.thread_time)
    out["new_empty_us"] = best_us(lambda: x.new_empty((rows, H)), n, reps, time.thread_time)
    raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw_stream is not None:
        out["raw_current_stream_us"] = best_us(lambda: raw_stream(dev), n, reps, time.thread_time)
    torch.cuda.synchronize()
    buf.destroy()
    return out


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    print(json.dumps(measure(), indent=1))
