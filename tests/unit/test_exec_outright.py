"""The exec supervisor's shortcut for the usual exec the rules simply allow
(ExecSupervisor._allowed_outright, answered by _allow_outright without the whole request) against
the decision `answer` makes from the whole request (decide_request): whenever the shortcut takes an
exec, the whole request's decision is the same `allow`; and it takes the plain case (else it would
cost without helping). Scripts, the dynamic loader, a name that leads elsewhere here than for the
caller, every decision but allow, and callers of no known depth go the whole way."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evidence.agent.recorder.exec_resolve import NR_EXECVE, Usual, usual_request
from evidence.agent.recorder.exec_supervisor import ExecSupervisor, Notification, decide_request
from evidence.policy.governance import CommandsPolicy

TRUE = os.path.realpath("/usr/bin/true")
LOADER = os.path.realpath("/lib64/ld-linux-x86-64.so.2")

POLICIES: dict[str, dict[str, Any]] = {
    "allow by default": {"default": "allow", "rules": []},
    "deny by default, true allowed": {
        "default": "deny",
        "rules": [{"name": "true", "program": ["true"], "decision": "allow"}],
    },
    "true allowed with args only": {
        "default": "deny",
        "rules": [
            {"name": "true", "program": ["true"], "decision": "allow"},
            {"name": "no-x", "program": ["true"], "args": ["-x*"], "decision": "deny"},
        ],
    },
    "true audited nested": {
        "default": "allow",
        "rules": [{"name": "audit", "program": [TRUE], "depth": "nested", "decision": "audit"}],
    },
    "true asked directly": {
        "default": "allow",
        "rules": [{"name": "ask", "program": ["tr*"], "depth": "direct", "decision": "approve"}],
    },
    "deeper than two denied": {
        "default": "allow",
        "rules": [{"name": "deep", "program": ["*"], "depth": {"min": 3}, "decision": "deny"}],
    },
    "others denied": {
        "default": "allow",
        "rules": [{"name": "cat", "program": ["cat", "/usr/bin/*sh"], "decision": "deny"}],
    },
}


def _supervisor(commands: CommandsPolicy, depth: int) -> ExecSupervisor:
    return ExecSupervisor(-1, commands, os.getpid(), depth_of=lambda _pid, _root: depth, record_only=True)


def _usual(named: str, argv: list[bytes], *, identity_of: str | None = None) -> Usual:
    st_ = os.stat(identity_of or named)
    with open(named, "rb") as f:
        head = f.read(256)
    return (named.encode(), argv, named.encode(), st_.st_dev, st_.st_ino, head)


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("outright") / "s"
    path.write_bytes(b"#!" + TRUE.encode() + b"\n")
    path.chmod(0o755)
    return str(path)


def _check(commands: CommandsPolicy, usual: Usual, depth: int) -> tuple[Any, Any]:
    """(the shortcut's (program, decision, depth) or None, the whole request's decision)."""
    sup = _supervisor(commands, depth)
    note = Notification(1, os.getpid(), NR_EXECVE, (0,) * 6)
    quick = sup._allowed_outright(note, usual)
    whole_depth = depth if sup._decider.needs_depth(usual_request(os.getpid(), usual).program) else 0
    whole = decide_request(commands, usual_request(os.getpid(), usual), whole_depth, sup._decider)
    return quick, whole


@settings(max_examples=300, deadline=None)
@given(
    policy=st.sampled_from(sorted(POLICIES)),
    depth=st.integers(min_value=-1, max_value=4),
    args=st.lists(st.sampled_from([b"-x", b"-xy", b"y", b"", b"\xff", b"--"]), max_size=3),
)
def test_what_the_shortcut_allows_the_whole_request_allows(
    policy: str, depth: int, args: list[bytes]
) -> None:
    commands = CommandsPolicy.model_validate(POLICIES[policy])
    quick, whole = _check(commands, _usual(TRUE, [b"true", *args]), depth)
    if quick is not None:
        _program, decision, _depth = quick
        assert whole.decision == "allow" and decision == whole
    else:  # taken whenever it can be: the whole way only for what is not a plain allow
        assert whole.decision != "allow" or depth < 0


def test_the_plain_case_takes_the_shortcut() -> None:
    commands = CommandsPolicy.model_validate(POLICIES["deny by default, true allowed"])
    quick, whole = _check(commands, _usual(TRUE, [b"true", b"bench-arg"]), 2)
    assert quick is not None and quick[0] == TRUE and quick[1] == whole and whole.decision == "allow"


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_scripts_the_loader_and_foreign_names_go_the_whole_way(policy: str, script: str) -> None:
    commands = CommandsPolicy.model_validate(POLICIES[policy])
    for usual in (
        _usual(script, [script.encode()]),  # its interpreter is judged too
        _usual(LOADER, [LOADER.encode(), TRUE.encode()]),  # what the loader loads is judged
        _usual(TRUE, [b"true"], identity_of="/usr/bin/env"),  # here its name is another file
    ):
        quick, _whole = _check(commands, usual, 1)
        assert quick is None, usual[2]


def test_a_name_that_leads_elsewhere_is_judged_by_the_default(tmp_path: Path) -> None:
    """The whole request's `foreign` rule (commands.default when stricter) is the reason the
    shortcut leaves such a name alone: under default deny it refuses what the rules allow."""
    commands = CommandsPolicy.model_validate(POLICIES["deny by default, true allowed"])
    quick, whole = _check(commands, _usual(TRUE, [b"true"], identity_of="/usr/bin/env"), 0)
    assert quick is None and whole.decision == "deny"
