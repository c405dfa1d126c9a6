#!/usr/bin/env bash
# Device run 4 (seventh session), one H200, the final build: Python GPU tests (pytest), the
# Python overhead bench (new: outputs spelled torch.empty_strided inside the call), allocation
# spellings; under MPS the 2-process tests (gpu_ipc, gpu_normal_proxy, gpu_ll_proxy), the normal
# proxy lane both ways and one way, the LL proxy tiny case with the IPC baseline.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
( cd "$B/python/tests"
  export PYTHONPATH=$B/python:$B/python/tests FABRIC_EP_LIBRARY=$B/python/fabric_ep/libfabric_ep.so CUDA_DEVICE_MAX_CONNECTIONS=32
  timeout 240 python3 -m pytest -q -p no:cacheprovider test_gpu.py test_gpu_abi.py test_torch.py >"$L/pytest-gpu.log" 2>&1
  say "python GPU tests (pytest) rc=$? $(tail -1 "$L/pytest-gpu.log")"
  timeout 60 python3 bench_overhead_gpu.py >"$L/overhead_gpu.json" 2>"$L/overhead_gpu.err"
  say "overhead rc=$?"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(k, d[k]) for k in ('python_side_us','python_side_prealloc_us','python_side_empty_strided_us','paired_median_difference_us')]" "$L/overhead_gpu.json" | tee -a "$S" )
timeout 60 python3 $B/bench_torch_alloc.py >"$L/torch_alloc.json" 2>"$L/torch_alloc.err"
say "torch alloc rc=$?"; cat "$L/torch_alloc.json" | tee -a "$S"
t() {  # test-binary log-suffix [filter...]
  local bin=$1 log="$L/$1-$2.log"; shift 2
  timeout 150 $B/tests/$bin --include-ignored --test-threads=1 "$@" >"$log" 2>&1
  say "$bin $* rc=$? $(grep -E '^test result' "$log" | tail -1)"; grep -E "panicked" -A2 "$log" | cut -c1-600 | head -4 | tee -a "$S"
}
mps=/tmp/fep-mps-g4; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
t gpu_ipc 1
t gpu_normal_proxy procs --exact two_processes_one_per_node_over_shm
t gpu_ll_proxy procs --skip proxy_matches_reference_across_node_splits
np=$B/examples/gpu_normal_proxy_bench
for ow in "" "--one-way"; do
  FEP_GPU_PROXY_WORKERS=6 timeout 100 $np --chunks 64 --slots 16 --iters 20 --pingpong-iters 2000 $ow >"$L/np-w6${ow}.log" 2>&1
  say "np workers 6 $ow rc=$?"; grep -E "^NPROXY_RESULT|^FI_PINGPONG|FAILED|panicked" "$L/np-w6${ow}.log" | sed -E 's/provider=shm //; s/dispatch_p99_us=[^ ]+ //; s/combine_p99_us=[^ ]+ //' | cut -c1-400 | tee -a "$S"
done
timeout 100 $B/examples/gpu_ll_proxy_bench --provider shm --cases tiny --iters 1000 --pingpong-iters 5000 --ipc-baseline >"$L/llpb-tiny-ipc.log" 2>&1
say "llproxy tiny + ipc rc=$?"; grep -E "^\| tiny|^LLPROXY_SHARE" "$L/llpb-tiny-ipc.log" | tee -a "$S"
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
