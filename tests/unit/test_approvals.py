"""The approvals broker (agent/recorder/approvals.py) on its own: who may see and answer a request,
what a timeout and a withdrawal record, that a request is resolved once however many answer it, and
that every record becomes a dev.evidence.policy.approval event the bundle format accepts."""

from __future__ import annotations

import itertools
import os
import threading
from typing import Any

import pytest

from evidence.agent.recorder.approvals import (
    AlreadyAnswered,
    ApprovalBroker,
    Asked,
    UnknownRequest,
)
from evidence.bundle import format as fmt
from evidence.bundle import records
from evidence.policy.commands import CommandDecision
from evidence.policy.governance import ApprovalsPolicy

OWNER = 1000


def _broker(recs: list[Any], *, step: float = 0.0) -> ApprovalBroker:
    ticks = itertools.count()
    mono = itertools.count(step=step) if step else None
    return ApprovalBroker(
        record=recs.append,
        clock_ns=lambda: 1_700_000_000_000_000_000 + next(ticks),
        monotonic=(lambda: float(next(mono))) if mono else (lambda: 0.0),  # type: ignore[arg-type]
        poll_s=0.001,
    )


def _asked(pending: bool = True) -> Asked:
    decision = CommandDecision("approve", 2, "push", "force-push needs a human")
    return Asked(1234, "/usr/bin/git", ("git", "push", "--force"), False, 1, decision, lambda: pending)


def _policy(timeout: str = "60s", on_timeout: str = "deny") -> ApprovalsPolicy:
    return ApprovalsPolicy.model_validate({"timeout": timeout, "on_timeout": on_timeout})


def test_an_owner_answers_and_both_records_say_who_when_and_why() -> None:
    recs: list[Any] = []
    broker = _broker(recs)
    got: list[bool] = []
    seen = threading.Event()
    broker.subscribe(lambda _r: seen.set())
    approve = broker.approver("run-1", OWNER, _policy())
    t = threading.Thread(target=lambda: got.append(approve(_asked())))
    t.start()
    assert seen.wait(10)
    (req,) = broker.pending(OWNER)
    assert (req.program, req.argv, req.depth, req.rule) == (
        "/usr/bin/git",
        ("git", "push", "--force"),
        1,
        "commands.rules[2] (push)",
    )
    broker.answer(req.id, True, uid=OWNER, via="terminal", reason="reviewed the branch")
    t.join(10)
    assert got == [True]
    requested, allowed = recs
    assert requested["state"] == "requested" and "via" not in requested
    assert allowed["state"] == "allowed" and allowed["via"] == "terminal" and allowed["by_uid"] == OWNER
    assert allowed["reason"] == "reviewed the branch" and allowed["t"] > requested["t"]
    assert allowed["requested_at"] == requested["requested_at"] == fmt.format_time(requested["t"])
    for rec in recs:  # each becomes an event the format accepts
        etype, subject, _, data = records.to_event(rec)
        assert etype == fmt.POLICY_APPROVAL and subject == "/usr/bin/git"
        fmt.PolicyApproval.model_validate(data)
    assert broker.pending(OWNER) == []


def test_only_root_and_the_runs_owner_see_and_answer_and_an_answer_is_final() -> None:
    recs: list[Any] = []
    broker = _broker(recs)
    mine = broker.open(_asked(), run="run-1", owner_uid=OWNER, policy=_policy())
    theirs = broker.open(_asked(), run="run-2", owner_uid=2000, policy=_policy())
    assert [r.id for r in broker.pending(OWNER)] == [mine.id]
    assert [r.id for r in broker.pending(2000)] == [theirs.id]
    assert {r.id for r in broker.pending(0)} == {mine.id, theirs.id}
    assert broker.pending(3000) == []
    with pytest.raises(UnknownRequest):  # another user's request is not disclosed
        broker.answer(theirs.id, True, uid=OWNER, via="api", reason=None)
    with pytest.raises(UnknownRequest):
        broker.answer("nope", True, uid=0, via="api", reason=None)
    broker.answer(theirs.id, False, uid=0, via="api", reason="root says no")
    with pytest.raises(AlreadyAnswered):
        broker.answer(theirs.id, True, uid=2000, via="api", reason=None)
    assert broker.wait(theirs.id).allowed is False  # the waiting exec gets the first answer
    assert [r["state"] for r in recs] == ["requested", "requested", "denied"]
    assert recs[-1]["by_uid"] == 0 and recs[-1]["via"] == "api"


@pytest.mark.parametrize(("on_timeout", "allowed"), [("deny", False), ("allow", True)])
def test_a_timeout_decides_by_on_timeout_and_is_recorded_as_such(on_timeout: str, allowed: bool) -> None:
    recs: list[Any] = []
    broker = _broker(recs, step=1.0)  # each look at the clock: a second later
    req = broker.open(_asked(), run="r", owner_uid=OWNER, policy=_policy("5s", on_timeout))
    answer = broker.wait(req.id)
    assert (answer.allowed, answer.via, answer.by_uid) == (allowed, "timeout", None)
    assert recs[-1]["via"] == "timeout" and recs[-1]["reason"] == "no answer in 5s"
    assert recs[-1]["state"] == ("allowed" if allowed else "denied")
    with pytest.raises(AlreadyAnswered):  # a late answer is refused, not taken
        broker.answer(req.id, True, uid=OWNER, via="terminal", reason=None)


