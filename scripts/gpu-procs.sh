#!/usr/bin/env bash
# The installed-package GPU check, in two halves (the GPU machine has Python + torch, no Rust):
#
#   scripts/gpu-procs.sh build    (here) the release wheel (`make wheel`, the native library and
#                                 libfabric inside) and ep-bench with the libfabric it loads,
#                                 gathered in gpu-bundle-procs/ (git-ignored).
#   bash scripts/gpu-procs.sh run (GPU machine, repo root) installs the wheel into a fresh
#                                 folder (no repository path on PYTHONPATH), starts the MPS
#                                 control daemon, runs tests/test_gpu_procs.py (DeepEP's sequence
#                                 as torchrun-style processes sharing the GPU), `ep-bench verify
#                                 --backend gpu` (FEP_VERIFY_CASES, default 150; FEP_VERIFY_SEED,
#                                 FEP_VERIFY_LAUNCH procs|threads|auto, FEP_VERIFY_JOBS cases
#                                 at once, FEP_VERIFY_REPEAT passes) and the Python
#                                 call-overhead bench; logs and a summary under $OUT.
#                                 call-overhead bench; "epbench" (not default): ep-bench's GPU
#                                 figures at DeepEP's setting.
#                                 "nomps": two processes without MPS must be refused; "step":
#                                 the MoE-layer step bench (benches/moe_step.py); "overlap":
#                                 dispatch / combine beside GEMMs (benches/overlap.py).
#                                 FEP_PROCS_SECTIONS (default "procs,verify,overhead") picks;
#                                 FEP_PROCS_CASES (e.g. 4/gloo/shrink_masked,2/env/deepep) runs
#                                 those process cases only.
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=gpu-bundle-procs

build() {
  make wheel
  cargo build --release -p ep-bench
  rm -rf "$bundle"
  mkdir -p "$bundle/lib" "$bundle/bin"
  cp dist/fabric_ep-*.whl "$bundle/"
  cp "${CARGO_TARGET_DIR:-target}/release/ep-bench" "$bundle/bin/"
  strip "$bundle/bin/ep-bench"
  local fab dep
  fab=$(ldconfig -p | awk '/libfabric\.so\.1 /{print $NF; exit}')
  cp -L "$fab" "$bundle/lib/libfabric.so.1"
  for dep in $(ldd "$fab" | awk '$3 ~ /^\// {print $3}'); do
    case "$(basename "$dep")" in libc.so.*|ld-linux*|libm.so.*|libpthread.so.*|libdl.so.*) continue ;; esac
    cp -L "$dep" "$bundle/lib/"
  done
  echo "built from $(git rev-parse --short HEAD)$(git diff --quiet || echo '+dirty')" >"$bundle/MANIFEST"
  du -sh "$bundle"
}

