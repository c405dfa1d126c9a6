#!/usr/bin/env bash
# Device run 4 (sixth session), two H200s: LL launches clamped to their work (send: tokens;
# receive/combine send: most rows in; combine receive: tokens), and the LL bench loops gated
# (each step / chunk of 32 timed pairs held by a spinning kernel until every rank has enqueued
# it). LL proxy bench (tiny traced, tiny hook, mid, standard), LL bench 1 and 4 ranks, tests
# (gpu_ll, gpu_buffer, gpu_ll_proxy threads + processes under MPS), ep-bench with 2 ranks as
# processes on 2 GPUs.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
timeout 150 $B/bin/ep-bench --backend gpu --procs --ranks 2 --iters 20 --no-nccl >"$L/epb-procs2.log" 2>&1
say "ep-bench procs 2 GPUs rc=$?"; grep -E "^(normal|low-latency)" "$L/epb-procs2.log" | tee -a "$S"
export CUDA_DEVICE_MAX_CONNECTIONS=32
timeout 90 $B/examples/gpu_ll_bench --ranks 1,4 --iters 300 >"$L/llb.log" 2>&1
say "llbench rc=$?"; grep -E "^LL_" "$L/llb.log" | tee -a "$S"
t() {  # test-binary log-suffix [filter...]
  local bin=$1 log="$L/$1-$2.log"; shift 2
  timeout 150 $B/tests/$bin --include-ignored --test-threads=1 "$@" >"$log" 2>&1
  say "$bin $* rc=$? $(grep -E '^test result' "$log" | tail -1)"; grep -E "panicked" -A2 "$log" | cut -c1-600 | head -4 | tee -a "$S"
}
t gpu_ll 1
t gpu_buffer 1
t gpu_ll_proxy thr --exact proxy_matches_reference_across_node_splits
unset CUDA_DEVICE_MAX_CONNECTIONS
mps=/tmp/fep-mps-r4; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
t gpu_ll_proxy procs --skip proxy_matches_reference_across_node_splits
pb=$B/examples/gpu_ll_proxy_bench
timeout 100 $pb --provider shm --cases tiny --iters 1000 --pingpong-iters 5000 --trace 20 >"$L/llpb-tiny-trace.log" 2>&1
say "llproxy tiny traced rc=$?"; grep -E "^\|" "$L/llpb-tiny-trace.log" | grep -vE "^\|---" | head -60 | tee -a "$S"
timeout 100 $pb --provider shm --cases tiny --iters 1000 --pingpong-iters 5000 --hook >"$L/llpb-tiny-hook.log" 2>&1
say "llproxy tiny hook rc=$?"; grep -E "^\| tiny" "$L/llpb-tiny-hook.log" | tee -a "$S"
timeout 150 $pb --provider shm --cases mid,standard --iters 500 --pingpong-iters 5000 >"$L/llpb-mid-std.log" 2>&1
say "llproxy mid,standard rc=$?"; grep -E "^\| (mid|standard)" "$L/llpb-mid-std.log" | tee -a "$S"
grep -E "^HOST" "$L"/llpb-*.log | tee -a "$S"
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
