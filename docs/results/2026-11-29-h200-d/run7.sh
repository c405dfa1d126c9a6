#!/usr/bin/env bash
# Device run 7 (fourth session): the GIL/driver probe (part 2: does one thread's blocking read
# hold up another thread's CUDA calls?), every Python GPU case once on the final library (the LL
# combine now reads own rows in place, PDL on), and the Python call-overhead bench.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_DEVICE_MAX_CONNECTIONS=32
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
timeout 60 python3 $B/gil_probe.py 2>&1 | tee -a "$S"
cd "$B/python/tests"
export PYTHONPATH=$B/python:$B/python/tests FABRIC_EP_LIBRARY=$B/python/fabric_ep/libfabric_ep.so
py() {  # case world
  local log="$L/py-$1-$2.log"
  timeout 60 python3 _gpu_cases.py "$1" "$2" >"$log" 2>&1
  say "py $1 $2 rc=$? $(grep -E '^CASE' "$log" | head -1)"
  grep -E "rows differ|buf.sync|host steps|rank [0-9]+: " "$log" | head -8 | tee -a "$S"
}
for w in 1 2 4; do py normal_bf16 $w; py normal_fp8 $w; py low_latency $w; done
for w in 2 4; do py normal_bf16_equal_tokens $w; done
for w in 1 4; do py low_latency_fp8 $w; done
py streams_and_events 1; py bad_arguments 1; py legacy_stream_refused 2; py auto_backend 1
py zero_token_rank 2
PYTHONUNBUFFERED=1 timeout 60 python3 bench_overhead_gpu.py >"$L/overhead_gpu.json" 2>"$L/overhead_gpu.err"
say "overhead rc=$?"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(k, d[k]) for k in ('python_side_us','python_side_prealloc_us','python_side_alloc_us','paired_median_difference_us')]" "$L/overhead_gpu.json" | tee -a "$S"
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
