#!/usr/bin/env bash
# Device run 6 (fourth session): low latency with PDL only outside graph capture, and the
# combine's own-expert rows read in place (self_pull, no hook). gpu_ll_bench pull / no-pull /
# no PDL, the PyTorch sequence on the same inputs (same job), the LL tests, ep-bench LL at 1 and
# 4 ranks (every result checked), and the proxy path (threads; processes under MPS).
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" PATH="$B/bin:$PATH" FI_TCP_IFACE=lo
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
export CUDA_DEVICE_MAX_CONNECTIONS=32 CUDA_MODULE_LOADING=EAGER
timeout 90 $B/examples/gpu_ll_bench --ranks 1,4 --dump /tmp/fep-ll-dump >"$L/llb-pull.log" 2>&1
say "llbench pull+pdl rc=$?"; grep -E "^LL_" "$L/llb-pull.log" | tee -a "$S"
timeout 90 $B/examples/gpu_ll_bench --ranks 1,4 --no-pull >"$L/llb-nopull.log" 2>&1
say "llbench no pull rc=$?"; grep -E "^LL_" "$L/llb-nopull.log" | tee -a "$S"
FEP_LL_PDL=0 timeout 60 $B/examples/gpu_ll_bench --ranks 1 --split >"$L/llb-split.log" 2>&1
say "llbench split (no pdl) rc=$?"; grep -E "^LL_" "$L/llb-split.log" | tee -a "$S"
PYTHONUNBUFFERED=1 timeout 60 python3 $B/bench_ll_torch.py /tmp/fep-ll-dump >"$L/torch.log" 2>&1
say "torch rc=$?"; tail -8 "$L/torch.log" | tee -a "$S"
for t in gpu_ll gpu_buffer gpu_ffi; do
  timeout 120 $B/tests/$t --include-ignored --test-threads=1 >"$L/$t.log" 2>&1
  say "$t rc=$? $(grep -E '^test result' "$L/$t.log")"; grep -E "panicked" -A2 "$L/$t.log" | head -4 | tee -a "$S"
done
timeout 60 $B/bin/ep-bench --backend gpu --ranks 1 --mode low-latency --iters 50 --cuda-graph --no-nccl >"$L/ll1.log" 2>&1
say "ep-bench ll 1 rank rc=$?"; grep -E '^low-latency' "$L/ll1.log" | tee -a "$S"
timeout 90 $B/bin/ep-bench --backend gpu --ranks 4 --mode low-latency --iters 30 --cuda-graph --no-nccl >"$L/ll4.log" 2>&1
say "ep-bench ll 4 ranks rc=$?"; grep -E '^low-latency' "$L/ll4.log" | tee -a "$S"
timeout 60 $B/tests/gpu_ll_proxy --include-ignored --test-threads=1 proxy_matches_reference stalled_remote >"$L/llp-inproc.log" 2>&1
say "gpu_ll_proxy in-process rc=$? $(grep -E '^test result' "$L/llp-inproc.log")"
unset CUDA_DEVICE_MAX_CONNECTIONS
mps=/tmp/fep-mps-r6; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
timeout 150 $B/tests/gpu_ll_proxy --include-ignored --test-threads=1 two_processes >"$L/llp-tests.log" 2>&1
say "gpu_ll_proxy procs rc=$? $(grep -E '^test result' "$L/llp-tests.log")"; grep -E "panicked" -A2 "$L/llp-tests.log" | head -4 | tee -a "$S"
timeout 100 $B/examples/gpu_ll_proxy_bench --cases tiny --iters 500 --pingpong-iters 3000 >"$L/llp-bench.log" 2>&1
say "llp bench rc=$? $(grep -E '^\| tiny \| (dispatch|combine)' "$L/llp-bench.log" | tr '\n' ' ')"
echo quit | nvidia-cuda-mps-control
say "end"
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
