#!/usr/bin/env bash
# Device run 7 (ninth session), one H200: LL dispatch send, bf16 rows stored 512 contiguous bytes
# per warp instruction (was lane l storing uint4 2l and 2l + 1: every instruction half holes).
# The LL tests (gpu_ll: bf16 bit-exact; gpu_buffer; gpu_ll_proxy threads incl. bf16 over shm and
# tcp), gpu_ll_bench fp8 and bf16 at 1 and 4 ranks, then run 6's traced proxy standard case,
# fp8 and bf16 (2 processes under MPS). gpu-bundle/old/ holds run 5's gpu_ll_bench and
# gpu_ll_proxy_bench (the kernels before the change, embedded): bf16 is run with both, A/B.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
t() {  # test-binary log-suffix [filter...]
  local bin=$1 log="$L/$1-$2.log"; shift 2
  timeout 200 $B/tests/$bin --include-ignored --test-threads=1 "$@" >"$log" 2>&1
  say "$bin $* rc=$? $(grep -E '^test result' "$log" | tail -1)"; grep -E "panicked|FAILED" -A2 "$log" | cut -c1-600 | head -6 | tee -a "$S"
}
export CUDA_DEVICE_MAX_CONNECTIONS=32
t gpu_ll 1
t gpu_buffer 1
t gpu_ll_proxy thr --skip two_processes --skip different_proxy_worker_counts
for v in fp8 bf16 old-bf16; do
  extra=""; bin=$B/examples/gpu_ll_bench
  case $v in bf16) extra="--bf16";; old-bf16) extra="--bf16"; bin=$B/old/gpu_ll_bench;; esac
  timeout 120 $bin --ranks 1,4 $extra >"$L/llb-$v.log" 2>&1
  say "gpu_ll_bench $v rc=$?"; grep -E "^LL_RESULT" "$L/llb-$v.log" | cut -c1-260 | tee -a "$S"
done
unset CUDA_DEVICE_MAX_CONNECTIONS
mps=/tmp/fep-mps-i7; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
pb=$B/examples/gpu_ll_proxy_bench
for v in fp8 bf16 old-bf16; do
  extra=""; pb=$B/examples/gpu_ll_proxy_bench
  case $v in bf16) extra="--bf16";; old-bf16) extra="--bf16"; pb=$B/old/gpu_ll_proxy_bench;; esac
  timeout 150 $pb --provider shm --cases standard --iters 100 --pingpong-iters 1000 --trace 10 $extra >"$L/llpb-std-trace-$v.log" 2>&1
  say "llproxy shm standard trace $v rc=$?"
  grep -E "^\| (dispatch|combine) \| [01] \| (send: begin -> published|receive: counts -> end)" "$L/llpb-std-trace-$v.log" | tee -a "$S"
  grep -E "^LLPROXY_PHASE" "$L/llpb-std-trace-$v.log" | head -4 | cut -c1-300 | tee -a "$S"
done
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
