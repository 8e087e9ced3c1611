"""Approvals with real supervised execs of a job run as nobody (agent/recorder/approvals.py with
exec_supervisor.py): an exec held until a person answers, while the job's other execs go on; a
denial and a timeout fail the exec with EACCES; a supervisor stopped, or killed, while an exec waits
fails that exec (ENOSYS from a listener that is gone) and the request is withdrawn."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from evidence.agent.recorder.approvals import ApprovalBroker, ApprovalRequest
from evidence.agent.recorder.exec_supervisor import ExecDecision, ExecSupervisor, receive_listener
from evidence.policy.governance import ApprovalsPolicy, CommandsPolicy
from tests.kernel.test_exec_supervisor import NOBODY
from tests.kernel.util import EXEC_LAUNCHER, as_user

OWNER = 1000


def _commands() -> CommandsPolicy:
    rules = [
        {"name": "ask-id", "program": ["/usr/bin/id"], "decision": "approve", "message": "who wants to know"}
    ]
    return CommandsPolicy.model_validate({"default": "allow", "rules": rules}, context={"variables": {}})


def _launch(script: str, cwd: Path) -> tuple[subprocess.Popen[str], socket.socket]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen(
        as_user(NOBODY, sys.executable, "-c", EXEC_LAUNCHER, str(theirs.fileno()), "/bin/sh", "-c", script),
        pass_fds=[theirs.fileno()],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
    )
    theirs.close()
    ours.settimeout(30)
    return proc, ours


def test_a_held_exec_runs_when_allowed_fails_when_denied_or_timed_out_and_others_go_on(place: Path) -> None:
    recs: list[Any] = []
    broker = ApprovalBroker(record=recs.append)
    opened: queue.Queue[ApprovalRequest] = queue.Queue()
    broker.subscribe(opened.put)
    decisions: list[ExecDecision] = []
    told: list[str] = []
    script = (
        "/usr/bin/id -u & /bin/echo meanwhile; wait $!; echo first=$?; "  # held while echo runs
        "/usr/bin/id -g; echo second=$?; "
        "/usr/bin/id -G; echo third=$?"
    )
    proc, sock = _launch(script, place)
    try:
        sup = ExecSupervisor(
            receive_listener(sock),
            _commands(),
            proc.pid,
            approver=broker.approver("run-1", OWNER, ApprovalsPolicy.model_validate({"timeout": "2s"})),
            on_decision=decisions.append,
            tell=told.append,
        )
        sup.start()
        first = opened.get(timeout=30)
        assert first.argv == ("/usr/bin/id", "-u") and first.depth == 1  # called by a fork of the shell
        # the job's other execs are answered while this one waits
        for _ in range(3000):
            if any(d.request and d.request.argv == ("/bin/echo", "meanwhile") for d in decisions):
                break
            threading.Event().wait(0.01)
        else:
            raise AssertionError("echo was held while id waited for approval")
        assert broker.pending(2000) == []  # another user does not see it
        broker.answer(first.id, True, uid=OWNER, via="api", reason="fine")
        second = opened.get(timeout=30)
        broker.answer(second.id, False, uid=0, via="terminal", reason="not now")
        opened.get(timeout=30)  # the third: nobody answers, the 2s timeout denies it
        out, err = proc.communicate(timeout=60)
        sup.stop()
    finally:
        sock.close()
        if proc.poll() is None:
            proc.kill()
    lines = out.splitlines()
    assert "meanwhile" in lines and "first=0" in lines and str(NOBODY) in lines, (out, err)
    assert "second=126" in lines and "third=126" in lines, (out, err)
    assert "Permission denied" in err
    states = [(r["argv"], r["state"], r.get("via"), r.get("by_uid")) for r in recs]
    assert states == [
        (["/usr/bin/id", "-u"], "requested", None, None),
        (["/usr/bin/id", "-u"], "allowed", "api", OWNER),
        (["/usr/bin/id", "-g"], "requested", None, None),
        (["/usr/bin/id", "-g"], "denied", "terminal", 0),
        (["/usr/bin/id", "-G"], "requested", None, None),
        (["/usr/bin/id", "-G"], "denied", "timeout", None),
    ]
    assert all(
        r["rule"] == "commands.rules[0] (ask-id)" and r["message"] == "who wants to know" for r in recs
    )
    waiting = (
        "evidence: exec of /usr/bin/id waits for approval by commands.rules[0] (ask-id): who wants to know"
    )
    assert told.count(waiting) == 3
    assert (
        told.count("evidence: exec of /usr/bin/id refused by commands.rules[0] (ask-id): not approved") == 2
    )


def test_a_supervisor_stopped_while_an_exec_waits_fails_it_and_withdraws_the_request(place: Path) -> None:
    recs: list[Any] = []
    broker = ApprovalBroker(record=recs.append, poll_s=0.05)
    opened: queue.Queue[ApprovalRequest] = queue.Queue()
    broker.subscribe(opened.put)
    proc, sock = _launch("/usr/bin/id; echo rc=$?; /bin/true; echo after=$?", place)
    try:
        sup = ExecSupervisor(
            receive_listener(sock),
            _commands(),
            proc.pid,
            approver=broker.approver("run-1", OWNER, ApprovalsPolicy.model_validate({"timeout": "10m"})),
        )
        sup.start()
        req = opened.get(timeout=30)
        sup.stop()
        out, err = proc.communicate(timeout=60)
        broker.wait(req.id)  # the waiting thread sees the exec gone
    finally:
        sock.close()
        if proc.poll() is None:
            proc.kill()
    assert "rc=126" in out.splitlines() and "after=126" in out.splitlines(), (out, err)
    assert "Function not implemented" in err  # ENOSYS: the listener is gone
    assert [(r["state"], r.get("via")) for r in recs] == [("requested", None), ("denied", "withdrawn")]


SUPERVISOR = """\
import socket, sys
from evidence.agent.recorder.approvals import ApprovalBroker
from evidence.agent.recorder.exec_supervisor import ExecSupervisor, receive_listener
from evidence.policy.governance import ApprovalsPolicy, CommandsPolicy
rules = [{"name": "ask-id", "program": ["/usr/bin/id"], "decision": "approve"}]
commands = CommandsPolicy.model_validate({"rules": rules}, context={"variables": {}})
broker = ApprovalBroker(record=lambda r: None)
broker.subscribe(lambda r: print("open", r.program, flush=True))
sock = socket.socket(fileno=int(sys.argv[1]))
sup = ExecSupervisor(receive_listener(sock), commands, int(sys.argv[2]),
                     approver=broker.approver("r", 0, ApprovalsPolicy.model_validate({"timeout": "10m"})))
