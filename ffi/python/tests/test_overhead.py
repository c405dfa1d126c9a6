"""Python call overhead over the native module. Measured by bench_overhead.py: the Python-side
work of a call with the native calls stubbed out, timed as this thread's CPU time (best of
several loops).

Issue 6's target is at most 10 us per dispatch/combine call above the C call; on an idle
machine (the H200 host, Python 3.12) bench_overhead.py measures about 8 us (dispatch) and 4-5 us
(combine). On a loaded 2-core CI box the same code measures 9-14 us for dispatch, run to run, so
this test guards against regressions at twice the target (a 2x slowdown of the hot path fails
it); FABRIC_EP_OVERHEAD_LIMIT_US=10 holds a quiet machine to the target itself."""

import os

from bench_overhead import measure

LIMIT_US = float(os.environ.get("FABRIC_EP_OVERHEAD_LIMIT_US", "20"))


def test_python_overhead_per_call():
    m = measure(n=3000, reps=5)
    print("overhead:", m["python_side_us"], "end-to-end:", m["end_to_end_us"], "raw:",
          m["raw_native_us"])
    for call in ("dispatch", "combine"):
        assert m["python_side_us"][call] <= LIMIT_US, (call, m)
