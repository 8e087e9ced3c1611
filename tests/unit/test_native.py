"""The compiled modules `make setup` builds (setup.py, bundle/native.py): under CI=true each is
built and in use, so that the tests of its C path (test_fast.py, test_lint_fast.py,
test_exec_fast.py, test_wire_fast.py) run against it, never silently without it;
EVIDENCE_PURE_PYTHON=1 leaves each unused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from evidence.bundle import native

MODULES = [
    "evidence.bundle._fast",
    "evidence.bundle._verify",
    "evidence.agent.recorder._exec",
    "evidence.agent.daemon._wire",
]


@pytest.mark.parametrize("module", MODULES)
def test_each_compiled_module_is_built_under_ci(module: str) -> None:
    if native.compiled(module) is None:
        if os.environ.get("CI") == "true":
            pytest.fail(
                f"{module} is not importable (`make setup` did not build it) or EVIDENCE_PURE_PYTHON is set"
            )
        pytest.skip("the compiled module is not built (make setup)")


def test_pure_python_leaves_every_one_unused() -> None:
    code = f"from evidence.bundle import native; print([native.compiled(m) for m in {MODULES!r}])"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "EVIDENCE_PURE_PYTHON": "1"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == str([None] * len(MODULES))
