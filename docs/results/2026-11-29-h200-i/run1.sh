#!/usr/bin/env bash
# Device run 1 (ninth session), one H200 machine (16 CPU cores). Direct per-rank sends vs DeepEP's
# hierarchy (ep::hier) on the HOST backend (CPU ranks as processes), every result checked against
# the reference: ep-bench --hierarchy runs the direct path, then the hierarchy on the same inputs,
# and prints both routings' internode bytes. "Network" = --provider, "node" = --intranode-provider
# (shm, standing in for NVLink). Then the normal-mode GPU tests (the reference's combine is now
# written as the node-grouped sum with one group: the GPU comparisons must be unchanged).
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST); $(nproc) CPUs"
h() {  # log-name args...
  local n=$1; shift
  local t0=$SECONDS
  timeout 240 $B/bin/ep-bench --backend host --mode normal --fp8 --hierarchy --iters 10 "$@" >"$L/hier-$n.log" 2>"$L/hier-$n.err"
  say "ep-bench --hierarchy $* rc=$? ($((SECONDS - t0)) s)"
  grep -E "^normal|^internode|error|Error" "$L/hier-$n.log" "$L/hier-$n.err" | cut -c1-400 | tee -a "$S"
}
h 8-2x4-shm --ranks 8 --ranks-per-node 4 --provider shm --tokens 512
h 8-2x4-tcp+shm --ranks 8 --ranks-per-node 4 --provider "tcp;ofi_rxm" --intranode-provider shm --tokens 512
h 8-2x4-tcp --ranks 8 --ranks-per-node 4 --provider "tcp;ofi_rxm" --tokens 512
h 16-2x8-tcp+shm --ranks 16 --ranks-per-node 8 --provider "tcp;ofi_rxm" --intranode-provider shm --tokens 512
h 16-4x4-tcp+shm --ranks 16 --ranks-per-node 4 --provider "tcp;ofi_rxm" --intranode-provider shm --tokens 512
t() {  # test-binary log-suffix [filter...]
  local bin=$1 log="$L/$1-$2.log"; shift 2
  timeout 200 $B/tests/$bin --include-ignored --test-threads=1 "$@" >"$log" 2>&1
  say "$bin $* rc=$? $(grep -E '^test result' "$log" | tail -1)"; grep -E "panicked|FAILED" -A2 "$log" | cut -c1-600 | head -6 | tee -a "$S"
}
export CUDA_DEVICE_MAX_CONNECTIONS=32
t gpu_normal 1
t gpu_buffer 1
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log logs/*.err
