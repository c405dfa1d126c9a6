#!/usr/bin/env bash
# Device run 5 (twelfth session), one H200: review mends. The low-latency dispatch's
# asynchronous form records cumulative_local_expert_recv_stats (updated on the comm stream) like
# its inputs, and the low_latency GPU case gains an asynchronous iteration (async_finish=True
# dispatch and combine, results read after current_stream_wait; it had none). The Python GPU
# tests of the low-latency and stream cases. Bundle: FEP_GPU_BUILD=python. (The first attempt failed only on the
# cases table, which still expected three iterations: _LL_MODES.)
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
cd "$B/python/tests"
export PYTHONPATH=$B/python:$B/python/tests FABRIC_EP_LIBRARY=$B/python/fabric_ep/libfabric_ep.so CUDA_DEVICE_MAX_CONNECTIONS=32
timeout 300 python3 -m pytest -q -p no:cacheprovider test_gpu.py -k "low_latency or streams or zero_token" >"$L/pytest-gpu.log" 2>&1
say "python GPU tests (pytest) rc=$? $(tail -1 "$L/pytest-gpu.log")"; grep -E "FAILED|Error" "$L/pytest-gpu.log" | head -8 | tee -a "$S"
tar -C "$OUT" -czf "$OUT/logs.tgz" logs
