#!/usr/bin/env bash
# Device run 1 (sixth session): the 4-rank-threads flake. (a) Which streams share a hardware
# work queue with a spinning stream (gpu_queue_probe, live and churned streams) under
# CUDA_DEVICE_MAX_CONNECTIONS unset / 8 / 32; (b) failure rate of fresh-Buffer rounds
# (gpu_flake_stress) by variant; (c) the GPU tests the fifth session's last mends touch.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
for c in unset 8 32; do
  if [ $c = unset ]; then env -u CUDA_DEVICE_MAX_CONNECTIONS timeout 60 $B/examples/gpu_queue_probe >"$L/probe-$c.log" 2>&1
  else CUDA_DEVICE_MAX_CONNECTIONS=$c timeout 60 $B/examples/gpu_queue_probe >"$L/probe-$c.log" 2>&1; fi
  say "probe $c rc=$?"; grep QUEUE_PROBE "$L/probe-$c.log" | tee -a "$S"
done
st() {  # log-name env... -- args
  local name=$1; shift
  env "$@" timeout 100 $B/examples/gpu_flake_stress $FS_ARGS >"$L/stress-$name.log" 2>&1
  say "stress $name rc=$? $(grep STRESS_RESULT "$L/stress-$name.log")"
  grep FAILED "$L/stress-$name.log" | head -2 | cut -c1-300 | tee -a "$S"
}
FS_ARGS="--rounds 20" st ll-c32 CUDA_DEVICE_MAX_CONNECTIONS=32
FS_ARGS="--rounds 20 --hook" st ll-hook-c32 CUDA_DEVICE_MAX_CONNECTIONS=32
FS_ARGS="--rounds 8 --standard" st ll-std-c32 CUDA_DEVICE_MAX_CONNECTIONS=32
FS_ARGS="--rounds 20 --sms 16" st ll-sms16-c32 CUDA_DEVICE_MAX_CONNECTIONS=32
FS_ARGS="--rounds 8 --standard --hook" st ll-std-hook-c32 CUDA_DEVICE_MAX_CONNECTIONS=32
FS_ARGS="--rounds 20 --mode normal" st normal-c32 CUDA_DEVICE_MAX_CONNECTIONS=32
t() {  # test-binary log-suffix [filter...]
  local bin=$1 log="$L/$1-$2.log"; shift 2
  CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 150 $B/tests/$bin --include-ignored --test-threads=1 "$@" >"$log" 2>&1
  say "$bin $* rc=$? $(grep -E '^test result' "$log")"; grep -E "panicked" -A2 "$log" | cut -c1-400 | head -4 | tee -a "$S"
}
t gpu_ll 1
t gpu_cuda 1
t gpu_ffi 1
t gpu_device_wait 1
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
