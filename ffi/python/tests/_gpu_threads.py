"""Helpers of the GPU tests: ranks as threads of this process on one GPU (the GPU backend's mode
in this version), torch <-> numpy conversions of the reference data of _rank.py."""

import ctypes
import os
import sys
import threading
import traceback

# Before CUDA initialises (this module imports no torch; its importers must not have initialised
# CUDA yet either): ranks are threads of one CUDA context here, and CUDA maps the context's
# streams onto CUDA_DEVICE_MAX_CONNECTIONS hardware queues (8 by default). With several ranks'
# streams two ranks can share a queue, and one rank's spinning kernel then waits behind another's
# (a deadlock until the timeout). 32 gives every stream its own; the library refuses to connect
# several ranks of one context with too few. Lazy module loading: see _gpu_cases.py.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import numpy as np  # noqa: E402

from fabric_ep import ThreadGroup  # noqa: E402
from fabric_ep._gpu import warm_allocator  # noqa: E402


def to_bf16(torch, a, dev):
    """numpy bf16 bits (uint16) -> torch.bfloat16 on ``dev``."""
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16).to(dev)


def host(t):
    """``t.cpu()``, after waiting for the current stream first.

    NOTES: ranks are threads of one process here, and the driver serialises pageable
    device-to-host copies across a process's threads (measured on the H200 with a probe of
    threads: a thread's ``z.cpu()`` took 450 ms while another thread's copy waited for a
    500 ms kernel; page-locked copies, launches and stream syncs were not held up, and torch
    releases the GIL in all these calls). A rank whose ``.cpu()`` waits for a collective kernel
    therefore blocks a peer thread's ``.cpu()`` of an earlier result, that peer cannot launch its
    part, and the group stalls until the kernels' timeout: the cause of intermittent normal-mode
    failures seen on the H200 (a rank's next call delayed by exactly the 10 s timeout). Waiting
    with ``Stream.synchronize`` first leaves the copy nothing to wait for. (The probe ran threads
    of one process; one process per rank, the real deployment, was not probed.) The library's
    own read inside a step (the counts after notify) uses page-locked memory."""
    import torch

    torch.cuda.current_stream(t.device).synchronize()
    return t.cpu()


def bits(t):
    """torch bf16 / fp8 tensor -> numpy raw bits (uint16 / uint8)."""
    import torch

    t = host(t.detach()).contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype.itemsize == 1:
        return t.view(torch.uint8).numpy()
    return t.numpy()


def own_stream(torch):
    """A new non-blocking stream of the current context (cuStreamCreate), as a torch stream.
    NOTES: not torch.cuda.Stream(): torch hands those out from a pool of 32, round-robin, so
    two ranks' streams can be one stream and serialise their spinning kernels."""
    cuda = ctypes.CDLL("libcuda.so.1")
    h = ctypes.c_void_p()
    rc = cuda.cuStreamCreate(ctypes.byref(h), 1)  # CU_STREAM_NON_BLOCKING
    if rc != 0:
        raise RuntimeError(f"cuStreamCreate: CUresult {rc}")
    return torch.cuda.ExternalStream(h.value, device=torch.device("cuda", 0)), h.value


def drop_stream(raw):
    ctypes.CDLL("libcuda.so.1").cuStreamDestroy_v2(ctypes.c_void_p(raw))


def run_ranks(world, fn, timeout=40.0):
    """Runs ``fn(group, rank, world)`` in ``world`` threads, each on its own CUDA stream with a
    warm caching allocator (no cudaMalloc inside a step: a peer's kernel may be spinning).
    Returns the per-rank results; raises with every failing rank's traceback. Needs
    CUDA_DEVICE_MAX_CONNECTIONS=32 from before CUDA initialised (set on import of this module)."""
    import torch

    groups = ThreadGroup.create(world, timeout_s=min(timeout, 120.0))
    results = [None] * world
    errors = [None] * world

    def body(r):
        raw = 0
        try:
            torch.cuda.set_device(0)
            torch.cuda.synchronize()  # the primary context is current on this thread
            s, raw = own_stream(torch)
            with torch.cuda.stream(s):
                warm_allocator(torch, 0)
                results[r] = fn(groups[r], r, world)
                s.synchronize()
        except BaseException:  # noqa: BLE001 - reported below with the rank
            errors[r] = traceback.format_exc()
            # Live, for logs of runs that are cut short (pytest -s).
            print(f"[world {world} rank {r}] FAILED:\n{errors[r]}", file=sys.stderr, flush=True)
        finally:
            if raw:
                drop_stream(raw)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if hung or bad:
        msg = [f"world {world}: ranks still running after {timeout} s: {hung}"] if hung else []
        msg += [f"--- rank {r}\n{e}" for r, e in bad]
        raise AssertionError("\n".join(msg))
    return results
