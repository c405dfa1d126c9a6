#!/usr/bin/env bash
# Device run 5 (eighth session), two H200s (NVLink). Normal combine on 2 GPUs is 0.6x NCCL
# (run 4): is the queue depth (16 chunks x 16 tokens in flight per peer) the limit across
# NVLink? ep-bench normal, one process per GPU, over queue shapes (--gpu-chunk, --gpu-slots),
# NCCL once; then 4 ranks as threads on GPU 0 at the same shapes (the intranode default's case).
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
e 2gpu-16x16 --ranks 2 --procs
for cs in 16x32 16x64 32x16 32x32 64x16 64x32; do
  c=${cs%x*}; s=${cs#*x}
  e 2gpu-$cs --ranks 2 --procs --no-nccl --gpu-chunk $c --gpu-slots $s
done
export CUDA_VISIBLE_DEVICES=0 CUDA_DEVICE_MAX_CONNECTIONS=32
for cs in 16x16 16x32 32x16 32x32 64x16; do
  c=${cs%x*}; s=${cs#*x}
  e 4thr-$cs --ranks 4 --no-nccl --gpu-chunk $c --gpu-slots $s
done
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
