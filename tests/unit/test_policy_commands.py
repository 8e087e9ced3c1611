"""Command rules, approvals and limits: loading, matching (most specific rule wins, deny > approve >
audit > allow on a tie), the line told to the job and its rate limit, profile's commands section."""

from __future__ import annotations

import itertools
import random
from fnmatch import fnmatchcase
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evidence.errors import PolicyError
from evidence.policy.commands import (
    DECISION_PRIORITY,
    Decider,
    ExecsSeen,
    NoticeLimiter,
    Specificity,
    args_match,
    decide,
    exec_notice,
    notice,
    rule_specificity,
    unallowed_programs,
)
from evidence.policy.governance import CommandsPolicy
from evidence.policy.model import parse_policy
from evidence.policy.profile import build_profile

DECISIONS = ("allow", "deny", "approve", "audit")


def _policy(text: str) -> Any:
    return parse_policy("version: 1\n" + text, name="p.yaml", variables={"WORKSPACE": "/ws"}, resolve=None)


def _commands(rules: list[dict[str, Any]], default: str = "allow") -> CommandsPolicy:
    return CommandsPolicy.model_validate({"default": default, "rules": rules}, context={"variables": {}})


def _error(text: str) -> str:
    with pytest.raises(PolicyError) as exc:
        _policy(text)
    assert "\n" not in exc.value.message
    return exc.value.message


ISSUE = """\
commands:
  default: allow
  rules:
    - name: no-force-push
      program: [git]
      args: ["push", "*--force*"]
      depth: any
      decision: deny
      message: "force-push needs a human"
    - name: no-network-tools
      program: [curl, wget, "/usr/bin/nc*"]
      decision: deny
    - name: publish
      program: npm
      args: [publish]
      depth: {min: 1, max: 3}
      decision: approve
approvals:
  timeout: 60s
  on_timeout: deny
limits:
  memory: 2GiB
  pids: 512
  cpu: 1.5
  wall: 30m
"""


# ---------------------------------------------------------------------------------------------------
# Loading


def test_issue_example_loads_and_summary_says_what_is_in_force() -> None:
    policy = _policy(ISSUE)
    assert policy.commands is not None and len(policy.commands.rules) == 3
    s = policy.summary()
    assert s["commands"]["default"] == "allow"
    assert s["commands"]["rule_count"] == 3
    assert s["commands"]["decisions"] == {"deny": 2, "approve": 1}
    assert s["commands"]["rules"][2] == {
        "name": "publish",
        "program": ["npm"],
        "args": ["publish"],
        "depth": "{min: 1, max: 3}",
        "decision": "approve",
    }
    assert s["approvals"] == {"timeout_ms": 60_000, "on_timeout": "deny"}
    assert s["limits"] == {"memory": 2 << 30, "pids": 512, "cpu_millis": 1500, "wall_ms": 30 * 60_000}

    def no_floats(v: Any) -> None:
        assert not isinstance(v, float)
        for x in v.values() if isinstance(v, dict) else v if isinstance(v, list) else ():
            no_floats(x)

    no_floats(s)


