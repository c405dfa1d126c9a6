#!/usr/bin/env bash
# Device run 5 (fifth session): the build to land (4 proxy workers by default, fi_pingpong best
# of 3 runs per size). Proxy lane at 1, 4 and 6 workers, chunk 16/32/64 x 16 slots, 20 iters;
# then every GPU test binary that the session's changes touch, the LL bench, and the Python GPU
# cases (LL and normal at world 4, streams/events) on the final library.
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
t gpu_buffer all
t gpu_buffer ll2 low_latency
t gpu_ll 1
t gpu_ffi 1
t gpu_cuda 1
FEP_TEST_PROVIDERS='shm,tcp;ofi_rxm' t gpu_normal_proxy threads --skip two_processes
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 60 $B/examples/gpu_ll_bench --ranks 1,4 --iters 300 >"$L/llb.log" 2>&1
say "llbench rc=$?"; grep -E "^LL_" "$L/llb.log" | tee -a "$S"
( cd "$B/python/tests"
  export PYTHONPATH=$B/python:$B/python/tests FABRIC_EP_LIBRARY=$B/python/fabric_ep/libfabric_ep.so
  for c in "low_latency 4" "low_latency_fp8 4" "normal_bf16 4" "normal_fp8 4" "streams_and_events 1"; do
    timeout 60 python3 _gpu_cases.py $c >"$L/py-${c// /-}.log" 2>&1
    say "py $c rc=$? $(grep -E '^CASE' "$L/py-${c// /-}.log" | head -1)"
  done )
mps=/tmp/fep-mps-r5; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
FEP_GPU_MPS=1 timeout 100 $B/tests/gpu_normal_proxy --include-ignored --test-threads=1 --exact two_processes_one_per_node_over_shm >"$L/np-2p.log" 2>&1
say "gpu_normal_proxy 2 procs (default workers) rc=$? $(grep -E '^test result' "$L/np-2p.log")"
for w in 4 6 1; do
  FEP_GPU_PROXY_WORKERS=$w timeout 170 $B/examples/gpu_normal_proxy_bench --chunks 16,32,64 --slots 16 --iters 20 --pingpong-iters 2000 >"$L/np-w$w.log" 2>&1
  say "np workers $w rc=$?"; grep -E "^NPROXY_RESULT|^FI_PINGPONG" "$L/np-w$w.log" | sed -E 's/provider=shm //; s/dispatch_p99_us=[^ ]+ //; s/combine_p99_us=[^ ]+ //' | tee -a "$S"
done
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
