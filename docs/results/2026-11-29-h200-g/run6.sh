#!/usr/bin/env bash
# Device run 6 (seventh session), two H200s (NVLink). Why normal mode across two GPUs ran at half
# the speed of two ranks on one GPU (sixth session): ep-bench normal, 2 ranks, fresh (layout +
# notify + host sync + dispatch) against --cached (the dispatch kernel alone), as one process per
# GPU (CUDA IPC over NVLink), as 2 processes on one GPU (MPS) and as 2 threads on one GPU.
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST); $(nvidia-smi -L | wc -l) GPUs"
nvidia-smi topo -m 2>&1 | head -4 | tee -a "$S"
e() {  # log-name args...
  local n=$1; shift
  timeout 120 $B/bin/ep-bench --backend gpu --mode normal --ranks 2 "$@" >"$L/epb-$n.log" 2>&1
  say "ep-bench $* rc=$?"; grep -E "^normal|^vs NCCL|error" "$L/epb-$n.log" | tee -a "$S"
}
e procs2gpu-fresh --procs
e procs2gpu-cached --procs --cached --no-nccl
e threads1gpu-fresh --no-nccl
e threads1gpu-cached --cached --no-nccl
mps=/tmp/fep-mps-g6; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log CUDA_VISIBLE_DEVICES=0
nvidia-cuda-mps-control -d; say "mps on GPU 0 rc=$?"
e procs1gpu-fresh --procs --no-nccl
e procs1gpu-cached --procs --cached --no-nccl
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
