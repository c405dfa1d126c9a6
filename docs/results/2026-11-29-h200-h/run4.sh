#!/usr/bin/env bash
# Device run 4 (eighth session), two H200s (NVLink). Normal mode on 2 GPUs after the seventh
# session's combine change (a rank's own rows read in place; its 2-GPU figures predate it):
# ep-bench normal, one process per GPU, against NCCL all-to-all + permute (both timed back to
# back), twice; the cached-handle dispatch; 2 threads on 2 GPUs; ep-bench with no arguments on GPU 0.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST); $(nvidia-smi -L | wc -l) GPUs; $(nvidia-smi topo -m | head -3 | tail -2 | tr -s ' ' | tr '\n' ';')"
e() {  # log-name args...
  local n=$1; shift
  timeout 120 $B/bin/ep-bench --backend gpu --mode normal --ranks 2 "$@" >"$L/epb-$n.log" 2>&1
  say "ep-bench $* rc=$?"; grep -E "^normal|^vs NCCL|^NCCL|error" "$L/epb-$n.log" | tee -a "$S"
}
e procs2gpu-fresh --procs
e procs2gpu-fresh-2 --procs
e procs2gpu-cached --procs --cached --no-nccl
CUDA_DEVICE_MAX_CONNECTIONS=32 e threads2gpu
CUDA_VISIBLE_DEVICES=0 CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 150 $B/bin/ep-bench >"$L/epb-default.log" 2>&1
say "ep-bench (no arguments, GPU 0 only) rc=$?"; grep -E "^normal|^low-latency|^vs NCCL|^NCCL|error" "$L/epb-default.log" | tee -a "$S"
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
