#!/usr/bin/env bash
# Device run 5 (thirteenth session), one H200: the helper's own tests again, run 4's one failure
# being the test's expectation (torch counts an nn.Parameter as an exact Tensor; the test now
# declines a real subclass and accepts a Parameter). Bundle: FEP_GPU_BUILD=python.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" TORCH_EXTENSIONS_DIR=/tmp/fep-torch-ext
L=$OUT/logs; mkdir -p "$L"
cd "$B/python/tests"
export PYTHONPATH=$B/python:$B/python/tests FABRIC_EP_LIBRARY=$B/python/fabric_ep/libfabric_ep.so
timeout 100 python3 -m pytest -q -p no:cacheprovider test_native.py >"$L/pytest-native.log" 2>&1
echo "== $(date +%T) test_native rc=$? $(tail -1 "$L/pytest-native.log")" | tee "$L/summary.txt"
grep -E "FAILED|Error" "$L/pytest-native.log" | head -8
