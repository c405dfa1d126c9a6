#!/usr/bin/env bash
# Device run 8 (ninth session), one H200: normal-mode records padded to 128 bytes
# (plan::NORMAL_RECORD_ALIGN; dispatch fp8 7472 -> 7552 B, combine 14368 -> 14464 B), so the
# payload's warp stores cover whole lines. Tests (gpu_normal, gpu_buffer, gpu_ffi,
# gpu_normal_proxy threads), then the normal proxy lane both ways at the default queue, new and
# run 7's binary (gpu-bundle/old/, the 16-byte-aligned records) alternated twice, 2 processes
# under MPS, shm.
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
t gpu_normal_proxy thr --skip two_processes
unset CUDA_DEVICE_MAX_CONNECTIONS
mps=/tmp/fep-mps-i8; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
FEP_GPU_MPS=1 t gpu_normal_proxy procs two_processes
f() { grep -E "^NPROXY_RESULT|^FI_PINGPONG|FAILED|panicked" "$1" | sed -E 's/provider=shm //; s/dispatch_p99_us=[^ ]+ //; s/combine_p99_us=[^ ]+ //; s/one_way=false //' | cut -c1-330 | tee -a "$S"; }
for i in 1 2; do
  for v in new old; do
    np=$B/examples/gpu_normal_proxy_bench; [ $v = old ] && np=$B/old/gpu_normal_proxy_bench
    timeout 200 $np --chunks 16 --slots 32 --iters 20 --pingpong-iters 2000 >"$L/np-$v-$i.log" 2>&1
    say "normal proxy both ways, default queue, $v records, round $i rc=$?"; f "$L/np-$v-$i.log"
  done
done
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
