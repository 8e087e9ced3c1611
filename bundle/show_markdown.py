"""`evidence show --format markdown`: the summary as GitHub-flavoured Markdown, for a job's page
(`>> $GITHUB_STEP_SUMMARY`).

A summary line first, the loss warning, then the process tree, files by access, network, denials and
lint's findings, each folded in a `<details>` block. Every name from the bundle (a path, an argv, an
address, a rule) is written as a code span: inside one, Markdown, HTML, entities and autolinks mean
nothing. The span's backtick fence is longer than any run of backticks in the name, control and
bidi characters are written out (text.printable), a `|` in a table cell is `\\|` (GFM unescapes it
before the cell's inline content is read, even in a code span) and no name starts a line, so a
hostile name can neither add markup or a link nor break a table, a list or a block. Names are cut at
MAX_NAME characters and each section at --limit entries: GitHub takes at most 1 MiB per step.
"""

from __future__ import annotations

import logging
import re
from typing import TypeVar

from evidence.bundle import show
from evidence.bundle.read_types import ManifestJSON
from evidence.bundle.text import join_lines, printable

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAX_NAME = 500  # characters of one name
_TICKS = re.compile(r"`+")


def code(text: str, *, cell: bool = False) -> str:
    """`text` as a Markdown code span that shows exactly its (printable) characters."""
    s = _cut_line(printable(text), MAX_NAME)
    if not s:
        return '`""`'
    fence = "`" * (max((len(m) for m in _TICKS.findall(s)), default=0) + 1)
    if s[0] in "` " or s[-1] in "` ":
        s = f" {s} "  # one space each side is taken off again
    if cell:
        s = s.replace("|", "\\|")
    return f"{fence}{s}{fence}"


def _cut_line(s: str, width: int) -> str:
    return s if len(s) <= width else s[: width - 3] + "..."


def _times(n: int) -> str:
    return f" ×{n}" if n > 1 else ""


def _details(title: str, body: list[str], open_: bool = False) -> list[str]:
    """A folded block; `title` is ours (fixed words and numbers), never a name."""
    return [f"<details{' open' if open_ else ''}><summary>{title}</summary>", "", *body, "", "</details>", ""]


def _more(n_all: int, limit: int) -> list[str]:
    return (
        [f"- … {n_all - limit} more (`evidence show --limit 0` lists all)"] if limit and n_all > limit else []
    )


def _cut(items: list[T], limit: int) -> list[T]:
    return items[:limit] if limit else items


def _exit(s: show.Summary) -> str:
    """show.exit_text, with the signal's name (the bundle's) as a code span."""
    if s.finished is not None and s.finished.get("signal"):
        return f"killed by {code(str(s.finished['signal']))}"
    return show.exit_text(s)


def _lost(m: ManifestJSON) -> str:
    """show.lost_text, with each kind (the bundle's) as a code span."""
    total = m["lost"]["total"]
    kinds = ", ".join(f"{code(k)} {v}" for k, v in m["lost"]["by_kind"].items() if v)
    return f"{total} events ({kinds})" if total else "none"


