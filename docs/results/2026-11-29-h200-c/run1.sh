#!/usr/bin/env bash
# Device run 1 of the third session: the work-queue fix (C ABI and Python, 4 ranks as threads)
# and the event trace of the low-latency proxy path (threads without MPS, processes under MPS).
set -u
B=gpu-bundle
O=${OUT:-/tmp/fep-out}
mkdir -p "$O"
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" PATH="$B/bin:$PATH" FI_TCP_IFACE=lo
s() { echo "== $(date +%T) $*" | tee -a "$O/run1.txt"; }
s "start $(cat $B/MANIFEST 2>/dev/null | head -1)"
export CUDA_DEVICE_MAX_CONNECTIONS=32
timeout 150 $B/tests/gpu_ffi --include-ignored --test-threads=1 --nocapture >"$O/gpu_ffi.log" 2>&1
s "gpu_ffi rc=$? $(grep -E '^test result' "$O/gpu_ffi.log")"
timeout 120 $B/tests/gpu_buffer --include-ignored --test-threads=1 >"$O/gpu_buffer.log" 2>&1
s "gpu_buffer rc=$? $(grep -E '^test result' "$O/gpu_buffer.log")"
timeout 90 $B/examples/gpu_ll_proxy_bench --threads --cases tiny,mid --trace 40 --iters 300 >"$O/llp_threads.log" 2>&1
s "llp threads rc=$? $(grep -E '^THREADS' "$O/llp_threads.log" | head -4 | tr '\n' ' ')"
FEP_GPU_SECTIONS=python FEP_PY_TIMEOUT=150 OUT="$O/py" timeout 240 bash $B/gpu-check.sh run >"$O/python-run.log" 2>&1
s "python rc=$? $(grep -E 'python-tests|OVERHEAD_GPU python_side' "$O/py/summary.txt" | tr '\n' ' ')"
unset CUDA_DEVICE_MAX_CONNECTIONS
mps=/tmp/fep-mps-r1; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; s "mps rc=$?"
timeout 120 $B/examples/gpu_ll_proxy_bench --cases tiny,mid --trace 40 --iters 300 --pingpong-iters 2000 >"$O/llp_procs.log" 2>&1
s "llp procs rc=$?"
echo quit | nvidia-cuda-mps-control
s "end"
