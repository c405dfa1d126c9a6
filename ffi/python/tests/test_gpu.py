"""GPU backend through the Python package (the cases are in _gpu_cases.py): torch CUDA tensors,
ranks as threads of one process on one GPU (world 1, 2, 4), normal and low-latency mode against
the numpy reference of _rank.py, DeepEP's stream options, bad arguments.

Each case runs in a fresh Python process of its own (``python3 _gpu_cases.py CASE WORLD``), with a
bounded wait (``FEP_GPU_CASE_TIMEOUT_S``, default 120 s): a failing case's rank threads and
kernels, still alive inside their own time bounds, cannot poison the next case, and every case
reports its own pass or fail (with the child's output).

Skipped (reported as skipped, with the reason) without torch or without a CUDA device: CI has
neither; scripts/gpu-check.sh runs them on the GPU machine."""

import os
import subprocess
import sys

import pytest

from conftest import HERE, PKG_ROOT

# Inherited by the case processes (_gpu_cases.py sets them too; see the reasons there): eager
# CUDA module loading, and a hardware queue per stream for ranks as threads of one context.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
torch = pytest.importorskip("torch", reason="torch is not installed on this machine")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible to torch", allow_module_level=True)

CASE_TIMEOUT_S = float(os.environ.get("FEP_GPU_CASE_TIMEOUT_S", "120"))


def run_case(case, world):
    """Runs one case of _gpu_cases.py in a new process; raises with its output unless it
    passed within CASE_TIMEOUT_S."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(PKG_ROOT), str(HERE)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("PYTHONUNBUFFERED", "1")
    p = subprocess.Popen([sys.executable, str(HERE / "_gpu_cases.py"), case, str(world)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = p.communicate(timeout=CASE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        p.kill()  # this case's own process, by its pid
        out, _ = p.communicate()
        raise AssertionError(f"{case} world {world}: no result after {CASE_TIMEOUT_S:.0f} s "
                             f"(process killed); its output:\n{out}") from None
    if p.returncode != 0:
        raise AssertionError(f"{case} world {world}: exit status {p.returncode}; its output:\n{out}")
    print(out, end="")  # shown with pytest -s (gpu-check.sh's log)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_normal_bf16_matches_reference(world):
    run_case("normal_bf16", world)


@pytest.mark.parametrize("world", [2, 4])
def test_normal_bf16_equal_token_counts(world):
    run_case("normal_bf16_equal_tokens", world)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_normal_fp8_matches_reference(world):
    run_case("normal_fp8", world)


@pytest.mark.parametrize("world", [2, 4])
def test_normal_internode_hierarchy_bf16(world):
    run_case("normal_hier_bf16", world)


def test_normal_internode_hierarchy_fp8():
    run_case("normal_hier_fp8", 4)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_low_latency_hook_and_no_hook_match_reference(world):
    run_case("low_latency", world)


@pytest.mark.parametrize("world", [1, 4])
def test_low_latency_fp8_matches_reference(world):
    run_case("low_latency_fp8", world)


def test_streams_and_events_world_1():
    run_case("streams_and_events", 1)


def test_bad_arguments_name_the_argument():
    run_case("bad_arguments", 1)


def test_threads_on_the_legacy_default_stream_are_refused():
    run_case("legacy_stream_refused", 2)


def test_auto_backend_picks_gpu_for_a_thread_group():
    run_case("auto_backend", 1)


def test_zero_token_rank_normal_and_low_latency():
    run_case("zero_token_rank", 2)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_low_latency_wait_costs_logfmt_and_local_buffer_tensor(world):
    run_case("ll_deepep_args", world)
