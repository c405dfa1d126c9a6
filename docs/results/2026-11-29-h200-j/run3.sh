#!/usr/bin/env bash
# Device run 3 (tenth session), one H200: ep-bench --hierarchy on the GPU again (run 2's binaries),
# with the proxy's spinning workers fitted to the 16-core host (FEP_GPU_PROXY_WORKERS: 4 ranks x 4
# workers by default; 8 ranks x 4 = 32 spinning threads overloaded it in run 2) and at DeepEP's
# 4096 tokens; and over tcp;ofi_rxm. hidden 7168, top-8 of 256, fp8, every step checked.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
export CUDA_DEVICE_MAX_CONNECTIONS=32
for c in "4 2 shm 2048 2" "4 2 shm 2048 4" "8 4 shm 2048 1" "4 2 shm 4096 2" "4 2 tcp;ofi_rxm 2048 2"; do
  set -- $c
  log="$L/epb-hier-$1x$2-${3%%;*}-t$4-w$5.log"
  FEP_GPU_PROXY_WORKERS=$5 timeout 120 $B/bin/ep-bench --backend gpu --mode normal --hierarchy --ranks $1 --ranks-per-node $2 --provider "$3" --tokens $4 --iters 10 >"$log" 2>&1
  say "ep-bench --hierarchy ranks $1 rpn $2 $3 tokens $4 workers $5 rc=$?"; grep -E "^normal" "$log" | cut -c1-300 | tee -a "$S"; grep -E "error" "$log" | head -2 | cut -c1-400 | tee -a "$S"
done
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
