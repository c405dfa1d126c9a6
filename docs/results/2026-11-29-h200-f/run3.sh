#!/usr/bin/env bash
# Device run 3 (sixth session), on TWO H200s: (a) ep-bench's GPU backend with 2 ranks as
# processes, one per GPU (CUDA IPC across GPUs), and with 2 ranks as threads on one GPU plus
# NCCL's all-to-all on 2 GPUs; (b) fresh processes, LL standard 4 ranks as threads (new build);
# (c) gpu_buffer and gpu_ll_proxy (threads; processes under MPS) with the capture fix; (d) the
# LL proxy bench, tiny case traced; (e) torch allocation costs and the Python overhead bench.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
nvidia-smi -L | tee -a "$S"; nvidia-smi topo -m 2>&1 | head -4 | tee -a "$S"
timeout 150 $B/bin/ep-bench --backend gpu --procs --ranks 2 --iters 20 >"$L/epb-procs2.log" 2>&1
say "ep-bench procs 2 GPUs rc=$?"; grep -E "^\||GB/s|us" "$L/epb-procs2.log" | head -20 | tee -a "$S"
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 150 $B/bin/ep-bench --backend gpu --ranks 2 --iters 20 >"$L/epb-thr2.log" 2>&1
say "ep-bench threads 2 + NCCL rc=$?"; grep -E "^\||NCCL" "$L/epb-thr2.log" | head -20 | tee -a "$S"
export CUDA_DEVICE_MAX_CONNECTIONS=32
f=0
for i in $(seq 1 16); do
  timeout 40 $B/examples/gpu_flake_stress --standard --rounds 2 >>"$L/fresh-new.log" 2>&1
  grep -q "failed=0" <(tail -1 "$L/fresh-new.log") || f=$((f+1))
done
say "fresh processes LL standard new: $f of 16 failed"; grep FAILED "$L/fresh-new.log" | head -2 | cut -c1-600 | tee -a "$S"
t() {  # test-binary log-suffix [filter...]
  local bin=$1 log="$L/$1-$2.log"; shift 2
  timeout 150 $B/tests/$bin --include-ignored --test-threads=1 "$@" >"$log" 2>&1
  say "$bin $* rc=$? $(grep -E '^test result' "$log" | tail -1)"; grep -E "panicked" -A2 "$log" | cut -c1-600 | head -4 | tee -a "$S"
}
t gpu_buffer 1
t gpu_ll_proxy thr --exact proxy_matches_reference_across_node_splits
( cd "$B/python/tests"
  export PYTHONPATH=$B/python:$B/python/tests FABRIC_EP_LIBRARY=$B/python/fabric_ep/libfabric_ep.so
  timeout 60 python3 $B/bench_torch_alloc.py >"$L/torch_alloc.json" 2>"$L/torch_alloc.err"; say "torch alloc rc=$?"; cat "$L/torch_alloc.json" | tee -a "$S"
  timeout 60 python3 bench_overhead_gpu.py >"$L/overhead_gpu.json" 2>"$L/overhead_gpu.err"; say "overhead rc=$?"; cat "$L/overhead_gpu.json" | tee -a "$S" )
unset CUDA_DEVICE_MAX_CONNECTIONS
mps=/tmp/fep-mps-r3; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
t gpu_ll_proxy procs --skip proxy_matches_reference_across_node_splits
timeout 120 $B/examples/gpu_ll_proxy_bench --provider shm --cases tiny --iters 1000 --pingpong-iters 5000 --trace 20 >"$L/llpb-trace.log" 2>&1
say "llproxy bench traced rc=$?"; grep -E "^\|" "$L/llpb-trace.log" | head -8 | tee -a "$S"
timeout 120 $B/examples/gpu_ll_proxy_bench --provider shm --cases tiny --iters 1000 --pingpong-iters 5000 --hook >"$L/llpb-hook.log" 2>&1
say "llproxy bench hook rc=$?"; grep -E "^\|" "$L/llpb-hook.log" | head -8 | tee -a "$S"
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
