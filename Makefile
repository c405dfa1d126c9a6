# The two commands README.md starts with: `make bench` (the main job) and `make test`.
# Both first run an idempotent set-up (Debian packages, the pinned CUDA 13.0 compiler wheels).
SHELL := /bin/bash
ROOT := $(CURDIR)
export NVCC ?= $(ROOT)/tools/cuda/nvidia/cu13/bin/nvcc
export PYTHONPATH := $(ROOT)/tools/py:$(ROOT)/ffi/python$(if $(PYTHONPATH),:$(PYTHONPATH))
CARGO ?= cargo

.PHONY: setup test bench lint gpu-bundle wheel clean-tools

setup:
	@bash scripts/setup.sh

# Tests: unit, multi-process fabric/bootstrap, host backend; GPU tests report themselves skipped
# on machines without a GPU.
# FEP_TEST_CARGO_PATH: the PATH cargo built with here, for the wheel test's cargo call (build.rs
# reruns on another PATH, and a python3 launcher such as pyenv's prepends its own folders).
test: setup
	$(CARGO) test --workspace --no-fail-fast
	$(CARGO) build --lib
	FEP_TEST_CARGO_PATH="$$PATH" FABRIC_EP_LIBRARY=$${CARGO_TARGET_DIR:-$(ROOT)/target}/debug/libfabric_ep.so \
	    python3 -m pytest -q tests/py ffi/python/tests

# The main job: ep-bench with its embedded defaults.
bench: setup
	$(CARGO) run --release --bin ep-bench --

# The C example links the cdylib/staticlib: tests/ffi_example.rs builds them (`cargo build --lib`).
lint: setup
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

# Release test/bench binaries for the GPU machine, gathered in gpu-bundle/ (scripts/gpu-check.sh).
gpu-bundle: setup
	bash scripts/gpu-check.sh build

# The Python package as one wheel in dist/ (fabric_ep, libfabric_ep.so built in release and
# stripped, the libfabric it links in fabric_ep/.libs/), for a machine without Rust:
# `pip install dist/fabric_ep-*.whl` there. Always a fresh release build from this checkout: a
# FABRIC_EP_LIBRARY in the environment (ffi/python/setup.py's prebuilt option) is ignored here.
wheel: setup
	rm -f dist/fabric_ep-*.whl
	env -u FABRIC_EP_LIBRARY -u FABRIC_EP_CARGO_PROFILE -u FABRIC_EP_ROOT \
	    python3 -m pip wheel -v --no-deps --disable-pip-version-check -w dist ffi/python
	@ls -l dist/fabric_ep-*.whl

clean-tools:
	rm -rf tools
