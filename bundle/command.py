"""The run's command: what the kernel executed, not what the caller claims.

A run whose command is started inside it (`evidence run`, which execs it, and `evidence run --agent`,
whose client forks it and has the agent isolate it before it execs) is described by the argv of its
first process's first successful exec, as the kernel copied it into the new program's memory (the
probe reads it at sched_process_exec, before the program runs an instruction): the manifest's
`command`. What the caller asked for is kept as `claimed_command`. A client of the agent is not
trusted: one that claims `make test` and execs `sh -c 'cat SECRET'` must not get a signed bundle that
says `make test`.

They agree when the kernel's argv is the claim, or, for a `#!` script (the exec record names its
interpreter), when it is the interpreter and its optional argument, the script's name as it was
executed (naming the exec's file), then the claim's arguments, and the claim's first word names the
script (the same name or, without a slash, its last component: a PATH lookup). Anything else is a
difference: a degradation with component COMPONENT, which lint reports as EV014 (an error); so is a
run in which no such exec was recorded (the exec failed, the client made none, or its record was
lost). An argv longer than the probe reads (argv_truncated) is checked up to where the kernel's copy
ends: the rest cannot be, which a degradation of the recorder says (a warning). An empty claim (an
API client that sent no command) contradicts nothing.

argv[0] is whatever the caller passed to execve, in any exec: which program ran is said by the
first process's exec event (`filename`, `sha256`), not by argv.

Pure: `judge` takes the claim and that exec record (the correlator keeps it as the run goes,
agent/recorder/correlate.py `root_exec`; recovery finds it in the spool).
"""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

COMPONENT = "command"  # the degradation's component when the command is not the claimed one (EV014)
_SHOWN = 200  # characters of an argv shown in a degradation


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The manifest's command (the kernel's argv; empty when no exec was recorded), and the
    degradation that says how it differs from the claim, if it does or cannot be checked whole."""

    command: list[str]
    degradation: dict[str, str] | None = None


def kernel_text(arg: str) -> str:
    """An argument as the recorder writes the kernel's copy of it: bytes that are not UTF-8 as
    \\xNN (a claim made by Python holds them as lone surrogates)."""
    try:
        return os.fsencode(arg).decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate no file name can hold: compared as it is
        return arg


def judge(claimed: Sequence[str], exec_rec: Mapping[str, Any] | None) -> Verdict:
    """The command of a run that claimed `claimed`, whose first process's first successful exec is
    `exec_rec` (None: none was recorded)."""
    claim = [kernel_text(a) for a in claimed]
    if not claim:  # nothing claimed (an API client may send no command): nothing to contradict
        return Verdict([str(a) for a in exec_rec.get("argv") or []] if exec_rec is not None else [])
    if exec_rec is None:
        return Verdict(
            [],
            {
                "component": COMPONENT,
                "reason": f"no exec of the claimed command {_show(claim)} by the run's first process "
                "was recorded: it never ran (its exec failed, or none was made), or its record was lost",
                "impact": "the manifest's command is empty; the claim is kept as claimed_command",
            },
        )
    argv = [str(a) for a in exec_rec.get("argv") or []]
    truncated = bool(exec_rec.get("argv_truncated"))
    for expected in _expected(claim, argv, exec_rec):
        if argv == expected:
            return Verdict(argv)
        if truncated and _prefix(argv, expected):
            return Verdict(
                argv,
                {
                    "component": "recorder",
                    "reason": "the command's argv is longer than the recorder reads: the kernel's copy "
                    "agrees with the claim as far as it was read, the rest was not checked",
                    "impact": "the manifest's command is cut where the recorder stopped reading; "
                    "claimed_command holds the claim whole",
                },
            )
    return Verdict(
        argv,
        {
            "component": COMPONENT,
            "reason": f"the kernel executed {_show(argv)}{' (cut)' if truncated else ''}, "
            f"not the claimed {_show(claim)}",
            "impact": "the manifest's command is what the kernel executed; the claim is kept as claimed_command",
        },
    )


def _expected(claim: list[str], argv: list[str], exec_rec: Mapping[str, Any]) -> list[list[str]]:
    """The argvs the kernel gives the claim: the claim itself, and for a `#!` script, the
    interpreter's (and its one optional argument's) before the script's name as executed."""
    out = [claim]
    interpreter = exec_rec.get("interpreter")
    if not claim or not interpreter or not argv or argv[0] != interpreter:
        return out
    for k in (1, 2):  # the interpreter, then its optional argument
        if len(argv) > k and _names_file(argv[k], exec_rec) and _names_script(claim[0], argv[k]):
            out.append([*argv[: k + 1], *claim[1:]])
    return out


def _names_file(name: str, exec_rec: Mapping[str, Any]) -> bool:
    """Whether `name` (as passed to execve) names the file the exec record says ran."""
    filename = exec_rec.get("filename")
    if name == filename:
        return True
    cwd = exec_rec.get("cwd")
    if not isinstance(filename, str) or not isinstance(cwd, str) or name.startswith("/"):
        return False
    return posixpath.normpath(posixpath.join(cwd, name)) == posixpath.normpath(filename)


def _names_script(word: str, name: str) -> bool:
    """Whether the claim's first word names the script executed as `name`: the same name, or
    without a slash (found on PATH) its last component."""
    return word == name or ("/" not in word and posixpath.basename(name) == word)


def _prefix(argv: list[str], expected: list[str]) -> bool:
    """Whether a cut argv is the start of `expected` (its last argument possibly cut too)."""
    if not argv or len(argv) > len(expected):
        return False
    return argv[:-1] == expected[: len(argv) - 1] and expected[len(argv) - 1].startswith(argv[-1])


def _show(argv: list[str]) -> str:
    text = json.dumps(argv, ensure_ascii=False)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."
