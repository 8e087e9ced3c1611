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

# both parts always run; the exit code is about correctness (exact counts, bundles that verify), not
# timing. BENCH_ARGS: e.g. --quick (a smoke test, bundles.py too) or --cases open10,distinct
bench: setup
	@command -v cc >/dev/null || (apt-get update -q >/dev/null && apt-get install -y -q gcc >/dev/null)
	@$(PY) -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(sysconfig.get_path("include") + "/Python.h"))' \
		|| (apt-get update -q >/dev/null && apt-get install -y -q python3-dev >/dev/null)
	@rc=0; $(PY) bench/bench.py $(BENCH_ARGS) || rc=1; $(PY) bench/bundles.py $(filter --quick,$(BENCH_ARGS)) || rc=1; exit $$rc

clean:
	rm -rf .venv build *.egg-info demo-out
