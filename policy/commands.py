"""Command rules: which rule decides an exec, the line the job is told, and the rules a run needs.

Pure: no I/O, no clock of its own. The supervisor (which reads what an exec would run) and the
recorder call these; docs/policy-format.md ("Commands") is the prose version.

Matching. A rule matches an exec when all three hold:
- `program`: one of its patterns matches the program really executed (an absolute path with its
  symlinks resolved): an absolute path exactly, an absolute glob (`*` and `?` within one component,
  `**` across components), a name (the last component, exactly) or a name glob (`python3*`).
- `args`: its patterns match argv[1:] as an ordered subsequence: each pattern (a glob over the whole
  argument, fnmatch style: `*` also matches `/`) matches one argument, each a later argument than the
  one before; arguments before, between and after are skipped. No patterns: any argv. So a deny of
  `[push, "*--force*"]` also catches `git -C dir push origin --force`, and an allow with patterns
  allows whatever else the command line holds.
- `depth`: the depth of the process that calls exec is in the rule's range.
When the supervisor could not read the whole argv (`truncated`), a deny, approve or audit rule's
patterns count as matching (the unread arguments might have matched) and an allow rule's do not.

Which rule decides: the most specific matching rule, specificity being, in this order,
1. the number of `args` patterns (more is more specific),
2. the kind of `program` pattern that matched: absolute path > absolute glob > name > name glob,
3. the depth range: bounded (`direct`, `{max: N}`) > from a depth on (`nested`, `{min: N}`) > `any`;
on equal specificity deny > approve > audit > allow, then the first rule in the file. No rule
matches: `commands.default`.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Literal, TypedDict

from evidence.bundle.text import printable
from evidence.policy.governance import CommandRule, CommandsPolicy

if TYPE_CHECKING:
    from evidence.bundle.read_types import EventJSON

logger = logging.getLogger(__name__)

Verdict = Literal["allow", "deny", "approve", "audit"]
DECISION_PRIORITY: dict[str, int] = {"deny": 3, "approve": 2, "audit": 1, "allow": 0}
PROGRAM_RANK: dict[str, int] = {"path": 3, "glob": 2, "name": 1, "name_glob": 0}
TARGET_MAX = 256  # characters of a path or address in a line told to the job


@dataclass(frozen=True, order=True)
class Specificity:
    """How specific a matching rule is; compared in field order (docs/policy-format.md)."""

    args: int
    program: int
    depth: int


@dataclass(frozen=True)
class CommandDecision:
    """What happens to an exec and which rule said so (rule None: `commands.default`)."""

    decision: Verdict
    rule_index: int | None = None
    rule_name: str | None = None
    message: str | None = None

    @property
    def label(self) -> str:
        """`commands.rules[2] (no-network-tools)` or `commands.default`."""
        if self.rule_index is None:
            return "commands.default"
        return f"commands.rules[{self.rule_index}] ({self.rule_name})"

    @property
    def runs(self) -> bool | None:
        """True: the exec goes on; False: it fails with EACCES; None: a person decides."""
        return {"allow": True, "audit": True, "deny": False}.get(self.decision)


@lru_cache(maxsize=4096)
def _arg_regex(pattern: str) -> re.Pattern[str]:
    return re.compile(fnmatch.translate(pattern), re.DOTALL)


def args_match(patterns: Sequence[str], args: Sequence[str]) -> bool:
    """Whether the patterns match `args` as an ordered subsequence (greedy leftmost is exact: each
    pattern judges one argument on its own, so taking the earliest match never loses one)."""
    i = 0
    for pattern in patterns:
        regex = _arg_regex(pattern)
        while i < len(args) and not regex.match(args[i]):
            i += 1
        if i == len(args):
            return False
        i += 1
    return True


def rule_specificity(
    rule: CommandRule, exe: str, argv: Sequence[str], depth: int, *, truncated: bool = False
) -> Specificity | None:
    """The rule's specificity for this exec, or None when it does not match."""
    if not rule.depth.contains(depth):
        return None
    ranks = [PROGRAM_RANK[p.kind] for p in rule.program if p.matches(exe)]
    if not ranks:
        return None
    if rule.args and not args_match(rule.args, argv[1:]) and not (truncated and rule.decision != "allow"):
        return None
    return Specificity(args=len(rule.args), program=max(ranks), depth=rule.depth.rank)


