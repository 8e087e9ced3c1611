"""One owner for a run's life (agent/recorder/run.py): what a `RunPlan` says reaches the session and
its run record, the record is rewritten whole when the run changes, and it goes once the bundle is
written (it stays, with the spool, when the bundle could not be). No kernel: a fake recorder hands
out real sessions."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from evidence.agent.recorder.correlate import Correlator
from evidence.agent.recorder.description import RunDescription
from evidence.agent.recorder.launch import COMPAT_ALLOWED
from evidence.agent.recorder.recovery import RUN_META_SUFFIX
from evidence.agent.recorder.run import Run, RunPlan
from evidence.agent.recorder.session import Session
from evidence.bundle.format import Degradation
from evidence.bundle.spool import SpoolWriter
from evidence.policy.model import parse_policy

SAID = Degradation(component="isolation", reason="a reason", impact="an impact")


class FakeRecorder:
    """Recorder.start and finish as Run calls them, with the recorder's own capabilities."""

    def __init__(self, spool_dir: Path, fail: bool = False) -> None:
        self.spool_dir = spool_dir
        self.fail = fail
        self.finished: list[tuple[Session, Path, dict[str, Any]]] = []

    def start(self, cgroup: Path, command: list[str], cwd: str, **kw: Any) -> Session:
        session = Session(
            slot=1,
            session_id=kw["session_id"],
            cgroup_path=cgroup,
            cgroup_id=1,
            command=command,
            cwd=cwd,
            detail=kw["detail"],
            labels=dict(kw["labels"]),
            spool=SpoolWriter(self.spool_dir / f"{kw['session_id']}.spool.zst"),
            correlator=Correlator(0),
            started_ns=1,
            attached_late=kw["attached_late"],
            roots=dict(kw["roots"]),
            network=kw["network"],
            capabilities={"recorder": "tracepoints+ringbuf", **kw["capabilities"]},
        )
        session.degrade(*kw["degradations"])
        return session

    @staticmethod
    def configure_resolvers(session: Session, pid: int) -> None:
        session.resolvers = ["127.0.0.53"]

    def finish(self, session: Session, bundle_path: Path, **kw: Any) -> dict[str, Any]:
        if self.fail:
            raise OSError(28, "No space left on device")
        self.finished.append((session, bundle_path, kw))
        return {"run_id": "run-x"}


class FakeEnforcement:
    """Enforcement as Run uses it: attached to the session, denials polled, closed."""

    def __init__(self) -> None:
        self.guard = object()
        self.closed = False
        self.polls = 0
        self.policy = parse_policy("version: 1\n", name="p.yaml", variables={})  # no limits: nothing to apply

    def enforce_on(self, session: Session, watch: Any = None, tell: Any = None) -> None:
        session.enforce({"mode": "enforce"}, [SAID], lambda recs: [])

    def poll_denials(self, exe_of: Callable[[int], str | None], timeout_ms: int = 0) -> list[Any]:
        self.polls += 1
        return [{"k": "denial", "t": 5, "pid": 9}]

    def close(self) -> None:
        self.closed = True


def _record(spool: Path, sid: str) -> RunDescription:
    return RunDescription.from_json((spool / f"{sid}{RUN_META_SUFFIX}").read_bytes(), sid)


def _run(
    tmp_path: Path, enforcement: Any = None, fail: bool = False, **plan: Any
) -> tuple[Run, FakeRecorder]:
    recorder = FakeRecorder(tmp_path, fail)
    base: dict[str, Any] = {"command": ["make", "test"], "cwd": "/w", "session_id": "s1"}
    run = Run(
        recorder,  # type: ignore[arg-type]
        RunPlan(**{**base, **plan}),
        record_dir=tmp_path,
        enforcement=enforcement,
        where={"bundle_name": "b.tar.gz"},
    )
    return run, recorder


def test_what_the_plan_says_is_in_the_run_record_from_the_start(tmp_path: Path) -> None:
    run, _ = _run(
        tmp_path,
        labels={"job": "1"},
        detail="full",
        network="none",
        roots={"${WORKSPACE}": "/w"},
        capabilities={"32bit_syscalls": "allowed, not recorded (--allow-32bit)"},
        degradations=(COMPAT_ALLOWED,),
    )
    run.start(tmp_path / "cg")
    record = _record(tmp_path, "s1")
    assert record.command == ["make", "test"] and record.cwd == "/w" and record.detail == "full"
    assert (
        record.labels == {"job": "1"} and record.network == "none" and record.roots == {"${WORKSPACE}": "/w"}
    )
    assert record.capabilities == {
        "recorder": "tracepoints+ringbuf",
        "32bit_syscalls": "allowed, not recorded (--allow-32bit)",
    }
    assert record.degradations == [COMPAT_ALLOWED] and record.bundle_name == "b.tar.gz"
    assert record.pid == 0 and not record.claimed


def test_the_command_s_process_and_its_policy_are_recorded_before_it_runs(tmp_path: Path) -> None:
    enforcement = FakeEnforcement()
    run, _ = _run(tmp_path, enforcement, degradations=(COMPAT_ALLOWED,))
    run.start(tmp_path / "cg")
    run.launched(4242)
    record = _record(tmp_path, "s1")
    assert record.pid == 4242 and record.claimed and record.resolvers == ["127.0.0.53"]
    # the run's own degradations, then its policy's
    assert record.policy == {"mode": "enforce"} and record.degradations == [COMPAT_ALLOWED, SAID]


def test_an_adopted_process_is_no_claim(tmp_path: Path) -> None:
    run, _ = _run(tmp_path)
    run.start(tmp_path / "cg")
    run.adopt(77)
    record = _record(tmp_path, "s1")
    assert record.pid == 77 and not record.claimed


def test_a_change_rewrites_the_record_whole(tmp_path: Path) -> None:
    run, _ = _run(tmp_path, labels={"a": "1"})
    run.start(tmp_path / "cg")
    run.degrade(SAID)
    run.update_labels({"b": "2"}, bundle_name="other.tar.gz")
    record = _record(tmp_path, "s1")
    assert record.degradations == [SAID] and record.labels == {"a": "1", "b": "2"}
    assert record.bundle_name == "other.tar.gz"


def test_finish_takes_the_last_denials_and_removes_the_record(tmp_path: Path) -> None:
    enforcement = FakeEnforcement()
    run, recorder = _run(tmp_path, enforcement)
    run.start(tmp_path / "cg")
    manifest = run.finish(tmp_path / "b.tar.gz", exit_code=0)
    assert manifest == {"run_id": "run-x"}
    ((session, path, kw),) = recorder.finished
    assert path == tmp_path / "b.tar.gz" and kw["exit_code"] == 0 and not kw["cut_short"]
    assert session.extra_records == [{"k": "denial", "t": 5, "pid": 9}] and enforcement.closed
    assert not (tmp_path / f"s1{RUN_META_SUFFIX}").exists()


def test_a_bundle_that_cannot_be_written_leaves_the_record_for_recovery(tmp_path: Path) -> None:
    run, _ = _run(tmp_path, fail=True)
    run.start(tmp_path / "cg")
    with pytest.raises(OSError):
        run.finish(tmp_path / "b.tar.gz", exit_code=3)
    run.save(exit_code=3, signal=None, finished_ns=9)
    record = _record(tmp_path, "s1")
    assert record.ended and record.exit_code == 3


def test_a_run_not_started_has_no_session(tmp_path: Path) -> None:
    run, _ = _run(tmp_path)
    assert run.save() is None
    with pytest.raises(RuntimeError):
        _ = run.session
