#!/usr/bin/env bash
# Device run 1 (seventh session), one H200. (a) What allocating a dispatch's four outputs costs
# through libtorch's C shim from ctypes against Tensor.new_empty (bench_torch_alloc.py). (b) The
# LL proxy bench's new --ipc-baseline: the same 1-token case with both ranks on one node (CUDA
# IPC), eager and as graph replays. (c) The normal proxy lane both ways (as before) and one way
# (--one-way: rank 1 keeps its tokens) against fi_pingpong at the same write size.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
timeout 120 python3 $B/bench_torch_alloc.py >"$L/torch_alloc.json" 2>"$L/torch_alloc.err"
say "torch alloc rc=$?"; cat "$L/torch_alloc.json" | tee -a "$S"; tail -3 "$L/torch_alloc.err" | tee -a "$S"
mps=/tmp/fep-mps-g1; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
pb=$B/examples/gpu_ll_proxy_bench
timeout 120 $pb --provider shm --cases tiny --iters 1000 --pingpong-iters 5000 --ipc-baseline >"$L/llpb-tiny-ipc.log" 2>&1
say "llproxy tiny eager + ipc baseline rc=$?"; grep -E "^\| tiny|^LLPROXY_SHARE|^HOST" "$L/llpb-tiny-ipc.log" | tee -a "$S"
timeout 120 $pb --provider shm --cases tiny --iters 1000 --pingpong-iters 5000 --ipc-baseline --graph >"$L/llpb-tiny-ipc-graph.log" 2>&1
say "llproxy tiny graph + ipc baseline rc=$?"; grep -E "^\| tiny|^LLPROXY_SHARE|^HOST" "$L/llpb-tiny-ipc-graph.log" | tee -a "$S"
np=$B/examples/gpu_normal_proxy_bench
for ow in "" "--one-way"; do
  FEP_GPU_PROXY_WORKERS=6 timeout 150 $np --chunks 32,64 --slots 16 --iters 20 --pingpong-iters 2000 $ow >"$L/np-w6${ow}.log" 2>&1
  say "np workers 6 $ow rc=$?"; grep -E "^NPROXY_RESULT|^FI_PINGPONG|FAILED|panicked" "$L/np-w6${ow}.log" | sed -E 's/provider=shm //; s/dispatch_p99_us=[^ ]+ //; s/combine_p99_us=[^ ]+ //' | cut -c1-400 | tee -a "$S"
done
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
