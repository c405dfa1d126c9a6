#!/usr/bin/env bash
# Device run 3 (fourth session): the failing normal cases again, now printing the device error
# (buf.sync() after the failed comparison) and each rank's host step times.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_DEVICE_MAX_CONNECTIONS=32
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(cat $B/BUILD_INFO 2>/dev/null)"
cd "$B/python/tests"
export PYTHONPATH=$B/python:$B/python/tests FABRIC_EP_LIBRARY=$B/python/fabric_ep/libfabric_ep.so
py() {  # sync case world
  local log="$L/py-$2-$3-sync$1-$(date +%s%N).log"
  FEP_CASE_SYNC=$1 timeout 60 python3 _gpu_cases.py "$2" "$3" >"$log" 2>&1
  say "py sync=$1 $2 $3 rc=$? $(grep -E '^CASE' "$log" | head -1)"
  grep -E "rows differ|after a device|buf.sync|host steps|rank [0-9]+: " "$log" | head -24 | tee -a "$S"
}
for m in 0 0; do py $m normal_fp8 4; done
py 0 normal_bf16 4
cd "$OUT" && tar czf logs.tgz logs && rm -rf logs/*.log
