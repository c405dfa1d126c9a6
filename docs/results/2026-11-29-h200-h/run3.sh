#!/usr/bin/env bash
# Device run 3 (eighth session), one H200. LL dispatch records padded to 128 bytes and written in
# whole lines (the tail: scales, source index, padding, from shared memory by one warp per
# destination). Tests: gpu_ll, gpu_buffer, gpu_ll_proxy (threads; 2 processes under MPS), the
# Python GPU tests. Bench: gpu_ll_bench --ranks 1,4 (device pointers), the LL proxy bench standard
# + mid (4 workers, IPC baseline) and one traced standard run, tiny.
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
  timeout 200 $B/tests/$bin --include-ignored --test-threads=1 "$@" >"$log" 2>&1
  say "$bin $* rc=$? $(grep -E '^test result' "$log" | tail -1)"; grep -E "panicked|FAILED" -A2 "$log" | cut -c1-600 | head -6 | tee -a "$S"
}
t gpu_ll 1
t gpu_buffer 1
t gpu_ll_proxy thr --exact proxy_matches_reference_across_node_splits
timeout 120 $B/examples/gpu_ll_bench --ranks 1,4 >"$L/llb.log" 2>&1
say "gpu_ll_bench rc=$?"; grep -E "^\|" "$L/llb.log" | tail -12 | tee -a "$S"
( cd "$B/python/tests" && PYTHONPATH=$B/python:$B/python/tests FABRIC_EP_LIBRARY=$B/python/fabric_ep/libfabric_ep.so \
  timeout 240 python3 -m pytest -q -p no:cacheprovider test_gpu.py test_gpu_abi.py test_torch.py >"$L/pytest-gpu.log" 2>&1 )
say "python GPU tests (pytest) rc=$? $(tail -1 "$L/pytest-gpu.log")"; grep -E "FAILED|Error" "$L/pytest-gpu.log" | head -5 | tee -a "$S"
unset CUDA_DEVICE_MAX_CONNECTIONS
mps=/tmp/fep-mps-h3; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
t gpu_ll_proxy procs --skip proxy_matches_reference_across_node_splits --skip stalled
pb=$B/examples/gpu_ll_proxy_bench
timeout 150 $pb --provider shm --cases standard,mid --iters 300 --pingpong-iters 2000 --ipc-baseline >"$L/llpb-std.log" 2>&1
say "llproxy shm standard,mid + ipc, default workers rc=$?"; grep -E "^LLPROXY_SHARE|^LLPROXY_PHASE" "$L/llpb-std.log" | tee -a "$S"
timeout 150 $pb --provider shm --cases standard --iters 100 --pingpong-iters 1000 --trace 10 >"$L/llpb-std-trace.log" 2>&1
say "llproxy shm standard trace rc=$?"; grep -E "^\| (dispatch|combine) \| 0 \|" "$L/llpb-std-trace.log" | tee -a "$S"
timeout 100 $pb --provider shm --cases tiny --iters 1000 --pingpong-iters 5000 --ipc-baseline >"$L/llpb-tiny.log" 2>&1
say "llproxy shm tiny + ipc rc=$?"; grep -E "^LLPROXY_SHARE" "$L/llpb-tiny.log" | tee -a "$S"
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
