#!/usr/bin/env bash
# Device run 4 (tenth session), one H200: the hierarchy through the C ABI and the Python package
# (fep_config.internode_hierarchy, fep_gpu_notify_inputs; Buffer(internode_hierarchy=True)).
# tests/gpu_hier, gpu_ffi and gpu_buffer (the ABI's GPU calls after the refactor), then the Python
# GPU tests (pytest: test_gpu.py with the new hierarchy cases at world 2 and 4, test_gpu_abi.py,
# test_torch.py).
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
t() {  # test-binary log-suffix [filter...]
  local bin=$1 log="$L/$1-$2.log"; shift 2
  timeout 150 $B/tests/$bin --include-ignored --test-threads=1 "$@" >"$log" 2>&1
  say "$bin $* rc=$? $(grep -E '^test result' "$log" | tail -1)"; grep -E "panicked|FAILED" -A2 "$log" | cut -c1-600 | head -10 | tee -a "$S"
}
export CUDA_DEVICE_MAX_CONNECTIONS=32
t gpu_hier 4
t gpu_ffi 4
t gpu_buffer 4
cd "$B/python/tests"
export PYTHONPATH=$B/python:$B/python/tests FABRIC_EP_LIBRARY=$B/python/fabric_ep/libfabric_ep.so
timeout 300 python3 -m pytest -q -p no:cacheprovider test_gpu.py test_gpu_abi.py test_torch.py >"$L/pytest-gpu.log" 2>&1
say "python GPU tests (pytest) rc=$? $(tail -1 "$L/pytest-gpu.log")"; grep -E "FAILED|Error" "$L/pytest-gpu.log" | head -8 | cut -c1-400 | tee -a "$S"
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
