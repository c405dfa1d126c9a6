#!/usr/bin/env bash
# Device run 9 (ninth session), one H200: the 128-byte normal records on the intranode path (4
# ranks as threads, peer pointers, device memory): ep-bench normal at its defaults (4096 tokens,
# hidden 7168, top-8 of 256, fp8), this build vs gpu-bundle/old/ep-bench (built from 75b677e, the
# 16-byte records; same LL kernels), alternated twice.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH CUDA_DEVICE_MAX_CONNECTIONS=32
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
for i in 1 2; do
  for v in new old; do
    e=$B/bin/ep-bench; [ $v = old ] && e=$B/old/ep-bench
    timeout 150 $e --backend gpu --mode normal --ranks 4 --no-nccl >"$L/epb-$v-$i.log" 2>&1
    say "ep-bench normal 4 threads, $v records, round $i rc=$?"; grep -E "^normal|error" "$L/epb-$v-$i.log" | tee -a "$S"
  done
done
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
