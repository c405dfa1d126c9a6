#!/usr/bin/env bash
# Device run 9 (eighth session), one H200, the final build (proxy stripes publish with SeqCst):
# gpu_ll_proxy (threads: node splits and the stalled peer; 2 processes under MPS: every case)
# and gpu_normal_proxy (threads; 2 processes under MPS).
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
t() {  # test-binary log-suffix [filter...]
  local bin=$1 log="$L/$1-$2.log"; shift 2
  timeout 200 $B/tests/$bin --include-ignored --test-threads=1 --nocapture "$@" >"$log" 2>&1
  say "$bin $* rc=$? $(grep -E '^test result' "$log" | tail -1)"; grep -E "panicked|FAILED|^ok:" "$log" | cut -c1-300 | head -12 | tee -a "$S"
}
export CUDA_DEVICE_MAX_CONNECTIONS=32
t gpu_ll_proxy thr --skip two_processes --skip different_proxy_worker_counts
t gpu_normal_proxy thr --skip two_processes
unset CUDA_DEVICE_MAX_CONNECTIONS
mps=/tmp/fep-mps-h9; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
t gpu_ll_proxy procs --skip proxy_matches_reference_across_node_splits --skip stalled
t gpu_normal_proxy procs --exact two_processes_one_per_node_over_shm
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
