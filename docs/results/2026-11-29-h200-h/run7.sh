#!/usr/bin/env bash
# Device run 7 (eighth session), one H200, the final build. The LL stalled-peer test with the
# default 4 proxy workers (threads); under MPS every two-process case: gpu_ll_proxy (default
# workers, graph replay, 3 workers, worker-count mismatch) and gpu_normal_proxy (it did not run
# in the seventh session: FEP_GPU_MPS was unset and it returned early); the normal proxy lane at
# the new default slots (32) against 16 (chunk 16, default workers, both directions).
set -u
B=$PWD/gpu-bundle
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDA_MODULE_LOADING=EAGER PATH=$B/bin:$PATH
L=$OUT/logs; mkdir -p "$L"
S=$L/summary.txt
say() { echo "== $(date +%T) $*" | tee -a "$S"; }
say "start $(head -1 $B/MANIFEST)"
t() {  # test-binary log-suffix [filter...]
  local bin=$1 log="$L/$1-$2.log"; shift 2
  timeout 200 $B/tests/$bin --include-ignored --test-threads=1 --nocapture "$@" >"$log" 2>&1
  say "$bin $* rc=$? $(grep -E '^test result' "$log" | tail -1)"; grep -E "panicked|FAILED|^ok:|refused in|checked in process" "$log" | cut -c1-300 | head -12 | tee -a "$S"
}
CUDA_DEVICE_MAX_CONNECTIONS=32 t gpu_ll_proxy stalled --exact stalled_remote_peer_is_a_timeout_naming_it_then_clean
mps=/tmp/fep-mps-h7; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; say "mps rc=$?"
t gpu_ll_proxy procs --skip proxy_matches_reference_across_node_splits --skip stalled
t gpu_normal_proxy procs --exact two_processes_one_per_node_over_shm
np=$B/examples/gpu_normal_proxy_bench
timeout 200 $np --chunks 16 --slots 16,32 --iters 20 --pingpong-iters 2000 >"$L/np-c16.log" 2>&1
say "normal proxy bench chunk 16, slots 16 and 32 rc=$?"; grep -E "^NPROXY_RESULT|^FI_PINGPONG|FAILED|panicked" "$L/np-c16.log" | sed -E 's/provider=shm //; s/dispatch_p99_us=[^ ]+ //; s/combine_p99_us=[^ ]+ //' | cut -c1-400 | tee -a "$S"
echo quit | nvidia-cuda-mps-control
cd "$OUT" && tar czf logs.tgz logs && rm -f logs/*.log
