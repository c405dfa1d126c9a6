#!/usr/bin/env bash
# Device run 7 (seventh session), two H200s (NVLink). ep-bench now times normal-mode steps back to
# back after the checked ones (run 6: the per-step barrier released processes apart, and that skew
# was inside each fresh dispatch). The same six runs as run 6, then ep-bench with no arguments on
# GPU 0 alone, and the normal-mode tests (the step loop was refactored).
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST); $(nvidia-smi -L | wc -l) GPUs"
e() {  # log-name args...
  local n=$1; shift
  timeout 120 $B/bin/ep-bench --backend gpu --mode normal --ranks 2 "$@" >"$L/epb-$n.log" 2>&1
  say "ep-bench $* rc=$?"; grep -E "^normal|^vs NCCL|error" "$L/epb-$n.log" | tee -a "$S"
}
e procs2gpu-fresh --procs
e procs2gpu-cached --procs --cached --no-nccl
e threads1gpu-fresh --no-nccl
e threads1gpu-cached --cached --no-nccl
CUDA_VISIBLE_DEVICES=0 CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 150 $B/bin/ep-bench >"$L/epb-default.log" 2>&1
say "ep-bench (no arguments, GPU 0 only) rc=$?"; grep -E "^normal|^low-latency|^vs NCCL|error" "$L/epb-default.log" | tee -a "$S"
t() {  # test-binary log-suffix [filter...]
  local bin=$1 log="$L/$1-$2.log"; shift 2
  CUDA_VISIBLE_DEVICES=0 CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 150 $B/tests/$bin --include-ignored --test-threads=1 "$@" >"$log" 2>&1
  say "$bin $* rc=$? $(grep -E '^test result' "$log" | tail -1)"; grep -E "panicked" -A2 "$log" | cut -c1-600 | head -4 | tee -a "$S"
}
t gpu_normal 1
t gpu_normal_proxy thr --skip two_processes
mps=/tmp/fep-mps-g7; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log CUDA_VISIBLE_DEVICES=0
nvidia-cuda-mps-control -d; say "mps on GPU 0 rc=$?"
e procs1gpu-fresh --procs --no-nccl
e procs1gpu-cached --procs --cached --no-nccl
t gpu_normal_proxy procs --exact two_processes_one_per_node_over_shm
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
