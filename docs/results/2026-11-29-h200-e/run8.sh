#!/usr/bin/env bash
# Device run 8 (fifth session): the normal proxy lane's remaining shapes at 6 workers: 16 and 32
# slots, chunk 32 and 64, at the standard 32 SMs per rank and at 48 (2 processes under MPS, shm;
# fi_pingpong best of 3 per size).
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
mps=/tmp/fep-mps-r8; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
for sms in 32 48; do
  FEP_GPU_PROXY_WORKERS=6 timeout 110 $B/examples/gpu_normal_proxy_bench --chunks 32,64 --slots 16,32 --sms $sms --iters 20 --pingpong-iters 2000 >"$L/np-sms$sms.log" 2>&1
  say "np workers 6 sms $sms rc=$?"; grep -E "^NPROXY_RESULT|^FI_PINGPONG" "$L/np-sms$sms.log" | sed -E 's/provider=shm //; s/dispatch_p99_us=[^ ]+ //; s/combine_p99_us=[^ ]+ //' | tee -a "$S"
done
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
