# fabric-ep's image for EFA jobs on EKS (docs/deploy/: PyTorchJob, MPIJob, TorchX): CUDA 13.0,
# AWS's EFA user space (libfabric, rdma-core, Open MPI), aws-ofi-nccl built against both, PyTorch
# with its NCCL, ep-bench and the C library (make install) built here, and the fabric-ep Python
# wheel that `make wheel` leaves in dist/:
#
#   make wheel
#   docker build -t fabric-ep:0.1.0 --build-arg FEP_GIT_COMMIT="$(git rev-parse HEAD)" .
#
# Every version that decides behaviour is an ARG pinned below; the *_SHA256 ARGs, when given,
# make the downloads fail on a mismatch. Distribution packages follow the pinned base image.
# Not built in this repository's CI (no container engine there): hadolint checks it
# (tests/py/test_deploy.py).

ARG CUDA_VERSION=13.0.2
ARG UBUNTU=ubuntu24.04
ARG RUST_VERSION=1.95.0

FROM rust:${RUST_VERSION}-slim-bookworm AS rust

# ---- build: ep-bench, libfabric_ep, aws-ofi-nccl -----------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS build
ARG EFA_INSTALLER_VERSION=1.44.0
ARG EFA_INSTALLER_SHA256=
ARG AWS_OFI_NCCL_VERSION=1.17.1
ARG AWS_OFI_NCCL_SHA256=
# sm_90 (H100/H200, P5) SASS + PTX; add 100 for B200 (P6).
ARG FEP_CUDA_ARCHS=90
ARG FEP_GIT_COMMIT=unknown
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive

# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl build-essential make \
      pkg-config libclang-dev clang libhwloc-dev \
 && rm -rf /var/lib/apt/lists/*

# EFA user space: libfabric with the efa provider, rdma-core, Open MPI (no kernel module in a
# container: the node's driver serves the device the EFA device plugin hands the pod).
WORKDIR /tmp/efa
RUN curl -fsSLO "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" \
 && if [ -n "${EFA_INSTALLER_SHA256}" ]; then \
      echo "${EFA_INSTALLER_SHA256}  aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" | sha256sum -c -; fi \
 && tar -xzf "aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz"
WORKDIR /tmp/efa/aws-efa-installer
RUN apt-get update \
 && ./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify \
 && rm -rf /tmp/efa /var/lib/apt/lists/*

# aws-ofi-nccl, NCCL's network plugin for libfabric, against this CUDA and the EFA libfabric.
WORKDIR /tmp/ofi
RUN curl -fsSLO "https://github.com/aws/aws-ofi-nccl/releases/download/v${AWS_OFI_NCCL_VERSION}/aws-ofi-nccl-${AWS_OFI_NCCL_VERSION}.tar.gz" \
 && if [ -n "${AWS_OFI_NCCL_SHA256}" ]; then \
      echo "${AWS_OFI_NCCL_SHA256}  aws-ofi-nccl-${AWS_OFI_NCCL_VERSION}.tar.gz" | sha256sum -c -; fi \
 && tar -xzf "aws-ofi-nccl-${AWS_OFI_NCCL_VERSION}.tar.gz" --strip-components=1 \
 && ./configure --prefix=/opt/aws-ofi-nccl --with-libfabric=/opt/amazon/efa \
      --with-cuda=/usr/local/cuda --enable-platform-aws --disable-tests \
 && make -j"$(nproc)" \
 && make install \
 && rm -rf /tmp/ofi

# fabric-ep against the EFA libfabric (pkg-config), with the Rust toolchain the repository pins.
COPY --from=rust /usr/local/cargo /usr/local/cargo
COPY --from=rust /usr/local/rustup /usr/local/rustup
ENV CARGO_HOME=/usr/local/cargo RUSTUP_HOME=/usr/local/rustup RUSTUP_TOOLCHAIN=${RUST_VERSION} \
    PATH=/usr/local/cargo/bin:${PATH} \
    PKG_CONFIG_PATH=/opt/amazon/efa/lib/pkgconfig:/opt/amazon/efa/lib64/pkgconfig \
    NVCC=/usr/local/cuda/bin/nvcc
WORKDIR /src
COPY . .
RUN FEP_CUDA_ARCHS="${FEP_CUDA_ARCHS}" FEP_GIT_COMMIT="${FEP_GIT_COMMIT}" \
      cargo build --release --locked -p ep-bench \
 && make install PREFIX=/opt/fabric-ep PROFILE=release \
 && install -D -m 755 target/release/ep-bench /opt/fabric-ep/bin/ep-bench

# ---- runtime ------------------------------------------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU}
ARG EFA_INSTALLER_VERSION=1.44.0
ARG EFA_INSTALLER_SHA256=
ARG TORCH_VERSION=2.9.1
ARG NCCL_VERSION=2.27.7
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive

# python for torch and the wheel; ssh for the MPIJob's launcher (mpi-operator starts ranks over
# ssh with keys it mounts); hwloc for aws-ofi-nccl.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl python3 python3-venv \
      openssh-server openssh-client libhwloc15 \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /run/sshd \
 && printf 'StrictHostKeyChecking no\nUserKnownHostsFile /dev/null\nLogLevel ERROR\n' \
      > /etc/ssh/ssh_config.d/50-mpi-operator.conf \
 && printf 'StrictModes no\n' > /etc/ssh/sshd_config.d/50-mpi-operator.conf

WORKDIR /tmp/efa
RUN curl -fsSLO "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" \
 && if [ -n "${EFA_INSTALLER_SHA256}" ]; then \
      echo "${EFA_INSTALLER_SHA256}  aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" | sha256sum -c -; fi \
 && tar -xzf "aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz"
# The installer's own aws-ofi-nccl goes: the one built above against CUDA 13 replaces it.
WORKDIR /tmp/efa/aws-efa-installer
RUN apt-get update \
 && ./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify \
 && rm -rf /tmp/efa /var/lib/apt/lists/* \
 && rm -rf /opt/amazon/ofi-nccl /etc/ld.so.conf.d/*ofinccl*.conf

COPY --from=build /opt/aws-ofi-nccl /opt/aws-ofi-nccl
COPY --from=build /opt/fabric-ep /opt/fabric-ep

# PyTorch built for CUDA 13.0 with the NCCL it was released with (pinned here too, so a torch
# that wants another fails the build instead of drifting), then the fabric-ep wheel.
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:/opt/fabric-ep/bin:/opt/amazon/openmpi/bin:/opt/amazon/efa/bin:${PATH}
COPY dist/ /tmp/dist/
RUN python3 -m venv /opt/venv \
 && pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cu130 \
      --extra-index-url https://pypi.org/simple "torch==${TORCH_VERSION}" "nvidia-nccl-cu13==${NCCL_VERSION}" \
 && pip install --no-cache-dir /tmp/dist/fabric_ep-*.whl \
 && rm -rf /tmp/dist

# One loader path for all of it: EFA's libfabric, our aws-ofi-nccl (libnccl-net-ofi.so, the
# NCCL_NET_PLUGIN=ofi the manifests set), fabric-ep's library, and the NCCL torch brought, which
# ep-bench's NCCL baseline loads by its soname.
RUN printf '%s\n' /opt/amazon/efa/lib /opt/aws-ofi-nccl/lib /opt/fabric-ep/lib \
      > /etc/ld.so.conf.d/000-fabric-ep.conf \
 && nccl="$(find /opt/venv -name 'libnccl.so.2' -print -quit)" \
 && test -n "${nccl}" \
 && ln -s "${nccl}" /usr/local/lib/libnccl.so.2 \
 && ldconfig \
 && ep-bench --version \
 && ep-bench plan --at 16 > /dev/null

ENV PKG_CONFIG_PATH=/opt/fabric-ep/lib/pkgconfig
WORKDIR /workspace
CMD ["ep-bench", "--help"]
