#!/usr/bin/env bash
# Device run 9 (seventh session), one H200. Normal combine reads a rank's own rows in place
# (no self chunk queue). The normal-mode tests (threads; processes under MPS), gpu_buffer, the
# intranode bench against the copy ceiling, ep-bench normal at 1 and 4 ranks.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
export CUDA_DEVICE_MAX_CONNECTIONS=32
t() {  # test-binary log-suffix [filter...]
  local bin=$1 log="$L/$1-$2.log"; shift 2
  timeout 120 $B/tests/$bin --include-ignored --test-threads=1 "$@" >"$log" 2>&1
  say "$bin $* rc=$? $(grep -E '^test result' "$log" | tail -1)"; grep -E "panicked" -A2 "$log" | cut -c1-600 | head -4 | tee -a "$S"
}
t gpu_normal 1
t gpu_buffer 1
t gpu_normal_proxy thr --skip two_processes
t gpu_ffi 1
timeout 60 $B/examples/gpu_normal_bench >"$L/nb.log" 2>&1
say "gpu_normal_bench rc=$?"; grep -iE "ceiling|dispatch|combine" "$L/nb.log" | tail -6 | tee -a "$S"
for r in 1 4; do
  timeout 90 $B/bin/ep-bench --backend gpu --mode normal --ranks $r --no-nccl >"$L/epb-$r.log" 2>&1
  say "ep-bench normal ranks $r rc=$?"; grep -E "^normal|error" "$L/epb-$r.log" | tee -a "$S"
done
unset CUDA_DEVICE_MAX_CONNECTIONS
mps=/tmp/fep-mps-g9; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
t gpu_ipc 1
t gpu_normal_proxy procs --exact two_processes_one_per_node_over_shm
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
