#!/usr/bin/env bash
# Device run 2 (eleventh session), one H200: the overhead bench, now with the fp8 dispatches
# and the Tensor.new_empty_strided spelling as a second alternative, three times; the package
# is run 1's. Bundle: FEP_GPU_BUILD=python.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
cd "$B/python/tests"
export PYTHONPATH=$B/python:$B/python/tests FABRIC_EP_LIBRARY=$B/python/fabric_ep/libfabric_ep.so CUDA_DEVICE_MAX_CONNECTIONS=32
for i in 1 2 3; do
  timeout 150 python3 bench_overhead_gpu.py >"$L/overhead_gpu-$i.json" 2>"$L/overhead_gpu-$i.err"; say "overhead $i rc=$?"; tail -3 "$L/overhead_gpu-$i.err"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(k, {c: round(v, 2) for c, v in d[k].items()}) for k in ('python_side_us','python_side_prealloc_us','python_side_new_empty_strided_us','paired_median_difference_us')]" "$L/overhead_gpu-$i.json" 2>&1 | tee -a "$S"
done
tar -C "$OUT" -czf "$OUT/logs.tgz" logs
