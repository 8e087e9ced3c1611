"""A recovered bundle says what was in force and what was degraded, as the run's own would have.

Before, `<session>.run.json` held a hand-picked subset of the run: a bundle that `evidence recover`
wrote after a `kill -9` of `evidence run` (or of the agent) had no policy, no roots, none of the
run's degradations (`--allow-setuid`, what the policy could not enforce), no capabilities, and pid 0.
Now the record is the run's description, whole (agent/recorder/description.py), written before the
command can run and rewritten when it changes; recovery reads it back whole.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from evidence.agent.commands.run import RUN_SPOOL_DIR
from tests.kernel.test_daemon import Agent
from tests.kernel.util import evidence, of_type, read_bundle

AS_NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--")


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory the job (nobody) can write: it says it started there."""
    d = Path(tempfile.mkdtemp(prefix="evidence-recwhole-", dir="/tmp"))
    d.chmod(0o777)
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


def _wait_for(path: Path, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)


def _live_record(session: str) -> dict[str, Any]:
    return json.loads((RUN_SPOOL_DIR / f"{session}.run.json").read_text())


def _kill_and_recover(
    tmp_path: Path, shared: Path, *extra: str, before: str = ""
) -> tuple[dict[str, Any], dict[str, Any], list[Any], Path]:
    """`evidence run` of a job (as nobody) that says it started and sleeps, killed with SIGKILL
    while the job runs, then `evidence recover`: (the live run record, the recovered manifest and
    events)."""
    started = shared / "started"
    proc = subprocess.Popen(
        [sys.executable, "-m", "evidence", "run", "--bundle", str(tmp_path / "run.tar.gz"), *extra, "--",
         *AS_NOBODY, "sh", "-c", f"{before}touch {started}; sleep 30"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )  # fmt: skip
    _wait_for(started, proc)
    records = sorted(RUN_SPOOL_DIR.glob("*.run.json"), key=lambda p: p.stat().st_mtime)
    live = [json.loads(p.read_text()) for p in records]
    mine = [r for r in live if r.get("bundle_path") == str(tmp_path / "run.tar.gz")]
    assert len(mine) == 1, live
    record = mine[0]
    time.sleep(2.5)  # the spool is flushed at least once a second
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    out = tmp_path / "recovered"
    rec = evidence("recover", "--bundle-dir", str(out))
    assert rec.returncode == 0, rec.stderr
    written = {read_bundle(p)[0]["session_id"]: Path(p) for p in rec.stdout.split()}
    assert record["session_id"] in written, (
        f"not recovered here (another `evidence recover` on this machine first?): {rec.stdout} {rec.stderr}"
    )
    manifest, events = read_bundle(written[record["session_id"]])
    return record, manifest, events, written[record["session_id"]]


def _pid(events: list[Any]) -> int:
    """The run's pid, as its run.started event says (the manifest has none)."""
    return int(of_type(events, "run.started")[0]["data"]["pid"])


def _reasons(events: list[Any]) -> list[str]:
    return [e["data"]["reason"] for e in of_type(events, "degradation")]


def test_a_killed_run_with_a_policy_and_a_private_network_is_recovered_whole(
    tmp_path: Path, shared: Path
) -> None:
    tmp_path.chmod(0o755)
    record, manifest, events, _ = _kill_and_recover(
        tmp_path, shared, "--policy", "default", "--workspace", str(shared), "--net", "none"
    )
    assert record["pid"] > 0 and record["policy"] and record["roots"]
    assert manifest["cut_short"] is True and manifest["exit_code"] is None
    assert manifest["policy"] == record["policy"] and manifest["policy"]["workspace"] == str(shared)
    assert manifest["network"] == "none"
    assert _pid(events) == record["pid"]
    assert manifest["capabilities"] == record["capabilities"]
    assert manifest["capabilities"]["enforcement"] != "none (observe only)"
    assert manifest["capabilities"]["32bit_syscalls"].startswith("refused")
    # the run's own degradations, then recovery's
    assert _reasons(events)[: len(record["degradations"])] == [d["reason"] for d in record["degradations"]]
    assert "stopped without finishing" in _reasons(events)[-1]
    # the job's first exec is the command's process: the record named it before the command ran
    execs = of_type(events, "process.exec")
    assert execs and execs[0]["data"]["pid"] == record["pid"]


def test_a_killed_runs_command_rule_refusals_are_recovered(tmp_path: Path, shared: Path) -> None:
    """The records made outside the ring buffer (here the exec supervisor's refusal) are journaled
    as they are made, not held until the run ends: a kill -9 of `evidence run` loses none."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "version: 1\ncommands:\n  default: allow\n  rules:\n    - {name: no-id, program: [id], decision: deny}\n"
    )
    _, manifest, events, _ = _kill_and_recover(
        tmp_path, shared, "--policy", str(policy), "--quiet-denials", before="id; "
    )
    assert manifest["cut_short"] is True
    refused = [e["data"] for e in of_type(events, "policy.denial") if e["data"]["operation"] == "exec"]
    assert [(d["target"], d["rule"]) for d in refused] == [("/usr/bin/id", "commands.rules[0] (no-id)")]


def test_a_killed_runs_limit_events_are_recovered(tmp_path: Path, shared: Path) -> None:
    """A limit event (forks refused at limits.pids) is journaled when the recorder's poll sees it,
    before the run's end would name its victims: a kill -9 of `evidence run` loses it not."""
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\nlimits:\n  pids: 8\n")
    bomb = shared / "bomb.py"
    bomb.write_text(
        "import os, time\nfor _ in range(32):\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        continue\n    if pid == 0:\n        time.sleep(2)\n        os._exit(0)\n"
    )
    bomb.chmod(0o644)
    _, manifest, events, _ = _kill_and_recover(
        tmp_path, shared, "--policy", str(policy), before=f"python3 {bomb}; "
    )
    assert manifest["cut_short"] is True
    forks = [e["data"] for e in of_type(events, "policy.limit") if e["data"]["kind"] == "fork_refused"]
    assert forks and sum(f["count"] for f in forks) > 0, forks


def test_a_killed_run_with_allow_setuid_keeps_its_degradation(tmp_path: Path, shared: Path) -> None:
    tmp_path.chmod(0o755)
    record, manifest, events, bundle = _kill_and_recover(tmp_path, shared, "--allow-setuid")
    assert manifest["capabilities"]["isolation"] == "none (--allow-setuid)"
    reasons = _reasons(events)
    assert any(r.startswith("--allow-setuid") for r in reasons), reasons
    assert _pid(events) == record["pid"] > 0
    lint = evidence("lint", str(bundle), "--fail-on", "warn")
    assert lint.returncode == 1 and "EV002" in lint.stdout and "EV007" in lint.stdout, lint.stdout


def test_a_killed_agents_isolated_run_with_a_policy_is_recovered_whole(tmp_path: Path) -> None:
    """Through the agent: `run --agent --policy default --net none`, then kill -9 of the agent; the
    agent that starts next recovers the run with its policy, network, degradations and pid."""
    tmp_path.chmod(0o755)
    agent = Agent(tmp_path)
    work = tmp_path / "ws"
    work.mkdir()
    started = work / "started"
    client = subprocess.Popen(
        [sys.executable, "-m", "evidence", "run", "--agent", str(agent.socket), "--policy", "default",
         "--workspace", str(work), "--net", "none", "--", "sh", "-c", f"touch {started}; sleep 30"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=work,
    )  # fmt: skip
    try:
        _wait_for(started, client)
        spool = tmp_path / "spool"
        (meta,) = spool.glob("*.run.json")
        record = json.loads(meta.read_text())
        time.sleep(3)  # the agent flushes spools every 2 s
        agent.stop(signal.SIGKILL)
    finally:
        client.kill()
        client.communicate(timeout=30)
    again = Agent(tmp_path)
    try:
        manifest, events = read_bundle(again.bundles / f"{record['session_id']}.tar.gz")
    finally:
        assert again.stop() == 0, again.output()
    assert record["pid"] > 0 and record["policy"] and record["network"] == "none"
    assert manifest["cut_short"] is True and _pid(events) == record["pid"]
    assert manifest["policy"] == record["policy"] and manifest["network"] == "none"
    assert manifest["capabilities"] == record["capabilities"]
    reasons = _reasons(events)
    assert reasons[: len(record["degradations"])] == [d["reason"] for d in record["degradations"]]
    assert "stopped without finishing" in reasons[-1]


def _state(pid: int) -> str:
    """The one-letter state of process `pid` (/proc/<pid>/stat): T stopped, Z exited, not reaped."""
    return _state_of(f"/proc/{pid}/stat")


def _state_of(stat: str) -> str:
    try:
        return Path(stat).read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def _all_stopped(pid: int) -> bool:
    """Every thread of process `pid` is stopped (state T)."""
    threads = [t.name for t in Path(f"/proc/{pid}/task").iterdir()]
    return all(_state_of(f"/proc/{pid}/task/{tid}/stat") == "T" for tid in threads)


def _until(what: str, check: Any, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while not check():
        assert proc.poll() is None and time.monotonic() < deadline, (what, proc.communicate())
        time.sleep(0.02)


def _job_that_stops(tmp_path: Path, shared: Path, bundle: Path, *, kill: bool) -> str:
    """`evidence run` of a job (as nobody) that says it started and stops itself (SIGSTOP of its
    own, nothing recorded after it), continued by the test once its records are spooled: it exits 0.
    `kill`: `evidence run` is stopped before the job is continued and killed (SIGKILL) once the job
    has exited, so that the run's end is never processed. The run's session id."""
    started = shared / "started"
    started.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "evidence", "run", "--bundle", str(bundle), "--",
         *AS_NOBODY, "sh", "-c", f"touch {started}; kill -STOP $$; exit 0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )  # fmt: skip
    try:
        _wait_for(started, proc)
        (record,) = [
            r
            for r in (json.loads(p.read_text()) for p in RUN_SPOOL_DIR.glob("*.run.json"))
            if r.get("bundle_path") == str(bundle)
        ]
        job = int(record["pid"])
        _until("the job stops itself", lambda: _state(job) == "T", proc)
        time.sleep(2.5)  # the spool is flushed at least once a second: all the job did is in it
        if kill:
            os.kill(proc.pid, signal.SIGSTOP)  # its end must not be seen: the job's exit is not read
            # SIGSTOP is only queued by kill(2): a thread of `evidence run` already woken in waitid
            # would still reap the job if it exited before that thread stopped
            _until("`evidence run` stops", lambda: _all_stopped(proc.pid), proc)
        os.kill(job, signal.SIGCONT)
        if kill:
            _until("the job exits (a zombie: its parent is stopped)", lambda: _state(job) == "Z", proc)
            os.kill(proc.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == (-signal.SIGKILL if kill else 0), err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    return str(record["session_id"])


def test_a_run_killed_after_its_command_exited_is_recovered_with_its_run_id(
    tmp_path: Path, shared: Path
) -> None:
    """kill -9 of `evidence run` after its command exited normally, before the run's end was
    processed: `evidence recover`'s bundle has the run id that the same job recorded without the
    kill has (the run record's roots, command and claim are the run's own), and is cut short."""
    tmp_path.chmod(0o755)
    whole = tmp_path / "whole.tar.gz"
    _job_that_stops(tmp_path, shared, whole, kill=False)
    expected, _ = read_bundle(whole)
    assert expected["exit_code"] == 0 and not expected["cut_short"]
    session = _job_that_stops(tmp_path, shared, tmp_path / "killed.tar.gz", kill=True)
    assert not (tmp_path / "killed.tar.gz").exists()
    rec = evidence("recover", "--bundle-dir", str(tmp_path / "recovered"))
    assert rec.returncode == 0, rec.stderr
    written = {read_bundle(p)[0]["session_id"]: Path(p) for p in rec.stdout.split()}
    assert session in written, f"not recovered here (another `evidence recover` first?): {rec.stdout}"
    manifest, events = read_bundle(written[session])
    assert manifest["cut_short"] is True and manifest["exit_code"] is None
    assert manifest["command"] == expected["command"]
    assert manifest["run_id"] == expected["run_id"]
    assert "stopped without finishing" in _reasons(events)[-1]
