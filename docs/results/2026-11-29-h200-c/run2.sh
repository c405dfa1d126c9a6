#!/usr/bin/env bash
# Device run 2: eager module load (C ABI / Python threads), one poller per host word and padded
# proxy counters (LL and normal proxy paths), each Python GPU case in its own process.
set -u
B=gpu-bundle
O=/tmp/fep-out; mkdir -p "$O"
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" PATH="$B/bin:$PATH" FI_TCP_IFACE=lo
S="$O/summary.txt"
s() { echo "== $(date +%T) $*" | tee -a "$S"; }
s "start $(head -1 $B/MANIFEST)"
export CUDA_DEVICE_MAX_CONNECTIONS=32
timeout 150 $B/tests/gpu_ffi --include-ignored --test-threads=1 --nocapture >"$O/gpu_ffi.log" 2>&1
s "gpu_ffi rc=$? $(grep -E '^test result' "$O/gpu_ffi.log")"
timeout 120 $B/examples/gpu_ll_proxy_bench --threads --cases tiny,mid,standard --trace 40 --iters 300 >"$O/llp_threads.log" 2>&1
s "llp threads rc=$? $(grep -E '^THREADS' "$O/llp_threads.log" | tr '\n' ' ')"
FEP_GPU_SECTIONS=python FEP_PY_TIMEOUT=300 OUT="$O/py" timeout 360 bash $B/gpu-check.sh run >"$O/python-run.log" 2>&1
s "python rc=$? $(grep -E 'python-tests|OVERHEAD_GPU' "$O/py/summary.txt" | tr '\n' ' ')"
unset CUDA_DEVICE_MAX_CONNECTIONS
mps=/tmp/fep-mps-r2; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; s "mps rc=$?"
timeout 120 $B/examples/gpu_ll_proxy_bench --cases tiny,mid,standard --trace 40 --iters 500 --pingpong-iters 3000 >"$O/llp_procs.log" 2>&1
s "llp procs rc=$? $(grep -E '^\| (tiny|mid|standard) \| (dispatch|combine)' "$O/llp_procs.log" | tr '\n' ' ')"
timeout 150 $B/tests/gpu_ll_proxy --include-ignored --test-threads=1 --nocapture >"$O/gpu_ll_proxy.log" 2>&1
s "gpu_ll_proxy rc=$? $(grep -E '^test result' "$O/gpu_ll_proxy.log")"
FEP_GPU_MPS=1 timeout 120 $B/tests/gpu_normal_proxy --include-ignored --test-threads=1 --nocapture --exact two_processes_one_per_node_over_shm >"$O/gpu_normal_proxy.log" 2>&1
s "gpu_normal_proxy 2procs rc=$? $(grep -E '^test result' "$O/gpu_normal_proxy.log")"
timeout 150 $B/examples/gpu_normal_proxy_bench --chunks 16,32 --slots 8 --iters 10 >"$O/nproxy.log" 2>&1
s "nproxy rc=$? $(grep -E 'NPROXY_RESULT' "$O/nproxy.log" | tr '\n' ' ')"
echo quit | nvidia-cuda-mps-control
s "end"
cd "$O" && tar czf logs.tgz --exclude=logs.tgz . 2>/dev/null; cp "$O/summary.txt" "$O/logs.tgz" "$OUT/"