def test_no_commands_or_limits_sections_leave_the_summary_as_before() -> None:
    s = _policy("env:\n  strip_secrets: true\n").summary()
    assert "commands" not in s and "limits" not in s and "approvals" not in s


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "commands:\n  rules:\n    - {name: a, program: git, decision: deny}\n    - {name: a, program: git, decision: deny}\n",
            "p.yaml:3: commands: two rules are named 'a'",
        ),
        (
            "commands:\n  rules:\n    - name: a\n      program: git\n      depth: {min: 3, max: 1}\n      decision: deny\n",
            "p.yaml:6: commands.rules[0].depth: max (1) is below min (3)",
        ),
        (
            "commands:\n  rules:\n    - name: a\n      program: git\n      depth: deep\n      decision: deny\n",
            "p.yaml:6: commands.rules[0].depth: 'deep': depth is direct, nested, any",
        ),
        (
            "commands:\n  rules:\n    - name: a\n      program: git\n      decision: maybe\n",
            "p.yaml:6: commands.rules[0].decision: 'maybe'",
        ),
        (
            "commands:\n  rules:\n    - name: a\n      program: [git, bin/x]\n      decision: deny\n",
            "p.yaml:5: commands.rules[0].program[1]: 'bin/x': a program is a name without '/'",
        ),
        (
            "commands:\n  rules:\n    - name: a\n      program: /usr/bin/../bin/x\n      decision: deny\n",
            "p.yaml:5: commands.rules[0].program[0]: '/usr/bin/../bin/x': '.' or '..'",
        ),
        (
            "commands:\n  rules:\n    - name: a\n      program: []\n      decision: deny\n",
            "p.yaml:5: commands.rules[0].program:",
        ),
        (
            "commands:\n  rules:\n    - name: a\n      program: git\n",
            "p.yaml:4: commands.rules[0].decision: required",
        ),
        (
            "commands:\n  rules:\n    - name: a\n      program: git\n      args: [1]\n      decision: deny\n",
            "p.yaml:6: commands.rules[0].args[0]:",
        ),
        ("commands:\n  default: maybe\n", "p.yaml:3: commands.default: 'maybe'"),
        ("commands:\n  rulez: []\n", "p.yaml:3: commands.rulez: unknown field"),
        ("limits:\n  memory: lots\n", "p.yaml:3: limits.memory: 'lots': not a size"),
        ("limits:\n  memory: 0\n", "p.yaml:3: limits.memory: 0: a size must be more than 0"),
        ("limits:\n  cpu: 0\n", "p.yaml:3: limits.cpu: 0: at least 0.01 CPU"),
        ("limits:\n  cpu: lots\n", "p.yaml:3: limits.cpu: cpu is a number of CPUs"),
        ("limits:\n  wall: 10y\n", "p.yaml:3: limits.wall: '10y': not a duration"),
        ("limits:\n  pids: 0\n", "p.yaml:3: limits.pids:"),
        ("limits:\n  pids: true\n", "p.yaml:3: limits.pids:"),
        ("limits:\n  swap: 1\n", "p.yaml:3: limits.swap: unknown field"),
        ("approvals:\n  timeout: -3s\n", "p.yaml:3: approvals.timeout: '-3s': not a duration"),
        ("approvals:\n  timeout: 0\n", "p.yaml:3: approvals.timeout: '0s': a duration must be more than 0"),
        ("approvals:\n  on_timeout: ask\n", "p.yaml:3: approvals.on_timeout: 'ask'"),
    ],
)
def test_bad_sections_are_one_line_with_the_line_and_field(text: str, expected: str) -> None:
    assert _error(text).startswith(expected), _error(text)


@pytest.mark.parametrize(
    ("value", "ms"), [("90", 90_000), (90, 90_000), ("1.5m", 90_000), ("500ms", 500), ("2h", 7_200_000)]
)
def test_durations(value: Any, ms: int) -> None:
    assert _policy(f"limits:\n  wall: {value}\n").limits.wall_ms == ms


@pytest.mark.parametrize(
    ("value", "size"),
    [("512MiB", 512 << 20), ("1GB", 10**9), ("4096", 4096), (4096, 4096), ("2 GiB", 2 << 30)],
)
def test_sizes(value: Any, size: int) -> None:
    assert _policy(f"limits:\n  memory: {value}\n").limits.memory == size


