"""Shared helpers: free ports and launching N ranks of tests/_rank.py as separate processes
with the torchrun variables (the host backend bootstraps from them)."""

import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

# The GPU tests run ranks as threads of one process; both set before CUDA initialises (pytest
# imports this first, and the GPU cases' processes inherit them):
# * CUDA's lazy module loading may synchronise the context on a kernel's first use while a
#   peer's kernel spins;
# * CUDA maps a context's streams onto CUDA_DEVICE_MAX_CONNECTIONS hardware queues (8 by
#   default): with several ranks' streams in one context, two ranks can share a queue and one
#   rank's spinning kernel waits behind another's (a deadlock until the timeout); 32 gives each
#   stream its own (the library refuses to connect several ranks of one context with too few).
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

HERE = pathlib.Path(__file__).resolve().parent
PKG_ROOT = HERE.parent  # ffi/python


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, local_world: int) -> dict:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank % local_world),
        LOCAL_WORLD_SIZE=str(local_world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        FEP_MASTER_PORT=str(port),
        FEP_JOB_ID=f"pytest-{os.getpid()}-{port}",
        FI_PROVIDER=os.environ.get("FI_PROVIDER", "shm"),
    )
    env["PYTHONPATH"] = os.pathsep.join(
        [str(PKG_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    return env


def run_ranks(script: pathlib.Path, world: int, local_world: int = 0, timeout: float = 60.0,
              extra_env: dict = None):
    """Runs ``script`` as ``world`` ranks; returns [(rc, output)] per rank (killed after
    ``timeout`` seconds, then reported with rc None)."""
    local_world = local_world or world
    port = free_port()
    procs = []
    for r in range(world):
        env = rank_env(r, world, port, local_world)
        # All ranks must agree on the extra ports: rank 0 picks them, the others take the same.
        if r == 0:
            extra_ports = (str(free_port()), str(free_port()), str(free_port()))
        env["FEP_TEST_PORT2"], env["FEP_TEST_PORT3"], env["FEP_TEST_PORT4"] = extra_ports
        env.update(extra_env or {})
        p = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        procs.append((p, None))
    deadline = time.monotonic() + timeout
    results = []
    for p, _ in procs:
        try:
            out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results.append((p.returncode, out))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            results.append((None, out + "\n[killed after timeout]"))
    return results


@pytest.fixture
def ranks():
    return run_ranks


def pytest_report_header(config):
    """Which native module the run uses (FABRIC_EP_EXTENSION, the package's, or a checkout
    build): a stale build is the usual cause of a surprising failure."""
    try:
        import fabric_ep
    except ImportError as e:
        return f"fabric_ep: does not import: {e}"
    return f"fabric_ep: {fabric_ep.native_status()}"
