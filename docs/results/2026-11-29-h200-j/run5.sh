#!/usr/bin/env bash
# Device run 5 (tenth session), one H200: the session's final build (the bench loops of the direct
# path and the hierarchy now share one implementation; the ABI's hierarchy checks moved before
# the bootstrap). gpu_hier, gpu_buffer and gpu_normal_proxy (threads) for the shared loop,
# gpu_ffi, the Python GPU tests of the ABI and the hierarchy, and ep-bench --hierarchy once.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
t() {  # test-binary log-suffix [filter...]
  local bin=$1 log="$L/$1-$2.log"; shift 2
  timeout 150 $B/tests/$bin --include-ignored --test-threads=1 "$@" >"$log" 2>&1
  say "$bin $* rc=$? $(grep -E '^test result' "$log" | tail -1)"; grep -E "panicked|FAILED" -A2 "$log" | cut -c1-600 | head -10 | tee -a "$S"
}
export CUDA_DEVICE_MAX_CONNECTIONS=32
t gpu_hier 5
t gpu_buffer 5
t gpu_normal_proxy thr forced_internode_threads_match_reference
t gpu_ffi 5
log="$L/epb-hier-4x2-shm.log"
FEP_GPU_PROXY_WORKERS=2 timeout 100 $B/bin/ep-bench --backend gpu --mode normal --hierarchy --ranks 4 --ranks-per-node 2 --provider shm --tokens 2048 --iters 10 >"$log" 2>&1
say "ep-bench --hierarchy 2x2 shm 2048 w2 rc=$?"; grep -E "^normal" "$log" | cut -c1-200 | tee -a "$S"
cd "$B/python/tests"
export PYTHONPATH=$B/python:$B/python/tests FABRIC_EP_LIBRARY=$B/python/fabric_ep/libfabric_ep.so
timeout 200 python3 -m pytest -q -p no:cacheprovider test_gpu_abi.py test_gpu.py -k "abi or hierarchy or normal_bf16_matches" >"$L/pytest-gpu.log" 2>&1
say "python GPU tests (pytest, ABI + hierarchy + normal_bf16) rc=$? $(tail -1 "$L/pytest-gpu.log")"; grep -E "FAILED|Error" "$L/pytest-gpu.log" | head -8 | cut -c1-400 | tee -a "$S"
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
