#!/usr/bin/env bash
# Device run 9 (fourth session, last ~3 minutes): programmatic dependent launch only for a
# receive launched right after its send (run 8 failed a hook case with it across stream joins).
# The LL tests (Buffer: hook and not, CUDA graphs; raw ranks) and the LL bench.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_DEVICE_MAX_CONNECTIONS=32 CUDA_MODULE_LOADING=EAGER
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
timeout 60 $B/tests/gpu_buffer --include-ignored --test-threads=1 low_latency >"$L/gpu_buffer.log" 2>&1
say "gpu_buffer low_latency rc=$? $(grep -E '^test result' "$L/gpu_buffer.log")"; grep -E "panicked" -A2 "$L/gpu_buffer.log" | head -4 | tee -a "$S"
timeout 40 $B/examples/gpu_ll_bench --ranks 1,4 --iters 200 >"$L/llb.log" 2>&1
say "llbench rc=$?"; grep -E "^LL_" "$L/llb.log" | tee -a "$S"
timeout 30 $B/tests/gpu_ll --include-ignored --test-threads=1 >"$L/gpu_ll.log" 2>&1
say "gpu_ll rc=$? $(grep -E '^test result' "$L/gpu_ll.log")"
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
