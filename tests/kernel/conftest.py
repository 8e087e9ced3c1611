"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def place() -> Iterator[Path]:
    """A directory in /tmp that a job run as nobody can enter and write (pytest's tmp_path is
    root's, 0700), removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="evidence-test-rt-", dir="/tmp"))
    d.chmod(0o777)
    yield d
    shutil.rmtree(d)
