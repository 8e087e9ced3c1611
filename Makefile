PY := .venv/bin/python
EVIDENCE := .venv/bin/evidence

.PHONY: setup demo test test-unit test-kernel lint bench clean

setup:
	@bash scripts/setup.sh

demo: setup
	@bash scripts/demo.sh

test: setup
	$(PY) -m pytest -q tests

test-unit: setup
	$(PY) -m pytest -q tests/unit

test-kernel: setup
	$(PY) -m pytest -q tests/kernel

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy

bench: setup
	@command -v cc >/dev/null || (apt-get update -q >/dev/null && apt-get install -y -q gcc >/dev/null)
	$(PY) bench/bench.py
	$(PY) bench/bundles.py

clean:
	rm -rf .venv build *.egg-info demo-out
