#!/usr/bin/env bash
# Device run 5: Python GPU normal mode with synchronous calls on the compute stream (no comm-stream
# hop), every multi-rank case three times in fresh processes; the GPU call-overhead bench.
set -u
B=$PWD/gpu-bundle
O=/tmp/fep-out; mkdir -p "$O"
S="$O/summary.txt"
s() { echo "== $(date +%T) $*" | tee -a "$S"; }
s "start $(head -1 $B/MANIFEST)"
export CUDA_DEVICE_MAX_CONNECTIONS=32 CUDA_MODULE_LOADING=EAGER
export PYTHONPATH="$B/python:$B/python/tests" FABRIC_EP_LIBRARY="$B/python/fabric_ep/libfabric_ep.so"
for rep in 1 2 3; do
for c in "normal_bf16 2" "normal_bf16 4" "normal_fp8 2" "normal_fp8 4" "normal_bf16_equal_tokens 4" "low_latency 4" "zero_token_rank 2" "streams_and_events 1"; do
  (cd $B/python/tests && timeout 60 python3 _gpu_cases.py $c) >"$O/py.log" 2>&1
  s "py $c rc=$? $(grep -E '^CASE' "$O/py.log") $(grep -E 'assert|Error' "$O/py.log" | head -2 | tr '\n' ' ')"
done
done
(cd $B/python/tests && timeout 90 python3 bench_overhead_gpu.py) >"$O/overhead_gpu.json" 2>"$O/overhead.err"
s "overhead rc=$?"
s "end"
cp "$O/summary.txt" "$O/overhead_gpu.json" "$OUT/"
