"""Which torch calls hold the GIL while they wait for the GPU? Thread A queues a ~0.5 s kernel
(torch.cuda._sleep) on its stream and then makes one blocking call; thread B counts Python loop
iterations meanwhile. A call that releases the GIL lets B count millions; one that holds it,
almost none. (Ranks as threads: a rank blocked in such a call starves a peer that still has to
launch its part of a collective.)"""
import threading
import time

import torch

torch.cuda.set_device(0)
s = torch.cuda.Stream()
x = torch.ones(1024, device="cuda")
CYCLES = int(0.5 * 1.98e9)


def probe(name, call):
    count = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1

    with torch.cuda.stream(s):
        torch.cuda._sleep(CYCLES)
        y = x * 2
        b = threading.Thread(target=spin)
        b.start()
        t0 = time.perf_counter()
        call(y)
        dt = time.perf_counter() - t0
        stop.set()
        b.join()
    print(f"{name:<28} waited {dt * 1e3:7.1f} ms; other thread counted {count[0]:>10}", flush=True)


torch.cuda.synchronize()
probe("stream.synchronize()", lambda y: torch.cuda.current_stream().synchronize())
probe("tensor.cpu()", lambda y: y.cpu())
probe("tensor.tolist()", lambda y: y.tolist())
probe("tensor[0].item()", lambda y: y[0].item())
probe("tensor.cpu() after sync", lambda y: (torch.cuda.current_stream().synchronize(), y.cpu()))
probe("event.synchronize()", lambda y: torch.cuda.current_stream().record_event().synchronize())


# Part 2: does one thread's blocking device-to-host copy (queued behind a long kernel) hold up
# another thread's CUDA calls on a different stream? Thread A: sleep kernel on stream sa, then
# y.cpu() (a pageable copy that waits for the kernel). Thread B, 50 ms later, on its own stream
# sb: one call on a tensor whose work is already done; its time says whether it waited for A.
sa, sb = torch.cuda.Stream(), torch.cuda.Stream()
with torch.cuda.stream(sb):
    z = torch.ones(1 << 16, device="cuda")
    zp = torch.empty(1 << 16, pin_memory=True)
torch.cuda.synchronize()


def cross(name, call):
    def a():
        with torch.cuda.stream(sa):
            torch.cuda._sleep(CYCLES)
            (x * 2).cpu()

    ta = threading.Thread(target=a)
    ta.start()
    time.sleep(0.05)
    with torch.cuda.stream(sb):
        t0 = time.perf_counter()
        call()
        dt = time.perf_counter() - t0
    ta.join()
    print(f"B's {name:<34} took {dt * 1e3:7.1f} ms while A's copy waited", flush=True)


cross("pageable z.cpu()", lambda: z.cpu())
cross("pinned copy + sb.synchronize()", lambda: (zp.copy_(z, non_blocking=True), sb.synchronize()))
cross("kernel launch (z * 2)", lambda: z * 2)
cross("sb.synchronize()", lambda: sb.synchronize())
