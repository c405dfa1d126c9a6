#!/usr/bin/env bash
# Device run 8 (seventh session), two H200s (NVLink). The NCCL baseline is now timed back to back
# too (run 7 timed ours back to back against NCCL's checked steps). gpu_nccl (both back-to-back
# paths), ep-bench normal at 2 GPUs (one process each) against NCCL, and ep-bench with no
# arguments on GPU 0 alone.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST); $(nvidia-smi -L | wc -l) GPUs"
timeout 120 $B/tests/gpu_nccl --include-ignored --test-threads=1 >"$L/gpu_nccl.log" 2>&1
say "gpu_nccl rc=$? $(grep -E '^test result' "$L/gpu_nccl.log" | tail -1)"; grep -E "panicked" -A2 "$L/gpu_nccl.log" | head -4 | tee -a "$S"
e() {  # log-name args...
  local n=$1; shift
  timeout 120 $B/bin/ep-bench --backend gpu --mode normal --ranks 2 "$@" >"$L/epb-$n.log" 2>&1
  say "ep-bench $* rc=$?"; grep -E "^normal|^vs NCCL|error" "$L/epb-$n.log" | tee -a "$S"
}
e procs2gpu-fresh --procs
e procs2gpu-fresh-2 --procs
e procs2gpu-cached --procs --cached --no-nccl
CUDA_VISIBLE_DEVICES=0 CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 150 $B/bin/ep-bench >"$L/epb-default.log" 2>&1
say "ep-bench (no arguments, GPU 0 only) rc=$?"; grep -E "^normal|^low-latency|^vs NCCL|error" "$L/epb-default.log" | tee -a "$S"
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
