"""What one CUDA tensor allocation costs from Python, by spelling (issue 6: a dispatch returns
three tensors and allocating them is most of its Python-side time), and the stream and event
work of the asynchronous calls (``stream_ops``).

Each figure: best of 5 loops of N iterations, CPU time of this thread per allocation (the tensor
is dropped at once, so its free is included), on the current CUDA device. Prints JSON.

Run: ``python3 scripts/bench_torch_alloc.py`` on a machine with torch and a GPU.
"""

import ctypes
import json
import os
import time

import torch

N = 20000


def best_us(fn, n=N, reps=5):
    best = float("inf")
    for _ in range(reps):
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        best = min(best, (time.thread_time() - t0) / n)
    return round(best * 1e6, 3)


def main():
    dev = torch.device("cuda", torch.cuda.current_device())
    rows, h, k = 4, 256, 1
    like = torch.empty((rows, h), dtype=torch.bfloat16, device=dev)
    like_f32 = torch.empty((1,), dtype=torch.float32, device=dev)
    shape = (rows, h)
    out = {
        "torch_version": torch.__version__,
        "new_empty_tuple": best_us(lambda: like.new_empty((rows, h))),
        "new_empty_cached_shape": best_us(lambda: like.new_empty(shape)),
        "new_empty_other_dtype": best_us(lambda: like_f32.new_empty(shape)),
        "empty_like": best_us(lambda: torch.empty_like(like)),
        "empty_kwargs": best_us(lambda: torch.empty(shape, dtype=torch.bfloat16, device=dev)),
        "empty_strided": best_us(
            lambda: torch.empty_strided(shape, (h, 1), dtype=torch.bfloat16, device=dev)),
        "new_empty_strided": best_us(lambda: like.new_empty_strided(shape, (h, 1))),
        "empty_strided_x3": best_us(
            lambda: (torch.empty_strided(shape, (h, 1), dtype=torch.bfloat16, device=dev),
                     torch.empty_strided((rows, k), (k, 1), dtype=torch.int64, device=dev),
                     torch.empty_strided((rows, k), (k, 1), dtype=torch.float32, device=dev))),
        "new_empty_x3": best_us(lambda: (like.new_empty(shape), like_f32.new_empty((rows, k)),
                                         like_f32.new_empty((rows, k)))),
        "empty_like_x3": best_us(lambda: (torch.empty_like(like), torch.empty_like(like_f32),
                                          torch.empty_like(like_f32))),
        "data_ptr": best_us(lambda: like.data_ptr()),
        "raw_current_stream": best_us(
            lambda: torch._C._cuda_getCurrentRawStream(dev.index)),
    }
    # A dispatch's four outputs (fp8 recv_x, scales, idx, weights) by spelling, before the shim
    # part below (it leaks handles into the allocator's pools).
    g = h // 128
    f8 = torch.empty(0, dtype=torch.float8_e4m3fn, device=dev)
    f32 = torch.empty(0, dtype=torch.float32, device=dev)
    i64 = torch.empty(0, dtype=torch.int64, device=dev)
    es = torch.empty_strided
    out["x4_new_empty"] = best_us(
        lambda: (f8.new_empty((rows, h)), f32.new_empty((rows, g)), i64.new_empty((rows, k)),
                 f32.new_empty((rows, k))))
    out["x4_empty_strided"] = best_us(
        lambda: (es((rows, h), (h, 1), dtype=torch.float8_e4m3fn, device=dev),
                 es((rows, g), (g, 1), dtype=torch.float32, device=dev),
                 es((rows, k), (k, 1), dtype=torch.int64, device=dev),
                 es((rows, k), (k, 1), dtype=torch.float32, device=dev)))
    out.update(aoti_shim(dev, rows, h, k))
    out.update(stream_ops(dev, rows, h))
    print(json.dumps(out))


