"""What one CUDA tensor allocation costs from Python, by spelling (issue 6: a dispatch returns
three tensors and allocating them is most of its Python-side time).

Each figure: best of 5 loops of N iterations, CPU time of this thread per allocation (the tensor
is dropped at once, so its free is included), on the current CUDA device. Prints JSON.

Run: ``python3 scripts/bench_torch_alloc.py`` on a machine with torch and a GPU.
"""

import json
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
        "new_empty_x3": best_us(lambda: (like.new_empty(shape), like_f32.new_empty((rows, k)),
                                         like_f32.new_empty((rows, k)))),
        "empty_like_x3": best_us(lambda: (torch.empty_like(like), torch.empty_like(like_f32),
                                          torch.empty_like(like_f32))),
        "data_ptr": best_us(lambda: like.data_ptr()),
        "raw_current_stream": best_us(
            lambda: torch._C._cuda_getCurrentRawStream(dev.index)),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