def decide(
    commands: CommandsPolicy, exe: str, argv: Sequence[str], depth: int, *, truncated: bool = False
) -> CommandDecision:
    """The decision for an exec of `exe` (absolute, symlinks resolved) with `argv` by a process at
    `depth` in the run's tree (0: the run's first process)."""
    best: tuple[Specificity, int, int] | None = None  # (specificity, decision priority, -index)
    for index, rule in enumerate(commands.rules):
        spec = rule_specificity(rule, exe, argv, depth, truncated=truncated)
        if spec is None:
            continue
        key = (spec, DECISION_PRIORITY[rule.decision], -index)
        if best is None or key > best:
            best = key
    if best is None:
        return CommandDecision(decision=commands.default)
    rule = commands.rules[-best[2]]
    return CommandDecision(
        decision=rule.decision, rule_index=-best[2], rule_name=rule.name, message=rule.message
    )


class Decider:
    """`decide` for one policy's rules, with what depends on the program alone worked out once per
    program: the rules whose `program` matches it and their program ranks (what costs most: up to
    one glob per pattern), and, when none of those has `args` patterns, the whole decision per
    depth. The same answers as `decide` (tests/unit/test_policy_commands.py holds them equal);
    each cache keeps its last `size` programs."""

    def __init__(self, commands: CommandsPolicy, size: int = 1024) -> None:
        self.commands = commands
        self.size = size
        # program -> (rule index, rule, its best program rank), in file order
        self._rules: dict[str, tuple[tuple[int, CommandRule, int], ...]] = {}
        self._decided: dict[tuple[str, int], CommandDecision] = {}  # argv-free programs

    def _matching(self, exe: str) -> tuple[tuple[int, CommandRule, int], ...]:
        got = self._rules.get(exe)
        if got is None:
            found = []
            for index, rule in enumerate(self.commands.rules):
                ranks = [PROGRAM_RANK[p.kind] for p in rule.program if p.matches(exe)]
                if ranks:
                    found.append((index, rule, max(ranks)))
            if len(self._rules) >= self.size:
                self._rules.clear()
                self._decided.clear()
            got = self._rules[exe] = tuple(found)
        return got

    def needs_depth(self, exe: str) -> bool:
        """Whether an exec of `exe`'s decision can depend on its depth (from 0 on): some rule whose
        program matches it has a depth range other than `any`."""
        return any(rule.depth.min > 0 or rule.depth.max is not None for _i, rule, _r in self._matching(exe))

    def allows_outright(self, exe: str) -> bool:
        """Whether every exec of `exe` is allowed, whatever its argv (read whole or not) and its
        depth: no rule whose program matches it has `args` patterns or a depth range other than
        `any`, and the decision they (or `commands.default`) make is `allow`."""
        rules = self._matching(exe)
        if any(rule.args or rule.depth.min > 0 or rule.depth.max is not None for _i, rule, _r in rules):
            return False
        return self(exe, (), 0).decision == "allow"

    def __call__(
        self, exe: str, argv: Sequence[str], depth: int, *, truncated: bool = False
    ) -> CommandDecision:
        rules = self._matching(exe)
        argv_free = not any(rule.args for _i, rule, _r in rules)
        if argv_free:  # neither argv nor its truncation can change the answer
            got = self._decided.get((exe, depth))
            if got is not None:
                return got
        best: tuple[Specificity, int, int] | None = None
        for index, rule, rank in rules:
            if not rule.depth.contains(depth):
                continue
            if (
                rule.args
                and not args_match(rule.args, argv[1:])
                and not (truncated and rule.decision != "allow")
            ):
                continue
            key = (
                Specificity(len(rule.args), rank, rule.depth.rank),
                DECISION_PRIORITY[rule.decision],
                -index,
            )
            if best is None or key > best:
                best = key
        if best is None:
            decision = CommandDecision(decision=self.commands.default)
        else:
            rule = self.commands.rules[-best[2]]
            decision = CommandDecision(
                decision=rule.decision, rule_index=-best[2], rule_name=rule.name, message=rule.message
            )
        if argv_free:
            if len(self._decided) >= self.size * 8:
                self._decided.clear()
            self._decided[(exe, depth)] = decision
        return decision


# ---------------------------------------------------------------------------------------------------
# What the job is told


def notice(
    operation: str, target: str, label: str, *, waiting: bool = False, message: str | None = None
) -> str:
    """One line for the job's stderr, e.g. `evidence: exec of /usr/bin/curl refused by
    commands.rules[2] (no-network-tools)`. The target and message are the job's or the policy's
    text: control characters escaped, long targets cut (with `...`)."""
    shown = printable(target)
    if len(shown) > TARGET_MAX:
        shown = shown[: TARGET_MAX - 3] + "..."
    verb = "waits for approval by" if waiting else "refused by"
    line = f"evidence: {operation} of {shown} {verb} {printable(label)}"
    if message:
        line += f": {printable(message)[:TARGET_MAX]}"
    return line


def exec_notice(exe: str, decision: CommandDecision) -> str | None:
    """The line for an exec decision, or None when the exec just goes on (allow, audit)."""
    if decision.runs:
        return None
    return notice("exec", exe, decision.label, waiting=decision.runs is None, message=decision.message)


