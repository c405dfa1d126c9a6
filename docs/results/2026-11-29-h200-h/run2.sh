#!/usr/bin/env bash
# Device run 2 (eighth session), one H200: where the standard LL proxy phase goes with several
# workers (event trace, 4 workers and 1), and mid over tcp;ofi_rxm with 1 and 4 workers.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
mps=/tmp/fep-mps-h2; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
pb=$B/examples/gpu_ll_proxy_bench
for w in 4 1; do
  FEP_LL_PROXY_WORKERS=$w timeout 150 $pb --provider shm --cases standard --iters 100 --pingpong-iters 1000 --trace 10 >"$L/llpb-std-trace-w$w.log" 2>&1
  say "llproxy shm standard trace, $w workers rc=$?"; grep -E "^\| standard|^HOST|^TRACE" "$L/llpb-std-trace-w$w.log" | tee -a "$S"
  sed -n '/^TRACE standard/,$p' "$L/llpb-std-trace-w$w.log" | head -60 | tee -a "$S"
done
for w in 1 4; do
  FEP_LL_PROXY_WORKERS=$w timeout 150 $pb --provider 'tcp;ofi_rxm' --cases mid --iters 300 --pingpong-iters 2000 --ipc-baseline >"$L/llpb-tcp-mid-w$w.log" 2>&1
  say "llproxy tcp mid + ipc, $w workers rc=$?"; grep -E "^LLPROXY_SHARE|^LLPROXY_PHASE" "$L/llpb-tcp-mid-w$w.log" | grep "rank=0" | tee -a "$S"
done
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
