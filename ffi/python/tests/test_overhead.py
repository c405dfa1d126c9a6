"""Python call overhead over the C ABI (issue 6's target: at most 10 us per dispatch/combine
call above the C call). Measured by bench_overhead.py: the Python-side work of a call with the C
entry points stubbed out, timed as this thread's CPU time (best of several loops)."""

import os

from bench_overhead import measure

LIMIT_US = float(os.environ.get("FABRIC_EP_OVERHEAD_LIMIT_US", "10"))


def test_python_overhead_per_call():
    m = measure(n=3000, reps=5)
    print("overhead:", m["python_side_us"], "end-to-end:", m["end_to_end_us"], "raw:",
          m["raw_ctypes_us"])
    for call in ("dispatch", "combine"):
        assert m["python_side_us"][call] <= LIMIT_US, (call, m)
