#!/usr/bin/env bash
# Device run 2 (tenth session), one H200: run 1 again after its fix (the back-to-back steps'
# events were one pair short in the hierarchy's bench loop). tests/gpu_hier, then ep-bench
# --hierarchy on the GPU (direct with the proxy lane between nodes, then the hierarchy, same
# inputs, every step checked), 2048 tokens, hidden 7168, top-8 of 256, fp8.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
export CUDA_DEVICE_MAX_CONNECTIONS=32
log=$L/gpu_hier-2.log
timeout 200 $B/tests/gpu_hier --include-ignored --test-threads=1 >"$log" 2>&1
say "gpu_hier rc=$? $(grep -E '^test result' "$log" | tail -1)"
grep -E "panicked|FAILED|^ok:|^test " -A2 "$log" | cut -c1-600 | head -30 | tee -a "$S"
for c in "4 2 shm" "8 4 shm"; do
  set -- $c
  log="$L/epb-hier-$1x$2-${3%%;*}.log"
  timeout 170 $B/bin/ep-bench --backend gpu --mode normal --hierarchy --ranks $1 --ranks-per-node $2 --provider "$3" --tokens 2048 --iters 5 >"$log" 2>&1
  say "ep-bench --hierarchy ranks $1 rpn $2 $3 rc=$?"; grep -E "^(normal|nodes|ep-bench)" "$log" | cut -c1-300 | tee -a "$S"; tail -2 "$log" | cut -c1-400 | tee -a "$S"
done
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
