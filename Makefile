# The two commands README.md starts with: `make bench` (the main job) and `make test`.
# Both first run an idempotent set-up (Debian packages, the pinned CUDA 13.0 compiler wheels).
SHELL := /bin/bash
ROOT := $(CURDIR)
export NVCC ?= $(ROOT)/tools/cuda/nvidia/cu13/bin/nvcc
export PYTHONPATH := $(ROOT)/tools/py:$(ROOT)/ffi/python$(if $(PYTHONPATH),:$(PYTHONPATH))
CARGO ?= cargo

.PHONY: setup test bench lint gpu-bundle clean-tools

setup:
	@bash scripts/setup.sh

# Tests: unit, multi-process fabric/bootstrap, host backend; GPU tests report themselves skipped
# on machines without a GPU.
test: setup
	$(CARGO) test --workspace --no-fail-fast
	$(CARGO) run --release --bin ep-bench -- verify --backend host --cases 300 --seed 1
	$(CARGO) build --lib
	FABRIC_EP_LIBRARY=$${CARGO_TARGET_DIR:-$(ROOT)/target}/debug/libfabric_ep.so python3 -m pytest -q tests/py ffi/python/tests

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

clean-tools:
	rm -rf tools
