#!/usr/bin/env bash
# Device run 6 (sixth session), two H200s. Since run 5: each LL receive kernel of a proxy lane
# refreshes the send's `sends_seen` from the host (one thread, off the critical path), and the
# dispatch receive loads a record's scales and source index before storing its row (one round
# trip for a record in host memory). LL proxy bench (tiny traced, hook, tcp; mid), LL bench,
# LL tests (proxy processes x2), Python LL cases.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
export CUDA_DEVICE_MAX_CONNECTIONS=32
timeout 90 $B/examples/gpu_ll_bench --ranks 1,4 --iters 300 >"$L/llb.log" 2>&1
say "llbench rc=$?"; grep -E "^LL_" "$L/llb.log" | sed -E 's/tokens=128 hidden=7168 topk=8 experts=256 //' | tee -a "$S"
t() {  # test-binary log-suffix [filter...]
  local bin=$1 log="$L/$1-$2.log"; shift 2
  timeout 150 $B/tests/$bin --include-ignored --test-threads=1 "$@" >"$log" 2>&1
  say "$bin $* rc=$? $(grep -E '^test result' "$log" | tail -1)"; grep -E "panicked" -A2 "$log" | cut -c1-600 | head -4 | tee -a "$S"
}
t gpu_ll 1
t gpu_buffer 1
t gpu_ll_proxy thr --exact proxy_matches_reference_across_node_splits
( cd "$B/python/tests"
  export PYTHONPATH=$B/python:$B/python/tests FABRIC_EP_LIBRARY=$B/python/fabric_ep/libfabric_ep.so
  for c in "low_latency 4" "low_latency_fp8 4"; do
    timeout 60 python3 _gpu_cases.py $c >"$L/py-${c// /-}.log" 2>&1
    say "py $c rc=$? $(grep -E '^CASE' "$L/py-${c// /-}.log" | head -1)"
  done )
unset CUDA_DEVICE_MAX_CONNECTIONS
mps=/tmp/fep-mps-r6; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
for i in 1 2; do t gpu_ll_proxy procs$i --skip proxy_matches_reference_across_node_splits; done
pb=$B/examples/gpu_ll_proxy_bench
timeout 100 $pb --provider shm --cases tiny --iters 1000 --pingpong-iters 5000 --trace 20 >"$L/llpb-tiny-trace.log" 2>&1
say "llproxy tiny traced rc=$?"; grep -E "^\|" "$L/llpb-tiny-trace.log" | grep -vE "^\|---" | grep -E "tiny|\| 0 \|" | head -40 | tee -a "$S"
timeout 100 $pb --provider shm --cases tiny,mid --iters 1000 --pingpong-iters 5000 >"$L/llpb-tiny-mid.log" 2>&1
say "llproxy tiny,mid rc=$?"; grep -E "^\| (tiny|mid)" "$L/llpb-tiny-mid.log" | tee -a "$S"
timeout 100 $pb --provider shm --cases tiny --iters 1000 --pingpong-iters 5000 --hook >"$L/llpb-tiny-hook.log" 2>&1
say "llproxy tiny hook rc=$?"; grep -E "^\| tiny" "$L/llpb-tiny-hook.log" | tee -a "$S"
timeout 100 $pb --provider 'tcp;ofi_rxm' --cases tiny --iters 1000 --pingpong-iters 5000 >"$L/llpb-tcp.log" 2>&1
say "llproxy tiny tcp rc=$?"; grep -E "^\| tiny" "$L/llpb-tcp.log" | tee -a "$S"
grep -E "^HOST" "$L"/llpb-*.log | tee -a "$S"
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