def test_program_paths_are_canonical_and_variables_expand(tmp_path: Any) -> None:
    real = tmp_path / "real"
    real.write_text("")
    (tmp_path / "link").symlink_to(real)
    policy = _policy(
        "commands:\n  rules:\n"
        f"    - {{name: a, program: ['{tmp_path}/link', '${{WORKSPACE}}/bin/*', 'python3*', git], decision: deny}}\n"
    )
    kinds = [(p.kind, p.pattern) for p in policy.commands.rules[0].program]
    assert kinds == [("path", str(real)), ("glob", "/ws/bin/*"), ("name_glob", "python3*"), ("name", "git")]
    # what really runs decides: the symlink's target is denied, the link's own name is not a path
    assert decide(policy.commands, str(real), ["x"], 0).decision == "deny"


# ---------------------------------------------------------------------------------------------------
# Matching


def test_issue_rules() -> None:
    c = _policy(ISSUE).commands
    git = "/usr/bin/git"
    d = decide(c, git, ["git", "push", "--force"], 0)
    assert (d.decision, d.label, d.message) == (
        "deny",
        "commands.rules[0] (no-force-push)",
        "force-push needs a human",
    )
    # skipped arguments before, between and after; the pattern is a glob over one whole argument
    for argv in (
        ["git", "-C", "/w", "push", "origin", "main", "--force-with-lease"],
        ["git", "push", "x", "--force", "more"],
    ):
        assert decide(c, git, argv, 5).decision == "deny", argv
    for argv in (["git", "--force", "push"], ["git", "push"], ["git"], [], ["git", "pushed", "--force"]):
        assert decide(c, git, argv, 0).decision == "allow", argv
    assert decide(c, "/usr/bin/curl", ["curl"], 0).label == "commands.rules[1] (no-network-tools)"
    assert decide(c, "/usr/bin/ncat", ["nc"], 0).decision == "deny"
    assert decide(c, "/usr/local/bin/ncat", ["nc"], 0).decision == "allow"  # the glob is of /usr/bin
    # depth {min 1, max 3}
    assert decide(c, "/usr/bin/npm", ["npm", "publish"], 0).decision == "allow"
    for depth in (1, 2, 3):
        assert decide(c, "/usr/bin/npm", ["npm", "publish"], depth).decision == "approve"
    assert decide(c, "/usr/bin/npm", ["npm", "publish"], 4).decision == "allow"


def test_default_deny_with_allows() -> None:
    c = _commands(
        [
            {"name": "tools", "program": ["/usr/bin/make", "cc", "/usr/lib/gcc/**"], "decision": "allow"},
            {"name": "shell", "program": "sh", "depth": "direct", "decision": "allow"},
        ],
        default="deny",
    )
    assert decide(c, "/usr/bin/make", ["make"], 3).runs is True
    assert decide(c, "/opt/x/cc", ["cc"], 3).runs is True
    assert decide(c, "/usr/lib/gcc/x86_64-linux-gnu/12/cc1", ["cc1"], 9).runs is True
    assert decide(c, "/usr/bin/sh", ["sh"], 0).runs is True
    d = decide(c, "/usr/bin/sh", ["sh"], 1)
    assert (d.runs, d.label, d.rule_index) == (False, "commands.default", None)
    assert decide(c, "/usr/bin/makex", ["make"], 0).runs is False


def test_depth_words() -> None:
    def at(depth: str, d: int) -> bool:
        return (
            decide(
                _commands([{"name": "r", "program": "x", "depth": depth, "decision": "deny"}]), "/x", [], d
            ).runs
            is False
        )

    assert [at("direct", d) for d in (0, 1, 7)] == [True, False, False]
    assert [at("nested", d) for d in (0, 1, 7)] == [False, True, True]
    assert [at("any", d) for d in (0, 1, 7)] == [True, True, True]


def test_truncated_argv_counts_for_deny_not_for_allow() -> None:
    c = _commands(
        [
            {"name": "ok", "program": "git", "args": ["status"], "decision": "allow"},
            {"name": "no", "program": "git", "args": ["push"], "depth": "nested", "decision": "deny"},
        ],
        default="deny",
    )
    assert decide(c, "/usr/bin/git", ["git", "status"], 1).runs is True
    # the supervisor saw only part of the argv: the unread part may hold "push"
    d = decide(c, "/usr/bin/git", ["git", "status"], 1, truncated=True)
    assert d.decision == "deny" and d.rule_name == "no"
    # and an allow rule is not taken on what was not read
    assert decide(c, "/usr/bin/git", ["git", "x"], 0, truncated=True).label == "commands.default"


