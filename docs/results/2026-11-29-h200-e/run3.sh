#!/usr/bin/env bash
# Device run 3 (fifth session): (1) is the proxy lane bound by one CPU copy stream? ep-bench
# fabric (CPU only, 2 processes, shm) with the writes' offsets fixed (cache-hot, fi_pingpong's
# pattern) and rotating over 64 MiB (data from memory), beside fi_pingpong; (2) the normal proxy
# lane with 1, 2, 4 and 8 proxy workers (FEP_GPU_PROXY_WORKERS), plain and traced, under MPS;
# gpu_normal_proxy's thread tests with 4 workers; (3) the LL/normal flakes of runs 1-2 again,
# now with the timed-out wait's expected and last-seen values.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
for sp in 0 67108864; do
  timeout 100 $B/bin/ep-bench fabric --provider shm --sizes 239104,1048576 --window 8 --span $sp >"$L/fabric-$sp.log" 2>&1
  say "fabric span $sp rc=$?"; grep -E "B \||span" "$L/fabric-$sp.log" | tee -a "$S"
done
t() {  # test-binary log-suffix [filter...]
  local bin=$1 log="$L/$1-$2.log"; shift 2
  CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 150 $B/tests/$bin --include-ignored --test-threads=1 "$@" >"$log" 2>&1
  say "$bin $* rc=$? $(grep -E '^test result' "$log")"; grep -E "panicked" -A2 "$log" | head -4 | tee -a "$S"
}
FEP_GPU_PROXY_WORKERS=4 FEP_TEST_PROVIDERS=shm t gpu_normal_proxy w4 --skip two_processes --skip stalled
t gpu_buffer ll1 low_latency
t gpu_buffer ll2 low_latency
t gpu_buffer w1 normal_num_worst
t gpu_buffer ll3 low_latency
mps=/tmp/fep-mps-r3; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
FEP_GPU_PROXY_WORKERS=4 FEP_GPU_MPS=1 timeout 100 $B/tests/gpu_normal_proxy --include-ignored --test-threads=1 --exact two_processes_one_per_node_over_shm >"$L/np-2p-w4.log" 2>&1
say "gpu_normal_proxy 2 procs w4 rc=$? $(grep -E '^test result' "$L/np-2p-w4.log")"
for w in 1 2 4 8; do
  FEP_GPU_PROXY_WORKERS=$w timeout 100 $B/examples/gpu_normal_proxy_bench --chunks 32 --slots 8 --iters 10 --pingpong-iters 2000 >"$L/np-w$w.log" 2>&1
  say "np workers $w rc=$?"; grep -E "^NPROXY_RESULT" "$L/np-w$w.log" | tee -a "$S"
done
FEP_GPU_PROXY_WORKERS=4 timeout 100 $B/examples/gpu_normal_proxy_bench --chunks 16,64 --slots 8,16 --iters 10 --pingpong-iters 2000 >"$L/np-w4-shapes.log" 2>&1
say "np workers 4 shapes rc=$?"; grep -E "^NPROXY_RESULT" "$L/np-w4-shapes.log" | tee -a "$S"
FEP_GPU_PROXY_WORKERS=4 timeout 100 $B/traced/gpu_normal_proxy_bench --chunks 32 --slots 8 --iters 5 --trace 3 >"$L/np-w4-traced.log" 2>&1
say "np traced w4 rc=$?"; grep -E "NPTRACE rank=0" "$L/np-w4-traced.log" | tee -a "$S"
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
