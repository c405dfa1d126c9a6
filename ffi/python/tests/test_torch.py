"""torch path: bootstrap over a torch.distributed group and torch CPU tensors. Skipped (with the
reason) where torch is not installed; CI's host machine has none, the H200 machine has torch."""

import pytest

from conftest import HERE, run_ranks

torch = pytest.importorskip("torch", reason="torch is not installed on this machine")


@pytest.mark.parametrize("world", [2])
def test_torch_group_bootstrap_and_cpu_tensors(world):
    results = run_ranks(HERE / "_torch_rank.py", world, timeout=120)
    bad = [(r, rc, out) for r, (rc, out) in enumerate(results) if rc != 0]
    assert not bad, "\n".join(f"--- rank {r} rc={rc}\n{out}" for r, rc, out in bad)
