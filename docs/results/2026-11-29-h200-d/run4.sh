#!/usr/bin/env bash
# Device run 4 (fourth session): (1) which torch calls hold the GIL while waiting for the GPU
# (gil_probe.py); (2) every Python GPU case of test_gpu.py, twice, with the test helpers now
# waiting for the stream (GIL released) before reading results; no per-call syncs.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_DEVICE_MAX_CONNECTIONS=32
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(cat $B/BUILD_INFO 2>/dev/null)"
timeout 60 python3 $B/gil_probe.py 2>&1 | tee -a "$S"
cd "$B/python/tests"
export PYTHONPATH=$B/python:$B/python/tests FABRIC_EP_LIBRARY=$B/python/fabric_ep/libfabric_ep.so
py() {  # case world
  local log="$L/py-$1-$2-$(date +%s%N).log"
  timeout 60 python3 _gpu_cases.py "$1" "$2" >"$log" 2>&1
  say "py $1 $2 rc=$? $(grep -E '^CASE' "$log" | head -1)"
  grep -E "rows differ|buf.sync|host steps|rank [0-9]+: " "$log" | head -8 | tee -a "$S"
}
for i in 1 2; do
  for w in 1 2 4; do py normal_bf16 $w; py normal_fp8 $w; py low_latency $w; done
  for w in 2 4; do py normal_bf16_equal_tokens $w; done
  for w in 1 4; do py low_latency_fp8 $w; done
  py streams_and_events 1; py bad_arguments 1; py legacy_stream_refused 2; py auto_backend 1
  py zero_token_rank 2
done
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs/*.log
