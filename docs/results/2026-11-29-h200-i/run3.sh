#!/usr/bin/env bash
# Device run 3 (ninth session), one H200: where the Python side of a GPU dispatch call goes
# (profile_overhead_gpu.py: cProfile of stubbed calls + each piece alone), and the overhead bench
# once for reference. Bundle: FEP_GPU_BUILD=python.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
cd "$B/python/tests"
export PYTHONPATH=$B/python:$B/python/tests FABRIC_EP_LIBRARY=$B/python/fabric_ep/libfabric_ep.so
timeout 120 python3 profile_overhead_gpu.py >"$L/profile.log" 2>&1; say "profile rc=$?"
timeout 60 python3 bench_overhead_gpu.py >"$L/overhead_gpu.json" 2>"$L/overhead_gpu.err"; say "overhead rc=$?"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(k, {c: round(v, 2) for c, v in d[k].items()}) for k in ('python_side_us','python_side_prealloc_us','paired_median_difference_us')]" "$L/overhead_gpu.json" | tee -a "$S"
