#!/usr/bin/env bash
# Device run 1 (twelfth session), one H200: the baseline of DeepEP's documented call forms (the
# layout's outputs passed in; previous_event + async_finish + allocate_on_comm_stream; the
# low-latency hooks) with the package as the eleventh session left it, and what the stream and
# event primitives cost from Python (scripts/bench_torch_alloc.py stream_ops). Bundle:
# FEP_GPU_BUILD=python.
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
  timeout 150 python3 bench_overhead_gpu.py >"$L/overhead_gpu-$i.json" 2>"$L/overhead_gpu-$i.err"; say "overhead $i rc=$?"; tail -3 "$L/overhead_gpu-$i.err"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('errors', d.get('errors')); [print(k, {c: round(v, 2) for c, v in d[k].items()}) for k in ('python_side_us','python_side_kept_us','python_side_prealloc_us','paired_median_difference_us','end_to_end_us')]" "$L/overhead_gpu-$i.json" 2>&1 | tee -a "$S"
done
timeout 150 python3 $B/bench_torch_alloc.py >"$L/torch_alloc.json" 2>"$L/torch_alloc.err"; say "torch primitives rc=$?"; tail -3 "$L/torch_alloc.err"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: v for k, v in d.items() if 'stream' in k or 'event' in k or 'alloc' in k})" "$L/torch_alloc.json" 2>&1 | tee -a "$S"
tar -C "$OUT" -czf "$OUT/logs.tgz" logs
