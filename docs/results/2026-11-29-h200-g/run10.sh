#!/usr/bin/env bash
# Device run 10 (seventh session), one H200, last build: the intranode bench with the combine's
# bytes model updated (own rows read in place), and ep-bench with no arguments.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
export CUDA_DEVICE_MAX_CONNECTIONS=32
timeout 60 $B/examples/gpu_normal_bench >"$L/nb.log" 2>&1
say "gpu_normal_bench rc=$?"; grep -E "ceiling|NORMAL_" "$L/nb.log" | tail -4 | tee -a "$S"
timeout 120 $B/bin/ep-bench >"$L/epb-default.log" 2>&1
say "ep-bench (no arguments) rc=$?"; grep -E "^normal|^low-latency|^vs NCCL|error" "$L/epb-default.log" | tee -a "$S"
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
