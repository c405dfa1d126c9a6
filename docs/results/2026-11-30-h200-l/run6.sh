#!/usr/bin/env bash
# Device run 6 (twelfth session), one H200: the asynchronous calls' inputs held by the Buffer until
# the call's event has completed instead of record_stream-ed (as ProcessGroupNCCL with
# TORCH_NCCL_AVOID_RECORD_STREAMS); the outputs still recorded. The overhead bench twice, then the
# Python GPU tests. Bundle: FEP_GPU_BUILD=python.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
cd "$B/python/tests"
export PYTHONPATH=$B/python:$B/python/tests FABRIC_EP_LIBRARY=$B/python/fabric_ep/libfabric_ep.so CUDA_DEVICE_MAX_CONNECTIONS=32
for i in 1 2; do
  timeout 100 python3 bench_overhead_gpu.py >"$L/overhead_gpu-$i.json" 2>"$L/overhead_gpu-$i.err"; say "overhead $i rc=$?"; tail -3 "$L/overhead_gpu-$i.err"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('errors', d.get('errors')); [print(k, {c: round(v, 2) for c, v in d[k].items()}) for k in ('python_side_us','python_side_kept_us','python_side_prealloc_us')]" "$L/overhead_gpu-$i.json" 2>&1 | tee -a "$S"
done
timeout 250 python3 -m pytest -q -p no:cacheprovider test_gpu.py test_gpu_abi.py test_torch.py >"$L/pytest-gpu.log" 2>&1
say "python GPU tests (pytest) rc=$? $(tail -1 "$L/pytest-gpu.log")"; grep -E "FAILED|Error" "$L/pytest-gpu.log" | head -8 | tee -a "$S"
tar -C "$OUT" -czf "$OUT/logs.tgz" logs
