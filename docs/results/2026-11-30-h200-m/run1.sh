#!/usr/bin/env bash
# Device run 1 (thirteenth session), one H200: the torch helper (ffi/python/fabric_ep/_native.cpp).
# Builds it (timed, then a cached load timed), its own tests (test_native.py), the overhead bench
# twice (the helper's calls and the pure-Python ones in turns in one process), the Python GPU
# tests with the helper required (FABRIC_EP_NATIVE=1), then the stream, fp8 and low-latency
# cases with it off (FABRIC_EP_NATIVE=0). Bundle: FEP_GPU_BUILD=python.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER
export CUDA_DEVICE_MAX_CONNECTIONS=32 TORCH_EXTENSIONS_DIR=/tmp/fep-torch-ext PYTHONUNBUFFERED=1
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST); $(nproc) cpus; $(g++ --version | head -1); ninja $(ninja --version 2>&1)"
cd "$B/python/tests"
export PYTHONPATH=$B/python:$B/python/tests FABRIC_EP_LIBRARY=$B/python/fabric_ep/libfabric_ep.so
load() {
  FABRIC_EP_NATIVE=1 python3 -c "import time, torch; t=time.perf_counter(); from fabric_ep import _native; _native.get(torch); print('$1 s', round(time.perf_counter()-t, 2), _native.status())"
}
FABRIC_EP_NATIVE_VERBOSE=1 load build >"$L/native-build.log" 2>&1; say "helper build rc=$? $(tail -1 "$L/native-build.log")"
load cached-load >>"$L/native-build.log" 2>&1; say "helper cached load rc=$? $(tail -1 "$L/native-build.log")"
timeout 120 python3 -m pytest -q -p no:cacheprovider test_native.py >"$L/pytest-native.log" 2>&1
say "test_native rc=$? $(tail -1 "$L/pytest-native.log")"; grep -E "FAILED|Error" "$L/pytest-native.log" | head -8 | tee -a "$S"
for i in 1 2; do
  timeout 200 python3 bench_overhead_gpu.py >"$L/overhead_gpu-$i.json" 2>"$L/overhead_gpu-$i.err"; say "overhead $i rc=$?"; tail -3 "$L/overhead_gpu-$i.err"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('errors', d.get('errors'), d['setting'].get('native')); [print(k, {c: round(v, 2) for c, v in d[k].items()}) for k in ('python_side_us','python_side_pure_us','python_side_kept_us','python_side_pure_kept_us','python_side_prealloc_us')]; print({k: round(d[k], 2) for k in ('alloc_separate_us','alloc_native_us','alloc_one_block_us') if k in d})" "$L/overhead_gpu-$i.json" 2>&1 | tee -a "$S"
done
FABRIC_EP_NATIVE=1 timeout 300 python3 -m pytest -q -p no:cacheprovider test_gpu.py test_gpu_abi.py test_torch.py >"$L/pytest-gpu-native.log" 2>&1
say "python GPU tests, helper required: rc=$? $(tail -1 "$L/pytest-gpu-native.log")"; grep -E "FAILED|Error" "$L/pytest-gpu-native.log" | head -8 | tee -a "$S"
FABRIC_EP_NATIVE=0 timeout 200 python3 -m pytest -q -p no:cacheprovider test_gpu.py -k "streams or low_latency or fp8" >"$L/pytest-gpu-pure.log" 2>&1
say "python GPU tests (streams, low latency, fp8), helper off: rc=$? $(tail -1 "$L/pytest-gpu-pure.log")"; grep -E "FAILED|Error" "$L/pytest-gpu-pure.log" | head -8 | tee -a "$S"
tar -C "$OUT" -czf "$OUT/logs.tgz" logs