def _subsequence(patterns: list[str], args: list[str]) -> bool:
    """Reference: some choice of increasing positions where each pattern matches its argument."""
    return any(
        all(fnmatchcase(args[i], p) for p, i in zip(patterns, pos, strict=True))
        for pos in itertools.combinations(range(len(args)), len(patterns))
    )


_ARG = st.text(alphabet="ab-*/", max_size=3)


@given(
    st.lists(st.sampled_from(["a", "b", "*", "-*", "*b", "a?", "[ab]", "?"]), max_size=3),
    st.lists(_ARG, max_size=6),
)
@settings(max_examples=400)
def test_args_match_is_the_ordered_subsequence_match(patterns: list[str], args: list[str]) -> None:
    # fnmatchcase: the same glob, case-sensitive, '*' crossing '/' (the reference is the stdlib's)
    assert args_match(patterns, args) == _subsequence(patterns, args)


def test_arg_globs_span_slashes_and_newlines() -> None:
    assert args_match(["*--force*"], ["x\n--force"])
    assert args_match(["/etc/*"], ["/etc/a/b"])
    assert not args_match(["a"], ["A"])


# Exhaustive specificity: every combination of two rules that both match one exec, one more
# specific than the other in exactly the dimensions chosen, and every pair of decisions.

PROGRAMS = {3: "/usr/bin/git", 2: "/usr/bin/g*", 1: "git", 0: "g?t"}
ARGS = {0: [], 1: ["push"], 2: ["push", "--force"]}
DEPTHS = {2: {"min": 0, "max": 4}, 1: "nested", 0: "any"}


def _rule(name: str, prog: int, nargs: int, depth: int, decision: str) -> dict[str, Any]:
    return {
        "name": name,
        "program": PROGRAMS[prog],
        "args": ARGS[nargs],
        "depth": DEPTHS[depth],
        "decision": decision,
    }


CASES = list(itertools.product(PROGRAMS, ARGS, DEPTHS))


@pytest.mark.parametrize("first", CASES)
def test_most_specific_rule_wins_and_the_tie_order_is_deny_approve_audit_allow(
    first: tuple[int, int, int],
) -> None:
    argv = ["git", "push", "--force"]
    for second in CASES:
        for d1, d2 in itertools.product(DECISIONS, repeat=2):
            rules = [_rule("one", *first, d1), _rule("two", *second, d2)]
            spec1 = Specificity(args=first[1], program=first[0], depth=first[2])
            spec2 = Specificity(args=second[1], program=second[0], depth=second[2])
            if spec1 != spec2:
                want = ("one", d1) if spec1 > spec2 else ("two", d2)
            elif DECISION_PRIORITY[d1] != DECISION_PRIORITY[d2]:
                want = ("one", d1) if DECISION_PRIORITY[d1] > DECISION_PRIORITY[d2] else ("two", d2)
            else:
                want = ("one", d1)  # the first in the file
            for order in (rules, rules[::-1]):
                got = decide(_commands(order), "/usr/bin/git", argv, 2)
                want_name = order[0]["name"] if want[0] == "one" and spec1 == spec2 and d1 == d2 else want[0]
                assert (got.rule_name, got.decision) == (want_name, want[1]), (order, got)


