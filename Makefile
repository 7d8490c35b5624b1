PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION := 2.13.0

.PHONY: serve test e2e lint typecheck bench install install-test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# torch's CPU build first, so the project's own torch requirement installs nothing more.
	$(BIN)/pip install torch==$(TORCH_VERSION)

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -e .
	touch $@

$(VENV)/.installed-test: $(BIN)/python pyproject.toml
	$(BIN)/pip install -e '.[test]'
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

serve: install
	$(BIN)/pagedllm serve $(ARGS)

test: install-test lint typecheck
	$(BIN)/pytest -q $(PYTEST_ARGS)

e2e: install-test
	$(BIN)/pytest -q e2e $(PYTEST_ARGS)

lint: install-test
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

# build/typecheck/pagedllm: links to node/'s entries, kernels/ and operator/ (see pyproject).
typecheck: install-test
	rm -rf build/typecheck && mkdir -p build/typecheck/pagedllm
	ln -s $(CURDIR)/node/* build/typecheck/pagedllm/
	ln -s $(CURDIR)/kernels $(CURDIR)/operator build/typecheck/pagedllm/
	$(BIN)/mypy

bench: install
	$(BIN)/pip install -e '.[bench]'
	$(BIN)/python bench/serving.py --setup-peers
