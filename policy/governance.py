"""What governs a job's commands: the policy's `commands` (rules by program, arguments and depth),
`approvals` (how long a held exec waits, and what a timeout decides) and `limits` (memory, pids, cpu,
wall) sections, validated when loaded, and the summary of the commands in force for the manifest.

Matching is policy/commands.py's; applying limits is agent/recorder/limits.py's. docs/policy-format.md
is the prose version.
"""

from __future__ import annotations

import re
from functools import cached_property
from typing import Annotated, Any, Literal, TypedDict

from pydantic import (
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    Strict,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from evidence.policy.paths import canonical_glob, canonical_path, expand_variables, glob_regex, is_glob

_FROZEN = ConfigDict(extra="forbid", frozen=True)

DECISIONS = ("allow", "deny", "approve", "audit")
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_DURATION_UNITS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}


def parse_duration_ms(value: Any) -> int:
    """`90`, `90s`, `1.5m`, `500ms`, `2h` -> milliseconds (a bare number is seconds); > 0."""
    if isinstance(value, bool):
        raise ValueError("a duration such as '60s', '30m' or '2h'")
    if isinstance(value, (int, float)):
        value = f"{value}s"
    m = _DURATION_RE.match(value) if isinstance(value, str) else None
    if m is None:
        raise ValueError(f"{value!r}: not a duration (a number and ms, s, m or h, e.g. '60s', '30m')")
    ms = round(float(m.group(1)) * _DURATION_UNITS[m.group(2) or "s"])
    if ms <= 0:
        raise ValueError(f"{value!r}: a duration must be more than 0")
    return ms


class ProgramPattern(BaseModel):
    """One entry of a rule's `program`: an absolute path, an absolute glob, a name or a name glob.

    `kind` is one of `path`, `glob`, `name`, `name_glob`; `pattern` is what is matched (an absolute
    path canonicalised like fs entries: symlinks resolved, so `/bin/sh` names what really runs)."""

    model_config = _FROZEN
    text: str
    kind: Literal["path", "glob", "name", "name_glob"]
    pattern: str

    @cached_property
    def _regex(self) -> re.Pattern[str]:
        if self.kind == "glob":
            return glob_regex(self.pattern, beneath=False)
        return glob_regex(self.pattern.replace("**", "*"), beneath=False)  # name_glob: one component

    def matches(self, exe: str) -> bool:
        """Whether the program really executed (an absolute, resolved path) is this one."""
        if self.kind == "path":
            return exe == self.pattern
        if self.kind == "glob":
            return bool(self._regex.match(exe))
        name = exe.rsplit("/", 1)[-1]
        if self.kind == "name":
            return name == self.pattern
        return bool(self._regex.match(name))


def _program_pattern(value: Any, info: ValidationInfo) -> Any:
    from evidence.bundle.format import has_dotdot  # (not at the top: the exec supervisor's process)

    if isinstance(value, ProgramPattern):
        return value
    if not isinstance(value, str) or not value.strip():
        raise ValueError("a program is a name ('git'), an absolute path or a glob ('/usr/bin/python3*')")
    if value != value.strip() or "\x00" in value:
        raise ValueError(f"{value!r}: leading or trailing blanks or NUL in a program")
    variables = (info.context or {}).get("variables", {})
    expanded = expand_variables(value, variables)
    if expanded.startswith("/"):
        if has_dotdot(expanded) or "/./" in expanded + "/":
            raise ValueError(f"{value!r}: '.' or '..' in a program path")
        if is_glob(expanded):
            return {"text": value, "kind": "glob", "pattern": canonical_glob(expanded)}
        return {"text": value, "kind": "path", "pattern": canonical_path(expanded)}
    if "/" in expanded:
        raise ValueError(f"{value!r}: a program is a name without '/' or an absolute path")
    return {"text": value, "kind": "name_glob" if is_glob(expanded) else "name", "pattern": expanded}


ProgramItem = Annotated[ProgramPattern, BeforeValidator(_program_pattern)]


class DepthRange(BaseModel):
    """Process depth in the run's tree: 0 is the run's first process, each fork adds one; an exec
    keeps the depth of the process that calls it. `max` None is unbounded."""

    model_config = _FROZEN
    min: int = Field(default=0, ge=0)
    max: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> DepthRange:
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max ({self.max}) is below min ({self.min})")
        return self

    def contains(self, depth: int) -> bool:
        return depth >= self.min and (self.max is None or depth <= self.max)

    @property
    def rank(self) -> int:
        """2 bounded (direct, {max: N}), 1 from a depth on (nested, {min: N}), 0 any depth."""
        if self.max is not None:
            return 2
        return 1 if self.min > 0 else 0

    def text(self) -> str:
        if (self.min, self.max) == (0, 0):
            return "direct"
        if (self.min, self.max) == (1, None):
            return "nested"
        if (self.min, self.max) == (0, None):
            return "any"
        return f"{{min: {self.min}, max: {'null' if self.max is None else self.max}}}"


