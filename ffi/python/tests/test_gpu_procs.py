"""GPU ranks as processes, launched as torchrun launches them (one process per rank with RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), running DeepEP's call sequence through
``fabric_ep.Buffer`` (tests/_gpu_proc_rank.py). On a one-GPU machine the ranks share the GPU,
which needs the MPS control daemon (``nvidia-cuda-mps-control -d``) started first.

Skipped without torch, a CUDA device, or (for several processes on one GPU) MPS. Runnable
without pytest: ``python3 test_gpu_procs.py`` runs every case and prints a summary."""

import os
import pathlib
import socket
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
RANK_SCRIPT = HERE / "_gpu_proc_rank.py"


def _mps_running():
    return os.path.exists(os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"),
                                       "control"))


def _why_skip(world):
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if os.environ.get("FEP_TEST_DEVICE") == "cpu":
        return None
    if not torch.cuda.is_available():
        return "no CUDA device"
    if world > torch.cuda.device_count() and not _mps_running():
        return "several processes per GPU need MPS (nvidia-cuda-mps-control -d)"
    return None


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_gpu_ready(limit=60):
    """After a client process was killed (the failed-peer cases kill one), MPS refuses new
    clients for a while (CUDA error 807, "MPS server is not ready to accept new MPS client
    requests"): wait until a fresh process starts CUDA, so that the next case's ranks do not
    fail in torch.cuda.set_device before fabric_ep is reached (the others would then wait in
    the group's rendezvous)."""
    t0 = time.monotonic()
    probe = "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()"
    while True:
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
        if r.returncode == 0:
            return
        if time.monotonic() - t0 > limit:
            raise RuntimeError(f"CUDA did not start in a fresh process within {limit} s:\n"
                               + r.stderr[-2000:])
        time.sleep(0.5)