def render(s: show.Summary, linted: show.Linted, limit: int = 50) -> str:
    m = s.manifest
    n_exec = sum(len(v) for v in s.procs.values())
    n_files = sum(len(g) for g in s.files.values())
    findings = linted.findings
    worst = {sev: sum(1 for f in findings if f.rule.severity == sev) for sev in ("error", "warning", "note")}
    exit_ = _exit(s) + (" (cut short)" if m.get("cut_short") else "")
    duration = f" · {show.duration_text(s)}" if s.finished else ""
    out = [
        f"### evidence: {code(show.argv_text(m['command']))} · exit {exit_}{duration}",
        "",
        f"{n_exec} execs · {n_files} files · {len(s.network)} destinations · {len(s.denials)} denials · "
        f"lost: {_lost(m)} · lint: {worst['error']} errors, {worst['warning']} warnings, "
        f"{worst['note']} notes · run {code(m['run_id'])} · bundle verified, "
        + (
            f"signed by keyid {', '.join(code(k) for k in linted.keyids)} (not checked here)"
            if linted.keyids
            else "not signed"
        ),
        "",
    ]
    labels = sorted((m.get("labels") or {}).items())
    if labels:
        shown = ", ".join(code(f"{k}={v}") for k, v in _cut(labels, limit))
        out += [
            f"Labels: {shown}"
            + (f" and {len(labels) - limit} more" if limit and len(labels) > limit else ""),
            "",
        ]
    if m["lost"]["total"]:
        out += [
            f"> **Warning:** {_lost(m)} were lost: what is absent may not have been recorded.",
            "",
        ]
    if s.degradations:
        out += ["> **Degraded:** " + "; ".join(code(d) for d in _cut(s.degradations, limit)), ""]
    if s.namespaces:
        out += [
            "**Namespaces, mounts and ptrace:** " + "; ".join(code(n) for n in _cut(s.namespaces, limit)),
            "",
        ]
    if m.get("policy") is None:
        out += ["Observe only: no policy was in force.", ""]

    tree = [_cut_line(printable(line), 2 * MAX_NAME) for line in show.tree_lines(s, limit)] or ["  none"]
    fence = "`" * max(3, max((len(t) for line in tree for t in _TICKS.findall(line)), default=0) + 1)
    out += _details(f"Processes ({n_exec} execs)", [fence + "text", *tree, fence])

    body: list[str] = []
    for klass in show.file_classes(s):
        group = s.files[klass]
        entries = sorted(group.items())
        body += [f"**{klass}** ({len(entries)})", ""]
        body += [f"- {code(p)}{_times(c[0])}" for p, c in _cut(entries, limit)]
        body += _more(len(entries), limit) + [""]
    out += _details(f"Files ({n_files} paths)", body or ["none"])

    rows = [
        f"| {code(dest, cell=True)} | {code(v[1] or '?', cell=True)} | {v[0]} |"
        for dest, v in _cut(sorted(s.network.items()), limit)
    ]
    table = ["| destination | by | count |", "| --- | --- | --- |", *rows] if rows else ["none"]
    out += _details(f"Network ({len(s.network)} destinations)", table + _more(len(s.network), limit))

    rows = [
        f"| {code(q, cell=True)} | {code(v[1] or '?', cell=True)} | {v[0]} |"
        for q, v in _cut(sorted(s.dns.items()), limit)
    ]
    if rows:  # a section only when the run resolved names
        table = ["| query | by | count |", "| --- | --- | --- |", *rows]
        out += _details(f"DNS ({len(s.dns)} queries)", table + _more(len(s.dns), limit))

    rows = [f"| {code(k, cell=True)} | {v[0]} |" for k, v in _cut(sorted(s.denials.items()), limit)]
    table = ["| denial | count |", "| --- | --- |", *rows] if rows else ["none"]
    out += _details(f"Denials ({len(s.denials)})", table + _more(len(s.denials), limit), bool(rows))

    if s.exec_denials or s.approvals or s.audits:  # a section only when the policy governed commands
        rows = [
            f"| refused | {code(k, cell=True)} | {v[0]} |"
            for k, v in _cut(sorted(s.exec_denials.items()), limit)
        ]
        rows += [f"| approval | {code(a, cell=True)} | 1 |" for a in _cut(show.approval_lines(s), limit)]
        rows += [
            f"| audit | {code(k, cell=True)} | {v[0]} |" for k, v in _cut(sorted(s.audits.items()), limit)
        ]
        table = ["| what | exec | count |", "| --- | --- | --- |", *rows]
        more = (
            _more(len(s.exec_denials), limit) + _more(len(s.approvals), limit) + _more(len(s.audits), limit)
        )
        out += _details(
            f"Commands ({len(s.exec_denials)} refused, {len(s.approvals)} approvals, {len(s.audits)} audited)",
            table + more,
            True,
        )

    rows = [
        f"| {f.rule.severity} | {f.rule.code} {f.rule.name} | {code(f.message, cell=True)} | {f.count} |"
        for f in _cut(findings, limit)
    ]
    table = (
        ["| severity | rule | finding | count |", "| --- | --- | --- | --- |", *rows] if rows else ["none"]
    )
    dropped = [f"- {linted.dropped} more findings not listed"] if linted.dropped else []
    out += _details(f"Lint findings ({len(findings)})", table + _more(len(findings), limit) + dropped)
    if s.untracked:
        out.append(
            f"_{s.untracked} events beyond {show.MAX_TRACKED} distinct entries per section are not listed._"
        )
    return join_lines(out)
