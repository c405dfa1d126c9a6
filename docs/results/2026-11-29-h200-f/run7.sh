#!/usr/bin/env bash
# Device run 7 (sixth session), one H200: the final build's normal-mode and user-facing paths
# (the device-wide synchronisations removed from connect and clean touch both modes; ep-bench's
# LL rows now come from back-to-back pairs): ep-bench with no arguments (the README's main job),
# gpu_normal, gpu_normal_proxy (threads; 2 processes under MPS), gpu_ipc under MPS, the Python
# GPU tests, the normal proxy lane bench at 6 workers.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
export CUDA_DEVICE_MAX_CONNECTIONS=32
timeout 150 $B/bin/ep-bench >"$L/epb-default.log" 2>&1
say "ep-bench (no arguments) rc=$?"; grep -E "^(normal|low-latency)|NCCL|ep-bench" "$L/epb-default.log" | cut -c1-250 | tee -a "$S"
t() {  # test-binary log-suffix [filter...]
  local bin=$1 log="$L/$1-$2.log"; shift 2
  timeout 150 $B/tests/$bin --include-ignored --test-threads=1 "$@" >"$log" 2>&1
  say "$bin $* rc=$? $(grep -E '^test result' "$log" | tail -1)"; grep -E "panicked" -A2 "$log" | cut -c1-600 | head -4 | tee -a "$S"
}
t gpu_normal 1
FEP_TEST_PROVIDERS='shm,tcp;ofi_rxm' t gpu_normal_proxy threads --skip two_processes
timeout 120 $B/examples/gpu_flake_stress --mode normal --rounds 20 >"$L/stress-normal.log" 2>&1; say "stress normal: $(grep STRESS_RESULT $L/stress-normal.log)"
( cd "$B/python/tests"
  export PYTHONPATH=$B/python:$B/python/tests FABRIC_EP_LIBRARY=$B/python/fabric_ep/libfabric_ep.so
  if python3 -c "import pytest" 2>/dev/null; then
    timeout 200 python3 -m pytest -q test_gpu.py test_gpu_abi.py >"$L/py-gpu.log" 2>&1; say "python GPU tests (pytest) rc=$? $(tail -1 $L/py-gpu.log)"
  else
    timeout 200 python3 plain_runner.py test_gpu.py test_gpu_abi.py >"$L/py-gpu.log" 2>&1; say "python GPU tests (plain runner) rc=$? $(grep -E '^[0-9]+ passed' $L/py-gpu.log | tail -1)"
  fi )
unset CUDA_DEVICE_MAX_CONNECTIONS
mps=/tmp/fep-mps-r7; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
FEP_GPU_MPS=1 t gpu_normal_proxy procs --exact two_processes_one_per_node_over_shm
t gpu_ipc mps
FEP_GPU_PROXY_WORKERS=6 timeout 120 $B/examples/gpu_normal_proxy_bench --chunks 64 --slots 16 --iters 20 --pingpong-iters 2000 >"$L/np-w6.log" 2>&1
say "np workers 6 rc=$?"; grep -E "^NPROXY_RESULT|^FI_PINGPONG" "$L/np-w6.log" | sed -E 's/provider=shm //; s/dispatch_p99_us=[^ ]+ //; s/combine_p99_us=[^ ]+ //' | tee -a "$S"
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
