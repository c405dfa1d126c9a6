# The two commands README.md starts with: `make bench` (the main job) and `make test`.
# Both first run an idempotent set-up (Debian packages, the pinned CUDA 13.0 compiler wheels).
SHELL := /bin/bash
ROOT := $(CURDIR)
export NVCC ?= $(ROOT)/tools/cuda/nvidia/cu13/bin/nvcc
export PYTHONPATH := $(ROOT)/tools/py:$(ROOT)/ffi/python$(if $(PYTHONPATH),:$(PYTHONPATH))
CARGO ?= cargo

.PHONY: setup test bench lint gpu-bundle wheel clean-tools lib install uninstall

setup:
	@bash scripts/setup.sh

# Tests: unit, multi-process fabric/bootstrap, host backend; GPU tests report themselves skipped
# on machines without a GPU (the workspace: fabric-ep's tests/ and ep-bench's ep-bench/tests/).
# The usage examples run as a user would run them (Rust: examples/host_roundtrip.rs, built by
# `cargo test`; Python: ffi/python/examples/). scripts/saturated.sh reruns the timing-sensitive
# tests with every core busy. scripts/modgraph.py --purity fails if src/protocol (the pure
# protocol core) names CUDA, libfabric, the proxy, the bootstrap, the C ABI, ep, threads or locks.
# The Python tests run the package from ffi/python over the debug build of its native module
# (fabric_ep._core, crate ffi/python/native; FABRIC_EP_EXTENSION names the file).
# FEP_TEST_CARGO_PATH: the PATH cargo built with here, for the wheel test's cargo call (build.rs
# reruns on another PATH, and a python3 launcher such as pyenv's prepends its own folders).
PY_EXT = $${CARGO_TARGET_DIR:-$(ROOT)/target}/debug/libfabric_ep_python.so
test: setup
	python3 scripts/modgraph.py --purity
	$(CARGO) test --workspace --no-fail-fast
	$(CARGO) run --example host_roundtrip
	$(CARGO) run --release -p ep-bench -- verify --backend host --cases 300 --seed 1
	CARGO="$(CARGO)" bash scripts/saturated.sh
	$(CARGO) build --lib
	$(CARGO) build -p fabric-ep-python --features extension-module
	FEP_TEST_CARGO_PATH="$$PATH" FABRIC_EP_EXTENSION=$(PY_EXT) \
	    python3 -m pytest -q tests/py ffi/python/tests
	FABRIC_EP_EXTENSION=$(PY_EXT) python3 ffi/python/examples/host_roundtrip.py

# The main job: ep-bench (the workspace crate ep-bench/) with its embedded defaults.
bench: setup
	$(CARGO) run --release -p ep-bench --

# The C example links the cdylib/staticlib: tests/ffi_example.rs builds them (`cargo build --lib`).
# scripts/modgraph.py fails on an import cycle between modules of src/protocol or of src/ep, and
# on a path src/protocol may not name (the purity check make test runs too).
lint: setup
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	python3 scripts/modgraph.py

# Release test/bench binaries for the GPU machine, gathered in gpu-bundle/ (scripts/gpu-check.sh).
gpu-bundle: setup
	bash scripts/gpu-check.sh build

