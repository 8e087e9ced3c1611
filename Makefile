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
	$(PY) bench/bench.py

clean:
	rm -rf .venv build *.egg-info demo-out
