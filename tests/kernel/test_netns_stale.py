"""A recorder killed before it removed its network namespace (`--net`) leaves it in /run/netns,
named after its pid (policy/netns.py): the next run that makes one removes it, and never one
whose process is still alive."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evidence.policy.netns import PrivateNetns
from tests.kernel.util import evidence

pytestmark = pytest.mark.kernel

RUN_NETNS = Path("/run/netns")


def _theirs(pid: int) -> list[str]:
    return (
        sorted(n for n in os.listdir(RUN_NETNS) if n.startswith(f"evidence-{pid}-"))
        if RUN_NETNS.is_dir()
        else []
    )


def test_a_killed_runs_namespace_is_removed_by_the_next_run_and_a_live_ones_kept(tmp_path: Path) -> None:
    killed = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "evidence",
            "run",
            "--net",
            "none",
            "--bundle",
            str(tmp_path / "k.tar.gz"),
            "--",
            "sleep",
            "60",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not _theirs(killed.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _theirs(killed.pid)
        assert left, "the run made no network namespace"
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
    finally:
        if killed.poll() is None:
            killed.kill()
            killed.wait()
    assert _theirs(killed.pid) == left  # killed before it could remove it: left behind
    live = PrivateNetns("none", name=f"evidence-{os.getpid()}-0badcafe")  # a process alive: ours
    live.create()
    try:
        done = evidence(
            "run", "--net", "none", "--bundle", str(tmp_path / "n.tar.gz"), "--", "true", cwd=tmp_path
        )
        assert done.returncode == 0, done.stderr
        assert _theirs(killed.pid) == []  # removed by the next run
        assert os.path.exists(live.path)  # its process is alive: kept
    finally:
        live.remove()
    assert not os.path.exists(live.path)
