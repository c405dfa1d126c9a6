#!/usr/bin/env bash
# Device run 8 (tenth session), one H200: the hierarchy's scratch grows to what arrives when a rank
# is alone in its CUDA context (processes); threads still reserve the worst case. gpu_hier
# (threads), then ep-bench --hierarchy with 4 processes under MPS (the growing scratch) and
# with threads.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
export CUDA_DEVICE_MAX_CONNECTIONS=32
log=$L/gpu_hier-8.log
timeout 60 $B/tests/gpu_hier --include-ignored --test-threads=1 >"$log" 2>&1
say "gpu_hier rc=$? $(grep -E '^test result' "$log" | tail -1)"; grep -E "panicked|FAILED" -A2 "$log" | head -6 | tee -a "$S"
unset CUDA_DEVICE_MAX_CONNECTIONS
mps=/tmp/fep-mps-j8; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
log="$L/epb-hier-procs.log"
FEP_GPU_PROXY_WORKERS=2 timeout 90 $B/bin/ep-bench --backend gpu --procs --mode normal --hierarchy --ranks 4 --ranks-per-node 2 --provider shm --tokens 2048 --iters 10 >"$log" 2>&1
say "ep-bench --hierarchy 4 processes 2x2 shm 2048 w2 rc=$?"; grep -E "^(normal|nodes)" "$log" | cut -c1-220 | tee -a "$S"; grep -i error "$log" | head -3 | cut -c1-400 | tee -a "$S"
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
