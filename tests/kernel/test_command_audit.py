"""`audit` command rules record what they matched (issue 24), the job run as nobody, standalone and
through the agent: each audited exec ran and is a policy.audit event (rule index and name, the
program really executed, argv, depth, the rule's message), `show` lists them and `lint` counts them
(EV022); a job execing an audited program past the run's cap of audit records has the rest counted
in the manifest's lost (audit_past_cap), which lint's EV001 says."""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from evidence.bundle.format import AUDIT_RECORDS_MAX
from tests.kernel.test_command_rules_run import _run
from tests.kernel.test_command_rules_via_agent import _run as _run_via_agent
from tests.kernel.test_daemon import Agent
from tests.kernel.test_policy_via_agent import agent  # noqa: F401 - the module's agent fixture
from tests.kernel.util import evidence, of_type

pytestmark = pytest.mark.kernel

AUDIT_ID = """\
default: allow
rules:
  - {name: no-curl, program: [curl], decision: deny}
  - {name: note-id, program: [id], decision: audit, message: "ids are looked at"}
"""


@pytest.fixture
def place() -> Iterator[Path]:  # nobody must reach it (pytest's tmp_path is 0700)
    d = Path(tempfile.mkdtemp(prefix="evidence-audit-"))
    d.chmod(0o777)
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


def _audits(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e["data"] for e in of_type(events, "policy.audit")]


def _check_audited(proc: subprocess.CompletedProcess[str], events: list[dict[str, Any]]) -> None:
    assert proc.stdout.split() == ["65534", "65534", "done"], proc.stdout + proc.stderr  # they ran
    audits = _audits(events)
    assert [(a["program"], a["argv"]) for a in audits] == [
        ("/usr/bin/id", ["id", "-u"]),
        ("/usr/bin/id", ["id", "-g"]),
    ], audits
    a = audits[0]
    assert (a["rule"], a["rule_index"], a["rule_name"], a["message"]) == (
        "commands.rules[1] (note-id)",
        1,
        "note-id",
        "ids are looked at",
    )
    assert a["argv_truncated"] is False and a["depth"] == 1, audits  # forked by the run's shell
    assert audits[1]["depth"] == 2  # through `sh -c`: one fork deeper
    # the execs' own records say the same program ran, in the same processes
    ran = {
        e["data"]["pid"] for e in of_type(events, "process.exec") if e["data"]["filename"] == "/usr/bin/id"
    }
    assert {a["pid"] for a in audits} == ran
    assert "evidence: exec of" not in proc.stderr  # an audit tells the job nothing


def _show_and_lint(bundle: Path) -> tuple[str, dict[str, Any]]:
    shown = evidence("show", str(bundle))
    linted = evidence("lint", "--format", "json", str(bundle))
    return shown.stdout, {f["rule"]: f for f in json.loads(linted.stdout)["findings"]}


SCRIPT = "id -u; sh -c 'id -g; true'; echo done"


def test_audited_execs_run_and_are_recorded(place: Path) -> None:
    proc, manifest, events = _run(place, AUDIT_ID, SCRIPT)
    _check_audited(proc, events)
    assert manifest["lost"]["by_kind"].get("audit_past_cap") is None
    shown, found = _show_and_lint(place / "run.tar.gz")
    assert "audit commands.rules[1] (note-id): ran /usr/bin/id (x2)" in shown, shown
    assert (
        found["EV022"]["count"] == 2 and "audited by commands.rules[1] (note-id)" in found["EV022"]["message"]
    )


def test_audits_past_the_cap_are_counted_not_kept(place: Path) -> None:
    n = AUDIT_RECORDS_MAX + 25
    proc, manifest, events = _run(
        place, AUDIT_ID, f"i=0; while [ $i -lt {n} ]; do id -u >/dev/null; i=$((i+1)); done; echo done"
    )
    assert proc.stdout.strip() == "done", proc.stderr
    assert len(_audits(events)) == AUDIT_RECORDS_MAX
    assert manifest["lost"]["by_kind"]["audit_past_cap"] == 25
    _, found = _show_and_lint(place / "run.tar.gz")
    assert "audit_past_cap: 25" in found["EV001"]["message"]


def test_audited_execs_are_recorded_through_the_agent(agent: Agent, place: Path) -> None:  # noqa: F811
    proc, manifest, events = _run_via_agent(agent, place, AUDIT_ID, SCRIPT)
    _check_audited(proc, events)
    assert manifest["lost"]["by_kind"].get("audit_past_cap") is None
    _, found = _show_and_lint(place / "agent.tar.gz")
    assert found["EV022"]["count"] == 2


def test_an_audited_exec_with_the_largest_undecodable_argv_is_recorded_whole(place: Path) -> None:
    """What crosses from the supervisor's process is one datagram: an argv the job makes as large as
    the supervisor reads (64 KiB) of bytes that are not UTF-8 (each escaped to six in the message)
    still crosses, and its record keeps every argument, such bytes as \\xNN as in the kernel's
    names (kept as the supervisor read them, they failed the run's bundle: no JSON encoder takes
    them)."""
    code = "import os; os.execv('/usr/bin/id', [b'id'] + [bytes([0xff]) * 1000] * 60)"
    proc, manifest, events = _run(place, AUDIT_ID, f'/usr/bin/python3 -c "{code}"')
    audits = _audits(events)
    assert len(audits) == 1, proc.stderr[-500:]  # (id takes the arguments for users: it fails, after it ran)
    assert len(audits[0]["argv"]) == 61 and audits[0]["argv"][1] == "\\xff" * 1000
    execs = [e["data"] for e in of_type(events, "process.exec") if e["data"]["filename"] == "/usr/bin/id"]
    assert execs[0]["argv"][1] == audits[0]["argv"][1]  # as the recorder's own exec event says it
    assert audits[0]["argv_truncated"] is False


def test_a_refused_program_with_an_undecodable_name_leaves_a_bundle(place: Path) -> None:
    """Under `default: deny` a job execs a program whose name is not UTF-8: the refusal is recorded
    with the name as \\\\xNN (its target kept as read failed the whole bundle)."""
    code = (
        f"import os, shutil; p = os.fsencode('{place}/') + bytes([0xff]); shutil.copy('/usr/bin/true', p); "
        "os.chmod(p, 0o755); os.execv(p, [p])"
    )
    allow_python = (
        "default: deny\nrules:\n  - {name: py, program: [setpriv, python3*, dash], decision: allow}\n"
    )
    proc, _, events = _run(place, allow_python, f'/usr/bin/python3 -c "{code}"; echo rc=$?')
    assert "rc=1" in proc.stdout, proc.stdout + proc.stderr  # python's execv failed: EACCES
    refused = [e["data"] for e in of_type(events, "policy.denial") if e["data"]["operation"] == "exec"]
    assert [r["target"] for r in refused] == [f"{place}/\\xff"], refused
