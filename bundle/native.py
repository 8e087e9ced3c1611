"""The compiled modules `make setup` builds from src/fast/ (setup.py), each the hot path of a Python
path that stays the reference and that a property test holds it equal to: full detail's
(`evidence.bundle._fast`), the reader's fast path over event lines (`evidence.bundle._verify`), the
exec supervisor's (`evidence.agent.recorder._exec`), the fleet publisher's framing
(`evidence.agent.daemon._wire`). Each is optional: a machine without a C compiler, or a copy of
the packages alone, runs the Python path; under CI=true tests/unit/test_native.py fails when one is
not built."""

from __future__ import annotations

import importlib
import os
from typing import Any


def compiled(module: str) -> Any:
    """The compiled module `module`, or None: not built, or EVIDENCE_PURE_PYTHON set (the Python
    path then does it all)."""
    if os.environ.get("EVIDENCE_PURE_PYTHON"):
        return None
    try:
        return importlib.import_module(module)
    except ImportError:  # pragma: no cover - tests/unit/test_native.py fails under CI=true without it
        return None
