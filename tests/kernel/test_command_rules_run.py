"""A policy's command rules on `evidence run --policy` (issue 24), the job run as nobody: execs
refused directly and nested (`sh -c`, `env`, a symlink, a `#!` script), by args patterns and by
`default: deny`; the line the job is told (and not with --quiet-denials); --dry-run; approvals that
time out (denied, or allowed by on_timeout); the recorder killed while an exec waits for approval
(the exec never runs, the watchdog kills the job); a policy without `commands` loads no filter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kernel.util import as_user, evidence, of_type, read_bundle

pytestmark = pytest.mark.kernel

NOBODY = 65534


@pytest.fixture
def place() -> Iterator[Path]:  # nobody must reach it (pytest's tmp_path is 0700)
    d = Path(tempfile.mkdtemp(prefix="evidence-cmds-"))
    d.chmod(0o777)
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


def _run(
    place: Path, commands: str, script: str, *extra: str, approvals: str = ""
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], list[dict[str, Any]]]:
    policy = place / "policy.yaml"
    policy.write_text(
        "version: 1\ncommands:\n" + textwrap.indent(textwrap.dedent(commands), "  ") + approvals
    )
    bundle = place / "run.tar.gz"
    bundle.unlink(missing_ok=True)
    proc = evidence(
        "run", "--bundle", str(bundle), "--policy", str(policy), *extra, "--",
        *as_user(NOBODY, "/bin/sh", "-c", script), cwd=place,
    )  # fmt: skip
    assert bundle.exists(), proc.stderr
    manifest, events = read_bundle(bundle)
    return proc, manifest, events


def _refused(events: list[dict[str, Any]]) -> dict[str, str]:
    """target -> rule of the exec denials."""
    return {
        e["data"]["target"]: e["data"]["rule"]
        for e in of_type(events, "policy.denial")
        if e["data"]["operation"] == "exec"
    }


DENY_ID = """\
default: allow
rules:
  - {name: no-id, program: [id], decision: deny, message: "ask a human"}
"""


def test_an_exec_is_refused_directly_and_nested_and_the_job_is_told(place: Path) -> None:
    (place / "myid").symlink_to("/usr/bin/id")
    script = place / "script"
    script.write_text("#!/usr/bin/id\n")
    script.chmod(0o755)
    proc, manifest, events = _run(
        place,
        DENY_ID,
        f"id; echo direct=$?; sh -c id; echo nested=$?; /usr/bin/env id; echo env=$?; "
        f"{place}/myid; echo link=$?; {script}; echo script=$?; echo done",
    )
    out = proc.stdout
    assert "uid=" not in out, out  # id never ran
    for what in ("direct", "nested", "env", "link", "script"):
        assert f"{what}=0" not in out, (what, out)
    assert "done" in out and proc.returncode == 0, proc.stderr
    refused = _refused(events)
    assert refused.get("/usr/bin/id") == "commands.rules[0] (no-id)", refused
    assert str(script) in refused  # decided on itself and on its interpreter: id
    assert "evidence: exec of /usr/bin/id refused by commands.rules[0] (no-id): ask a human" in proc.stderr
    assert manifest["policy"]["commands"]["rule_count"] == 1
    said = [e["data"]["component"] for e in of_type(events, "degradation")]
    assert "commands" not in said, said


def test_quiet_denials_tells_the_job_nothing(place: Path) -> None:
    proc, _, events = _run(place, DENY_ID, "id; echo rc=$?", "--quiet-denials")
    assert "uid=" not in proc.stdout and "/usr/bin/id" in _refused(events)
    assert "refused by" not in proc.stderr, proc.stderr


def test_args_patterns_and_default_deny(place: Path) -> None:
    proc, _, events = _run(
        place,
        """\
        default: deny
        rules:
          - {name: shells, program: [dash, setpriv], decision: allow}
          - {name: cat, program: [cat], decision: allow}
          - {name: no-secret-cat, program: [cat], args: ["*secret*"], decision: deny}
        """,
        "cat /etc/hostname >/dev/null; echo cat=$?; cat /etc/secret-thing; echo secret=$?; id; echo id=$?",
    )
    assert "cat=0" in proc.stdout and "secret=126" in proc.stdout and "id=126" in proc.stdout, proc.stdout
    refused = _refused(events)
    assert refused["/usr/bin/id"] == "commands.default"
    assert "no-secret-cat" in refused["/usr/bin/cat"]


def test_dry_run_decides_records_and_exits_4(place: Path) -> None:
    proc, manifest, events = _run(place, DENY_ID, "id", "--dry-run")
    assert "uid=65534" in proc.stdout  # it ran
    assert proc.returncode == 4, proc.stderr
    den = [e["data"] for e in of_type(events, "policy.denial") if e["data"]["target"] == "/usr/bin/id"]
    assert den and not den[0]["enforced"], den
    assert "refused by" not in proc.stderr  # nothing was refused


APPROVE_ID = """\
default: allow
rules:
  - {name: ask-id, program: [id], decision: approve, message: "id needs a yes"}