has() { case ",${FEP_PROCS_SECTIONS:-procs,verify,overhead}," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

run() {
  local out=${OUT:-/tmp/fep-procs-out} site=/tmp/fep-site rc fail=0
  mkdir -p "$out"
  : >"$out/summary.txt"
  rm -rf "$site"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$bundle"/fabric_ep-*.whl
  if has nomps; then
    # Before the MPS daemon starts: two processes on the one GPU must be refused, saying why.
    set +e
    echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
    (cd /tmp && PYTHONPATH=$site timeout 150 python3 "$OLDPWD/ffi/python/tests/test_gpu_procs.py" \
      --no-mps) 2>&1 | tee "$out/nomps.log"
    rc=${PIPESTATUS[0]}
    set -e
    [ "$rc" -eq 0 ] || fail=1
    echo "nomps rc=$rc $(tail -n 1 "$out/nomps.log")" >>"$out/summary.txt"
  fi
  nvidia-cuda-mps-control -d || true
  sleep 1
  export PYTHONUNBUFFERED=1
  if has procs; then
    set +e
    local pick=()
    [ -z "${FEP_PROCS_CASES:-}" ] || pick=(--cases "$FEP_PROCS_CASES")
    (cd /tmp && PYTHONPATH=$site timeout "${FEP_PROCS_TIMEOUT:-500}" python3 \
      "$OLDPWD/ffi/python/tests/test_gpu_procs.py" "${pick[@]}") 2>&1 | tee "$out/procs.log"
    rc=${PIPESTATUS[0]}
    set -e
    [ "$rc" -eq 0 ] || fail=1
    echo "procs rc=$rc $(tail -n 1 "$out/procs.log")" >>"$out/summary.txt"
  fi
  if has verify; then
    set +e
    # Ranks as threads of one context need many hardware queues; processes under MPS must not
    # ask for them (their contexts then fail to start: out of memory).
    local threads_env=()
    [ "${FEP_VERIFY_LAUNCH:-procs}" = procs ] || threads_env=(CUDA_DEVICE_MAX_CONNECTIONS=32)
    env "${threads_env[@]}" CUDA_MODULE_LOADING=EAGER LD_LIBRARY_PATH=$bundle/lib \
      timeout "${FEP_VERIFY_TIMEOUT:-300}" "$bundle/bin/ep-bench" verify --backend gpu \
      --launch "${FEP_VERIFY_LAUNCH:-procs}" --cases "${FEP_VERIFY_CASES:-150}" \
      --seed "${FEP_VERIFY_SEED:-1}" --jobs "${FEP_VERIFY_JOBS:-1}" \
      --repeat "${FEP_VERIFY_REPEAT:-1}" 2>&1 | tee "$out/verify.log"
    rc=${PIPESTATUS[0]}
    set -e
    [ "$rc" -eq 0 ] || fail=1
    echo "verify rc=$rc $(tail -n 1 "$out/verify.log")" >>"$out/summary.txt"
  fi
  if has overhead; then
    set +e
    (cd /tmp && PYTHONPATH=$site timeout 140 python3 \
      "$OLDPWD/ffi/python/tests/bench_overhead_gpu.py") 2>&1 | tee "$out/overhead.log"
    rc=${PIPESTATUS[0]}
    set -e
    echo "overhead rc=$rc" >>"$out/summary.txt"
  fi
  if has epbench; then
    # The normal mode at DeepEP's setting: 1 rank beside NCCL all-to-all + permute (fresh and
    # cached dispatch), then 2 and 4 processes sharing the GPU; low latency at 1 and 4.
    set +e
    for args in "--ranks 1 --mode normal --fp8" "--ranks 1 --mode normal --fp8 --cached" \
        "--ranks 1 --mode normal --fp8 --cached --sms 24" \
        "--ranks 2 --procs --mode normal --fp8" "--ranks 4 --procs --mode normal --fp8" \
        "--ranks 1 --mode low-latency --fp8" "--ranks 4 --procs --mode low-latency --fp8"; do
      echo "===== ep-bench --backend gpu $args" | tee -a "$out/epbench.log"
      LD_LIBRARY_PATH=$bundle/lib timeout 75 "$bundle/bin/ep-bench" --backend gpu $args 2>&1 \
        | tee -a "$out/epbench.log"
      echo "epbench rc=${PIPESTATUS[0]} $args" >>"$out/summary.txt"
    done
    set -e
  fi
  if has overlap; then
    # Dispatch / combine on the communication stream beside a GEMM chain on the compute stream.
    # Then with the GEMMs leaving the library's 24 SMs free (cuBLAS's SM carve-out).
    set +e
    local c
    for c in 0 24; do
      (cd /tmp && PYTHONPATH=$site timeout 200 python3 "$OLDPWD/benches/overlap.py" \
        --gemm-carveout $c --json "$out/overlap-$c.json") 2>&1 | tee "$out/overlap-$c.log"
      echo "overlap carveout $c rc=${PIPESTATUS[0]} $(tail -n 2 "$out/overlap-$c.log" | tr '\n' ' ')" \
        >>"$out/summary.txt"
    done
    set -e
  fi
  if has step; then
    # The MoE-layer step (dispatch + grouped GEMM + combine, forward and backward) on both
    # stacks, one rank; projections to 64 ranks over one P5 GPU's EFA share and over 25 GB/s.
    set +e
    (cd /tmp && PYTHONPATH=$site timeout 300 python3 "$OLDPWD/benches/moe_step.py" \
      --model-ep 16 --model-ep 64 --link-gbps "${FEP_STEP_LINK_GBPS:-50}" \
      --json "$out/step.json") 2>&1 | tee "$out/step.log"
    echo "step rc=${PIPESTATUS[0]}" >>"$out/summary.txt"
    set -e
  fi
  echo quit | nvidia-cuda-mps-control || true
  cat "$out/summary.txt"
  return $fail
}

case "${1:-}" in
  build) build ;;
  run) run ;;
  *) echo "usage: $0 build | run" >&2; exit 2 ;;
esac