def test_specificity_order_is_args_then_program_then_depth() -> None:
    assert Specificity(1, 0, 0) > Specificity(0, 3, 2)
    assert Specificity(1, 1, 0) > Specificity(1, 0, 2)
    assert Specificity(1, 1, 1) > Specificity(1, 1, 0)
    rule = _commands([_rule("r", 2, 1, 1, "deny")]).rules[0]
    assert rule_specificity(rule, "/usr/bin/git", ["git", "push"], 1) == Specificity(1, 2, 1)
    assert rule_specificity(rule, "/usr/bin/git", ["git", "push"], 0) is None  # nested: not depth 0
    # a rule whose several programs match takes its most specific one
    many = _commands([{"name": "m", "program": ["g*", "/usr/bin/git"], "decision": "deny"}]).rules[0]
    assert rule_specificity(many, "/usr/bin/git", [], 0) == Specificity(0, 3, 0)


_RULE = st.builds(
    _rule,
    st.just("r"),
    st.sampled_from(list(PROGRAMS)),
    st.sampled_from(list(ARGS)),
    st.sampled_from(list(DEPTHS)),
    st.sampled_from(DECISIONS),
)
_EXE = st.sampled_from(["/usr/bin/git", "/usr/bin/gat", "/usr/local/bin/git", "/usr/bin/go", "/bin/x"])
_ARGV = st.lists(st.sampled_from(["git", "push", "--force", "pull", "-f"]), max_size=4)


@given(
    st.lists(_RULE, max_size=6),
    _EXE,
    _ARGV,
    st.integers(0, 6),
    st.sampled_from(["allow", "deny"]),
    st.randoms(),
)
@settings(max_examples=300)
def test_decision_is_the_maximum_whatever_the_order(
    raw: list[dict[str, Any]], exe: str, argv: list[str], depth: int, default: str, rnd: random.Random
) -> None:
    rules = [{**r, "name": f"r{i}"} for i, r in enumerate(raw)]
    c = _commands(rules, default)
    got = decide(c, exe, argv, depth)
    matching = [
        (s, DECISION_PRIORITY[r.decision], r)
        for r in c.rules
        if (s := rule_specificity(r, exe, argv, depth)) is not None
    ]
    if not matching:
        assert (got.decision, got.rule_index) == (default, None)
        return
    top = max(m[:2] for m in matching)
    winners = [m[2] for m in matching if m[:2] == top]
    assert got.rule_name == winners[0].name and got.decision == winners[0].decision
    assert c.rules[got.rule_index].name == got.rule_name
    # the verdict does not depend on the order of the rules, and non-matching rules change nothing
    shuffled = rules[:]
    rnd.shuffle(shuffled)
    assert decide(_commands(shuffled, default), exe, argv, depth).decision == got.decision
    extra = [*rules, {"name": "never", "program": "/nowhere", "decision": "deny"}]
    assert decide(_commands(extra, default), exe, argv, depth) == got


@given(
    st.lists(_RULE, max_size=6),
    st.lists(st.tuples(_EXE, _ARGV, st.integers(0, 6), st.booleans()), min_size=1, max_size=12),
    st.sampled_from(["allow", "deny"]),
    st.integers(1, 3),
)
@settings(max_examples=300)
def test_the_supervisors_cached_decider_answers_as_decide(
    raw: list[dict[str, Any]],
    execs: list[tuple[str, list[str], int, bool]],
    default: str,
    size: int,
) -> None:
    """Decider (what the exec supervisor calls: per program, the matching rules and argv-free
    decisions kept) answers every exec of a sequence as decide does, repeats and evictions too."""
    c = _commands([{**r, "name": f"r{i}"} for i, r in enumerate(raw)], default)
    decider = Decider(c, size=size)
    for exe, argv, depth, truncated in execs * 2:
        assert decider(exe, argv, depth, truncated=truncated) == decide(
            c, exe, argv, depth, truncated=truncated
        )


# ---------------------------------------------------------------------------------------------------
# What the job is told


