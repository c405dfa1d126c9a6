#!/usr/bin/env bash
# Device run 2 (fifth session): (1) the "synchronous" copies and fills of device memory now run on
# a private stream and wait for it (Device::blocking): run 1's graph-replay failure was a test
# input copy racing the next step's kernels. gpu_buffer low_latency three times, gpu_buffer all,
# gpu_ll. (2) The normal proxy lane with trace points (traced/, FEP_TRACE_NORMAL=1) under MPS,
# 2 processes x 1 rank per node over shm, beside the plain build's bench at the same shape.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
t() {  # test-binary log-suffix [filter...]
  local bin=$1 log="$L/$1-$2.log"; shift 2
  CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 120 $B/tests/$bin --include-ignored --test-threads=1 "$@" >"$log" 2>&1
  say "$bin $* rc=$? $(grep -E '^test result' "$log")"; grep -E "panicked" -A2 "$log" | head -4 | tee -a "$S"
}
t gpu_buffer ll1 low_latency
t gpu_buffer ll2 low_latency
t gpu_buffer ll3 low_latency
t gpu_buffer all
t gpu_ll 1
mps=/tmp/fep-mps-r2; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
timeout 150 $B/examples/gpu_normal_proxy_bench --chunks 32 --slots 8 --iters 10 >"$L/np-plain.log" 2>&1
say "np plain rc=$?"; grep -E "NPROXY|RESULT|pingpong|FI_PINGPONG|ratio|GB/s" "$L/np-plain.log" | head -12 | tee -a "$S"
timeout 150 $B/traced/gpu_normal_proxy_bench --chunks 32 --slots 8 --iters 5 --trace 3 >"$L/np-traced.log" 2>&1
say "np traced rc=$?"; grep -E "NPROXY|RESULT|ratio" "$L/np-traced.log" | head -6 | tee -a "$S"
grep -E "NPTRACE|span|median|wait|stage|push|copy" "$L/np-traced.log" | head -60 | tee -a "$S"
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