sup.serve()
"""


def test_a_supervisor_killed_while_an_exec_waits_fails_that_exec(place: Path) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    job = subprocess.Popen(
        as_user(
            NOBODY,
            sys.executable,
            "-c",
            EXEC_LAUNCHER,
            str(theirs.fileno()),
            "/bin/sh",
            "-c",
            "/usr/bin/id; echo rc=$?; /bin/true; echo after=$?",
        ),
        pass_fds=[theirs.fileno()],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=place,
    )
    theirs.close()
    sup = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, str(ours.fileno()), str(job.pid)],
        pass_fds=[ours.fileno()],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
    )
    ours.close()
    try:
        assert sup.stdout is not None
        assert sup.stdout.readline() == "open /usr/bin/id\n"
        sup.send_signal(signal.SIGKILL)
        sup.wait(30)
        out, err = job.communicate(timeout=60)
    finally:
        for p in (job, sup):
            if p.poll() is None:
                p.kill()
    assert out.splitlines() == ["rc=126", "after=126"], (out, err)
    assert "Function not implemented" in err and "uid=" not in out


def test_execs_waiting_at_once_are_capped(place: Path) -> None:
    """A job that asks without end holds no more than max_waiting of the recorder's threads: the
    exec past the cap is refused at once."""
    recs: list[Any] = []
    broker = ApprovalBroker(record=recs.append)
    opened: queue.Queue[ApprovalRequest] = queue.Queue()
    broker.subscribe(opened.put)
    decisions: list[ExecDecision] = []
    proc, sock = _launch("/usr/bin/id -u & /usr/bin/id -g & wait", place)
    try:
        sup = ExecSupervisor(
            receive_listener(sock),
            _commands(),
            proc.pid,
            approver=broker.approver("run-1", OWNER, ApprovalsPolicy.model_validate({"timeout": "10m"})),
            on_decision=decisions.append,
            max_waiting=1,
        )
        sup.start()
        first = opened.get(timeout=30)
        for _ in range(3000):  # the other is refused while the first waits
            if any(d.error == "too many execs wait for approval" for d in decisions):
                break
            threading.Event().wait(0.01)
        else:
            raise AssertionError(decisions)
        broker.answer(first.id, True, uid=OWNER, via="api", reason=None)
        out, err = proc.communicate(timeout=60)
        sup.stop()
    finally:
        sock.close()
        if proc.poll() is None:
            proc.kill()
    assert len(out.split()) == 1 and out.split()[0].isdigit(), (out, err)  # one id ran, one refused
    assert [r["state"] for r in recs] == ["requested", "allowed"]
