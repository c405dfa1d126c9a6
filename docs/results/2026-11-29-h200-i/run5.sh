#!/usr/bin/env bash
# Device run 5 (ninth session), one H200, the session's final build: the GPU tests that go
# through Buffer, the reference or the proxy (gpu_normal, gpu_buffer, gpu_ffi, gpu_ll,
# gpu_normal_proxy and gpu_ll_proxy as threads), then the normal proxy lane both ways at the
# default (chunk 16, 32 slots, 4 workers) twice, 2 processes under MPS, for the ratio's spread.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
t() {  # test-binary log-suffix [filter...]
  local bin=$1 log="$L/$1-$2.log"; shift 2
  timeout 200 $B/tests/$bin --include-ignored --test-threads=1 "$@" >"$log" 2>&1
  say "$bin $* rc=$? $(grep -E '^test result' "$log" | tail -1)"; grep -E "panicked|FAILED" -A2 "$log" | cut -c1-600 | head -6 | tee -a "$S"
}
export CUDA_DEVICE_MAX_CONNECTIONS=32
t gpu_normal 1
t gpu_buffer 1
t gpu_ffi 1
t gpu_ll 1
t gpu_normal_proxy thr --skip two_processes
t gpu_ll_proxy thr --skip two_processes --skip different_proxy_worker_counts
unset CUDA_DEVICE_MAX_CONNECTIONS
mps=/tmp/fep-mps-i5; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
np=$B/examples/gpu_normal_proxy_bench
f() { grep -E "^NPROXY_RESULT|^FI_PINGPONG|FAILED|panicked" "$1" | sed -E 's/provider=shm //; s/dispatch_p99_us=[^ ]+ //; s/combine_p99_us=[^ ]+ //' | cut -c1-400 | tee -a "$S"; }
for i in 1 2; do
  timeout 200 $np --chunks 16 --slots 32 --iters 20 --pingpong-iters 2000 >"$L/np-default-$i.log" 2>&1
  say "normal proxy bench both ways, default queue, run $i rc=$?"; f "$L/np-default-$i.log"
done
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
