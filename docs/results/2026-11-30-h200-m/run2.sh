#!/usr/bin/env bash
# Device run 2 (thirteenth session), one H200: the overhead bench three times, now with the
# torch floor of each call form (torch_floor_us: the torch work DeepEP's semantics need, made
# through the helper alone; own_us = python_side_us - torch_floor_us), the helper's calls and the
# pure-Python ones in turns; then every Python GPU test with the helper off (FABRIC_EP_NATIVE=0;
# run 1 ran them all with it required). Bundle: FEP_GPU_BUILD=python.
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
for i in 1 2 3; do
  FABRIC_EP_NATIVE=1 timeout 200 python3 bench_overhead_gpu.py >"$L/overhead_gpu-$i.json" 2>"$L/overhead_gpu-$i.err"; say "overhead $i rc=$? load $(cut -d' ' -f1-3 /proc/loadavg)"; tail -3 "$L/overhead_gpu-$i.err"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('errors', d.get('errors'), d['setting'].get('native'), d['setting'].get('native_load_s')); [print(k, {c: round(v, 2) for c, v in d[k].items()}) for k in ('python_side_us','python_side_pure_us','python_side_kept_us','python_side_pure_kept_us','torch_floor_us','own_us')]; print({k: round(d[k], 2) for k in ('alloc_separate_us','alloc_native_us','alloc_one_block_us') if k in d})" "$L/overhead_gpu-$i.json" 2>&1 | tee -a "$S"
done
FABRIC_EP_NATIVE=0 timeout 300 python3 -m pytest -q -p no:cacheprovider test_gpu.py test_gpu_abi.py test_torch.py >"$L/pytest-gpu-pure.log" 2>&1
say "python GPU tests, helper off: rc=$? $(tail -1 "$L/pytest-gpu-pure.log")"; grep -E "FAILED|Error" "$L/pytest-gpu-pure.log" | head -8 | tee -a "$S"
tar -C "$OUT" -czf "$OUT/logs.tgz" logs
