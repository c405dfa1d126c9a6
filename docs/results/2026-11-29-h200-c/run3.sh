#!/usr/bin/env bash
# Device run 3: Python normal-mode cases with equal vs uneven token counts; the LL proxy path with
# the cached tail / sends_seen words; LL one rank and gpu_buffer as regressions.
set -u
B=gpu-bundle
O=/tmp/fep-out; mkdir -p "$O"
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" PATH="$B/bin:$PATH" FI_TCP_IFACE=lo
S="$O/summary.txt"
s() { echo "== $(date +%T) $*" | tee -a "$S"; }
s "start $(head -1 $B/MANIFEST)"
export CUDA_DEVICE_MAX_CONNECTIONS=32 CUDA_MODULE_LOADING=EAGER
export PYTHONPATH="$B/python:$B/python/tests" FABRIC_EP_LIBRARY="$B/python/fabric_ep/libfabric_ep.so"
for c in "normal_bf16_equal_tokens 2" "normal_bf16_equal_tokens 4" "normal_bf16 2" "normal_bf16 4" "normal_fp8 4"; do
  (cd $B/python/tests && timeout 60 python3 _gpu_cases.py $c) >"$O/py_${c// /_}.log" 2>&1
  s "py $c rc=$? $(grep -E '^CASE' "$O/py_${c// /_}.log")"
done
timeout 90 $B/tests/gpu_buffer --include-ignored --test-threads=1 >"$O/gpu_buffer.log" 2>&1
s "gpu_buffer rc=$? $(grep -E '^test result' "$O/gpu_buffer.log")"
timeout 60 $B/bin/ep-bench --backend gpu --ranks 1 --mode low-latency --iters 50 --cuda-graph --no-nccl >"$O/ll1.log" 2>&1
s "ll 1 rank rc=$? $(grep -E '^low-latency' "$O/ll1.log" | tr '\n' ' ')"
unset CUDA_DEVICE_MAX_CONNECTIONS
mps=/tmp/fep-mps-r3; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; s "mps rc=$?"
timeout 120 $B/examples/gpu_ll_proxy_bench --cases tiny,mid,standard --trace 40 --iters 500 --pingpong-iters 3000 >"$O/llp_procs.log" 2>&1
s "llp procs rc=$? $(grep -E '^\| (tiny|mid|standard) \| (dispatch|combine)' "$O/llp_procs.log" | tr '\n' ' ')"
echo quit | nvidia-cuda-mps-control
s "end"
cd "$O" && tar czf logs.tgz --exclude=logs.tgz . 2>/dev/null; cp "$O/summary.txt" "$O/logs.tgz" "$OUT/"
