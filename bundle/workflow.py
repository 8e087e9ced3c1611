"""GitHub Actions workflow commands (`::error title=...::message`) for `evidence lint --format github`.

GitHub reads a line of a step's output that starts with `::` as a command. Whatever a bundle names
(a path, an argv, a subject) is escaped so it can neither end the command nor start another: the
message escapes `%`, CR and LF (`%25`, `%0D`, `%0A`), a property value also `:` and `,` (`%3A`,
`%2C`), as GitHub's own toolkit does (actions/toolkit, `command.ts`). Control and bidi characters
are written out first (text.printable), so an annotation reads as the bundle's bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from evidence.bundle.text import join_lines, printable

if TYPE_CHECKING:
    from evidence.bundle.lint_rules import Finding

logger = logging.getLogger(__name__)

# lint's severities (SARIF levels) -> workflow commands
COMMAND = {"error": "error", "warning": "warning", "note": "notice"}


def escape_data(s: str) -> str:
    """A command's message (what follows the second `::`)."""
    return s.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(s: str) -> str:
    """A property value (`title=...`)."""
    return escape_data(s).replace(":", "%3A").replace(",", "%2C")


def command(name: str, message: str, **properties: str) -> str:
    """One workflow command line, without its newline."""
    props = ",".join(f"{k}={escape_property(printable(v))}" for k, v in properties.items() if v)
    return f"::{name}{' ' + props if props else ''}::{escape_data(printable(message))}"


def render_lint(path: str, findings: Sequence[Finding], dropped: int, signature: str = "") -> str:
    """One annotation per finding (error, warning or notice), then a plain summary line (with what
    lint says of the signature)."""
    out = []
    for f in findings:
        where = f" [event {f.seq}]" if f.seq is not None else ""
        times = f" (x{f.count})" if f.count > 1 else ""
        out.append(
            command(
                COMMAND[f.rule.severity],
                f"{f.message}{times}{where}",
                title=f"evidence {f.rule.code} {f.rule.name}",
            )
        )
    more = f" ({dropped} more not listed)" if dropped else ""
    out.append(
        f"evidence lint: {path}: {len(findings)} findings{more}" + (f"; {signature}" if signature else "")
    )
    return join_lines(out)  # the commands are printable already: unchanged


def render_problems(path: str, problems: Iterable[str]) -> str:
    """The reasons a bundle failed verification, as error annotations."""
    return "".join(
        command("error", f"{path}: {p}", title="evidence: bundle failed verification") + "\n"
        for p in problems
    )
