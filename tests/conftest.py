"""Shared test set-up: kernel tests need root, BPF and cgroup v2. Under CI=true a kernel test that
cannot run is a failure, not a skip: CI runs as root on a kernel that has everything."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest


def _kernel_missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN)"
    if not Path("/sys/kernel/btf/vmlinux").exists():
        return "needs kernel BTF at /sys/kernel/btf/vmlinux"
    try:
        import bcc  # noqa: F401
    except ImportError:
        return "needs BCC (Debian python3-bpfcc)"
    if "cgroup2" not in Path("/proc/self/mounts").read_text():
        return "needs a cgroup v2 mount"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "/tests/kernel/" in str(item.fspath):
            item.add_marker(pytest.mark.kernel)


@pytest.fixture(autouse=True)
def _require_kernel(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("kernel") is None:
        return
    missing = _kernel_missing()
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"kernel test cannot run under CI: {missing}")
        pytest.skip(missing)


@pytest.fixture(autouse=True)
def _evidence_logger_as_it_was() -> Iterator[None]:
    """A test that calls the CLI's `main` in-process gives the `evidence` logger a handler on that
    test's sys.stderr (a capture, closed when the test ends): put the logger back after each test,
    so that a later test's records (a publisher thread's among them) do not go to a closed file."""
    lg = logging.getLogger("evidence")
    handlers, level, propagate = lg.handlers[:], lg.level, lg.propagate
    yield
    lg.handlers[:], lg.level, lg.propagate = handlers, level, propagate