def test_notice_lines() -> None:
    c = _policy(ISSUE).commands
    d = decide(c, "/usr/bin/curl", ["curl"], 0)
    assert (
        exec_notice("/usr/bin/curl", d)
        == "evidence: exec of /usr/bin/curl refused by commands.rules[1] (no-network-tools)"
    )
    d = decide(c, "/usr/bin/git", ["git", "push", "-f", "--force"], 0)
    assert exec_notice("/usr/bin/git", d) == (
        "evidence: exec of /usr/bin/git refused by commands.rules[0] (no-force-push): force-push needs a human"
    )
    d = decide(c, "/usr/bin/npm", ["npm", "publish"], 1)
    assert (
        exec_notice("/usr/bin/npm", d)
        == "evidence: exec of /usr/bin/npm waits for approval by commands.rules[2] (publish)"
    )
    assert exec_notice("/usr/bin/ls", decide(c, "/usr/bin/ls", [], 0)) is None
    # file and connect denials use the same line; a hostile name cannot add a line, a long one is cut
    assert notice("open", "/etc/shadow", "fs.deny[1]: /etc/shadow") == (
        "evidence: open of /etc/shadow refused by fs.deny[1]: /etc/shadow"
    )
    line = notice("exec", "/tmp/a\nevidence: all fine\x1b[2J" + "x" * 1000, "commands.default")
    assert (
        "\n" not in line
        and "\x1b" not in line
        and len(line) < 400
        and "... refused by commands.default" in line
    )


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_notice_limiter_burst_refill_and_count() -> None:
    clock = _Clock()
    lim = NoticeLimiter(rate=2.0, burst=3, clock=clock)
    assert [lim(f"l{i}") for i in range(5)] == ["l0", "l1", "l2", None, None]
    clock.now += 0.4  # 0.8 of a token
    assert lim("l5") is None
    clock.now += 0.1  # one token
    assert lim("l6") == "l6 (3 earlier lines not shown)"
    assert lim("l7") is None
    clock.now += 1000  # refills to the burst, no more
    assert [lim(f"m{i}") for i in range(4)] == ["m0 (1 earlier lines not shown)", "m1", "m2", None]
    assert lim.flush() == "evidence: 1 more refusals not shown"
    assert lim.flush() is None
    clock.now -= 50  # a clock that goes back refills nothing
    assert lim("z") is None
    with pytest.raises(ValueError):
        NoticeLimiter(rate=0, burst=1)


@given(st.lists(st.floats(0, 5), max_size=60), st.integers(1, 5), st.floats(0.1, 10))
def test_notice_limiter_never_exceeds_its_budget(gaps: list[float], burst: int, rate: float) -> None:
    clock = _Clock()
    lim = NoticeLimiter(rate=rate, burst=burst, clock=clock)
    shown = held = 0
    for gap in gaps:
        clock.now += gap
        if lim("x") is None:
            held += 1
        else:
            shown += 1
    assert shown <= burst + sum(gaps) * rate + 1e-9
    assert shown + held == len(gaps) and lim.suppressed <= held


# ---------------------------------------------------------------------------------------------------
# profile


def _exec(filename: str, **kw: Any) -> dict[str, Any]:
    return {
        "type": "dev.evidence.process.exec",
        "data": {"filename": filename, "argv": [filename], "depth": 1, "result": 0, "cwd": "/w", **kw},
    }


