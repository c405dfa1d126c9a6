#!/usr/bin/env bash
# Device run 2 (seventh session), one H200. The LL proxy receive reads one packed word per poll
# (arrivals and sums in one 64-bit load). The new wait's GPU tests, the LL tests (threads; proxy
# as threads and as 2 processes under MPS), gpu_buffer; the LL proxy bench at one token with the
# IPC baseline (eager with a trace, graph replay), tcp, and the mid case.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
export CUDA_DEVICE_MAX_CONNECTIONS=32
t() {  # test-binary log-suffix [filter...]
  local bin=$1 log="$L/$1-$2.log"; shift 2
  timeout 150 $B/tests/$bin --include-ignored --test-threads=1 "$@" >"$log" 2>&1
  say "$bin $* rc=$? $(grep -E '^test result' "$log" | tail -1)"; grep -E "panicked" -A2 "$log" | cut -c1-600 | head -4 | tee -a "$S"
}
t gpu_device_wait 1
t gpu_ll 1
t gpu_buffer 1
t gpu_ll_proxy thr --exact proxy_matches_reference_across_node_splits
unset CUDA_DEVICE_MAX_CONNECTIONS
mps=/tmp/fep-mps-g2; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
for i in 1 2; do t gpu_ll_proxy procs$i --skip proxy_matches_reference_across_node_splits; done
pb=$B/examples/gpu_ll_proxy_bench
timeout 120 $pb --provider shm --cases tiny --iters 1000 --pingpong-iters 5000 --ipc-baseline --trace 20 >"$L/llpb-tiny-ipc-trace.log" 2>&1
say "llproxy tiny eager + ipc + trace rc=$?"; grep -E "^\| tiny|^LLPROXY_SHARE|^HOST" "$L/llpb-tiny-ipc-trace.log" | tee -a "$S"
grep -E "^\|" "$L/llpb-tiny-ipc-trace.log" | grep -E "\| 0 \|" | grep -vE "^\| tiny" | head -30 | tee -a "$S"
timeout 120 $pb --provider shm --cases tiny --iters 1000 --pingpong-iters 5000 --ipc-baseline --graph >"$L/llpb-tiny-ipc-graph.log" 2>&1
say "llproxy tiny graph + ipc rc=$?"; grep -E "^LLPROXY_SHARE|^HOST" "$L/llpb-tiny-ipc-graph.log" | tee -a "$S"
timeout 120 $pb --provider shm --cases tiny --iters 1000 --pingpong-iters 5000 --ipc-baseline --hook >"$L/llpb-tiny-ipc-hook.log" 2>&1
say "llproxy tiny hook + ipc rc=$?"; grep -E "^LLPROXY_SHARE|^\| tiny \| \(hook" "$L/llpb-tiny-ipc-hook.log" | tee -a "$S"
timeout 120 $pb --provider 'tcp;ofi_rxm' --cases tiny,mid --iters 1000 --pingpong-iters 5000 --ipc-baseline >"$L/llpb-tcp.log" 2>&1
say "llproxy tcp tiny,mid + ipc rc=$?"; grep -E "^LLPROXY_SHARE" "$L/llpb-tcp.log" | tee -a "$S"
timeout 120 $pb --provider shm --cases mid,standard --iters 500 --pingpong-iters 5000 --ipc-baseline >"$L/llpb-mid-std.log" 2>&1
say "llproxy shm mid,standard + ipc rc=$?"; grep -E "^LLPROXY_SHARE" "$L/llpb-mid-std.log" | tee -a "$S"
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
