"""A job that double-forks to leave the run's process tree (its process reparented past the run's
first process, so /proc's parent links no longer give its depth) is still held to the command
rules, standalone and through the agent, as nobody: a rule for any depth refuses its exec, which
ran before (no rule's depth range held the depth -1 it got; issue 24's red team)."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kernel.test_command_rules_run import DENY_ID, _refused, _run
from tests.kernel.test_command_rules_via_agent import _run as _run_via_agent
from tests.kernel.test_daemon import Agent
from tests.kernel.test_policy_via_agent import agent  # noqa: F401 - the module's agent fixture
from tests.kernel.util import of_type

pytestmark = pytest.mark.kernel

# the inner shell is orphaned when its subshell exits at once; it runs id a moment later
ORPHAN = "(sh -c 'sleep 0.3; /usr/bin/id; echo orphan=$?' &); sleep 1.5; echo done"


@pytest.fixture
def place() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="evidence-orphan-"))
    d.chmod(0o777)
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


def _check(proc: subprocess.CompletedProcess[str], events: list[dict]) -> None:  # type: ignore[type-arg]
    assert "orphan=126" in proc.stdout and "uid=" not in proc.stdout, proc.stdout + proc.stderr
    assert _refused(events).get("/usr/bin/id") == "commands.rules[0] (no-id)"
    ran = [e for e in of_type(events, "process.exec") if e["data"]["filename"] == "/usr/bin/id"]
    assert all(e["data"]["result"] != 0 for e in ran), ran


def test_an_orphaned_process_is_held_to_the_rules(place: Path) -> None:
    proc, _, events = _run(place, DENY_ID, ORPHAN)
    _check(proc, events)


def test_an_orphaned_process_is_held_to_the_rules_through_the_agent(agent: Agent, place: Path) -> None:  # noqa: F811
    proc, _, events = _run_via_agent(agent, place, DENY_ID, ORPHAN)
    _check(proc, events)