"""


@pytest.mark.parametrize("on_timeout", ["deny", "allow"])
def test_an_approval_nobody_answers_times_out(place: Path, on_timeout: str) -> None:
    proc, _, events = _run(
        place,
        APPROVE_ID,
        "/usr/bin/id; echo rc=$?",
        approvals=f"approvals:\n  timeout: 1s\n  on_timeout: {on_timeout}\n",
    )
    asked = [e["data"] for e in of_type(events, "policy.approval")]
    assert [a["state"] for a in asked] == ["requested", "allowed" if on_timeout == "allow" else "denied"], (
        asked
    )
    assert asked[1]["via"] == "timeout" and asked[0]["program"] == "/usr/bin/id"
    assert ("uid=65534" in proc.stdout) == (on_timeout == "allow"), proc.stdout
    assert "waits for approval by commands.rules[0] (ask-id)" in proc.stderr, proc.stderr


def test_the_recorder_killed_while_an_exec_waits(place: Path) -> None:
    """kill -9 of `evidence run` while the job's exec waits for approval: the exec never runs
    (its listener is gone: ENOSYS) and the watchdog kills the job."""
    policy = place / "policy.yaml"
    policy.write_text(
        "version: 1\ncommands:\n" + textwrap.indent(APPROVE_ID, "  ") + "approvals:\n  timeout: 60s\n"
    )
    marker = place / "ran"
    after = place / "after"
    proc = subprocess.Popen(
        [sys.executable, "-m", "evidence", "run", "--bundle", str(place / "b.tar.gz"), "--policy", str(policy),
         "--", *as_user(NOBODY, "/bin/sh", "-c", f"echo $$ > {place}/pid; id > {marker}; sleep 30; touch {after}")],
        cwd=place, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (place / "pid").exists() or not (place / "pid").read_text().strip():
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        time.sleep(1.0)  # the exec of id waits for an answer
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        job = int((place / "pid").read_text())
        deadline = time.monotonic() + 20
        while Path(f"/proc/{job}").exists():
            assert time.monotonic() < deadline, "the job outlived its recorder"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not marker.exists() or marker.read_text() == "", "id ran"
    assert not after.exists()
    rec = evidence("recover")  # the run's records are left for recover, which writes its bundle
    assert rec.returncode == 0 and "(cut short)" in rec.stderr, rec.stderr

    # ours among what it wrote (another run killed on this machine may be recovered with it), by
    # the command it claimed: its manifest's command is empty when its first exec's record was not
    # flushed before the kill (bundle/command.py judge)
    def claimed(p: str) -> list[str]:
        manifest = read_bundle(p)[0]
        return list(manifest.get("claimed_command") or manifest["command"])

    ours = [Path(p) for p in rec.stdout.split() if str(place) in " ".join(claimed(p))]
    assert len(ours) == 1, (rec.stdout, rec.stderr)
    (recovered,) = ours
    _, events = read_bundle(recovered)
    recovered.unlink()
    # (the supervisor's records are kept in memory until the run finishes, as the connect guard's
    # denials are: the request is not in the recovered bundle; the exec that ran nothing is)
    asked = [e["data"]["state"] for e in of_type(events, "policy.approval")]
    assert "allowed" not in asked, asked
    assert not [e for e in of_type(events, "process.exec") if e["data"]["filename"] == "/usr/bin/id"]


def test_a_policy_without_commands_loads_no_filter(place: Path) -> None:
    policy = place / "policy.yaml"
    policy.write_text("version: 1\nenv:\n  strip_secrets: true\n")
    proc = evidence(
        "run", "--bundle", str(place / "b.tar.gz"), "--policy", str(policy), "--",
        *as_user(NOBODY, "/bin/sh", "-c", "grep -E '^(Seccomp|Seccomp_filters):' /proc/self/status"),
        cwd=place,
    )  # fmt: skip
    filters = int(proc.stdout.split("Seccomp_filters:")[1].split()[0])
    policy.write_text("version: 1\ncommands:\n" + textwrap.indent(DENY_ID, "  "))
    proc2 = evidence(
        "run", "--bundle", str(place / "d.tar.gz"), "--policy", str(policy), "--",
        *as_user(NOBODY, "/bin/sh", "-c", "grep -E '^(Seccomp|Seccomp_filters):' /proc/self/status"),
        cwd=place,
    )  # fmt: skip
    assert int(proc2.stdout.split("Seccomp_filters:")[1].split()[0]) == filters + 1, (
        proc.stdout,
        proc2.stdout,
    )


def test_an_approval_answered_on_the_terminal_evidence_run_was_started_from(place: Path) -> None:
    """`evidence run` on a terminal (pexpect): the held exec is asked there; `y` and a reason
    allow it, recorded with the terminal owner's uid; `n` denies the next."""
    import pexpect

    policy = place / "policy.yaml"
    policy.write_text("version: 1\ncommands:\n" + textwrap.indent(APPROVE_ID, "  "))
    bundle = place / "tty.tar.gz"
    job = "/usr/bin/id -u; echo rc=$?; /usr/bin/id -g; echo rc2=$?"
    child = pexpect.spawn(
        sys.executable,
        ["-m", "evidence", "run", "--bundle", str(bundle), "--policy", str(policy), "--",
         *as_user(NOBODY, "/bin/sh", "-c", job)],
        encoding="utf-8", timeout=60, cwd=str(place),
    )  # fmt: skip
    try:
        child.expect(r"allow\? \[y/N")
        assert "exec of /usr/bin/id" in child.before
        child.sendline("y checked it")
        child.expect(r"allow\? \[y/N")
        out = child.before
        child.sendline("no not today")
        child.expect(pexpect.EOF)
        out += child.before
    finally:
        child.close(force=True)
    assert "rc=0" in out and "rc2=126" in out, out
    _, events = read_bundle(bundle)
    asked = [
        (e["data"]["state"], e["data"].get("via"), e["data"].get("reason"))
        for e in of_type(events, "policy.approval")
    ]
    assert asked == [
        ("requested", None, None),
        ("allowed", "terminal", "checked it"),
        ("requested", None, None),
        ("denied", "terminal", "not today"),
    ], asked
    owner = 0  # the pseudo-terminal pexpect made is root's
    assert {
        e["data"].get("by_uid")
        for e in of_type(events, "policy.approval")
        if e["data"]["state"] != "requested"
    } == {owner}
