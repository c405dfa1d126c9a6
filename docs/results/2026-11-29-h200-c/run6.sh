#!/usr/bin/env bash
# Device run 6 (the last ~2.5 minutes of the session's device time): the C ABI test with the
# Python cases' step order, with and without barriers between steps.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_DEVICE_MAX_CONNECTIONS=32
timeout 100 $B/tests/gpu_ffi --include-ignored --test-threads=1 --nocapture >"$OUT/gpu_ffi.log" 2>&1
echo "gpu_ffi rc=$?"
grep -E "^ok:|^test |panicked|test result" "$OUT/gpu_ffi.log" | head -40
