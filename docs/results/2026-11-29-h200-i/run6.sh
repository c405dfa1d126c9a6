#!/usr/bin/env bash
# Device run 6 (ninth session), one H200, run 5's build: is the LL proxy dispatch's staging into
# host memory bandwidth-bound? The standard case traced (10 pairs, 4 workers, 2 processes under
# MPS, shm) with fp8 dispatch (3.6 MB staged per rank) and with bf16 dispatch (--bf16, twice the
# bytes); the send span "begin -> published" of each.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
mps=/tmp/fep-mps-i6; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
pb=$B/examples/gpu_ll_proxy_bench
for v in fp8 bf16; do
  extra=""; [ $v = bf16 ] && extra="--bf16"
  timeout 150 $pb --provider shm --cases standard --iters 100 --pingpong-iters 1000 --trace 10 $extra >"$L/llpb-std-trace-$v.log" 2>&1
  say "llproxy shm standard trace $v rc=$?"
  grep -E "^\| (dispatch|combine) \| [01] \| (send: begin -> published|send: begin -> staging free|receive: counts -> end)" "$L/llpb-std-trace-$v.log" | tee -a "$S"
  grep -E "^LLPROXY_PHASE|^LLPROXY_RESULT" "$L/llpb-std-trace-$v.log" | head -4 | cut -c1-300 | tee -a "$S"
done
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
