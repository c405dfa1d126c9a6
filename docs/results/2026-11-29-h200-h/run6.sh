#!/usr/bin/env bash
# Device run 6 (eighth session), two H200s (NVLink). The GPU Buffer's default slots per peer is
# now 32 up to 8 ranks (16 beyond): ep-bench normal at 2 GPUs with the default (one process per
# GPU, against NCCL; and as threads); then on GPU 0 alone: ep-bench with no arguments, the
# normal-mode GPU tests (gpu_normal, gpu_buffer, gpu_ffi, gpu_normal_proxy threads), gpu_ipc and
# gpu_normal_proxy as 2 processes under MPS, the Python GPU tests.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST); $(nvidia-smi -L | wc -l) GPUs"
e() {  # log-name args...
  local n=$1; shift
  timeout 120 $B/bin/ep-bench --backend gpu --mode normal "$@" >"$L/epb-$n.log" 2>&1
  say "ep-bench $* rc=$?"; grep -E "^normal|^vs NCCL|error" "$L/epb-$n.log" | tee -a "$S"
}
e 2gpu-procs --ranks 2 --procs
e 2gpu-procs-2 --ranks 2 --procs
CUDA_DEVICE_MAX_CONNECTIONS=32 e 2gpu-threads --ranks 2
export CUDA_VISIBLE_DEVICES=0 CUDA_DEVICE_MAX_CONNECTIONS=32
timeout 150 $B/bin/ep-bench >"$L/epb-default.log" 2>&1
say "ep-bench (no arguments, GPU 0 only) rc=$?"; grep -E "^normal|^low-latency|^vs NCCL|error" "$L/epb-default.log" | tee -a "$S"
t() {  # test-binary log-suffix [filter...]
  local bin=$1 log="$L/$1-$2.log"; shift 2
  timeout 200 $B/tests/$bin --include-ignored --test-threads=1 "$@" >"$log" 2>&1
  say "$bin $* rc=$? $(grep -E '^test result' "$log" | tail -1)"; grep -E "panicked|FAILED" -A2 "$log" | cut -c1-600 | head -6 | tee -a "$S"
}
t gpu_normal 1
t gpu_buffer 1
t gpu_ffi 1
t gpu_normal_proxy thr --skip two_processes
( cd "$B/python/tests" && PYTHONPATH=$B/python:$B/python/tests FABRIC_EP_LIBRARY=$B/python/fabric_ep/libfabric_ep.so \
  timeout 240 python3 -m pytest -q -p no:cacheprovider test_gpu.py test_gpu_abi.py test_torch.py >"$L/pytest-gpu.log" 2>&1 )
say "python GPU tests (pytest) rc=$? $(tail -1 "$L/pytest-gpu.log")"; grep -E "FAILED|Error" "$L/pytest-gpu.log" | head -5 | tee -a "$S"
unset CUDA_DEVICE_MAX_CONNECTIONS
mps=/tmp/fep-mps-h6; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
t gpu_ipc 1
t gpu_normal_proxy procs --exact two_processes_one_per_node_over_shm
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
