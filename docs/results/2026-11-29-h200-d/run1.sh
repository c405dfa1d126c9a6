#!/usr/bin/env bash
# Device run 1 (fourth session): the C ABI test with canaries, then the Python normal-mode
# cases that failed intermittently in run 5 of the third session, with row diagnostics, with
# and without a stream sync after every call (FEP_CASE_SYNC=1).
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_DEVICE_MAX_CONNECTIONS=32
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(cat $B/BUILD_INFO 2>/dev/null)"
timeout 100 $B/tests/gpu_ffi --include-ignored --test-threads=1 --nocapture >"$L/gpu_ffi.log" 2>&1
say "gpu_ffi rc=$? $(grep -E 'test result' "$L/gpu_ffi.log")"
grep -E "panicked|wrote" "$L/gpu_ffi.log" | head -5 | tee -a "$S"
cd "$B/python/tests"
export PYTHONPATH=$B/python:$B/python/tests FABRIC_EP_LIBRARY=$B/python/fabric_ep/libfabric_ep.so
py() {  # sync case world
  local log="$L/py-$2-$3-sync$1-$(date +%s%N).log"
  FEP_CASE_SYNC=$1 timeout 60 python3 _gpu_cases.py "$2" "$3" >"$log" 2>&1
  say "py sync=$1 $2 $3 rc=$? $(grep -E '^CASE' "$log" | head -1)"
  grep -E "rows differ|  row |rank [0-9]+: " "$log" | head -12 | tee -a "$S"
}
for i in 1 2; do py 0 normal_fp8 4; done
for i in 1 2; do py 1 normal_fp8 4; done
py 0 normal_bf16 4
py 1 normal_bf16 4
py 0 normal_bf16_equal_tokens 4
py 1 normal_bf16_equal_tokens 4
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs/*.log
