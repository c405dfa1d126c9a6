#!/usr/bin/env bash
# GPU check in two halves, so the GPU machine needs no Rust toolchain:
#
#   scripts/gpu-check.sh build     (here, no GPU) build the GPU test binaries (tests/gpu_*.rs,
#                                  ep-bench/tests/gpu_*.rs) and examples (ep-bench/examples/
#                                  gpu_*.rs) in release, and gather them with the scripts
#                                  they need into the MAIN checkout's ignored
#                                  gpu-bundle/ (override: FEP_GPU_BUNDLE=dir), with the release
#                                  libfabric_ep.so inside the Python package (python/fabric_ep/)
#                                  and the Python tests (python/tests/). FEP_GPU_BUILD=python
#                                  builds only the library and the package (the "python" section);
#                                  FEP_GPU_BUILD=tests the test binaries and the package (no
#                                  examples, benches or ep-bench). The device tool carries at most
#                                  64 MiB: a bundle over 60 MiB is refused here (the full one was
#                                  52 MiB when last measured).
#                                  FEP_GPU_TRACE=1 adds traced/gpu_normal_proxy_bench, built with
#                                  FEP_TRACE_NORMAL=1 (build.rs) in target/trace.
#   bash gpu-bundle/gpu-check.sh run   (GPU machine, repo root) run every GPU test
#                                  (--include-ignored), the layout benchmark and the PyTorch
#                                  comparison; logs under $OUT (default /tmp/fep-gpu-out); a short
#                                  table at the end. Exit status non-zero if anything failed.
#                                  FEP_GPU_SECTIONS (default "tests,memcheck,memcheck-proxy,layout,
#                                  proxy,normal,nproxy,epbench,python") picks what runs, FEP_GPU_TESTS
#                                  (default all) which test binaries; "proxy" is the GPU proxy
#                                  latency bench (with and without MPS) and the loopback proxy
#                                  throughput bench; "python" the Python package's GPU tests
#                                  (pytest if installed, else tests/plain_runner.py) and the GPU
#                                  call-overhead bench, logs in $OUT/python.log.
#                                  "ipc" (not in the default list) runs ep-bench's GPU backend with 4
#                                  ranks as threads, then starts the MPS control daemon, runs it
#                                  with 4 ranks as processes (CUDA IPC) and tests/gpu_ipc.rs, and
#                                  stops the daemon. The "tests" section leaves gpu_ipc to it.
#                                  "nproxy": normal mode forced internode through the proxy (MPS).
#                                  "llproxy" (not in the default list): tests/gpu_ll_proxy and
#                                  examples/gpu_ll_proxy_bench under MPS (started and stopped
#                                  inside the section).
#
# The bundle carries this machine's libfabric (lib/, with its dependencies) and fi_pingpong (bin/):
# the GPU machine may have none, and fi_pingpong must use the same libfabric as the tests.
set -euo pipefail

usage() { echo "usage: $0 build | run | run-ll" >&2; exit 2; }
[ $# -ge 1 ] || usage

build() {
  cd "$(dirname "$0")/.."
  local common main bundle
  common=$(git rev-parse --path-format=absolute --git-common-dir)
  main=$(dirname "$common")
  bundle=${FEP_GPU_BUNDLE:-$main/gpu-bundle}
  echo "gpu-check: building release GPU tests and examples (bundle: $bundle)"
  local json
  json=$(mktemp)
  # The GPU tests are fabric-ep's (tests/) and ep-bench's (ep-bench/tests/).
  local pkgs=(-p fabric-ep -p ep-bench)
  case "${FEP_GPU_BUILD:-all}" in
    python) : >"$json" ;;
    tests) cargo test --release --no-run --message-format=json "${pkgs[@]}" --test 'gpu_*' >"$json" ;;
    all)
      cargo test --release --no-run --message-format=json "${pkgs[@]}" --test 'gpu_*' >"$json"
      cargo build --release --message-format=json -p ep-bench --example 'gpu_*' >>"$json"
      cargo bench --no-run --message-format=json --bench proxy >>"$json"
      cargo build --release --message-format=json -p ep-bench --bin ep-bench >>"$json"
      ;;
    *) echo "gpu-check: FEP_GPU_BUILD=${FEP_GPU_BUILD} (expected all, tests or python)" >&2; exit 2 ;;
  esac
  cargo build --release --lib
  cargo build --release -p fabric-ep-python --features extension-module
  rm -rf "$bundle"
  mkdir -p "$bundle/tests" "$bundle/examples" "$bundle/benches" "$bundle/lib" "$bundle/bin"
  python3 - "$json" "$bundle" <<'EOF'
import json, os, shutil, sys
src, bundle = sys.argv[1], sys.argv[2]
ptxas = None
for line in open(src):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "build-script-executed" and m.get("package_id", "").find("fabric-ep") >= 0:
        p = os.path.join(m["out_dir"], "ptxas.log")
        if os.path.exists(p):
            ptxas = p
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    name, kinds = m["target"]["name"], m["target"]["kind"]
    if "bench" in kinds and name == "proxy":
        sub = "benches"
    elif "bin" in kinds and name == "ep-bench":
        sub = "bin"
    elif not name.startswith("gpu_"):
        continue
    else:
        sub = "examples" if "example" in kinds else "tests"
    shutil.copy2(m["executable"], os.path.join(bundle, sub, name))
    print(f"  {sub}/{name}")
