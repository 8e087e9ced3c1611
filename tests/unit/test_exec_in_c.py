"""What lets the exec supervisor answer the usual allowed exec wholly in C (src/fast/_exec.c
next_usual, ExecSupervisor._serve_usual), held to the Python it stands in for: C's pin of an exec is
exec_check.pin_exec's (SipHash-2-4 under the run's key, the kernel's device encoding); a name C
takes as allowed outright (Decider.allows_outright) is allowed by `decide` and by the whole
request's decision (decide_request) whatever the argv, its truncation and the depth, an unknown
one included; and the supervisor teaches C a name only when the Python shortcut allowed it and
allows_outright holds."""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evidence.agent.recorder import exec_supervisor
from evidence.agent.recorder.exec_check import pin_exec
from evidence.agent.recorder.exec_resolve import NR_EXECVE, ExecRequest
from evidence.agent.recorder.exec_supervisor import ExecSupervisor, Notification, decide_request
from evidence.policy.commands import Decider, decide
from tests.unit.test_policy_commands import _ARGV, _EXE, _RULE, _commands

needs_fast = pytest.mark.skipif(
    exec_supervisor._fast is None, reason="the compiled module is not built (make setup)"
)


@needs_fast
@settings(max_examples=500, deadline=None)
@given(
    key=st.binary(min_size=16, max_size=16),
    dev=st.integers(0, 2**32 - 1),
    ino=st.integers(0, 2**64 - 1),
    argv=st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\0", b"")), max_size=8),
)
def test_the_c_pin_is_pin_exec(key: bytes, dev: int, ino: int, argv: list[bytes]) -> None:
    want = pin_exec(key, (dev, ino), argv)
    assert want is not None
    assert exec_supervisor._fast.pin(key, dev, ino, argv) == want.pack()


@needs_fast
def test_the_c_pin_of_long_arg_areas_and_what_cannot_be_pinned() -> None:
    key = os.urandom(16)
    for size in (0, 7, 8, 9, 4095, 65535, 131071):  # SipHash's tail at each length mod 8, the limit
        argv = [b"a" * size] if size else []
        want = pin_exec(key, (2049, 7), argv)
        assert want is not None and exec_supervisor._fast.pin(key, 2049, 7, argv) == want.pack(), size
    too_long = [b"a" * 131072]  # with its NUL, past abi.EXEC_ARGS_MAX: refused by both
    assert pin_exec(key, (2049, 7), too_long) is None
    assert exec_supervisor._fast.pin(key, 2049, 7, too_long) is None
    with pytest.raises(ValueError):
        exec_supervisor._fast.pin(b"short", 1, 1, [])


def _plain(exe: str, argv: list[str], truncated: bool) -> ExecRequest:
    return ExecRequest(pid=1, path=exe, program=exe, argv=tuple(argv), truncated=truncated, identity=(1, 1))


@settings(max_examples=400, deadline=None)
@given(
    st.lists(_RULE, max_size=6),
    _EXE,
    st.lists(st.tuples(_ARGV, st.booleans()), min_size=1, max_size=4),
    st.sampled_from(["allow", "deny"]),
)
def test_a_name_allowed_outright_is_allowed_whatever_the_argv_and_the_depth(
    raw: list[dict[str, Any]], exe: str, argvs: list[tuple[list[str], bool]], default: str
) -> None:
    c = _commands([{**r, "name": f"r{i}"} for i, r in enumerate(raw)], default)
    decider = Decider(c)
    if not decider.allows_outright(exe):
        return
    for argv, truncated in argvs:
        for depth in range(-1, 7):
            if depth >= 0:
                assert decide(c, exe, argv, depth, truncated=truncated).decision == "allow"
            assert decide_request(c, _plain(exe, argv, truncated), depth, decider).decision == "allow"


def test_allowed_outright_when_no_rule_of_the_program_has_args_or_depth() -> None:
    c = _commands(
        [
            {"name": "git", "program": "git", "decision": "allow"},
            {"name": "push", "program": "git", "args": ["push"], "decision": "deny"},
            {"name": "ls", "program": "ls", "decision": "allow"},
            {"name": "cat", "program": "cat", "depth": "direct", "decision": "allow"},
            {"name": "id", "program": "id", "decision": "audit"},
        ],
        "deny",
    )
    decider = Decider(c)
    assert decider.allows_outright("/usr/bin/ls")
    assert not decider.allows_outright("/usr/bin/git")  # its argv can change the answer
    assert not decider.allows_outright("/usr/bin/cat")  # its depth can
    assert not decider.allows_outright("/usr/bin/id")  # audited: recorded, never C's
    assert not decider.allows_outright("/usr/bin/env")  # the default denies it


def test_the_supervisor_teaches_c_only_names_allowed_outright() -> None:
    true = os.path.realpath("/usr/bin/true")
    st_ = os.stat(true)
    with open(true, "rb") as f:
        head = f.read(256)
    note = Notification(1, os.getpid(), NR_EXECVE, (0,) * 6)
    usual = (true.encode(), [b"true", b"x"], true.encode(), st_.st_dev, st_.st_ino, head)
    cases = {
        "true": ([{"name": "t", "program": "true", "decision": "allow"}], True),
        "true by args": ([{"name": "t", "program": "true", "args": ["x"], "decision": "allow"}], False),
        "true nested": ([{"name": "t", "program": "true", "depth": "any", "decision": "allow"}], True),
        "true direct": ([{"name": "t", "program": "true", "depth": "direct", "decision": "allow"}], False),
    }
    for what, (rules, taught) in cases.items():
        sup = ExecSupervisor(
            -1, _commands(rules, "deny"), os.getpid(), depth_of=lambda _p, _r: 0, record_only=True
        )
        assert sup._allowed_outright(note, usual) is not None, what  # the Python shortcut allows each
        assert (true.encode() in sup._outright) is taught, what