def _depth(value: Any) -> Any:
    named = {"direct": (0, 0), "nested": (1, None), "any": (0, None)}
    if isinstance(value, str):
        if value not in named:
            raise ValueError(f"{value!r}: depth is direct, nested, any or {{min: N, max: M}}")
        lo, hi = named[value]
        return {"min": lo, "max": hi}
    if isinstance(value, bool) or not isinstance(value, (dict, DepthRange)):
        raise ValueError("depth is direct, nested, any or {min: N, max: M}")
    return value


def _one_or_more(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


class CommandRule(BaseModel):
    """One entry of commands.rules (docs/policy-format.md, "Commands")."""

    model_config = _FROZEN
    name: str = Field(min_length=1, max_length=128)
    program: Annotated[tuple[ProgramItem, ...], BeforeValidator(_one_or_more)] = Field(min_length=1)
    args: tuple[str, ...] = ()
    depth: Annotated[DepthRange, BeforeValidator(_depth)] = Field(default_factory=DepthRange)
    decision: Literal["allow", "deny", "approve", "audit"]
    message: str | None = Field(default=None, max_length=512)


class CommandsPolicy(BaseModel):
    model_config = _FROZEN
    default: Literal["allow", "deny"] = "allow"
    rules: tuple[CommandRule, ...] = ()

    @model_validator(mode="after")
    def _unique_names(self) -> CommandsPolicy:
        seen: set[str] = set()
        for rule in self.rules:
            if rule.name in seen:
                raise ValueError(f"two rules are named {rule.name!r}: a denial names its rule")
            seen.add(rule.name)
        return self


class ApprovalsPolicy(BaseModel):
    """How long an `approve` decision waits for a person, and what a timeout means."""

    model_config = _FROZEN
    timeout_ms: Annotated[int, BeforeValidator(parse_duration_ms)] = Field(default=60_000, alias="timeout")
    on_timeout: Literal["deny", "allow"] = "deny"


def _byte_size(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("a size such as '2GiB' or '512MiB'")
    try:
        size = int(TypeAdapter(ByteSize).validate_python(value))
    except ValidationError:
        raise ValueError(
            f"{value!r}: not a size (bytes, or a number and KiB, MiB, GiB, KB, MB, GB)"
        ) from None
    if size <= 0:
        raise ValueError(f"{value!r}: a size must be more than 0")
    return size


def _cpus(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("cpu is a number of CPUs, such as 1.5")
    millis = round(float(value) * 1000)
    if millis < 10:
        raise ValueError(f"{value!r}: at least 0.01 CPU")
    return millis


class LimitsPolicy(BaseModel):
    """Resource limits on the run's cgroup. Sizes in bytes, cpu in thousandths of a CPU, wall in ms."""

    model_config = _FROZEN
    memory: Annotated[int, BeforeValidator(_byte_size)] | None = None
    pids: Annotated[int, Strict()] | None = Field(default=None, ge=1, le=4_194_304)
    cpu_millis: Annotated[int, BeforeValidator(_cpus)] | None = Field(default=None, alias="cpu")
    wall_ms: Annotated[int, BeforeValidator(parse_duration_ms)] | None = Field(default=None, alias="wall")

    def summary(self) -> dict[str, int]:
        """The limits set (no floats): memory bytes, pids, cpu_millis, wall_ms."""
        out = {
            "memory": self.memory,
            "pids": self.pids,
            "cpu_millis": self.cpu_millis,
            "wall_ms": self.wall_ms,
        }
        return {k: v for k, v in out.items() if v is not None}


class CommandRuleSummary(TypedDict):
    """A command rule as the manifest's policy summary lists it."""

    name: str
    program: list[str]  # the patterns as written
    args: list[str]
    depth: str
    decision: Literal["allow", "deny", "approve", "audit"]


class CommandsSummary(TypedDict):
    """policy.commands in the manifest's policy summary (`commands_summary`)."""

    default: Literal["allow", "deny"]
    rule_count: int
    decisions: dict[str, int]  # decision -> how many rules have it (those with some)
    rules: list[CommandRuleSummary]


def commands_summary(commands: CommandsPolicy) -> CommandsSummary:
    """The commands section in force, for the manifest: its default, how many rules of each
    decision, and each rule (name, program as written, args, depth, decision)."""
    counts = {d: sum(r.decision == d for r in commands.rules) for d in DECISIONS}
    return {
        "default": commands.default,
        "rule_count": len(commands.rules),
        "decisions": {d: n for d, n in counts.items() if n},
        "rules": [
            {
                "name": r.name,
                "program": [p.text for p in r.program],
                "args": list(r.args),
                "depth": r.depth.text(),
                "decision": r.decision,
            }
            for r in commands.rules
        ],
    }
