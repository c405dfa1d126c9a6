#!/usr/bin/env bash
# Device run 8 (fourth session): the notify's count readback now goes through page-locked memory
# (copy_to_pinned_async). Normal-mode GPU tests (threads: gpu_normal, gpu_buffer, gpu_ffi) and
# the Python normal cases at world 4.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_DEVICE_MAX_CONNECTIONS=32 CUDA_MODULE_LOADING=EAGER
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
for t in gpu_normal gpu_buffer gpu_ffi; do
  timeout 100 $B/tests/$t --include-ignored --test-threads=1 >"$L/$t.log" 2>&1
  say "$t rc=$? $(grep -E '^test result' "$L/$t.log")"; grep -E "panicked" -A2 "$L/$t.log" | head -4 | tee -a "$S"
done
cd "$B/python/tests"
export PYTHONPATH=$B/python:$B/python/tests FABRIC_EP_LIBRARY=$B/python/fabric_ep/libfabric_ep.so
for c in "normal_bf16 4" "normal_fp8 4" "normal_bf16_equal_tokens 4" "low_latency 4"; do
  timeout 60 python3 _gpu_cases.py $c >"$L/py-${c// /-}.log" 2>&1
  say "py $c rc=$? $(grep -E '^CASE' "$L/py-${c// /-}.log" | head -1)"
done
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