def stream_ops(dev, rows, h):
    """What the asynchronous calls' stream work costs from Python (DeepEP's ``async_finish``,
    ``previous_event`` and ``allocate_on_comm_stream``): switching the current stream around an
    allocation, making a stream object, ``record_stream``, making and recording an event; each
    by torch's public spelling and by the lower one under it (``torch._C``)."""
    res = {}
    C = torch._C
    idx = dev.index
    comm = torch.cuda.Stream(device=dev)
    like = torch.empty((rows, h), dtype=torch.bfloat16, device=dev)
    st = (h, 1)
    cur = torch.cuda.current_stream(dev)
    cid = (comm.stream_id, comm.device_index, comm.device_type)

    def ctx_alloc():
        with torch.cuda.stream(comm):
            return like.new_empty_strided((rows, h), st)

    set_stream = getattr(C, "_cuda_setStream", None)
    get_stream = getattr(C, "_cuda_getCurrentStream", None)
    res["alloc_only"] = best_us(lambda: like.new_empty_strided((rows, h), st))
    res["stream_ctx_alloc"] = best_us(ctx_alloc)
    if set_stream is not None and get_stream is not None:
        def raw_alloc():
            prev = get_stream(idx)
            set_stream(stream_id=cid[0], device_index=cid[1], device_type=cid[2])
            try:
                return like.new_empty_strided((rows, h), st)
            finally:
                set_stream(stream_id=prev[0], device_index=prev[1], device_type=prev[2])

        res["raw_set_stream_alloc"] = best_us(raw_alloc)
        res["get_current_stream_tuple"] = best_us(lambda: get_stream(idx))
        s = get_stream(idx)
        res["torch_Stream_from_ids"] = best_us(
            lambda: torch.Stream(stream_id=s[0], device_index=s[1], device_type=s[2]))
        res["cuda_Stream_from_ids"] = best_us(
            lambda: torch.cuda.Stream(stream_id=s[0], device_index=s[1], device_type=s[2]))
    res["current_stream"] = best_us(lambda: torch.cuda.current_stream(dev))
    # record_stream: on the allocation stream (the allocator ignores it) and on another one;
    # each on a fresh tensor (one record per tensor, as a call makes), minus the allocation.
    res["alloc_record_same_stream"] = best_us(
        lambda: like.new_empty_strided((rows, h), st).record_stream(cur))
    res["alloc_record_other_stream"] = best_us(
        lambda: like.new_empty_strided((rows, h), st).record_stream(comm))
    torch.cuda.synchronize()
    res["event_new"] = best_us(lambda: torch.cuda.Event())
    res["event_new_record"] = best_us(lambda: torch.cuda.Event().record(comm))
    base_new, base_record = C._CudaEventBase.__new__, C._CudaEventBase.record
    Event = torch.cuda.Event

    def low_event():
        e = base_new(Event)
        base_record(e, comm)
        return e

    res["event_new_record_base"] = best_us(low_event)
    torch.cuda.synchronize()
    return res


def aoti_shim(dev, rows, h, k):
    """The same four outputs a dispatch makes (recv_x, scales, idx, weights), allocated through
    libtorch's C shim (``aoti_torch_empty_strided``, the entry AOTInductor's generated code calls)
    from ctypes and wrapped into Python tensors by one ``torch._C._aoti`` call: what a
    dispatch would pay if it skipped torch's Python argument parsing."""
    res = {}
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        empty = lib.aoti_torch_empty_strided
        wrap = torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs
    except (OSError, AttributeError) as e:
        return {"aoti_error": repr(e)}
    i64p = ctypes.POINTER(ctypes.c_int64)
    empty.argtypes = [ctypes.c_int64, i64p, i64p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
                      ctypes.POINTER(ctypes.c_void_p)]
    empty.restype = ctypes.c_int32
    code = {}
    for name in ("float8_e4m3fn", "bfloat16", "float32", "int64"):
        f = getattr(lib, "aoti_torch_dtype_" + name)
        f.restype = ctypes.c_int32
        code[name] = f()
    dt = lib.aoti_torch_device_type_cuda
    dt.restype = ctypes.c_int32
    cuda = dt()
    capsule = ctypes.pythonapi.PyCapsule_New
    capsule.restype = ctypes.py_object
    capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    g = h // 128
    shapes = [((rows, h), (h, 1), code["float8_e4m3fn"]), ((rows, g), (g, 1), code["float32"]),
              ((rows, k), (k, 1), code["int64"]), ((rows, k), (k, 1), code["float32"])]
    arrs = [((ctypes.c_int64 * 2)(*s), (ctypes.c_int64 * 2)(*st), c) for s, st, c in shapes]
    outs = [ctypes.c_void_p() for _ in shapes]
    refs = [ctypes.byref(o) for o in outs]
    idx = dev.index

    def four():
        hs = []
        for (sz, st, c), r, o in zip(arrs, refs, outs):
            if empty(2, sz, st, c, cuda, idx, r):
                raise RuntimeError("aoti_torch_empty_strided failed")
            hs.append(capsule(o.value, None, None))
        return wrap(hs)

    t = four()
    assert [tuple(x.shape) for x in t] == [s for s, _, _ in shapes], t
    assert t[0].dtype == torch.float8_e4m3fn and t[0].device == dev and t[2].dtype == torch.int64
    res["aoti_x4_with_wrap"] = best_us(four)
    res["aoti_empty_only"] = best_us(lambda: empty(2, arrs[0][0], arrs[0][1], arrs[0][2], cuda,
                                                   idx, refs[0]), n=2000)
    # (the handles of the line above leak on purpose: 2000 x 5 tiny tensors, measured only.)
    res["capsule_new"] = best_us(lambda: capsule(1, None, None))
    f8 = torch.empty(0, dtype=torch.float8_e4m3fn, device=dev)
    f32 = torch.empty(0, dtype=torch.float32, device=dev)
    i64 = torch.empty(0, dtype=torch.int64, device=dev)
    res["new_empty_x4_same_outputs"] = best_us(
        lambda: (f8.new_empty((rows, h)), f32.new_empty((rows, g)), i64.new_empty((rows, k)),
                 f32.new_empty((rows, k))))
    return res


if __name__ == "__main__":
    main()
