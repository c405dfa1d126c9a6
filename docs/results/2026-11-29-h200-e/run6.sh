#!/usr/bin/env bash
# Device run 6 (fifth session): the 4-rank gpu_buffer flake. Its LL tests six times with
# programmatic dependent launch (default) and six times without (FEP_LL_PDL=0), and the normal
# num_worst_tokens test four times; a failed LL run now carries every rank's protocol state
# (ticket, epochs, last flag from each source: LlGpuRank::state_snapshot).
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
for i in 1 2 3 4 5 6; do
  for pdl in 1 0; do
    log="$L/ll-pdl$pdl-$i.log"
    FEP_LL_PDL=$pdl timeout 100 $B/tests/gpu_buffer --include-ignored --test-threads=1 low_latency >"$log" 2>&1
    say "LL pdl=$pdl #$i rc=$? $(grep -E '^test result' "$log")"; grep -E "panicked" -A2 "$log" | head -3 | tee -a "$S"
  done
done
for i in 1 2 3 4; do
  log="$L/worst-$i.log"
  timeout 60 $B/tests/gpu_buffer --include-ignored --test-threads=1 normal_num_worst >"$log" 2>&1
  say "normal worst #$i rc=$? $(grep -E '^test result' "$log")"; grep -E "panicked" -A2 "$log" | head -3 | tee -a "$S"
done
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
