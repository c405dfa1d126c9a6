#!/usr/bin/env bash
# Device run 3 (seventh session), one H200, the session's final build: ep-bench with no
# arguments, then every GPU test binary that needs no MPS (ranks as threads).
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
export CUDA_DEVICE_MAX_CONNECTIONS=32
timeout 150 $B/bin/ep-bench >"$L/epb-default.log" 2>&1
say "ep-bench (no arguments) rc=$?"; grep -vE "^\s*$|[|]/|\[" "$L/epb-default.log" | grep -E "normal|low-latency|vs NCCL|ep-bench|NCCL" | tee -a "$S"
t() {  # test-binary log-suffix [filter...]
  local bin=$1 log="$L/$1-$2.log"; shift 2
  timeout 200 $B/tests/$bin --include-ignored --test-threads=1 "$@" >"$log" 2>&1
  say "$bin $* rc=$? $(grep -E '^test result' "$log" | tail -1)"; grep -E "panicked" -A2 "$log" | cut -c1-600 | head -4 | tee -a "$S"
}
for b in gpu_cuda gpu_device_wait gpu_ffi gpu_layout gpu_ll gpu_nccl gpu_normal gpu_proxy gpu_buffer; do t $b 1; done
t gpu_ll_proxy thr --exact proxy_matches_reference_across_node_splits
t gpu_normal_proxy thr --skip two_processes
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
