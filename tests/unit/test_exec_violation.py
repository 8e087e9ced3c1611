"""The exec check's violation from the kernel's record to the bundle: the correlator maps decode's
exec_violation to a `violation` record (policy.violation), kills the process itself when the kernel
could not, and show and lint report it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from evidence.agent.recorder.correlate import Correlator
from evidence.bundle import format as fmt
from evidence.cli import main
from tests.unit.conftest_bundles import records, violation, write


def _violation(**kw: Any) -> dict[str, Any]:  # a decoded exec_violation (decode.py)
    rec = {
        "kind": "exec_violation",
        "ts": 5,
        "cgid": 1,
        "run": 1,
        "tgid": 10,
        "tid": 10,
        "flags": 0,
        "old_tid": 11,
        "reasons": ["args"],
        "file": (os.makedev(254, 1), 131),
        "args_len": 24,
        "argv_hash": 0xABC,
        "decided": (os.makedev(254, 1), 131),
        "decided_args_len": 17,
        "decided_hash": 0xDEF,
        "decided_flags": 0,
        "killed": True,
        "kill_error": 0,
    }
    return rec | kw


def test_a_violation_becomes_a_policy_violation_record() -> None:
    c = Correlator(wall_offset_ns=1000)
    c.add_root(10, 1, "/w", exe="/usr/bin/sh")
    killed: list[int] = []
    c.kill = lambda pid: killed.append(pid) is None
    (rec,) = c.feed(_violation())  # type: ignore[arg-type]
    assert rec == {
        "k": "violation",
        "t": 1005,
        "pid": 10,
        "tid": 11,
        "exe": "/usr/bin/sh",
        "operation": "exec",
        "reasons": ["args"],
        "loaded": "254:1:131",
        "decided": "254:1:131",
        "args_len": 24,
        "decided_args_len": 17,
        "rule": fmt.EXEC_CHECK_RULE,
        "killed": True,
        "result": "SIGKILL",
    }
    assert killed == []  # the kernel killed it
    fmt.PolicyViolation.model_validate({k: v for k, v in rec.items() if k not in ("k", "t")})


def test_a_violation_the_kernel_could_not_kill_is_killed_by_the_recorder() -> None:
    c = Correlator(wall_offset_ns=0)
    c.add_root(10, 1, "/w")
    killed: list[int] = []
    c.kill = lambda pid: killed.append(pid) is None
    no_pin = _violation(reasons=["no_pin"], decided=None, killed=False, kill_error=-11, file=(0, 0))
    (rec,) = c.feed(no_pin)  # type: ignore[arg-type]
    assert killed == [10]
    assert (rec["killed"], rec["result"], rec["decided"], rec["decided_args_len"], rec["loaded"]) == (
        True,
        "EAGAIN",
        None,
        None,
        None,
    )


def test_the_recorders_kill_spares_a_process_that_is_gone() -> None:
    c = Correlator(wall_offset_ns=0)
    assert c._kill_in_run(2**22 + 12345) is False  # past pid_max: no such process


def test_show_lists_a_violation_and_lint_reports_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path / "a.tar.gz", [*records(), violation(9000, "file", "args")])
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert (
        "  killed exec /usr/bin/sh: not as decided (file, args; rule commands: the exec check)"
        in out.splitlines()
    )
    assert main(["lint", str(path)]) == 1  # an error
    assert "EV021" in capsys.readouterr().out
    assert main(["lint", "--explain", "exec-not-as-decided"]) == 0