def test_profile_commands_section_allows_what_ran_and_denies_the_rest(tmp_path: Any) -> None:
    events = [
        _exec("/usr/bin/make"),
        _exec("/bin/sh"),
        _exec("/w/tools/gen.sh", interpreter="/usr/bin/bash"),
        _exec("/opt/a/cc"),
        _exec("/opt/b/cc"),
        _exec("/opt/secret/tool", result="EACCES"),
        _exec("/usr/local/bin/make", result="ENOENT"),  # a PATH search: nothing ran
        _exec("/inner/bin/x", mntns="other"),
    ]
    manifest = {"run_id": "r1", "command": ["make"], "cwd": str(tmp_path), "policy": None}
    text, policy = build_profile(
        manifest, events, workspace=str(tmp_path), tmpdir=str(tmp_path), home=str(tmp_path)
    )
    assert "commands:\n  default: deny\n  rules:\n" in text
    c = policy.commands
    assert c is not None and c.default == "deny"
    names = [r.name for r in c.rules]
    assert names == ["run-sh", "run-cc", "run-cc-2", "run-bash", "run-make", "run-gen.sh"]
    for exe in ("/usr/bin/make", "/opt/a/cc", "/opt/b/cc", "/usr/bin/bash", "/w/tools/gen.sh"):
        assert decide(c, exe, [exe], 3).runs is True, exe
    import os

    assert decide(c, os.path.realpath("/bin/sh"), ["sh"], 0).runs is True  # matched on what really runs
    for exe in ("/opt/secret/tool", "/inner/bin/x", "/usr/bin/curl", "/usr/local/bin/make"):
        assert decide(c, exe, [exe], 1).runs is False, exe
    seen = ExecsSeen()
    list(
        seen.watch([*events, _exec("rel", cwd=None)])
    )  # bundle names are absolute; a relative one is not placed
    assert seen.other_ns == 1 and seen.unplaced == {"rel"}
    assert unallowed_programs(c, seen) == []
    assert unallowed_programs(None, seen) == sorted(seen.programs)


def test_profile_of_a_run_with_no_execs_denies_every_program(tmp_path: Any) -> None:
    manifest = {"run_id": "r1", "command": [], "cwd": str(tmp_path), "policy": None}
    text, policy = build_profile(
        manifest, [], workspace=str(tmp_path), tmpdir=str(tmp_path), home=str(tmp_path)
    )
    assert "commands:\n  default: deny\n  rules: []\n" in text
    assert decide(policy.commands, "/usr/bin/true", [], 0).runs is False


def test_a_script_is_decided_by_the_more_restrictive_of_itself_and_its_interpreter() -> None:
    from evidence.agent.recorder.exec_resolve import ExecRequest
    from evidence.agent.recorder.exec_supervisor import decide_request

    c = _commands(
        [
            {"name": "scripts", "program": "/ws/*.sh", "decision": "allow"},
            {"name": "no-perl", "program": "perl", "decision": "deny"},
            {"name": "ask-py", "program": "python3*", "decision": "approve"},
        ],
        default="deny",
    )

    def req(interp: str | None) -> ExecRequest:
        return ExecRequest(
            pid=1, path="./a.sh", program="/ws/a.sh", argv=("./a.sh",), truncated=False, interpreter=interp
        )

    assert decide_request(c, req("/usr/bin/perl"), 0).rule_name == "no-perl"
    assert decide_request(c, req("/usr/bin/python3.11"), 0).rule_name == "ask-py"
    assert decide_request(c, req(None), 0).rule_name == "scripts"
    # an interpreter matched by no rule falls to the default (deny) and that is more restrictive
    assert decide_request(c, req("/usr/bin/bash"), 0).label == "commands.default"


def test_loader_payload_skips_the_loaders_options() -> None:
    from evidence.agent.recorder.exec_resolve import is_dynamic_loader, loader_payload

    assert loader_payload(("ld.so", "/usr/bin/curl", "-s")) == "/usr/bin/curl"
    assert loader_payload(("ld.so", "--library-path", "/x", "--inhibit-cache", "curl")) == "curl"
    assert loader_payload(("ld.so", "--preload", "a.so", "--", "--weird")) == "--weird"
    assert loader_payload(("ld.so", "--list")) is None and loader_payload(()) is None
    assert is_dynamic_loader("/lib64/ld-linux-x86-64.so.2") and is_dynamic_loader("/lib/ld-musl-x86_64.so.1")
    assert not is_dynamic_loader("/usr/bin/ldd") and not is_dynamic_loader("/usr/bin/ld")
