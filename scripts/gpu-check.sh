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
set -euo pipefail

usage() { echo "usage: $0 build | run" >&2; exit 2; }
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
  rm -rf "$bundle"
  mkdir -p "$bundle/tests" "$bundle/examples"
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
    if not name.startswith("gpu_"):
        continue
    sub = "examples" if "example" in kinds else "tests"
    shutil.copy2(m["executable"], os.path.join(bundle, sub, name))
    print(f"  {sub}/{name}")
if ptxas:
    shutil.copy2(ptxas, os.path.join(bundle, "ptxas.log"))
EOF
  rm -f "$json"
  strip "$bundle"/tests/* "$bundle"/examples/* 2>/dev/null || true
  cp scripts/gpu-check.sh scripts/bench_layout_torch.py "$bundle/"
  for f in "$bundle"/tests/* "$bundle"/examples/*; do
    if ldd "$f" | grep -q "not found\|libfabric\|libcuda"; then
      echo "gpu-check: $f links a library the GPU machine may lack:" >&2
      ldd "$f" | grep "not found\|libfabric\|libcuda" >&2
      exit 1
    fi
  done
  { echo "built $(date -u +%FT%TZ) from $(git rev-parse --short HEAD)$(git diff --quiet || echo '+dirty') on $(hostname)"; } >"$bundle/MANIFEST"
  du -sh "$bundle"
  local size
  size=$(du -sm "$bundle" | cut -f1)
  [ "$size" -le 50 ] || { echo "gpu-check: bundle is ${size} MiB (> 50)" >&2; exit 1; }
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
    echo "== $(cat "$b/MANIFEST" 2>/dev/null)"
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv,noheader || true
  } | tee -a "$sum"
  for t in "$b"/tests/*; do
    local name rc line
    name=$(basename "$t")
    echo "===== $name" >>"$tests_log"
    set +e
    timeout 300 "$t" --include-ignored --test-threads=1 >>"$tests_log" 2>&1
    rc=$?
    set -e
    line=$(awk -v n="===== $name" '$0==n{f=1} f && /^test result:/{print; exit}' "$tests_log")
    [ "$rc" -eq 0 ] || fail=1
    printf '%-18s rc=%-3s %s\n' "$name" "$rc" "${line:-no result line}" | tee -a "$sum"
  done
  grep -E "^test .*(FAILED|ok)$|SKIP|timeout path|random cases" "$tests_log" >>"$sum" || true

  if command -v compute-sanitizer >/dev/null && [ -x "$b/tests/gpu_layout" ]; then
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
  if command -v compute-sanitizer >/dev/null && [ -x "$b/tests/gpu_device_wait" ]; then
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
  if [ -x "$b/examples/gpu_layout_bench" ]; then
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
  if [ -x "$b/examples/gpu_normal_bench" ]; then
    set +e
    timeout 240 "$b/examples/gpu_normal_bench" --chunks 16,32 2>&1 | tee -a "$bench_log"
    local rc=${PIPESTATUS[0]}
    set -e
    [ "$rc" -eq 0 ] || fail=1
    grep -E "^copy ceiling|NORMAL_RESULT|NORMAL_MOVED" "$bench_log" | tee -a "$sum" >/dev/null
  fi
  [ -f "$b/ptxas.log" ] && cp "$b/ptxas.log" "$out/ptxas.log"
  echo
  echo "================ gpu-check summary ================"
  cat "$sum"
  echo "overall: $([ $fail -eq 0 ] && echo PASS || echo FAIL)"
  return $fail
}

case "$1" in
  build) build ;;
  run) run ;;
  *) usage ;;
esac
