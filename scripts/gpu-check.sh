#!/usr/bin/env bash
# GPU check in two halves, so the GPU machine needs no Rust toolchain:
#
#   scripts/gpu-check.sh build     (here, no GPU) build the GPU test binaries (tests/gpu_*.rs) and
#                                  examples (examples/gpu_*.rs) in release, and gather them with
#                                  the scripts they need into the MAIN checkout's ignored
#                                  gpu-bundle/ (override: FEP_GPU_BUNDLE=dir).
#   bash gpu-bundle/gpu-check.sh run   (GPU machine, repo root) run every GPU test
#                                  (--include-ignored), the layout benchmark and the PyTorch
#                                  comparison; logs under $OUT (default /tmp/fep-gpu-out); a short
#                                  table at the end. Exit status non-zero if anything failed.
#                                  FEP_GPU_SECTIONS (default "tests,memcheck,memcheck-proxy,layout,
#                                  proxy") picks what runs, FEP_GPU_TESTS (default all) which test
#                                  binaries; "proxy" is the GPU proxy latency bench (with and
#                                  without MPS) and the loopback proxy throughput bench;
#                                  "llproxy" (not in the default list) runs tests/gpu_ll_proxy and
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
  cargo test --release --no-run --message-format=json --test 'gpu_*' >"$json"
  cargo build --release --message-format=json --example 'gpu_*' >>"$json"
  cargo bench --no-run --message-format=json --bench proxy >>"$json"
  cargo build --release --message-format=json --bin ep-bench >>"$json"
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
  cp scripts/gpu-check.sh scripts/bench_layout_torch.py scripts/bench_ll_torch.py "$bundle/"
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
  for f in "$bundle"/tests/* "$bundle"/examples/* "$bundle"/benches/* "$bundle"/bin/*; do
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
  [ "$size" -le 50 ] || { echo "gpu-check: bundle is ${size} MiB (> 50)" >&2; exit 1; }
}

has_section() { case ",${FEP_GPU_SECTIONS:-tests,memcheck,memcheck-proxy,layout,proxy,normal,epbench}," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

# GPU proxy latency (examples/gpu_proxy_bench.rs): first as the machine is (two processes on one
# GPU time-slice it: few rounds), then under MPS if its control daemon is there (the daemon is
# stopped again at the end); then the loopback proxy throughput (benches/proxy.rs).
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

# Low-latency mode through the proxy, forced internode on one GPU (tests/gpu_ll_proxy.rs,
# examples/gpu_ll_proxy_bench.rs), all under MPS (two processes' kernels must be resident at once;
# the daemon is stopped again at the end). FEP_LLPROXY_ITERS: timed pairs per bench case.
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
  export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
  set +e
  nvidia-cuda-mps-control -d
  rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "MPS control daemon did not start (rc $rc)" | tee -a "$log"
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    set -e
    return 1
  fi
  if [ -x "$b/tests/gpu_ll_proxy" ]; then
    echo "===== gpu_ll_proxy (MPS)" >>"$log"
    timeout 240 "$b/tests/gpu_ll_proxy" --include-ignored --test-threads=1 --nocapture >>"$log" 2>&1
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
  {
    echo "== $(cat "$b/MANIFEST" 2>/dev/null)"
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv,noheader || true
  } | tee -a "$sum"
  for t in "$b"/tests/*; do
    has_section tests || break
    local name rc line
    name=$(basename "$t")
    case " ${FEP_GPU_TESTS:-$name} " in *" $name "*) ;; *) continue ;; esac
    echo "===== $name" >>"$tests_log"
    set +e
    # --nocapture: the tests' own lines (timeout paths, what each rank checked) reach the log.
    timeout 300 "$t" --include-ignored --test-threads=1 --nocapture >>"$tests_log" 2>&1
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
  if has_section llproxy; then
    run_llproxy_section "$b" "$out" || fail=1
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
  [ -f "$b/ptxas.log" ] && cp "$b/ptxas.log" "$out/ptxas.log"
  echo
  echo "================ gpu-check summary ================"
  cat "$sum"
  echo "overall: $([ $fail -eq 0 ] && echo PASS || echo FAIL)"
  return $fail
}

# Low-latency mode only (tests/gpu_ll.rs, examples/gpu_ll_bench.rs, scripts/bench_ll_torch.py).
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
