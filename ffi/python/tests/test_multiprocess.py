"""Multi-process correctness on the host backend: N ranks (2, 4, and 4 split over two "nodes")
run layout / dispatch / combine / cached handle / num_worst_tokens / fp8 against a numpy
reference (tests/_rank.py)."""

import pytest

from conftest import HERE, run_ranks


@pytest.mark.parametrize(
    "world,local_world",
    [(2, 2), (4, 4), (4, 2)],
    ids=["2ranks", "4ranks", "4ranks-2nodes"],
)
def test_dispatch_combine_against_numpy(world, local_world):
    results = run_ranks(HERE / "_rank.py", world, local_world, timeout=90)
    bad = [(r, rc, out) for r, (rc, out) in enumerate(results) if rc != 0]
    assert not bad, "\n".join(f"--- rank {r} rc={rc}\n{out}" for r, rc, out in bad)
    for r, (_, out) in enumerate(results):
        assert f"rank {r}/{world}: ok" in out, out
