#!/usr/bin/env bash
# Device run 2 (sixth session). Run 1: a running kernel never held another stream's kernel
# (40 streams, 8 or 32 connections), and only the first LL standard round of a process failed.
# (a) gpu_queue_probe again with a third layout: a stream whose head WAITS for an event behind
# the spin (what on_ll_stream's joins did); (b) fresh processes, LL standard 4 ranks: the old
# build (old/gpu_flake_stress, side stream + joins) vs the new one (launches on the caller's
# stream); (c) tests on the new build: gpu_buffer x2, gpu_ll_proxy (threads, then processes
# under MPS), the LL proxy bench (tiny, mid), Python LL/normal world 4.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
for c in 8 32; do
  CUDA_DEVICE_MAX_CONNECTIONS=$c timeout 60 $B/examples/gpu_queue_probe --streams 36 >"$L/probe-$c.log" 2>&1
  say "probe $c rc=$?"; grep QUEUE_PROBE "$L/probe-$c.log" | tee -a "$S"
done
export CUDA_DEVICE_MAX_CONNECTIONS=32
for v in old new; do
  bin=$B/examples/gpu_flake_stress; [ $v = old ] && bin=$B/old/gpu_flake_stress
  f=0
  for i in $(seq 1 12); do
    timeout 40 $bin --standard --rounds 2 >>"$L/fresh-$v.log" 2>&1
    grep -q "failed=0" <(tail -1 "$L/fresh-$v.log") || f=$((f+1))
  done
  say "fresh processes LL standard $v: $f of 12 failed"; grep FAILED "$L/fresh-$v.log" | head -2 | cut -c1-600 | tee -a "$S"
done
timeout 120 $B/examples/gpu_flake_stress --rounds 30 --hook >"$L/stress-hook.log" 2>&1; say "stress small hook new: $(grep STRESS_RESULT $L/stress-hook.log)"
t() {  # test-binary log-suffix [filter...]
  local bin=$1 log="$L/$1-$2.log"; shift 2
  timeout 150 $B/tests/$bin --include-ignored --test-threads=1 "$@" >"$log" 2>&1
  say "$bin $* rc=$? $(grep -E '^test result' "$log")"; grep -E "panicked" -A2 "$log" | cut -c1-600 | head -4 | tee -a "$S"
}
t gpu_buffer 1
t gpu_buffer 2
t gpu_ll_proxy thr --exact proxy_matches_reference_across_node_splits
( cd "$B/python/tests"
  export PYTHONPATH=$B/python:$B/python/tests FABRIC_EP_LIBRARY=$B/python/fabric_ep/libfabric_ep.so
  for c in "low_latency 4" "low_latency_fp8 4" "normal_fp8 4"; do
    timeout 60 python3 _gpu_cases.py $c >"$L/py-${c// /-}.log" 2>&1
    say "py $c rc=$? $(grep -E '^CASE' "$L/py-${c// /-}.log" | head -1)"
  done )
unset CUDA_DEVICE_MAX_CONNECTIONS
mps=/tmp/fep-mps-r2; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
t gpu_ll_proxy procs --skip proxy_matches_reference_across_node_splits
timeout 120 $B/examples/gpu_ll_proxy_bench --provider shm --cases tiny,mid --iters 1000 --pingpong-iters 5000 >"$L/llpb.log" 2>&1
say "llproxy bench rc=$?"; grep -E "^\|" "$L/llpb.log" | head -12 | tee -a "$S"
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
