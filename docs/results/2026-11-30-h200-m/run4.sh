#!/usr/bin/env bash
# Device run 4 (thirteenth session), one H200: the helper's third call, ptrs (a fresh dispatch's,
# a combine's and a low-latency dispatch's inputs checked and read in one call; ABI 2): its
# tests, the overhead bench, the Python GPU tests with the helper required, the bench again.
# Bundle: FEP_GPU_BUILD=python.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER
export CUDA_DEVICE_MAX_CONNECTIONS=32 TORCH_EXTENSIONS_DIR=/tmp/fep-torch-ext PYTHONUNBUFFERED=1
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST); load $(cut -d' ' -f1-3 /proc/loadavg)"
cd "$B/python/tests"
export PYTHONPATH=$B/python:$B/python/tests FABRIC_EP_LIBRARY=$B/python/fabric_ep/libfabric_ep.so
timeout 120 python3 -m pytest -q -p no:cacheprovider test_native.py >"$L/pytest-native.log" 2>&1
say "test_native rc=$? $(tail -1 "$L/pytest-native.log")"; grep -E "FAILED|Error" "$L/pytest-native.log" | head -8 | tee -a "$S"
bench() {
  FABRIC_EP_NATIVE=1 timeout 200 python3 bench_overhead_gpu.py >"$L/overhead_gpu-$1.json" 2>"$L/overhead_gpu-$1.err"; say "overhead $1 rc=$? load $(cut -d' ' -f1-3 /proc/loadavg)"; tail -3 "$L/overhead_gpu-$1.err"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('errors', d.get('errors'), d['setting'].get('native')); [print(k, {c: round(v, 2) for c, v in d[k].items()}) for k in ('python_side_us','python_side_pure_us','python_side_kept_us','torch_floor_us','own_us')]" "$L/overhead_gpu-$1.json" 2>&1 | tee -a "$S"
}
bench 1
FABRIC_EP_NATIVE=1 timeout 300 python3 -m pytest -q -s -p no:cacheprovider test_gpu.py test_gpu_abi.py test_torch.py >"$L/pytest-gpu-native.log" 2>&1
say "python GPU tests, helper required: rc=$? $(tail -1 "$L/pytest-gpu-native.log")"; grep -E "FAILED|Error" "$L/pytest-gpu-native.log" | head -8 | tee -a "$S"
say "cases passed with the helper loaded: $(grep -c 'PASSED (torch helper: loaded' "$L/pytest-gpu-native.log")"
tar -C "$OUT" -czf "$OUT/logs.tgz" logs
bench 2
tar -C "$OUT" -czf "$OUT/logs.tgz" logs
