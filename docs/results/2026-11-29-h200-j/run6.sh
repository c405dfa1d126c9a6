#!/usr/bin/env bash
# Device run 6 (tenth session), one H200: regression of the final build's shared normal-mode bench
# loop on the paths run 5 did not cover: gpu_normal (threads), ranks as processes through CUDA
# IPC and through the proxy lane (gpu_ipc, gpu_normal_proxy two_processes; MPS), and ep-bench with
# no arguments (normal + NCCL comparison + low latency, 4 ranks as threads).
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
t() {  # test-binary log-suffix [filter...]
  local bin=$1 log="$L/$1-$2.log"; shift 2
  timeout 120 $B/tests/$bin --include-ignored --test-threads=1 "$@" >"$log" 2>&1
  say "$bin $* rc=$? $(grep -E '^test result' "$log" | tail -1)"; grep -E "panicked|FAILED" -A2 "$log" | cut -c1-600 | head -6 | tee -a "$S"
}
export CUDA_DEVICE_MAX_CONNECTIONS=32
t gpu_normal 6
timeout 120 $B/bin/ep-bench --iters 10 >"$L/epbench-default.log" 2>&1
say "ep-bench (no arguments but --iters 10) rc=$?"; grep -E "^(normal|low-latency)" "$L/epbench-default.log" | cut -c1-200 | tee -a "$S"
unset CUDA_DEVICE_MAX_CONNECTIONS
mps=/tmp/fep-mps-j6; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
t gpu_ipc mps
FEP_GPU_MPS=1 t gpu_normal_proxy procs two_processes
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
