"""The exec check wired into runs (issue 24, "no race past the decision"): a job as nobody whose
thread execs an allowed program while another thread rewrites the path and the arguments (to a
refused program and other arguments of the same lengths) never gets the rewritten exec to run: the
supervisor pinned what it decided, the kernel kills an exec that loads another file or copies other
arguments before its first instruction, and the bundle has the violation (lint EV021). On
`evidence run --policy` and through an agent (`run --agent`)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kernel.test_command_rules_run import _run as run_standalone
from tests.kernel.test_command_rules_via_agent import _run as run_via_agent
from tests.kernel.test_daemon import Agent
from tests.kernel.test_policy_via_agent import agent  # noqa: F401 - the module's agent fixture
from tests.kernel.util import of_type

pytestmark = pytest.mark.kernel

ATTEMPTS = 30

# Each attempt: a child whose main thread execs `a okay` (a -> /usr/bin/true: allowed) from a
# mapping that a second thread flips to `b mark` (b -> /usr/bin/touch: refused) and back, path and
# last argument each on its own: the supervisor reads one version, the kernel copies whichever
# stands then. It prints each attempt's status (0: ran as decided, 3: refused, -9: killed).
JOB = r"""
import ctypes, mmap, os, sys, threading
place = sys.argv[1]
libc = ctypes.CDLL(None, use_errno=True)
a = (f"{place}/a".encode(), f"{place}/okay".encode())
b = (f"{place}/b".encode(), f"{place}/mark".encode())
for i in range(int(sys.argv[2])):
    pid = os.fork()
    if pid == 0:
        shared = mmap.mmap(-1, 4096)
        base = ctypes.addressof(ctypes.c_char.from_buffer(shared))
        off = 1024
        shared[0 : len(a[0]) + 1] = a[0] + b"\0"
        shared[off : off + len(a[1]) + 1] = a[1] + b"\0"
        argv = (ctypes.c_char_p * 3)(base, base + off, None)
        def flip():
            while True:
                for p, x in (a, b):
                    shared[0 : len(p)] = p
                    shared[off : off + len(x)] = x
        threading.Thread(target=flip, daemon=True).start()
        libc.execve(ctypes.c_char_p(base), argv, (ctypes.c_char_p * 1)(None))
        os._exit(3)
    _, status = os.waitpid(pid, 0)
    print("status", os.waitstatus_to_exitcode(status), flush=True)
print("done", flush=True)
"""

DENY_TOUCH = """\
default: allow
rules:
  - {name: no-touch, program: [touch], decision: deny}
"""


@pytest.fixture
def place() -> Iterator[Path]:  # nobody must reach it (pytest's tmp_path is 0700)
    d = Path(tempfile.mkdtemp(prefix="evidence-exec-check-"))
    d.chmod(0o777)
    (d / "a").symlink_to("/usr/bin/true")
    (d / "b").symlink_to("/usr/bin/touch")
    (d / "job.py").write_text(JOB)
    (d / "job.py").chmod(0o644)
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


def _check(place: Path, proc: subprocess.CompletedProcess[str], events: list[dict[str, Any]]) -> None:
    statuses = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("status ")]
    assert len(statuses) == ATTEMPTS and "done" in proc.stdout, proc.stdout + proc.stderr
    assert set(statuses) <= {0, 3, -9}, statuses
    # the rewritten exec never ran: touch made neither file
    assert not (place / "mark").exists() and not (place / "okay").exists()
    killed = statuses.count(-9)
    assert killed >= 1, statuses  # the rewrites did land between the decision and the kernel's copy
    violations = of_type(events, "policy.violation")
    assert len(violations) == killed, violations
    said = [e["data"]["component"] for e in of_type(events, "degradation")]
    assert "commands" not in said, said


def _lint(bundle: Path) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "evidence", "lint", str(bundle)], capture_output=True, text=True, timeout=120
    )
    return out.stdout + out.stderr


def test_a_thread_that_rewrites_the_exec_after_the_decision_is_killed(place: Path) -> None:
    proc, _, events = run_standalone(
        place, DENY_TOUCH, f"/usr/bin/python3 -S {place}/job.py {place} {ATTEMPTS}", "--quiet-denials"
    )
    _check(place, proc, events)
    assert "EV021" in _lint(place / "run.tar.gz")


def test_a_thread_that_rewrites_the_exec_after_the_decision_is_killed_via_agent(
    agent: Agent,  # noqa: F811
    place: Path,
) -> None:
    proc, _, events = run_via_agent(
        agent, place, DENY_TOUCH, f"/usr/bin/python3 -S {place}/job.py {place} {ATTEMPTS}", "--quiet-denials"
    )
    _check(place, proc, events)
    assert "EV021" in _lint(place / "agent.tar.gz")


def test_normal_runs_are_not_killed(place: Path) -> None:
    proc, _, events = run_standalone(place, DENY_TOUCH, f"{place}/a; echo a=$?; {place}/b x; echo b=$?")
    assert "a=0" in proc.stdout and "b=0" not in proc.stdout, proc.stdout + proc.stderr
    assert of_type(events, "policy.violation") == []
    assert os.path.exists(place / "x") is False
