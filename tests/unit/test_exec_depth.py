"""The caller's depth in the supervisor's decision (agent/recorder/exec_supervisor.decide_request):
a caller whose depth cannot be told (-1: its parent links do not reach the run's first process, a
double-forked orphan) is decided by the most restrictive decision of any depth from 1 on, never by
no rule at all; and Decider.needs_depth says truly when a program's decision cannot depend on it
(the supervisor then reads no depth for an exec it simply allows)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from evidence.agent.recorder.exec_resolve import ExecRequest
from evidence.agent.recorder.exec_supervisor import decide_request
from evidence.policy.commands import DECISION_PRIORITY, Decider, decide
from evidence.policy.governance import CommandsPolicy

DEPTHS: list[Any] = [
    "any",
    "direct",
    "nested",
    {"min": 2},
    {"max": 1},
    {"min": 1, "max": 3},
    {"min": 4, "max": 4},
]
_RULE = st.fixed_dictionaries(
    {
        "program": st.sampled_from(["id", "/usr/bin/id", "i*", "git"]),
        "depth": st.sampled_from(DEPTHS),
        "decision": st.sampled_from(["allow", "deny", "approve", "audit"]),
    }
)


def _commands(rules: list[dict[str, Any]], default: str) -> CommandsPolicy:
    named = [{**r, "name": f"r{i}"} for i, r in enumerate(rules)]
    return CommandsPolicy.model_validate({"default": default, "rules": named}, context={"variables": {}})


REQ = ExecRequest(7, "/usr/bin/id", "/usr/bin/id", ("id",), False)


def test_an_orphan_is_not_let_past_a_deny_rule() -> None:
    c = _commands([{"program": "id", "depth": "any", "decision": "deny"}], "allow")
    assert decide(c, "/usr/bin/id", ["id"], -1).decision == "allow"  # the matcher: no range holds -1
    assert decide_request(c, REQ, -1).decision == "deny"  # the supervisor: at some depth, refused
    assert decide_request(c, REQ, -1, Decider(c)).decision == "deny"


@settings(max_examples=300, deadline=None)
@given(st.lists(_RULE, max_size=6), st.sampled_from(["allow", "deny"]))
def test_an_unknown_depth_gets_the_most_restrictive_decision_of_any_depth(
    rules: list[dict[str, Any]], default: str
) -> None:
    c = _commands(rules, default)
    worst = max(
        (decide_request(c, REQ, d) for d in range(1, 12)), key=lambda x: DECISION_PRIORITY[x.decision]
    )
    got = decide_request(c, REQ, -1, Decider(c))
    assert DECISION_PRIORITY[got.decision] == DECISION_PRIORITY[worst.decision]


@settings(max_examples=300, deadline=None)
@given(st.lists(_RULE, max_size=6), st.sampled_from(["allow", "deny"]))
def test_a_program_that_needs_no_depth_is_decided_alike_at_every_depth(
    rules: list[dict[str, Any]], default: str
) -> None:
    c = _commands(rules, default)
    decider = Decider(c)
    if not decider.needs_depth("/usr/bin/id"):
        answers = {decide_request(c, REQ, d, decider) for d in (-1, *range(0, 8))}
        assert len(answers) == 1
