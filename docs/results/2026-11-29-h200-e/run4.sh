#!/usr/bin/env bash
# Device run 4 (fifth session): the normal dispatch receiver copies a chunk from the proxy's
# receive region into its device slot in one wide pass before unpacking (it unpacked from host
# memory with a chain of dependent PCIe reads per row). Correctness (gpu_normal_proxy threads and
# 2 processes, gpu_normal, gpu_buffer normal), then the proxy lane bench at 4 and 6 workers over
# chunk 16/32/64 x 8/16 slots, and the trace at 4 workers.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
t() {  # test-binary log-suffix [filter...]
  local bin=$1 log="$L/$1-$2.log"; shift 2
  CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 150 $B/tests/$bin --include-ignored --test-threads=1 "$@" >"$log" 2>&1
  say "$bin $* rc=$? $(grep -E '^test result' "$log")"; grep -E "panicked" -A2 "$log" | head -4 | tee -a "$S"
}
FEP_GPU_PROXY_WORKERS=4 FEP_TEST_PROVIDERS='shm,tcp;ofi_rxm' t gpu_normal_proxy w4 --skip two_processes
t gpu_normal 1
t gpu_buffer normal normal
mps=/tmp/fep-mps-r4; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
for w in 1 4; do
  FEP_GPU_PROXY_WORKERS=$w FEP_GPU_MPS=1 timeout 100 $B/tests/gpu_normal_proxy --include-ignored --test-threads=1 --exact two_processes_one_per_node_over_shm >"$L/np-2p-w$w.log" 2>&1
  say "gpu_normal_proxy 2 procs w$w rc=$? $(grep -E '^test result' "$L/np-2p-w$w.log")"
done
for w in 4 6; do
  FEP_GPU_PROXY_WORKERS=$w timeout 150 $B/examples/gpu_normal_proxy_bench --chunks 16,32,64 --slots 8,16 --iters 10 --pingpong-iters 2000 >"$L/np-w$w.log" 2>&1
  say "np workers $w rc=$?"; grep -E "^NPROXY_RESULT" "$L/np-w$w.log" | sed -E 's/provider=shm //; s/dispatch_p99_us=[^ ]+ //; s/combine_p99_us=[^ ]+ //' | tee -a "$S"
done
FEP_GPU_PROXY_WORKERS=1 timeout 100 $B/examples/gpu_normal_proxy_bench --chunks 32 --slots 8 --iters 10 --pingpong-iters 2000 >"$L/np-w1.log" 2>&1
say "np workers 1 rc=$?"; grep -E "^NPROXY_RESULT" "$L/np-w1.log" | tee -a "$S"
FEP_GPU_PROXY_WORKERS=4 timeout 100 $B/traced/gpu_normal_proxy_bench --chunks 32 --slots 8 --iters 5 --trace 3 >"$L/np-w4-traced.log" 2>&1
say "np traced w4 rc=$?"; grep -E "NPTRACE rank=0" "$L/np-w4-traced.log" | tee -a "$S"
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
