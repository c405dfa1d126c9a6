#!/usr/bin/env bash
# Device run 4: Python normal-mode diagnosis (equal vs uneven tokens, memcheck), the merged
# main's GPU checks (C ABI, Python, ep-bench, IPC processes, LL proxy), the normal proxy path
# with registered pages and the CPU RMA stream on this host.
set -u
B=$PWD/gpu-bundle
O=/tmp/fep-out; mkdir -p "$O"
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" PATH="$B/bin:$PATH" FI_TCP_IFACE=lo
S="$O/summary.txt"
s() { echo "== $(date +%T) $*" | tee -a "$S"; }
s "start $(head -1 $B/MANIFEST)"
export CUDA_DEVICE_MAX_CONNECTIONS=32 CUDA_MODULE_LOADING=EAGER
export PYTHONPATH="$B/python:$B/python/tests" FABRIC_EP_LIBRARY="$B/python/fabric_ep/libfabric_ep.so"
for c in "normal_bf16_equal_tokens 2" "normal_bf16_equal_tokens 4" "normal_bf16 2" "normal_fp8 2"; do
  (cd $B/python/tests && timeout 60 python3 _gpu_cases.py $c) >"$O/py_${c// /_}.log" 2>&1
  s "py $c rc=$? $(grep -E '^CASE' "$O/py_${c// /_}.log") $(grep -E 'Error|assert' "$O/py_${c// /_}.log" | head -3 | tr '\n' ' ')"
done
(cd $B/python/tests && timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 python3 _gpu_cases.py normal_bf16 2) >"$O/py_memcheck.log" 2>&1
s "py memcheck normal_bf16 2 rc=$? $(grep -E 'ERROR SUMMARY|^CASE' "$O/py_memcheck.log" | tr '\n' ' ')"
timeout 60 $B/tests/gpu_ffi --include-ignored --test-threads=1 >"$O/gpu_ffi.log" 2>&1
s "gpu_ffi rc=$? $(grep -E '^test result' "$O/gpu_ffi.log")"
timeout 100 $B/tests/gpu_ll_proxy --include-ignored --test-threads=1 --nocapture proxy_matches_reference_across_node_splits >"$O/gpu_ll_proxy_threads.log" 2>&1
s "gpu_ll_proxy threads (no MPS) rc=$? $(grep -E '^test result' "$O/gpu_ll_proxy_threads.log")"
timeout 150 $B/bin/ep-bench --backend gpu --ranks 4 --iters 10 --cuda-graph >"$O/epbench.log" 2>&1
s "ep-bench rc=$?"
grep -E "^(normal|low-latency) |nccl|ratio" "$O/epbench.log" >>"$S"
unset CUDA_DEVICE_MAX_CONNECTIONS
mps=/tmp/fep-mps-r4; mkdir -p $mps/pipe $mps/log
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
nvidia-cuda-mps-control -d; s "mps rc=$?"
timeout 90 $B/tests/gpu_ipc --include-ignored --test-threads=1 >"$O/gpu_ipc.log" 2>&1
s "gpu_ipc rc=$? $(grep -E '^test result' "$O/gpu_ipc.log")"
timeout 120 $B/tests/gpu_ll_proxy --include-ignored --test-threads=1 --nocapture --skip proxy_matches_reference_across_node_splits >"$O/gpu_ll_proxy_procs.log" 2>&1
s "gpu_ll_proxy procs rc=$? $(grep -E '^test result' "$O/gpu_ll_proxy_procs.log")"
FEP_GPU_PROXY_HOSTMEM=register timeout 90 $B/examples/gpu_normal_proxy_bench --chunks 32 --slots 8 --iters 10 >"$O/nproxy_register.log" 2>&1
s "nproxy register rc=$? $(grep -E 'NPROXY_RESULT' "$O/nproxy_register.log" | tr '\n' ' ')"
echo quit | nvidia-cuda-mps-control
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
timeout 60 $B/bin/ep-bench fabric --ranks 2 --sizes 27954,119552,239104 --window 8 >"$O/fabric.log" 2>&1
s "ep-bench fabric rc=$?"
grep -E "\|" "$O/fabric.log" | head -20 >>"$S"
s "end"
cd "$O" && tar czf logs.tgz --exclude=logs.tgz . 2>/dev/null; cp "$O/summary.txt" "$O/logs.tgz" "$OUT/"
