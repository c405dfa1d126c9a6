"""A rank killed mid-run under a process-group stand-in (``all_gather_bytes``, no TCP store):
every survivor's error names it within 2 s (the callback bootstrap's liveness channel), not at
the data-path timeout (4 s here)."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

from conftest import HERE, free_port, rank_env

WORLD = 3


def _run(victim):
    hub = free_port()
    procs, lines = [], []
    lock = threading.Lock()
    for r in range(WORLD):
        env = rank_env(r, WORLD, free_port(), 1)
        for k in ("MASTER_ADDR", "MASTER_PORT", "FEP_MASTER_PORT", "FI_PROVIDER"):
            env.pop(k, None)  # the group is the only bootstrap; the rank names its provider
        env["FEP_TEST_HUB_PORT"] = str(hub)
        p = subprocess.Popen([sys.executable, str(HERE / "_liveness_rank.py")], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(p)

        def pump(r=r, p=p):
            for line in p.stdout:
                with lock:
                    lines.append((r, time.monotonic(), line.rstrip()))

        threading.Thread(target=pump, daemon=True).start()
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            with lock:
                done = {r for r, _, l in lines if l.startswith("iter 2")}
                early = [(r, l) for r, _, l in lines if not l.startswith("iter ")]
            assert not early, "\n".join(f"rank {r}: {l}" for r, l in early)
            if done == set(range(WORLD)):
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"no progress: {lines[-10:]}")
        os.kill(procs[victim].pid, signal.SIGKILL)
        faulted = time.monotonic()
        errors = {}
        while time.monotonic() - faulted < 30 and len(errors) < WORLD - 1:
            with lock:
                for r, at, l in lines:
                    if r != victim and l.startswith("ERROR ") and r not in errors:
                        errors[r] = (at - faulted, l[6:])
            time.sleep(0.02)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert len(errors) == WORLD - 1, (errors, lines[-20:])
    for r, (after, msg) in errors.items():
        body = msg.split(": ", 1)[-1]
        assert re.search(rf"\brank {victim}\b", body), f"rank {r}: {msg}"
        assert after < 2.0, f"rank {r} named it after {after:.2f} s: {msg}"
        print(f"rank {r}: {after:.3f} s after the kill: {msg}")


def test_killed_rank_is_named_over_a_group():
    _run(victim=1)


def test_killed_rank_0_is_named_over_a_group():
    _run(victim=0)
