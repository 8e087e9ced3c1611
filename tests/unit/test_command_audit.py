"""Audit records (agent/recorder/command_rules.py, exec_supervisor.audit_record): an exec an `audit`
rule matched becomes a policy.audit record with the rule's index and name, the program, argv and
depth; a run keeps the first `audit_max` and counts the rest into the session's past_cap (the
manifest's lost); what crosses from the supervisor's process to the recorder (exec_process.py) is
only what makes a record, and comes back whole, undecodable bytes and all."""

from __future__ import annotations

from typing import Any

from evidence.agent.recorder.approvals import ApprovalBroker
from evidence.agent.recorder.command_rules import AUDIT_PAST_CAP, CommandRules
from evidence.agent.recorder.exec_process import result_json, result_of
from evidence.agent.recorder.exec_resolve import ExecRequest
from evidence.agent.recorder.exec_supervisor import ExecDecision, audit_record, recordable
from evidence.bundle import format as fmt
from evidence.bundle import records
from evidence.policy.commands import CommandDecision
from evidence.policy.model import parse_policy

AUDIT = CommandDecision("audit", 1, "note-git", "git is looked at")
REQ = ExecRequest(42, "/usr/bin/git", "/usr/bin/git", ("git", "push", "--tags"), False)


def _rules(recs: list[Any], past_cap: dict[str, int], audit_max: int) -> CommandRules:
    policy = parse_policy(
        "version: 1\ncommands:\n  default: allow\n  rules:\n"
        "    - {name: no-curl, program: curl, decision: deny}\n"
        "    - {name: note-git, program: git, decision: audit, message: git is looked at}\n",
        name="p.yaml",
        variables={},
        resolve=None,
    )
    return CommandRules(
        "run-1",
        policy,
        add_records=recs.extend,
        broker=ApprovalBroker(record=lambda _rec: None),
        owner_uid=0,
        clock_ns=lambda: 1_000_000,
        past_cap=past_cap,
        audit_max=audit_max,
    )


def test_an_audited_exec_is_a_record_with_the_rule_program_argv_and_depth() -> None:
    rec = audit_record(ExecDecision(REQ, AUDIT, 3, True), 7)
    assert rec == {
        "k": "audit",
        "t": 7,
        "pid": 42,
        "program": "/usr/bin/git",
        "argv": ["git", "push", "--tags"],
        "argv_truncated": False,
        "depth": 3,
        "rule": "commands.rules[1] (note-git)",
        "rule_index": 1,
        "rule_name": "note-git",
        "message": "git is looked at",
    }
    assert records.KIND_TYPE["audit"] == fmt.POLICY_AUDIT
    fmt.PolicyAudit.model_validate(records.data(rec))  # the event's data is the format's model
    # an exec allowed or refused by another rule, or not read, is no audit
    assert audit_record(ExecDecision(REQ, CommandDecision("allow"), 3, True), 7) is None
    assert audit_record(ExecDecision(REQ, CommandDecision("deny", 0, "no-curl"), 3, False), 7) is None
    assert audit_record(ExecDecision(None, AUDIT, 3, False, "unreadable"), 7) is None


def test_a_run_keeps_the_first_audits_and_counts_the_rest_as_lost() -> None:
    recs: list[Any] = []
    past_cap: dict[str, int] = {"open_past_cap": 4}
    rules = _rules(recs, past_cap, audit_max=3)
    for _ in range(5):
        rules._decided(ExecDecision(REQ, AUDIT, 1, True))
    rules._decided(ExecDecision(REQ, CommandDecision("allow"), 1, True))  # no record
    rules._decided(ExecDecision(REQ, CommandDecision("deny", 0, "no-curl"), 1, False))  # a denial
    assert [r["k"] for r in recs] == ["audit"] * 3 + ["denial"]
    rules.close()
    assert past_cap == {"open_past_cap": 4, AUDIT_PAST_CAP: 2}


def test_a_records_time_is_when_the_supervisor_answered() -> None:
    import time

    recs: list[Any] = []
    rules = _rules(recs, {}, audit_max=3)
    answered = time.monotonic_ns() - 5_000_000  # the news came 5 ms later
    rules._decided(ExecDecision(REQ, AUDIT, 1, True, answered_ns=answered))
    assert 1_000_000 - recs[0]["t"] >= 5_000_000


def test_only_what_makes_a_record_crosses_from_the_supervisors_process_and_comes_back_whole() -> None:
    odd = ExecRequest(9, "/tmp/x", "/tmp/x\udcff", ("x", "caf\udce9", "\n"), True)
    crossing = [
        ExecDecision(odd, AUDIT, 2, True),
        ExecDecision(odd, CommandDecision("deny", 0, "no-curl", None), 2, False),
        ExecDecision(odd, CommandDecision("deny"), 2, False, dry_run=True),  # would be refused
        ExecDecision(None, CommandDecision("deny"), 0, False, "bad address in the caller"),
    ]
    assert all(recordable(d) for d in crossing)
    assert not recordable(ExecDecision(odd, CommandDecision("allow"), 2, True))
    assert not recordable(ExecDecision(odd, CommandDecision("allow"), 2, True, dry_run=True))
    import json

    for d in crossing:
        back = result_of(json.loads(json.dumps(result_json(d, 123))))
        assert back.answered_ns == 123
        assert (back.decision, back.depth, back.allowed, back.error, back.dry_run) == (
            d.decision,
            d.depth,
            d.allowed,
            d.error,
            d.dry_run,
        )
        if d.request is None:
            assert back.request is None
        else:
            assert back.request is not None
            got, want = back.request, d.request
            assert (got.pid, got.path, got.program, got.argv, got.truncated) == (
                want.pid,
                want.path,
                want.program,
                want.argv,
                want.truncated,
            )


def test_records_carry_undecodable_bytes_as_the_kernels_names_do() -> None:
    """The supervisor reads names and arguments keeping bytes that are not UTF-8 as surrogates (to
    match and pin them exactly); its records carry them as \\xNN, as the recorder's exec events do,
    and encode as JSON (a surrogate failed the run's bundle)."""
    import orjson

    from evidence.agent.recorder.exec_supervisor import denial_record

    odd = ExecRequest(9, "/tmp/\udcff", "/tmp/\udcff", ("x", "caf\udce9"), False)
    audit = audit_record(ExecDecision(odd, AUDIT, 1, True), 5)
    denial = denial_record(ExecDecision(odd, CommandDecision("deny", 0, "no-curl"), 1, False), 5)
    assert audit is not None and denial is not None
    assert (audit["program"], audit["argv"], denial["target"]) == (
        "/tmp/\\xff",
        ["x", "caf\\xe9"],
        "/tmp/\\xff",
    )
    orjson.dumps(audit)
    orjson.dumps(denial)
