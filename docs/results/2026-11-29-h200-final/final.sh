#!/usr/bin/env bash
# Final check of the merged main on one H200, each part bounded; logs in $OUT.
B=$(cd "$(dirname "$0")" && pwd); OUT=${OUT:-/tmp/fep-final}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=$B/lib PATH=$B/bin:$PATH FI_TCP_IFACE=lo
export FEP_NCCL_LIB=$(python3 -c 'import nvidia.nccl as m, os; print(os.path.join(list(m.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
S=$OUT/final.txt; : >"$S"
log() { echo "== $(date +%T) $*" | tee -a "$S"; }
step() { local t=$1 n=$2; shift 2; log "start $n"; timeout "$t" "$@" >"$OUT/$n.log" 2>&1; local rc=$?
  log "end $n rc=$rc $(grep -E '^test result|passed|failed' "$OUT/$n.log" | tail -1)"; }
cat "$B/MANIFEST" | tee -a "$S"
# Threads of one process first (no MPS: an MPS client gets few hardware queues).
step 45 gpu_buffer "$B/tests/gpu_buffer" --include-ignored --test-threads=1 --nocapture
export PYTHONPATH=$B/python:$B/python/tests FABRIC_EP_LIBRARY=$B/python/fabric_ep/libfabric_ep.so CUDA_MODULE_LOADING=EAGER PYTHONUNBUFFERED=1
if python3 -c "import pytest" 2>/dev/null; then
  (cd "$B/python/tests" && step 70 python python3 -m pytest -q -s -rs -p no:cacheprovider test_gpu.py test_gpu_abi.py)
else
  (cd "$B/python/tests" && step 70 python python3 plain_runner.py test_gpu.py test_gpu_abi.py)
fi
step 30 gpu_ffi "$B/tests/gpu_ffi" --include-ignored --test-threads=1 --nocapture
step 35 ll_proxy_threads "$B/tests/gpu_ll_proxy" --include-ignored --test-threads=1 --nocapture --skip two_processes
step 40 epbench "$B/bin/ep-bench" --backend gpu --ranks 4 --cuda-graph --iters 5 --timeout 20
# Processes sharing the GPU: MPS.
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log; mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d && log "MPS started"
step 40 gpu_ipc "$B/tests/gpu_ipc" --include-ignored --test-threads=1 --nocapture
echo quit | nvidia-cuda-mps-control
grep -hE "^ok|^test .*(ok|FAILED)$|panicked|timeout path|^normal |^low-latency|^vs NCCL|PASSED|FAILED|Error" "$OUT"/*.log | cut -c1-220 | head -120
cat "$S"
