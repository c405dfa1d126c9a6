#!/usr/bin/env bash
# Device run 3 (twelfth session), one H200. Run 2's benches crashed at the end of every process
# (both packages): torch freed a tensor record_stream-ed on the Buffer's comm stream after
# Buffer.destroy() had destroyed that stream (cuEventRecord on it, SIGSEGV). The library now
# keeps its comm streams for the process (Stream::kept). Here: the CUDA-layer tests (the new
# gpu_kept_stream_outlives_its_owner_and_is_reused among them) and the C ABI's GPU tests; then
# run 2's benches again (old package = eedd736's Python over this library, new = this
# session's), in turns; then the Python GPU tests. Bundle: full build + gpu-bundle/old.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
export CUDA_DEVICE_MAX_CONNECTIONS=32
for t in gpu_cuda gpu_ffi; do
  timeout 200 "$B/tests/$t" --include-ignored --test-threads=1 >"$L/$t.log" 2>&1
  say "$t rc=$? $(grep -E '^test result:' "$L/$t.log" | tail -1)"; grep -E "FAILED|panicked" "$L/$t.log" | head -5 | tee -a "$S"
done
cd "$B/python/tests"
export FABRIC_EP_LIBRARY=$B/python/fabric_ep/libfabric_ep.so
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
