#!/usr/bin/env bash
# Device run 7 (eleventh session), one H200: the review mend (the low-latency hooks' stream order
# from a _Block like every other call's, no struct pack): the Python GPU tests that go through
# the hooks and the low-latency paths, plus the stream/event and bad-argument cases.
# Bundle: FEP_GPU_BUILD=python.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
cd "$B/python/tests"
export PYTHONPATH=$B/python:$B/python/tests FABRIC_EP_LIBRARY=$B/python/fabric_ep/libfabric_ep.so CUDA_DEVICE_MAX_CONNECTIONS=32
timeout 200 python3 -m pytest -q -p no:cacheprovider test_gpu.py -k "low_latency or streams or bad_arguments or zero_token" >"$L/pytest-gpu.log" 2>&1
say "python GPU tests (pytest, low-latency subset) rc=$? $(tail -1 "$L/pytest-gpu.log")"; grep -E "FAILED|Error" "$L/pytest-gpu.log" | head -8 | tee -a "$S"
