#!/usr/bin/env bash
# Device run 10 (eighth session), two H200s (NVLink). Chunk x slots with 512 tokens in flight per
# peer (16 x 32, the new default, against 32 x 16) and 32 x 32: two GPUs one process each,
# alternated twice; 4 ranks as threads on GPU 0 once each. Same build as run 9.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST); $(nvidia-smi -L | wc -l) GPUs"
e() {  # log-name args...
  local n=$1; shift
  timeout 120 $B/bin/ep-bench --backend gpu --mode normal "$@" >"$L/epb-$n.log" 2>&1
  say "ep-bench $* rc=$?"; grep -E "^normal|^vs NCCL|error" "$L/epb-$n.log" | tee -a "$S"
}
e 2gpu-nccl --ranks 2 --procs
for rep in 1 2; do
  for cs in 16x32 32x16 32x32; do
    c=${cs%x*}; s=${cs#*x}
    e 2gpu-$cs-$rep --ranks 2 --procs --no-nccl --gpu-chunk $c --gpu-slots $s
  done
done
export CUDA_VISIBLE_DEVICES=0 CUDA_DEVICE_MAX_CONNECTIONS=32
for cs in 16x32 32x16; do
  c=${cs%x*}; s=${cs#*x}
  e 4thr-$cs --ranks 4 --no-nccl --gpu-chunk $c --gpu-slots $s
done
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
