#!/usr/bin/env bash
# Device run 1 (eighth session), one H200. The low-latency proxy lane with several workers
# (FEP_LL_PROXY_WORKERS: every worker posts a stripe of the one ring's commands on its own
# endpoint). Tests: gpu_ll_proxy as threads with 1 and 3 workers, as 2 processes under MPS
# (incl. the 3-worker and the worker-mismatch tests). Bench: standard (128 tokens, 128 messages
# per phase) and mid over shm with 1, 2, 4, 6 workers and the IPC baseline; tiny with 1 and 4.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
export CUDA_DEVICE_MAX_CONNECTIONS=32
t() {  # test-binary log-suffix [filter...]
  local bin=$1 log="$L/$1-$2.log"; shift 2
  timeout 150 $B/tests/$bin --include-ignored --test-threads=1 "$@" >"$log" 2>&1
  say "$bin $* rc=$? $(grep -E '^test result' "$log" | tail -1)"; grep -E "panicked|FAILED" -A2 "$log" | cut -c1-600 | head -6 | tee -a "$S"
}
t gpu_ll_proxy thr-w1 --exact proxy_matches_reference_across_node_splits
FEP_LL_PROXY_WORKERS=3 t gpu_ll_proxy thr-w3 --exact proxy_matches_reference_across_node_splits
unset CUDA_DEVICE_MAX_CONNECTIONS
mps=/tmp/fep-mps-h1; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
t gpu_ll_proxy procs --skip proxy_matches_reference_across_node_splits --skip stalled
pb=$B/examples/gpu_ll_proxy_bench
for w in 1 2 4 6; do
  FEP_LL_PROXY_WORKERS=$w timeout 150 $pb --provider shm --cases standard,mid --iters 300 --pingpong-iters 2000 --ipc-baseline >"$L/llpb-std-w$w.log" 2>&1
  say "llproxy shm standard,mid + ipc, $w workers rc=$?"; grep -E "^LLPROXY_SHARE|^LLPROXY_PHASE" "$L/llpb-std-w$w.log" | grep "rank=0" | tee -a "$S"
done
for w in 1 4; do
  FEP_LL_PROXY_WORKERS=$w timeout 100 $pb --provider shm --cases tiny --iters 1000 --pingpong-iters 5000 --ipc-baseline >"$L/llpb-tiny-w$w.log" 2>&1
  say "llproxy shm tiny + ipc, $w workers rc=$?"; grep -E "^LLPROXY_SHARE" "$L/llpb-tiny-w$w.log" | tee -a "$S"
done
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
