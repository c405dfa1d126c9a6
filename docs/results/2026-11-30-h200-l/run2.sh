#!/usr/bin/env bash
# Device run 2 (twelfth session), one H200: DeepEP's documented call forms (bench_overhead_gpu.py's
# dispatch_layout / dispatch_async / combine_async and the low-latency hook forms) with the
# package before (gpu-bundle/old: the eleventh session's, eedd736) and after this session's
# changes (raw stream switch, the events through their base class, record_stream on the stream
# that shares each tensor, the last layout not checked again), in turns: old, new, old, new.
# Then the Python GPU tests (pytest) on the new package. Bundle: FEP_GPU_BUILD=python, plus
# gpu-bundle/old/fabric_ep (git show eedd736's package with the same library).
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
cd "$B/python/tests"
export FABRIC_EP_LIBRARY=$B/python/fabric_ep/libfabric_ep.so CUDA_DEVICE_MAX_CONNECTIONS=32
show() {
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('errors', d.get('errors')); [print(k, {c: round(v, 2) for c, v in d[k].items()}) for k in ('python_side_us','python_side_kept_us','python_side_prealloc_us','paired_median_difference_us')]" "$1" 2>&1 | tee -a "$S"
}
for i in 1 2; do
  for pkg in old new; do
    if [ $pkg = old ]; then P=$B/old; else P=$B/python; fi
    PYTHONPATH=$P:$B/python/tests timeout 200 python3 bench_overhead_gpu.py >"$L/overhead_gpu-$pkg-$i.json" 2>"$L/overhead_gpu-$pkg-$i.err"
    say "overhead $pkg $i rc=$?"; tail -3 "$L/overhead_gpu-$pkg-$i.err"; show "$L/overhead_gpu-$pkg-$i.json"
  done
done
export PYTHONPATH=$B/python:$B/python/tests
timeout 300 python3 -m pytest -q -p no:cacheprovider test_gpu.py test_gpu_abi.py test_torch.py >"$L/pytest-gpu.log" 2>&1
say "python GPU tests (pytest) rc=$? $(tail -1 "$L/pytest-gpu.log")"; grep -E "FAILED|Error" "$L/pytest-gpu.log" | head -8 | tee -a "$S"
tar -C "$OUT" -czf "$OUT/logs.tgz" logs
