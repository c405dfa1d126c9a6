#!/usr/bin/env bash
# Device run 1 (tenth session), one H200: DeepEP's hierarchy on the GPU backend
# (ep::hier_gpu::GpuHierBuffer, new). tests/gpu_hier (threads: 2x2, 2x4, 4x1 node splits over shm
# and tcp;ofi_rxm, bf16/fp8, fresh/cached/worst; few tokens; a stalled rank), gpu_buffer as a
# regression check, then ep-bench --hierarchy on the GPU: direct (proxy lane between nodes) and
# the hierarchy on the same inputs, 4096 tokens, hidden 7168, top-8 of 256, fp8.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
t() {  # test-binary log-suffix [filter...]
  local bin=$1 log="$L/$1-$2.log"; shift 2
  timeout 240 $B/tests/$bin --include-ignored --test-threads=1 "$@" >"$log" 2>&1
  say "$bin $* rc=$? $(grep -E '^test result' "$log" | tail -1)"; grep -E "panicked|FAILED|^ok:" -A2 "$log" | cut -c1-600 | head -20 | tee -a "$S"
}
export CUDA_DEVICE_MAX_CONNECTIONS=32
t gpu_hier 1
t gpu_buffer 1
for c in "4 2 shm" "8 4 shm" "4 2 tcp;ofi_rxm"; do
  set -- $c
  log="$L/epb-hier-$1x$2-${3%%;*}.log"
  timeout 240 $B/bin/ep-bench --backend gpu --mode normal --hierarchy --ranks $1 --ranks-per-node $2 --provider "$3" --iters 10 >"$log" 2>&1
  say "ep-bench --hierarchy ranks $1 rpn $2 $3 rc=$?"; grep -E "^(normal|nodes|ep-bench)" "$log" | cut -c1-300 | tee -a "$S"; tail -3 "$log" | tee -a "$S"
done
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