if ptxas:
    shutil.copy2(ptxas, os.path.join(bundle, "ptxas.log"))
EOF
  rm -f "$json"
  strip "$bundle"/tests/* "$bundle"/examples/* "$bundle"/benches/* "$bundle"/bin/ep-bench 2>/dev/null || true
  cp scripts/gpu-check.sh scripts/bench_layout_torch.py scripts/bench_ll_torch.py scripts/bench_torch_alloc.py "$bundle/"
  # The Python package with its release native module inside (fabric_ep/_core.abi3.so), and
  # its tests. The GPU machine has python3 + torch but no Rust.
  mkdir -p "$bundle/python/tests"
  cp -r ffi/python/fabric_ep "$bundle/python/"
  rm -rf "$bundle/python/fabric_ep/__pycache__"
  cp "${CARGO_TARGET_DIR:-target}/release/libfabric_ep_python.so" "$bundle/python/fabric_ep/_core.abi3.so"
  strip "$bundle/python/fabric_ep/_core.abi3.so" 2>/dev/null || true
  cp ffi/python/tests/*.py "$bundle/python/tests/"
  # libfabric and everything it loads (not libc/ld.so), and the fabtests we compare against.
  local fab dep
  fab=$(ldconfig -p | awk '/libfabric\.so\.1 /{print $NF; exit}')
  [ -n "$fab" ] || { echo "gpu-check: libfabric.so.1 not found here (apt-get install libfabric1)" >&2; exit 1; }
  cp -L "$fab" "$bundle/lib/libfabric.so.1"
  for dep in $(ldd "$fab" | awk '$3 ~ /^\// {print $3}'); do
    case "$(basename "$dep")" in libc.so.*|ld-linux*|libm.so.*|libpthread.so.*|libdl.so.*) continue ;; esac
    cp -L "$dep" "$bundle/lib/"
  done
  for t in fi_pingpong fi_info; do
    command -v "$t" >/dev/null && cp -L "$(command -v "$t")" "$bundle/bin/"
  done
  [ -x "$bundle/bin/fi_pingpong" ] || echo "gpu-check: no fi_pingpong here (apt-get install libfabric-bin)" >&2
  ls "$bundle/lib" | sed 's/^/  lib\//'
  if [ "${FEP_GPU_TRACE:-0}" = 1 ]; then
    # The diagnosis build of the normal proxy bench (trace points in the normal kernels' proxy
    # lanes, build.rs FEP_TRACE_NORMAL) in its own target folder, beside the plain one.
    echo "gpu-check: traced build of gpu_normal_proxy_bench (target/trace)"
    CARGO_TARGET_DIR=target/trace FEP_TRACE_NORMAL=1 cargo build --release -p ep-bench \
      --example gpu_normal_proxy_bench
    mkdir -p "$bundle/traced"
    cp target/trace/release/examples/gpu_normal_proxy_bench "$bundle/traced/"
    strip "$bundle/traced/gpu_normal_proxy_bench"
  fi
  for f in "$bundle"/tests/* "$bundle"/examples/* "$bundle"/benches/* "$bundle"/bin/* "$bundle"/traced/* \
      "$bundle/python/fabric_ep/_core.abi3.so"; do
    [ -f "$f" ] || continue
    # libcuda is loaded at run time (cudarc), never linked; libfabric comes from the bundle.
    if LD_LIBRARY_PATH="$bundle/lib" ldd "$f" | grep -q "not found\|libcuda"; then
      echo "gpu-check: $f links a library the bundle lacks:" >&2
      LD_LIBRARY_PATH="$bundle/lib" ldd "$f" | grep "not found\|libcuda" >&2
      exit 1
    fi
  done
  { echo "built $(date -u +%FT%TZ) from $(git rev-parse --short HEAD)$(git diff --quiet || echo '+dirty') on $(hostname)"; } >"$bundle/MANIFEST"
  du -sh "$bundle"
  local size
  size=$(du -sm "$bundle" | cut -f1)
  [ "$size" -le 60 ] || {
    echo "gpu-check: bundle is ${size} MiB (> 60; the device tool carries 64): build a part" \
      "(FEP_GPU_BUILD=tests or python)" >&2
    exit 1
  }
}

has_section() { case ",${FEP_GPU_SECTIONS:-tests,memcheck,memcheck-proxy,layout,proxy,normal,nproxy,epbench,python}," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

# GPU proxy latency (ep-bench/examples/gpu_proxy_bench.rs): first as the machine is (two
# processes on one GPU time-slice it: few rounds), then under MPS if its control daemon is there
# (the daemon is stopped again at the end); then the loopback proxy throughput (benches/proxy.rs).
run_proxy_section() {
  local b=$1 out=$2 log=$2/proxy.log rc fail=0
  : >"$log"
  local pb="$b/examples/gpu_proxy_bench"
  if [ -x "$pb" ]; then
    set +e
    timeout 150 "$pb" --iters 20000 --warmup 1000 --remote-iters 40 --remote-warmup 4 --sizes 64 \
      --label " no MPS" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    set -e
    [ "$rc" -eq 0 ] || fail=1
    printf '%-18s rc=%-3s %s\n' "proxy-bench" "$rc" "local + 2 procs time-sliced" >>"$out/summary.txt"
    if command -v nvidia-cuda-mps-control >/dev/null; then
      local mps=/tmp/fep-mps
      mkdir -p "$mps/pipe" "$mps/log"
      set +e
      CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log nvidia-cuda-mps-control -d
      rc=$?
      if [ "$rc" -eq 0 ]; then
        CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log \
          timeout 150 "$pb" --skip-local --iters 20000 --warmup 1000 --sizes 8,64,4096 \
          --label " MPS" 2>&1 | tee -a "$log"
        rc=${PIPESTATUS[0]}
        [ "$rc" -eq 0 ] || fail=1
        printf '%-18s rc=%-3s %s\n' "proxy-bench-mps" "$rc" "2 procs under MPS, shm" >>"$out/summary.txt"
        CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log \
          timeout 100 "$pb" --skip-local --iters 5000 --warmup 500 --sizes 64 --provider 'tcp;ofi_rxm' \
          --label " MPS" 2>&1 | tee -a "$log"
        rc=${PIPESTATUS[0]}
        printf '%-18s rc=%-3s %s\n' "proxy-bench-mps" "$rc" "2 procs under MPS, tcp;ofi_rxm" >>"$out/summary.txt"
        echo quit | CUDA_MPS_PIPE_DIRECTORY=$mps/pipe nvidia-cuda-mps-control
        sleep 1
      else
        echo "MPS control daemon did not start (rc $rc)" | tee -a "$log"
      fi
      tail -n 20 "$mps"/log/*.log >>"$log" 2>/dev/null
      set -e
    else
      echo "no nvidia-cuda-mps-control: no MPS run" | tee -a "$log"
    fi
  fi
  if [ -x "$b/benches/proxy" ]; then
    set +e
    echo "===== benches/proxy (loopback, one worker) on $(nproc) CPUs" >>"$log"
    timeout 120 "$b/benches/proxy" --bench --warm-up-time 1 --measurement-time 2 >>"$log" 2>&1
    rc=$?
    set -e
    printf '%-18s rc=%-3s %s\n' "proxy-throughput" "$rc" "benches/proxy" >>"$out/summary.txt"
  fi
  {
    grep -E "^\| |PROXY_RESULT|FI_PINGPONG|FAILED|MPS|proxy_wake|p50" "$log" || true
    grep -E -A3 "^proxy_loopback/" "$log" | grep -E "proxy_loopback|thrpt" || true
  } >>"$out/summary.txt"
  return $fail
}

# ep-bench's GPU backend at DeepEP's settings with 4 ranks as threads of one process (no MPS, as
# it runs by default) and as 4 processes through CUDA IPC under MPS, then tests/gpu_ipc.rs (GPU
# ranks as processes sharing the GPU) under MPS. Processes sharing a GPU need the control daemon
# so that their kernels run at once: started here and stopped again at the end, as in
# run_proxy_section. (Threads of one process run before the daemon: an MPS client gets few
# hardware work queues, and 4 ranks' spinning kernels on 4 streams then wait behind each other
# until the timeout, unless CUDA_DEVICE_MAX_CONNECTIONS=32.)
run_ipc_section() {
  local b=$1 out=$2 log=$2/ipc.log rc fail=0 line
  local iters=${FEP_EPBENCH_ITERS:-20}
  : >"$log"
  set +e
  if [ -x "$b/bin/ep-bench" ]; then
    echo "===== ep-bench --backend gpu --ranks 4 (threads, no MPS)" >>"$log"
    timeout 300 "$b/bin/ep-bench" --backend gpu --ranks 4 --iters "$iters" --timeout 30 >>"$log" 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || fail=1
    printf '%-18s rc=%-3s %s\n' "ep-bench-threads" "$rc" "4 ranks as threads, no MPS" >>"$out/summary.txt"
  fi
  if ! command -v nvidia-cuda-mps-control >/dev/null; then
    echo "no nvidia-cuda-mps-control: ranks as processes not run" | tee -a "$log" >>"$out/summary.txt"
    set -e
    return 1
  fi
  local mps=/tmp/fep-mps-ipc
  mkdir -p "$mps/pipe" "$mps/log"
  export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
  nvidia-cuda-mps-control -d
  rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "MPS control daemon did not start (rc $rc)" | tee -a "$log" >>"$out/summary.txt"
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    set -e
    return 1
  fi
  # ep-bench first: gpu_ipc ends with a killed rank (the one case that might upset the server).
  if [ -x "$b/bin/ep-bench" ]; then
    echo "===== ep-bench --backend gpu --ranks 4 --procs (processes, MPS)" >>"$log"
    timeout 300 "$b/bin/ep-bench" --backend gpu --ranks 4 --procs --iters "$iters" --timeout 30 \
      >>"$log" 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || fail=1
    printf '%-18s rc=%-3s %s\n' "ep-bench-procs" "$rc" "4 ranks as processes, MPS" >>"$out/summary.txt"
    grep -E "^ep-bench \(GPU|^mode |^normal |^low-latency|error" "$log" >>"$out/summary.txt"
  fi
  if [ -x "$b/tests/gpu_ipc" ]; then
    echo "===== gpu_ipc (under MPS)" >>"$log"
    timeout 400 "$b/tests/gpu_ipc" --include-ignored --test-threads=1 --nocapture >>"$log" 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || fail=1
    line=$(grep -E "^test result:" "$log" | tail -1)
    printf '%-18s rc=%-3s %s\n' "gpu_ipc (MPS)" "$rc" "${line:-no result line}" >>"$out/summary.txt"
    grep -E "^test .*(FAILED|ok)$|SKIP|reaches its|timeout path|every case checked|dead peer named" \
      "$log" >>"$out/summary.txt"
  fi
  echo quit | nvidia-cuda-mps-control
  sleep 1
  tail -n 20 "$mps"/log/*.log >>"$log" 2>/dev/null
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  set -e
  return $fail
}

# The Python package on the GPU (ffi/python/tests/test_gpu.py: ranks as threads of one process,
# world 1/2/4, normal + low-latency against the numpy reference; test_gpu_abi.py), with pytest
# when the machine has it, else the bundled plain runner; then the GPU call-overhead bench and
# the host one, for comparison. Everything in $out/python.log; the closing lines in the summary.
run_python_section() {
  local b=$1 out=$2 log=$2/python.log rc fail=0 t=$1/python/tests
  : >"$log"
  export PYTHONPATH="$b/python:$t${PYTHONPATH:+:$PYTHONPATH}"
  unset FABRIC_EP_EXTENSION  # the bundled package's own module
  # Ranks are threads of one process: no lazy kernel loading (it may synchronise the context
  # while a peer's kernel spins).
  export CUDA_MODULE_LOADING=EAGER
  echo "== python: $(python3 --version 2>&1); torch/numpy/pytest: $(python3 -c 'import torch, numpy; print(torch.__version__, torch.cuda.is_available(), numpy.__version__)' 2>&1 | tail -1) $(python3 -c 'import pytest; print(pytest.__version__)' 2>&1 | tail -1)" | tee -a "$log"
  set +e
  if python3 -c "import pytest" 2>/dev/null; then
    (cd "$t" && PYTHONUNBUFFERED=1 timeout "${FEP_PY_TIMEOUT:-120}" python3 -m pytest -v -s -rs -p no:cacheprovider \
      test_gpu.py test_gpu_abi.py test_torch.py) >>"$log" 2>&1
    rc=$?
    printf '%-18s rc=%-3s %s\n' "python-tests" "$rc" "pytest: $(grep -E '^=+ .*(passed|failed|skipped).* =+$' "$log" | tail -1)" >>"$out/summary.txt"
  else
    echo "(no pytest on this machine: tests/plain_runner.py)" >>"$log"
    (cd "$t" && PYTHONUNBUFFERED=1 timeout "${FEP_PY_TIMEOUT:-120}" python3 plain_runner.py test_gpu.py test_gpu_abi.py) >>"$log" 2>&1
    rc=$?
    printf '%-18s rc=%-3s %s\n' "python-tests" "$rc" "plain runner: $(grep -E '^[0-9]+ passed, [0-9]+ failed' "$log" | tail -1)" >>"$out/summary.txt"
  fi
  [ "$rc" -eq 0 ] || fail=1
  echo "===== bench_overhead_gpu.py" >>"$log"
  PYTHONUNBUFFERED=1 timeout 50 python3 "$t/bench_overhead_gpu.py" >"$out/overhead_gpu.json" 2>>"$log"
  rc=$?
  cat "$out/overhead_gpu.json" >>"$log"
  printf '%-18s rc=%-3s %s\n' "python-overhead" "$rc" "bench_overhead_gpu.py -> overhead_gpu.json" >>"$out/summary.txt"
  [ "$rc" -eq 0 ] || fail=1
  echo "===== bench_overhead.py (host backend)" >>"$log"
  FI_PROVIDER=shm PYTHONUNBUFFERED=1 timeout 40 python3 "$t/bench_overhead.py" >"$out/overhead_host.json" 2>>"$log"
  cat "$out/overhead_host.json" >>"$log"
  set -e
  grep -E "^(PASSED|FAILED|SKIPPED) |(PASSED|FAILED|SKIPPED|ERROR)( |$)|passed|failed" "$log" | grep -v "^ " | tail -40 >>"$out/summary.txt" || true
  python3 - "$out/overhead_gpu.json" >>"$out/summary.txt" 2>/dev/null <<'PYEOF' || true
import json, sys
m = json.load(open(sys.argv[1]))
for k in ("python_side_us", "end_to_end_us", "raw_native_us", "difference_us"):
    print("OVERHEAD_GPU", k, " ".join(f"{c}={v:.2f}" for c, v in m[k].items()))
print("OVERHEAD_GPU", " ".join(f"{k}={m[k]:.2f}" for k in ("torch_empty_us", "new_empty_us", "current_stream_us", "raw_current_stream_us") if k in m))
print("OVERHEAD_GPU paired_median_difference_us", " ".join(f"{c}={v:.2f}" for c, v in m["paired_median_difference_us"].items()))
PYEOF
  return $fail
}

# Low-latency mode through the proxy, forced internode on one GPU (tests/gpu_ll_proxy.rs,
# ep-bench/examples/gpu_ll_proxy_bench.rs), all under MPS (two processes' kernels must be
# resident at once; the daemon is stopped again at the end). FEP_LLPROXY_ITERS: timed pairs per
# bench case.
run_llproxy_section() {
  local b=$1 out=$2 log=$2/llproxy.log rc fail=0
  : >"$log"
  if ! command -v nvidia-cuda-mps-control >/dev/null; then
    echo "no nvidia-cuda-mps-control: llproxy needs MPS" | tee -a "$log"
    printf '%-18s rc=%-3s %s\n' "llproxy" "-" "no MPS control daemon" >>"$out/summary.txt"
    return 1
  fi
  local mps=/tmp/fep-mps-llp
  mkdir -p "$mps/pipe" "$mps/log"
  set +e
  # Ranks as threads first, before the daemon: an MPS client gets fewer hardware work queues.
  if [ -x "$b/tests/gpu_ll_proxy" ]; then
    echo "===== gpu_ll_proxy in-process node splits (no MPS)" >>"$log"
    CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 150 "$b/tests/gpu_ll_proxy" --include-ignored \
      --test-threads=1 --nocapture --exact proxy_matches_reference_across_node_splits >>"$log" 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || fail=1
    printf '%-18s rc=%-3s %s\n' "gpu_ll_proxy-thr" "$rc" "$(grep -E '^test result:' "$log" | tail -1)" >>"$out/summary.txt"
  fi
  export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
  nvidia-cuda-mps-control -d
  rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "MPS control daemon did not start (rc $rc)" | tee -a "$log"
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    set -e
    return 1
  fi
  if [ -x "$b/tests/gpu_ll_proxy" ]; then
    echo "===== gpu_ll_proxy processes (MPS)" >>"$log"
    timeout 240 "$b/tests/gpu_ll_proxy" --include-ignored --test-threads=1 --nocapture \
      --skip proxy_matches_reference_across_node_splits >>"$log" 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || fail=1
    printf '%-18s rc=%-3s %s\n' "gpu_ll_proxy" "$rc" "$(grep -E '^test result:' "$log" | tail -1)" >>"$out/summary.txt"
  fi
  local pb="$b/examples/gpu_ll_proxy_bench" it=${FEP_LLPROXY_ITERS:-2000}
  if [ -x "$pb" ]; then
    timeout 150 "$pb" --provider shm --iters "$it" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}; [ "$rc" -eq 0 ] || fail=1
    printf '%-18s rc=%-3s %s\n' "ll-proxy-bench" "$rc" "shm, fp8, tiny/mid/standard" >>"$out/summary.txt"
    timeout 90 "$pb" --provider 'tcp;ofi_rxm' --cases tiny,mid --iters "$it" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}; [ "$rc" -eq 0 ] || fail=1
    printf '%-18s rc=%-3s %s\n' "ll-proxy-bench" "$rc" "tcp;ofi_rxm, fp8, tiny/mid" >>"$out/summary.txt"
    # Hook mode splits each phase into its send part and the hook's receive.
    timeout 60 "$pb" --provider shm --cases tiny,mid --hook --iters "$it" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}; [ "$rc" -eq 0 ] || fail=1
    printf '%-18s rc=%-3s %s\n' "ll-proxy-bench" "$rc" "shm, fp8, hook, tiny/mid" >>"$out/summary.txt"
    # CUDA-graph replay of a captured pair: one launch per pair (no per-kernel launch cost).
    timeout 60 "$pb" --provider shm --cases tiny,mid --graph --iters "$it" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}; [ "$rc" -eq 0 ] || fail=1
    printf '%-18s rc=%-3s %s\n' "ll-proxy-bench" "$rc" "shm, fp8, CUDA graph, tiny/mid" >>"$out/summary.txt"
  fi
  echo quit | nvidia-cuda-mps-control
  sleep 1
  tail -n 20 "$mps"/log/*.log >>"$log" 2>/dev/null
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  set -e
  grep -E "^ok:|^FAILED:|^HOST|timeout path|proxy lane over|checked in process|SKIP|^test .*(ok|FAILED)$|panicked|LLPROXY_RESULT|^\| " "$log" >>"$out/summary.txt" || true
  return $fail
}

# Normal mode's forced-internode GPU path (tests/gpu_normal_proxy.rs, examples/
# gpu_normal_proxy_bench.rs): the threads-as-ranks tests as the machine is, then under MPS (the
# control daemon is started here and stopped at the end) the two-process test and the bench,
# which runs fi_pingpong at the chunk write size in the same run. FEP_NPROXY_CHUNKS (default
# 16,32,64), FEP_NPROXY_SLOTS (default 8), FEP_NPROXY_ITERS (default 20),
# FEP_NPROXY_REGISTER_CHUNKS (default 16,32: the bench again with registered pages; empty: skip),
# FEP_NPROXY_HOST (default 1: ep-bench fabric and the host backend on the same machine),
# FEP_NPROXY_PROVIDERS (tests; default shm,tcp;ofi_rxm).
run_nproxy_section() {
  local b=$1 out=$2 log=$2/nproxy.log rc fail=0
  : >"$log"
  local t="$b/tests/gpu_normal_proxy" nb="$b/examples/gpu_normal_proxy_bench"
  if [ -x "$t" ]; then
    set +e
    CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32} \
      FEP_TEST_PROVIDERS=${FEP_NPROXY_PROVIDERS:-shm,tcp;ofi_rxm} timeout "${FEP_NPROXY_TEST_S:-150}" \
      "$t" --include-ignored --test-threads=1 --nocapture --skip two_processes >>"$log" 2>&1
    rc=$?
    set -e
    [ "$rc" -eq 0 ] || fail=1
    printf '%-18s rc=%-3s %s\n' "nproxy-threads" "$rc" \
      "$(grep -E '^test result:' "$log" | tail -1)" >>"$out/summary.txt"
  fi
  if command -v nvidia-cuda-mps-control >/dev/null; then
    local mps=/tmp/fep-mps-np
    mkdir -p "$mps/pipe" "$mps/log"
    set +e
    CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log nvidia-cuda-mps-control -d
    rc=$?
    if [ "$rc" -eq 0 ]; then
      export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
      if [ -x "$t" ]; then
        FEP_GPU_MPS=1 timeout "${FEP_NPROXY_2P_S:-120}" "$t" --include-ignored --test-threads=1 --nocapture --exact \
          two_processes_one_per_node_over_shm >>"$log" 2>&1
        rc=$?
        [ "$rc" -eq 0 ] || fail=1
        printf '%-18s rc=%-3s %s\n' "nproxy-2procs" "$rc" "2 processes x 1 per node, shm, MPS" >>"$out/summary.txt"
      fi
      if [ -x "$nb" ]; then
        timeout "${FEP_NPROXY_BENCH_S:-240}" "$nb" --chunks "${FEP_NPROXY_CHUNKS:-16,32,64}" \
          --slots "${FEP_NPROXY_SLOTS:-8}" --iters "${FEP_NPROXY_ITERS:-20}" 2>&1 | tee -a "$log"
        rc=${PIPESTATUS[0]}
        [ "$rc" -eq 0 ] || fail=1
        printf '%-18s rc=%-3s %s\n' "nproxy-bench" "$rc" "2 processes under MPS" >>"$out/summary.txt"
      fi
      if [ -x "$nb" ] && [ -n "${FEP_NPROXY_REGISTER_CHUNKS-16,32}" ]; then
        # The same bench with the regions in registered anonymous pages (cuMemHostRegister)
        # instead of cuMemHostAlloc memory.
        FEP_GPU_PROXY_HOSTMEM=register timeout 90 "$nb" --chunks "${FEP_NPROXY_REGISTER_CHUNKS-16,32}" \
          --slots 8 --iters "${FEP_NPROXY_ITERS:-20}" 2>&1 \
          | sed 's/^NPROXY_RESULT /NPROXY_RESULT hostmem=register /' | tee -a "$log"
      fi
      echo quit | nvidia-cuda-mps-control
      unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
      sleep 1
    else
      echo "MPS control daemon did not start (rc $rc)" | tee -a "$log"
      fail=1
    fi
    tail -n 20 "$mps"/log/*.log >>"$log" 2>/dev/null
    set -e
  else
    echo "no nvidia-cuda-mps-control: no two-process run" | tee -a "$log"
  fi
  # The CPU side alone on the same machine: our RMA-write stream vs fi_pingpong, and the host
  # backend's normal mode (same wire protocol, same inputs) between 2 processes over shm.
  if [ -x "$b/bin/ep-bench" ] && [ "${FEP_NPROXY_HOST:-1}" = 1 ]; then
    set +e
    echo "===== ep-bench fabric (CPU RMA writes, shm)" >>"$log"
    timeout 60 "$b/bin/ep-bench" fabric --ranks 2 --sizes 119552,239104 --window 8 >>"$log" 2>&1
    echo "===== ep-bench --backend host normal, 2 processes x 1 per node, shm" >>"$log"
    timeout 90 "$b/bin/ep-bench" --backend host --ranks 2 --ranks-per-node 1 --mode normal \
      --tokens 4096 --fp8 --iters 5 >>"$log" 2>&1
    rc=$?
    set -e
    printf '%-18s rc=%-3s %s\n' "nproxy-host" "$rc" "ep-bench host backend, 2 procs, shm" >>"$out/summary.txt"
  fi
  grep -E "^ok:|timeout path|SKIP|panicked|FAILED|^\| |NPROXY_RESULT|steps checked|B \||^mode |^normal |rror" \
    "$log" >>"$out/summary.txt" || true
  return $fail
}

run() {
  local b out
  b=$(cd "$(dirname "$0")" && pwd)
  out=${OUT:-/tmp/fep-gpu-out}
  mkdir -p "$out"
  local sum="$out/summary.txt" tests_log="$out/tests.log" bench_log="$out/bench.log"
  : >"$sum"; : >"$tests_log"; : >"$bench_log"
  local fail=0
  {
    echo "== system libfabric: $(ldconfig -p | grep -c 'libfabric\.so') entries; fi_pingpong: $(command -v fi_pingpong || echo none); using the bundle's"
  } | tee -a "$sum"
  # The bundle's libfabric (Debian's) for our binaries and for fi_pingpong alike.
  export LD_LIBRARY_PATH="$b/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export PATH="$b/bin:$PATH"
  # The tcp provider on loopback only: the GPU machine reaches nothing outside it.
  export FI_TCP_IFACE=${FI_TCP_IFACE:-lo}
  # NCCL for ep-bench's baseline (ep-bench/src/nccl.rs): the PyTorch wheel's copy.
  if [ -z "${FEP_NCCL_LIB:-}" ]; then
    FEP_NCCL_LIB=$(python3 -c 'import nvidia.nccl as m, os; print(os.path.join(list(m.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null || true)
    export FEP_NCCL_LIB
  fi
  {
    echo "== $(cat "$b/MANIFEST" 2>/dev/null)"
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv,noheader || true
  } | tee -a "$sum"
  for t in "$b"/tests/*; do
    has_section tests || break
    local name rc line
    name=$(basename "$t")
    case " ${FEP_GPU_TESTS:-$name} " in *" $name "*) ;; *) continue ;; esac
    # Processes sharing the GPU need MPS: the "ipc" section runs it under the daemon.
    [ "$name" = gpu_ipc ] && continue
    echo "===== $name" >>"$tests_log"
    set +e
    # --nocapture: the tests' own lines (timeout paths, what each rank checked) reach the log.
    # Ranks as threads of one context: a hardware work queue per stream (GpuBuffer's
    # check_work_queues refuses fewer).
    # The two-process cases need MPS (they fail without it): the ipc, nproxy and llproxy
    # sections run them under the daemon.
    CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32} \
      timeout 300 "$t" --include-ignored --test-threads=1 --nocapture \
      --skip two_processes --skip different_proxy_worker_counts >>"$tests_log" 2>&1
    rc=$?
    set -e
    line=$(awk -v n="===== $name" '$0==n{f=1} f && /^test result:/{print; exit}' "$tests_log")
    [ "$rc" -eq 0 ] || fail=1
    printf '%-18s rc=%-3s %s\n' "$name" "$rc" "${line:-no result line}" | tee -a "$sum"
  done
  grep -E "^test .*(FAILED|ok)$|SKIP|timeout path|random cases|checked in|exchange job|silent-peer job" "$tests_log" >>"$sum" || true

  if has_section memcheck-proxy && command -v compute-sanitizer >/dev/null && [ -x "$b/tests/gpu_proxy" ]; then
    echo "===== compute-sanitizer memcheck gpu_proxy (two processes, shm)" >>"$tests_log"
    set +e
    FEP_TEST_PROVIDERS=shm timeout 120 compute-sanitizer --tool memcheck --target-processes all \
      --error-exitcode 9 "$b/tests/gpu_proxy" --include-ignored --test-threads=1 --nocapture exchange \
      >>"$tests_log" 2>&1
    local rc=$?
    set -e
    [ "$rc" -eq 0 ] || fail=1
    printf '%-18s rc=%-3s %s\n' "memcheck-proxy" "$rc" \
      "$(grep -E 'ERROR SUMMARY' "$tests_log" | tail -1)" | tee -a "$sum"
  fi
  if has_section memcheck && command -v compute-sanitizer >/dev/null && [ -x "$b/tests/gpu_layout" ]; then
    echo "===== compute-sanitizer memcheck gpu_layout (small cases)" >>"$tests_log"
    set +e
    timeout 180 compute-sanitizer --tool memcheck --error-exitcode 9 "$b/tests/gpu_layout" \
      --include-ignored --test-threads=1 unaligned zero_tokens bad_index all_tokens >>"$tests_log" 2>&1
    local rc=$?
    set -e
    [ "$rc" -eq 0 ] || fail=1
    printf '%-18s rc=%-3s %s\n' "memcheck-layout" "$rc" \
      "$(grep -E 'ERROR SUMMARY' "$tests_log" | tail -1)" | tee -a "$sum"
  fi
  if has_section memcheck && command -v compute-sanitizer >/dev/null && [ -x "$b/tests/gpu_device_wait" ]; then
    echo "===== compute-sanitizer memcheck gpu_device_wait (timeout paths)" >>"$tests_log"
    set +e
    timeout 180 compute-sanitizer --tool memcheck --error-exitcode 9 "$b/tests/gpu_device_wait" \
      --include-ignored --test-threads=1 timeout >>"$tests_log" 2>&1
    local rc=$?
    set -e
    [ "$rc" -eq 0 ] || fail=1
    printf '%-18s rc=%-3s %s\n' "memcheck-wait" "$rc" \
      "$(grep -E 'ERROR SUMMARY' "$tests_log" | tail -1)" | tee -a "$sum"
  fi

  local dump=/tmp/fep-layout-dump
  if has_section layout && [ -x "$b/examples/gpu_layout_bench" ]; then
    set +e
    timeout 180 "$b/examples/gpu_layout_bench" --dump "$dump" 2>&1 | tee -a "$bench_log"
    local rc=${PIPESTATUS[0]}
    timeout 180 "$b/examples/gpu_layout_bench" --tokens 4096 --topk 8 --experts 256 --ranks 8 \
      --tiles 32 2>&1 | tee -a "$bench_log"
    timeout 180 "$b/examples/gpu_layout_bench" --tokens 16384 --topk 8 --experts 256 --ranks 64 \
      --tiles 32,64 --iters 1000 2>&1 | tee -a "$bench_log"
    set -e
    [ "$rc" -eq 0 ] || fail=1
    grep -E "^layout tile|LAYOUT_RESULT" "$bench_log" | tee -a "$sum" >/dev/null
    if [ "$rc" -eq 0 ]; then
      set +e
      PYTHONUNBUFFERED=1 timeout 180 python3 "$b/bench_layout_torch.py" "$dump" 2>&1 | tee -a "$bench_log"
      rc=${PIPESTATUS[0]}
      set -e
      [ "$rc" -eq 0 ] || fail=1
      grep -E "TORCH_RESULT|outputs equal" "$bench_log" >>"$sum" || true
    fi
  fi
  if has_section proxy; then
    run_proxy_section "$b" "$out" || fail=1
  fi
  if has_section nproxy; then
    run_nproxy_section "$b" "$out" || fail=1
  fi
  if has_section normal && [ -x "$b/examples/gpu_normal_bench" ]; then
    set +e
    timeout 240 "$b/examples/gpu_normal_bench" --chunks 16,32 2>&1 | tee -a "$bench_log"
    rc=${PIPESTATUS[0]}
    set -e
    [ "$rc" -eq 0 ] || fail=1
    grep -E "^copy ceiling|NORMAL_RESULT|NORMAL_MOVED" "$bench_log" | tee -a "$sum" >/dev/null
  fi
  # ep-bench's GPU backend (ranks as threads of one process through Buffer, DeepEP's standard
  # settings, every result checked; exits non-zero on a mismatch).
  if has_section epbench && [ -x "$b/bin/ep-bench" ]; then
    set +e
    timeout 300 "$b/bin/ep-bench" --backend gpu --ranks 4 --iters "${FEP_EPBENCH_ITERS:-20}" 2>&1 | tee -a "$bench_log"
    rc=${PIPESTATUS[0]}
    set -e
    [ "$rc" -eq 0 ] || fail=1
    printf '%-18s rc=%-3s %s\n' "ep-bench-gpu" "$rc" "ep-bench --backend gpu --ranks 4" >>"$sum"
    grep -E "^ep-bench \(GPU|^mode |^normal |^low-latency|error" "$bench_log" >>"$sum" || true
  fi
  if has_section llproxy; then
    run_llproxy_section "$b" "$out" || fail=1
  fi
  if has_section ipc; then
    run_ipc_section "$b" "$out" || fail=1
  fi
  if has_section python && [ -d "$b/python/fabric_ep" ]; then
    run_python_section "$b" "$out" || fail=1
  fi
  [ -f "$b/ptxas.log" ] && cp "$b/ptxas.log" "$out/ptxas.log"
  echo
  echo "================ gpu-check summary ================"
  cat "$sum"
  echo "overall: $([ $fail -eq 0 ] && echo PASS || echo FAIL)"
  return $fail
}

# Low-latency mode only (tests/gpu_ll.rs, ep-bench/examples/gpu_ll_bench.rs,
# scripts/bench_ll_torch.py).
run_ll() {
  local b out
  b=$(cd "$(dirname "$0")" && pwd)
  out=${OUT:-/tmp/fep-gpu-out}
  mkdir -p "$out"
  local log="$out/ll.log" fail=0 rc
  : >"$log"
  echo "== $(cat "$b/MANIFEST" 2>/dev/null)" | tee -a "$log"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$log" || true
  set +e
  timeout 120 "$b/tests/gpu_ll" --include-ignored --test-threads=1 --nocapture >>"$log" 2>&1
  rc=$?
  [ "$rc" -eq 0 ] || fail=1
  echo "gpu_ll tests rc=$rc" | tee -a "$log"
  timeout 60 "$b/examples/gpu_ll_bench" --ranks 1,4 --dump /tmp/fep-ll-dump 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}; [ "$rc" -eq 0 ] || fail=1
  timeout 30 "$b/examples/gpu_ll_bench" --ranks 1,4 --bf16 --iters 200 2>&1 | tee -a "$log"
  PYTHONUNBUFFERED=1 timeout 45 python3 "$b/bench_ll_torch.py" /tmp/fep-ll-dump 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}; [ "$rc" -eq 0 ] || fail=1
  set -e
  echo "================ gpu-check ll summary ================"
  grep -E "^test .*(ok|FAILED)$|^ok:|timeout path|test result|LL_RESULT|TORCH_RESULT|rc=|panicked" "$log"
  echo "overall: $([ $fail -eq 0 ] && echo PASS || echo FAIL)"
  return $fail
}

case "$1" in
  build) build ;;
  run) run ;;
  run-ll) run_ll ;;
  *) usage ;;
esac
