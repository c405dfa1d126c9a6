#!/usr/bin/env bash
# Device run 8 (eighth session), one H200, same build as run 7: the normal proxy lane both ways
# at chunk 16 with 32 and 64 slots (default 4 workers), and 32 slots with 6 workers: a second
# measurement of run 7's 0.75-0.86 of fi_pingpong at 32 slots.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
mps=/tmp/fep-mps-h8; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
np=$B/examples/gpu_normal_proxy_bench
f() { grep -E "^NPROXY_RESULT|^FI_PINGPONG|FAILED|panicked" "$1" | sed -E 's/provider=shm //; s/dispatch_p99_us=[^ ]+ //; s/combine_p99_us=[^ ]+ //' | cut -c1-400 | tee -a "$S"; }
timeout 200 $np --chunks 16 --slots 32,64 --iters 20 --pingpong-iters 2000 >"$L/np-c16-w4.log" 2>&1
say "normal proxy bench chunk 16, slots 32 and 64, 4 workers rc=$?"; f "$L/np-c16-w4.log"
FEP_GPU_PROXY_WORKERS=6 timeout 200 $np --chunks 16 --slots 32 --iters 20 --pingpong-iters 2000 >"$L/np-c16-w6.log" 2>&1
say "normal proxy bench chunk 16, slots 32, 6 workers rc=$?"; f "$L/np-c16-w6.log"
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
