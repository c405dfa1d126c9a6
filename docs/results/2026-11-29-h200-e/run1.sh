#!/usr/bin/env bash
# Device run 1 (fifth session): the final build of the fourth session (92b3a38), never run on a
# GPU: programmatic dependent launch only for a receive launched right after its send, the
# bounds-checked own-row read of the LL combine, the shared ll_complete of the Python hooks.
# Every GPU test binary run three times where PDL matters (gpu_buffer low_latency), the LL bench,
# every Python LL case and the normal cases at world 4.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_DEVICE_MAX_CONNECTIONS=32 CUDA_MODULE_LOADING=EAGER
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
t() {  # test-binary log-suffix [filter...]
  local bin=$1 log="$L/$1-$2.log"; shift 2
  timeout 120 $B/tests/$bin --include-ignored --test-threads=1 "$@" >"$log" 2>&1
  say "$bin $* rc=$? $(grep -E '^test result' "$log")"; grep -E "panicked" -A2 "$log" | head -4 | tee -a "$S"
}
t gpu_buffer all
t gpu_buffer ll2 low_latency
t gpu_buffer ll3 low_latency
t gpu_ll 1
t gpu_ffi 1
t gpu_normal 1
timeout 60 $B/examples/gpu_ll_bench --ranks 1,4 --iters 300 >"$L/llb.log" 2>&1
say "llbench rc=$?"; grep -E "^LL_" "$L/llb.log" | tee -a "$S"
cd "$B/python/tests"
export PYTHONPATH=$B/python:$B/python/tests FABRIC_EP_LIBRARY=$B/python/fabric_ep/libfabric_ep.so
py() {  # case world
  local log="$L/py-$1-$2.log"
  timeout 60 python3 _gpu_cases.py "$1" "$2" >"$log" 2>&1
  say "py $1 $2 rc=$? $(grep -E '^CASE' "$log" | head -1)"
}
for w in 1 2 4; do py low_latency $w; done
py low_latency_fp8 4; py streams_and_events 1; py normal_bf16 4; py normal_fp8 4
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
