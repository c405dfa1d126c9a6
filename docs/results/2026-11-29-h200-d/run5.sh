#!/usr/bin/env bash
# Device run 5 (fourth session): low-latency kernels with programmatic dependent launch and one
# system fence per block in the ticket (GPU peers). Bench with PDL on and off (FEP_LL_PDL=0),
# the send/receive split (PDL off), then the LL tests (threads, Buffer incl. CUDA graphs, C
# ABI) and, under MPS, the proxy path's tests and its tiny-case bench.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" PATH="$B/bin:$PATH" FI_TCP_IFACE=lo
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
export CUDA_DEVICE_MAX_CONNECTIONS=32 CUDA_MODULE_LOADING=EAGER
timeout 90 $B/examples/gpu_ll_bench --ranks 1,4 >"$L/llb-pdl.log" 2>&1
say "llbench pdl rc=$?"; grep -E "^LL_" "$L/llb-pdl.log" | tee -a "$S"
FEP_LL_PDL=0 timeout 90 $B/examples/gpu_ll_bench --ranks 1,4 >"$L/llb-nopdl.log" 2>&1
say "llbench no pdl rc=$?"; grep -E "^LL_" "$L/llb-nopdl.log" | tee -a "$S"
FEP_LL_PDL=0 timeout 60 $B/examples/gpu_ll_bench --ranks 1 --split >"$L/llb-split.log" 2>&1
say "llbench split rc=$?"; grep -E "^LL_" "$L/llb-split.log" | tee -a "$S"
for t in gpu_ll gpu_buffer gpu_ffi; do
  timeout 120 $B/tests/$t --include-ignored --test-threads=1 >"$L/$t.log" 2>&1
  say "$t rc=$? $(grep -E '^test result' "$L/$t.log")"; grep -E "panicked" "$L/$t.log" | head -3 | tee -a "$S"
done
timeout 60 $B/bin/ep-bench --backend gpu --ranks 1 --mode low-latency --iters 50 --cuda-graph --no-nccl >"$L/ll1.log" 2>&1
say "ep-bench ll 1 rank rc=$? $(grep -E '^low-latency' "$L/ll1.log" | tr '\n' ' ')"
timeout 60 $B/tests/gpu_ll_proxy --include-ignored --test-threads=1 proxy_matches_reference stalled_remote >"$L/llp-inproc.log" 2>&1
say "gpu_ll_proxy in-process rc=$? $(grep -E '^test result' "$L/llp-inproc.log")"
unset CUDA_DEVICE_MAX_CONNECTIONS
mps=/tmp/fep-mps-r5; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
timeout 150 $B/tests/gpu_ll_proxy --include-ignored --test-threads=1 two_processes >"$L/llp-tests.log" 2>&1
say "gpu_ll_proxy procs rc=$? $(grep -E '^test result' "$L/llp-tests.log")"; grep -E "panicked" "$L/llp-tests.log" | head -3 | tee -a "$S"
timeout 100 $B/examples/gpu_ll_proxy_bench --cases tiny,mid --iters 500 --pingpong-iters 3000 >"$L/llp-bench.log" 2>&1
say "llp bench rc=$? $(grep -E '^\| (tiny|mid) \| (dispatch|combine)' "$L/llp-bench.log" | tr '\n' ' ')"
echo quit | nvidia-cuda-mps-control
say "end"
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