@dataclass
class NoticeLimiter:
    """Rate limit for the lines told to the job: a token bucket of `burst` lines refilled at `rate`
    a second, on the clock it is given. A line let through after some were held back says how many."""

    rate: float = 2.0
    burst: int = 10
    clock: Callable[[], float] = field(default=lambda: 0.0)
    _tokens: float = field(init=False)
    _last: float | None = field(init=False, default=None)
    suppressed: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self._tokens = float(self.burst)

    def __call__(self, line: str) -> str | None:
        """The line to write now (with a count of the ones held back before it), or None."""
        now = self.clock()
        if self._last is not None and now > self._last:
            self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.rate)
        self._last = now if self._last is None else max(self._last, now)
        if self._tokens < 1.0:
            self.suppressed += 1
            return None
        self._tokens -= 1.0
        if self.suppressed:
            line = f"{line} ({self.suppressed} earlier lines not shown)"
            self.suppressed = 0
        return line

    def flush(self) -> str | None:
        """At the end of the run: a line for what was held back since the last one shown."""
        if not self.suppressed:
            return None
        line, self.suppressed = f"evidence: {self.suppressed} more refusals not shown", 0
        return line


# ---------------------------------------------------------------------------------------------------
# `evidence profile`: the commands a run executed

PROCESS_EXEC = "dev.evidence.process.exec"


@dataclass
class ExecsSeen:
    """The programs a run executed, gathered while profile reads the events (`watch`)."""

    programs: set[str] = field(default_factory=set)
    other_ns: int = 0  # execs in another mount namespace: their names are not host paths
    unplaced: set[str] = field(default_factory=set)  # relative names with no cwd, '..' after a component

    def watch(self, events: Iterable[EventJSON]) -> Iterator[EventJSON]:
        for ev in events:
            if ev.get("type") == PROCESS_EXEC:
                self.add(ev.get("data") or {})
            yield ev

    def add(self, data: Mapping[str, object]) -> None:
        from evidence.bundle.format import has_dotdot  # (not at the top: the exec supervisor's process)

        if data.get("result", 0) != 0:  # refused, or nothing there (a PATH search's ENOENT): nothing ran
            return
        if data.get("mntns") == "other":
            self.other_ns += 1
            return
        for name in (data.get("filename"), data.get("interpreter")):
            if not isinstance(name, str) or not name:
                continue
            cwd = data.get("cwd")
            if not name.startswith("/"):
                if not isinstance(cwd, str) or not cwd.startswith("/"):
                    self.unplaced.add(name)
                    continue
                name = os.path.join(cwd, name)
            if has_dotdot(name):
                self.unplaced.add(name)
                continue
            self.programs.add(os.path.normpath(name))


class ProfileRule(TypedDict):
    """A `commands.rules` entry that `evidence profile` writes: allow one program by its path."""

    name: str
    program: list[str]
    decision: Literal["allow"]


def profile_rules(seen: ExecsSeen) -> list[ProfileRule]:
    """`commands.rules` allowing each program the run executed, by its absolute path, at any depth
    (one rule a program, named after it); `commands.default` is deny. Only execs that succeeded
    count: one refused, or of a name that was not there (a PATH search), ran nothing."""
    names: dict[str, int] = {}
    rules: list[ProfileRule] = []
    for program in sorted(seen.programs):
        base = re.sub(r"[^A-Za-z0-9._+-]", "_", program.rsplit("/", 1)[-1])[:60] or "program"
        names[base] = names.get(base, 0) + 1
        name = base if names[base] == 1 else f"{base}-{names[base]}"
        rules.append({"name": f"run-{name}", "program": [program], "decision": "allow"})
    return rules


def render_commands(seen: ExecsSeen) -> list[str]:
    """The YAML lines of the `commands` section for `evidence profile` (values as JSON strings)."""
    import json

    lines = ["commands:", "  default: deny"]
    rules = profile_rules(seen)
    if not rules:
        return [*lines, "  rules: []"]
    lines.append("  rules:")
    for r in rules:
        lines.append(f"    - name: {json.dumps(r['name'])}")
        lines.append(f"      program: [{json.dumps(r['program'][0])}]")
        lines.append("      decision: allow")
    return lines


def unallowed_programs(commands: CommandsPolicy | None, seen: ExecsSeen) -> list[str]:
    """The programs the run executed that `commands` would not let run at its first process's depth
    or any other (profile's check of its own output): each must be allowed by some rule."""
    if commands is None:
        return sorted(seen.programs)
    from evidence.policy.paths import canonical_path

    return sorted(p for p in seen.programs if decide(commands, canonical_path(p), [p], 0).runs is not True)
