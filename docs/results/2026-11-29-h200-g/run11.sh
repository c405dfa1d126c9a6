#!/usr/bin/env bash
# Device run 11 (seventh session), one H200, right after run 10 (same build, the machine still
# warm; the command given to the device tool directly): the intranode bench at 16 and 32 slots.
export LD_LIBRARY_PATH=$PWD/gpu-bundle/lib CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32; mkdir -p $OUT/logs; for s in 16 32; do timeout 30 gpu-bundle/examples/gpu_normal_bench --spp $s 2>&1 | grep -E "ceiling|NORMAL_" | tee -a $OUT/logs/run11-nb.log; done