# The Python package as one wheel in dist/ (fabric_ep, its native module fabric_ep/_core.abi3.so
# built in release and stripped, the libfabric it links in fabric_ep/.libs/), for a machine
# without Rust: `pip install dist/fabric_ep-*.whl` there (any CPython >= 3.8: abi3). Always a
# fresh release build from this checkout: a FABRIC_EP_EXTENSION in the environment
# (ffi/python/setup.py's prebuilt option) is ignored here.
wheel: setup
	# setuptools copies into ffi/python/build/ and never removes what a source tree no longer
	# has: a stale build folder would ship deleted modules.
	rm -rf dist/fabric_ep-*.whl ffi/python/build ffi/python/*.egg-info
	env -u FABRIC_EP_EXTENSION -u FABRIC_EP_CARGO_PROFILE -u FABRIC_EP_ROOT \
	    python3 -m pip wheel -v --no-deps --disable-pip-version-check -w dist ffi/python
	@ls -l dist/fabric_ep-*.whl

clean-tools:
	rm -rf tools

# The C library, built without the `bench-kernels` feature (no test or bench kernels in what ships).
# `make lib` builds libfabric_ep.so (SONAME libfabric_ep.so.0, RUNPATH $ORIGIN) and
# libfabric_ep.a in target/$(PROFILE), with a libfabric_ep.so.0 link beside the .so so programs
# linked there (-L target/release -lfabric_ep -Wl,-rpath,...) find it. `make install
# PREFIX=/opt/fabric-ep` (DESTDIR for staging) installs:
#   include/fabric_ep.h
#   lib/libfabric_ep.so.$(VERSION), libfabric_ep.so.0 -> it, libfabric_ep.so -> libfabric_ep.so.0
#   lib/libfabric_ep.a
#   lib/pkgconfig/fabric_ep.pc (shared; --static: + Requires.private/Libs.private)
#   lib/pkgconfig/fabric_ep-static.pc (links libfabric_ep.a)
#   lib/cmake/fabric_ep/ (find_package(fabric_ep): fabric_ep::fabric_ep, fabric_ep::fabric_ep_static)
# fabric_ep.pc's Libs carry -Wl,-rpath,$(LIBDIR) (PC_RPATH=no: without, for a prefix the loader
# searches anyway). tests/ffi_example.rs installs into a temporary prefix and links
# ffi/examples/roundtrip.c every way. Needs no set-up beyond the build's (libfabric, nvcc).
PREFIX ?= /usr/local
LIBDIR ?= $(PREFIX)/lib
INCLUDEDIR ?= $(PREFIX)/include
PROFILE ?= release
PC_RPATH ?= yes
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' $(ROOT)/Cargo.toml | head -n1)
LIB_BUILD_DIR = $(or $(CARGO_TARGET_DIR),$(ROOT)/target)/$(if $(filter release,$(PROFILE)),release,debug)
# rustc's `--print native-static-libs` for libfabric_ep.a, less libfabric (a pkg-config Requires).
FEP_NATIVE_LIBS := -ldl -lgcc_s -lutil -lrt -lpthread -lm -lc
FEP_PC_SED = -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@LIBDIR@|$(LIBDIR)|g' \
	-e 's|@INCLUDEDIR@|$(INCLUDEDIR)|g' -e 's|@VERSION@|$(VERSION)|g' \
	-e 's|@NATIVE_LIBS@|$(FEP_NATIVE_LIBS)|g' \
	-e 's|@NATIVE_LIBS_CMAKE@|$(subst $(eval) ,;,$(patsubst -l%,%,$(FEP_NATIVE_LIBS)))|g' \
	-e 's|@RPATH@|$(if $(filter yes,$(PC_RPATH)),-Wl$(comma)-rpath$(comma)$${libdir} )|g' \
	-e "s|@LIBDIR_FROM_CMAKEDIR@|$$(realpath -m --relative-to=$(LIBDIR)/cmake/fabric_ep $(LIBDIR))|g" \
	-e "s|@INCLUDEDIR_FROM_CMAKEDIR@|$$(realpath -m --relative-to=$(LIBDIR)/cmake/fabric_ep $(INCLUDEDIR))|g"
comma := ,

lib:
	$(CARGO) build --lib --no-default-features $(if $(filter release,$(PROFILE)),--release)
	ln -sf libfabric_ep.so $(LIB_BUILD_DIR)/libfabric_ep.so.0

install: lib
	@test -n "$(VERSION)" || { echo "install: no version in Cargo.toml" >&2; exit 1; }
	install -d $(DESTDIR)$(INCLUDEDIR) $(DESTDIR)$(LIBDIR)/pkgconfig $(DESTDIR)$(LIBDIR)/cmake/fabric_ep
	install -m 644 ffi/include/fabric_ep.h $(DESTDIR)$(INCLUDEDIR)/fabric_ep.h
	install -m 755 $(LIB_BUILD_DIR)/libfabric_ep.so $(DESTDIR)$(LIBDIR)/libfabric_ep.so.$(VERSION)
	ln -sf libfabric_ep.so.$(VERSION) $(DESTDIR)$(LIBDIR)/libfabric_ep.so.0
	ln -sf libfabric_ep.so.0 $(DESTDIR)$(LIBDIR)/libfabric_ep.so
	install -m 644 $(LIB_BUILD_DIR)/libfabric_ep.a $(DESTDIR)$(LIBDIR)/libfabric_ep.a
	for f in fabric_ep fabric_ep-static; do \
	  sed $(FEP_PC_SED) ffi/pkgconfig/$$f.pc.in > $(DESTDIR)$(LIBDIR)/pkgconfig/$$f.pc || exit 1; done
	for f in fabric_epConfig fabric_epConfigVersion; do \
	  sed $(FEP_PC_SED) ffi/cmake/$$f.cmake.in > $(DESTDIR)$(LIBDIR)/cmake/fabric_ep/$$f.cmake || exit 1; done

uninstall:
	rm -f $(DESTDIR)$(INCLUDEDIR)/fabric_ep.h $(DESTDIR)$(LIBDIR)/libfabric_ep.so.$(VERSION) \
	  $(DESTDIR)$(LIBDIR)/libfabric_ep.so.0 $(DESTDIR)$(LIBDIR)/libfabric_ep.so \
	  $(DESTDIR)$(LIBDIR)/libfabric_ep.a $(DESTDIR)$(LIBDIR)/pkgconfig/fabric_ep.pc \
	  $(DESTDIR)$(LIBDIR)/pkgconfig/fabric_ep-static.pc
	rm -rf $(DESTDIR)$(LIBDIR)/cmake/fabric_ep