def test_an_exec_that_no_longer_waits_is_withdrawn_and_a_run_that_ends_withdraws_its_own() -> None:
    recs: list[Any] = []
    broker = _broker(recs)
    gone = broker.open(_asked(pending=False), run="r", owner_uid=OWNER, policy=_policy())
    answer = broker.wait(gone.id, lambda: False)
    assert (answer.allowed, answer.via) == (False, "withdrawn")
    a = broker.open(_asked(), run="r", owner_uid=OWNER, policy=_policy())
    b = broker.open(_asked(), run="other", owner_uid=OWNER, policy=_policy())
    assert broker.close_run("r") == 1
    assert recs[-1]["id"] == a.id and recs[-1]["via"] == "withdrawn"
    with pytest.raises(UnknownRequest):  # the ended run's requests are forgotten
        broker.wait(a.id)
    assert [r.id for r in broker.pending(OWNER)] == [b.id]


def test_many_answers_at_once_resolve_a_request_once() -> None:
    recs: list[Any] = []
    broker = _broker(recs)
    req = broker.open(_asked(), run="r", owner_uid=OWNER, policy=_policy())
    outcomes: list[str] = []
    lock = threading.Lock()

    def answer(i: int) -> None:
        try:
            broker.answer(req.id, i % 2 == 0, uid=OWNER, via="api", reason=str(i))
            result = "ok"
        except AlreadyAnswered:
            result = "late"
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=answer, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(outcomes) == ["late"] * 31 + ["ok"]
    resolutions = [r for r in recs if r["state"] != "requested"]
    assert len(resolutions) == 1 and broker.wait(req.id).reason == resolutions[0]["reason"]


def test_a_failing_subscriber_leaves_the_request_open_for_the_others() -> None:
    broker = _broker([])
    seen: list[str] = []

    def bad(_r: Any) -> None:
        raise RuntimeError("boom")

    broker.subscribe(bad)
    broker.subscribe(lambda r: seen.append(r.id))
    req = broker.open(_asked(), run="r", owner_uid=OWNER, policy=_policy())
    assert seen == [req.id] and broker.get(req.id) == req


def test_the_terminal_answers_for_its_run_whoever_owns_it() -> None:
    recs: list[Any] = []
    broker = _broker(recs)
    req = broker.open(_asked(), run="r", owner_uid=0, policy=_policy())  # a run started through sudo
    broker.answer(req.id, True, uid=OWNER, via="terminal", reason=None)  # the terminal's owner typed it
    assert recs[-1]["by_uid"] == OWNER and recs[-1]["via"] == "terminal"


def test_the_prompt_shows_every_string_escaped_and_an_answer_is_read_strictly() -> None:
    from evidence.agent.recorder.tty_approver import describe, parse_answer

    asked = Asked(
        9,
        "/usr/bin/\x1b[2Jcurl",
        ("curl", "http://x/\x1b]0;title\x07", "a b", "x" * 500),
        True,
        2,
        CommandDecision("approve", 0, "net\u202e", "line\nbreak"),
    )
    prompt = describe(_broker([]).open(asked, run="r", owner_uid=0, policy=_policy("30s")))
    assert "\x1b" not in prompt and "\x07" not in prompt and "\u202e" not in prompt
    assert prompt.count("\n") == 4  # the lines of the prompt itself, none from the job's strings
    assert "'a b'" in prompt and "..." in prompt and "[more arguments not shown]" in prompt
    assert "no answer in 30s: deny" in prompt
    assert parse_answer("y") == (True, None)
    assert parse_answer("YES  looked at the diff ") == (True, "looked at the diff")
    assert parse_answer("n") == (False, None) and parse_answer("") == (False, None)
    assert parse_answer("yep") == (False, None)  # only y or yes allows
    assert parse_answer("nope, risky") == (False, "risky")


def _read_until(fd: int, marker: bytes) -> bytes:
    got = b""
    while marker not in got:
        chunk = os.read(fd, 4096)
        assert chunk, got
        got += chunk
    return got


def test_the_terminal_prompt_on_a_pseudo_terminal_answers_and_gives_up_when_resolved_elsewhere() -> None:
    from evidence.agent.recorder.tty_approver import TtyApprover

    master, slave = os.openpty()
    if os.getuid() == 0:
        os.fchown(slave, OWNER, -1)  # as login gives a user their terminal
    recs: list[Any] = []
    broker = ApprovalBroker(record=recs.append, poll_s=0.01)
    tty = TtyApprover(broker, slave, poll_s=0.01)
    tty.start()
    got: list[bool] = []
    approve = broker.approver("r", 0, _policy())
    t = threading.Thread(target=lambda: got.append(approve(_asked())))
    t.start()
    assert b"exec of /usr/bin/git" in _read_until(master, b"allow? [y/N")
    os.write(master, b"yes read the diff\n")
    t.join(10)
    assert got == [True] and recs[-1]["reason"] == "read the diff"
    assert recs[-1]["by_uid"] == os.fstat(slave).st_uid  # the terminal's owner
    # shown, then answered through the API: the prompt gives up and says so
    t = threading.Thread(target=lambda: got.append(approve(_asked())))
    t.start()
    _read_until(master, b"allow? [y/N")
    (req,) = broker.pending(0)
    broker.answer(req.id, False, uid=0, via="api", reason="no")
    t.join(10)
    assert got == [True, False]
    assert b"answered elsewhere" in _read_until(master, b"timed out")
    tty.stop()
    os.close(master)
