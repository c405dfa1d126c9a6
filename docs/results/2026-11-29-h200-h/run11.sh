#!/usr/bin/env bash
# Device run 11 (eighth session), one H200, same build as run 9: where the 16-token LL proxy
# phase goes (mid case, event trace, default 4 workers), for the next session.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
mps=/tmp/fep-mps-h11; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
timeout 100 $B/examples/gpu_ll_proxy_bench --provider shm --cases mid --iters 300 --pingpong-iters 2000 --ipc-baseline --trace 20 >"$L/llpb-mid-trace.log" 2>&1
say "llproxy shm mid trace + ipc rc=$?"; grep -E "^LLPROXY_SHARE|^\| (dispatch|combine) \| 0 \|" "$L/llpb-mid-trace.log" | tee -a "$S"
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