def launch(world, group, case="deepep", timeout=200):
    """Runs ``world`` rank processes; returns [(rc, output)]. With ``case="stalled_peer"`` the
    last rank (stopped by itself) is killed once the others are done."""
    if os.environ.get("FEP_TEST_DEVICE") != "cpu" and case != "no_mps" and _mps_running():
        _wait_gpu_ready()
    port, store = _port(), _port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   FEP_MASTER_PORT=str(store), FEP_TEST_GROUP=group, FEP_TEST_CASE=case,
                   PYTHONUNBUFFERED="1")
        procs.append(subprocess.Popen([sys.executable, str(RANK_SCRIPT)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    deadline = time.monotonic() + timeout
    out = []
    for i, p in enumerate(procs):
        if case in ("stalled_peer", "shrink_stall") and i == world - 1:
            p.kill()
        try:
            o, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            out.append((p.returncode, o))
        except subprocess.TimeoutExpired:
            p.kill()
            o, _ = p.communicate()
            out.append((None, o + "\n[killed after the timeout: a hang]"))
    return out


def check(world, group, case="deepep"):
    results = launch(world, group, case)
    failing = ("dead_peer", "stalled_peer", "shrink_dead", "shrink_stall")
    survivors = range(world - 1) if case in failing else range(world)
    bad = [(r, rc, o) for r, (rc, o) in enumerate(results) if r in survivors and
           (rc != 0 or f"rank {r}/{world}: ok" not in o)]
    assert not bad, "\n".join(f"--- rank {r} rc={rc}\n{o}" for r, rc, o in bad)
    return results


try:
    import pytest

    def _case(world):
        why = _why_skip(world)
        return pytest.mark.skipif(why is not None, reason=why or "")

    @pytest.mark.parametrize("world,group", [(2, "gloo"), (4, "gloo"), (2, "env"), (4, "env")])
    def test_deepep_sequence(world, group):
        if _why_skip(world):
            pytest.skip(_why_skip(world))
        check(world, group)

    @pytest.mark.parametrize("case", ["dead_peer", "stalled_peer"])
    def test_failed_peer_is_named(case):
        if _why_skip(3):
            pytest.skip(_why_skip(3))
        check(3, "gloo", case)

    @pytest.mark.parametrize("case,world", [("shrink_masked", 4), ("shrink_dead", 3),
                                            ("shrink_stall", 3)])
    def test_shrink_mode(case, world):
        if _why_skip(world):
            pytest.skip(_why_skip(world))
        check(world, "gloo", case)

    @pytest.mark.parametrize("world", [1, 2])
    def test_nccl_group(world):
        if _why_skip(world) or os.environ.get("FEP_TEST_DEVICE") == "cpu":
            pytest.skip(_why_skip(world) or "an NCCL group needs CUDA")
        try:
            nccl_case(world)
        except Skip as e:
            pytest.skip(str(e))

    def test_no_mps_is_refused():
        why = no_mps_skip()
        if why:
            pytest.skip(why)
        no_mps_case()
except ImportError:  # the plain runner below
    pass


class Skip(Exception):
    pass


def nccl_case(world):
    """An NCCL group bootstraps the Buffer. NCCL refuses two ranks on one GPU ("Duplicate GPU
    detected"): with more ranks than GPUs that refusal is NCCL's, reported as a skip."""
    results = launch(world, "nccl")
    if world > 1 and any("Duplicate GPU" in o for _, o in results):
        raise Skip("NCCL refuses several ranks on one GPU (Duplicate GPU detected)")
    bad = [(r, rc, o) for r, (rc, o) in enumerate(results)
           if rc != 0 or f"rank {r}/{world}: ok" not in o]
    assert not bad, "\n".join(f"--- rank {r} rc={rc}\n{o}" for r, rc, o in bad)
    return results


def no_mps_skip():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if os.environ.get("FEP_TEST_DEVICE") == "cpu" or not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.device_count() > 1:
        return "more than one GPU: the processes need not share one"
    if _mps_running():
        return "MPS is running (this case needs it stopped)"
    return None


def no_mps_case():
    """Two processes on one GPU without MPS: every rank must fail with an error that says MPS
    is needed, well before the launcher's deadline (never a hang)."""
    t0 = time.monotonic()
    results = launch(2, "env", timeout=120)
    took = time.monotonic() - t0
    bad = [(r, rc, o) for r, (rc, o) in enumerate(results) if rc in (0, None) or "MPS" not in o]
    assert not bad, "\n".join(f"--- rank {r} rc={rc}\n{o}" for r, rc, o in bad)
    assert took < 100, f"the refusal took {took:.0f} s"
    return results


if __name__ == "__main__":
    if sys.argv[1:] == ["--no-mps"]:
        cases = [(2, "env", "no_mps")]
    elif sys.argv[1:2] == ["--cases"]:  # e.g. --cases 2/gloo/deepep,3/gloo/stalled_peer
        cases = [(int(w), g, c) for w, g, c in (x.split("/") for x in sys.argv[2].split(","))]
    else:
        cases = [(2, "gloo", "deepep"), (4, "gloo", "deepep"), (2, "env", "deepep"),
                 (4, "env", "deepep"), (1, "nccl", "deepep"), (2, "nccl", "deepep"),
                 (3, "gloo", "dead_peer"), (3, "gloo", "stalled_peer"),
                 (4, "gloo", "shrink_masked"), (3, "gloo", "shrink_dead"),
                 (3, "gloo", "shrink_stall")]
    passed = failed = skipped = 0
    for world, group, case in cases:
        why = no_mps_skip() if case == "no_mps" else _why_skip(world)
        name = f"{case} world={world} group={group}"
        if why:
            print(f"SKIP {name}: {why}")
            skipped += 1
            continue
        t0 = time.time()
        try:
            if case == "no_mps":
                res = no_mps_case()
            elif group == "nccl":
                res = nccl_case(world)
            else:
                res = check(world, group, case)
            print(f"PASS {name} ({time.time() - t0:.1f} s)")
            for r, (_, o) in enumerate(res):
                for line in o.splitlines():
                    if "took" in line or "raised after" in line or "masked rank" in line or (
                            r == 0 and "fabric_ep from" in line):
                        print("   ", line)
            passed += 1
        except Skip as e:
            print(f"SKIP {name}: {e}")
            skipped += 1
        except AssertionError as e:
            print(f"FAIL {name} ({time.time() - t0:.1f} s)\n{e}")
            failed += 1
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    sys.exit(1 if failed else 0)
