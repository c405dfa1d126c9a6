#!/usr/bin/env bash
# Device run 7 (fifth session): the 4-rank flake again (run 6: always the LL "standard" case's
# first step, PDL on or off; one rank's dispatch send published 30 s late, after the others gave
# up). Does the late rank's host thread block while enqueueing (stderr names a > 0.5 s enqueue),
# and does it happen without the 0xAB output fills (FEP_GPU_TEST_NO_POISON=1)?
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
for i in 1 2 3; do
  for np in 0 1; do
    log="$L/ll-nopoison$np-$i.log"
    FEP_GPU_TEST_NO_POISON=$np timeout 45 $B/tests/gpu_buffer --include-ignored --test-threads=1 --exact low_latency_matches_reference_hook_and_not >"$log" 2>&1
    say "LL no_poison=$np #$i rc=$? $(grep -E '^test result' "$log")"
    grep -E "enqueueing|panicked" -A1 "$log" | cut -c1-400 | head -6 | tee -a "$S"
  done
done
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
