"""`evidence show --format html > report.html`: one self-contained page, readable without JavaScript.

At the top the run's labels and what verification proved; then the process tree (nested lists, each
process with children folded in a `<details>`), files by access, network, denials, loss and lint's
findings. The page holds no script and loads nothing: its only style is inline, and a
Content-Security-Policy (`default-src 'none'`) forbids anything else, so even a browser that was
handed a forged page would run nothing of it. Every name from the bundle goes through
text.printable (control and bidi characters written out) and html.escape (quotes too): it is text,
never markup. The tree nests at most MAX_NEST deep (a hostile bundle may nest a million processes);
deeper processes are listed at that level with their depth.
"""

from __future__ import annotations

import html
import logging
from typing import TypeVar

from evidence.bundle import show
from evidence.bundle.text import join_lines, printable

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAX_NEST = 32
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src 'none'; form-action 'none'"
STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 72em; padding: 0 1em; color: #1f2328; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #d0d7de; }
code, pre { font: 12.5px ui-monospace, monospace; background: #f6f8fa; padding: 0 .25em; word-break: break-all; }
table { border-collapse: collapse; } th, td { border: 1px solid #d0d7de; padding: .2em .5em; text-align: left; vertical-align: top; }
ul.tree, ul.tree ul { list-style: none; padding-left: 1.2em; margin: 0; } ul.tree { padding-left: 0; }
ul.tree li { margin: .1em 0; } details > summary { cursor: pointer; }
.ok { color: #1a7f37; font-weight: 600; } .bad { color: #cf222e; font-weight: 600; }
.warn { color: #9a6700; font-weight: 600; } .note { color: #57606a; }
.failed { color: #cf222e; }
"""


def esc(text: str) -> str:
    """A name as HTML text: printable, then escaped (quotes too: safe in attributes as well)."""
    return html.escape(printable(text), quote=True)


def _code(text: str) -> str:
    return f"<code>{esc(text)}</code>"


def _times(n: int) -> str:
    return f" ×{n}" if n > 1 else ""


def _more(n_all: int, limit: int, tag: str = "p") -> list[str]:
    if limit and n_all > limit:
        return [
            f'<{tag} class="note">… {n_all - limit} more (<code>evidence show --limit 0</code> lists all)</{tag}>'
        ]
    return []


def _cut(items: list[T], limit: int) -> list[T]:
    return items[:limit] if limit else items


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    """A table; `head` is ours, the cells are HTML already."""
    if not rows:
        return ["<p>none</p>"]
    out = ["<table>", "<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    out += ["<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows]
    return out + ["</table>"]


def _process(s: show.Summary, pid: int) -> str:
    parts = []
    for i, (_, shown, result) in enumerate(s.procs[pid]):
        status = "" if result == 0 else f' <span class="failed">[failed: {esc(str(result))}]</span>'
        lead = f"{pid} " if i == 0 else " → exec "
        parts.append(f"{lead}{_code(shown)}{status}")
    return "".join(parts)


def tree(s: show.Summary, limit: int) -> list[str]:
    """The process tree as nested lists: a process with children is a <details open>."""
    rows = list(show.walk(s))
    shown = _cut(rows, limit)
    has_kids = {pid for i, (depth, pid) in enumerate(rows[:-1]) if rows[i + 1][0] > depth}
    out = ['<ul class="tree">']
    level = 0  # lists open below the top one
    for depth, pid in shown:
        nest = min(depth, MAX_NEST)
        while level > nest:
            out.append("</ul></details></li>")
            level -= 1
        deep = f' <span class="note">(depth {depth})</span>' if depth > MAX_NEST else ""
        item = _process(s, pid) + deep
        if pid in has_kids and depth < MAX_NEST:
            out.append(f"<li><details open><summary>{item}</summary><ul>")
            level += 1
        else:
            out.append(f"<li>{item}</li>")
    out += ["</ul></details></li>"] * level + ["</ul>"]
    return out + _more(len(rows), limit)


def _signature(linted: show.Linted) -> str:
    if not linted.keyids:
        return (
            '<p><span class="warn">Not signed</span>: verification proves the bundle whole, not who '
            "wrote it.</p>"
        )
    keys = ", ".join(_code(k) for k in linted.keyids)
    return (
        f"<p>Signed by keyid {keys}: the signature is not checked here; check it with "
        "<code>evidence verify BUNDLE --key KEY.pub</code>.</p>"
    )


def _header(s: show.Summary, linted: show.Linted, path: str) -> list[str]:
    m = s.manifest
    failed = s.finished is None or bool(s.finished.get("signal")) or s.finished.get("exit_code") != 0
    exit_cls = "bad" if failed else "ok"
    out = [
        f"<h1>evidence: {_code(show.argv_text(m['command']))}</h1>",
        '<p><span class="ok">Verified</span>: the bundle is whole and consistent with its manifest '
        f"(file hash, root hash <code>{esc(m['root_hash'][:16])}…</code>, {m['events']} events in "
        "sequence).</p>",
        _signature(linted),
    ]
    facts = [
        ("bundle", _code(path)),
        ("run", _code(m["run_id"])),
        ("exit", f'<span class="{exit_cls}">{esc(show.exit_text(s))}</span>'
         + (' <span class="bad">(cut short)</span>' if m.get("cut_short") else "")),
        ("command", _code(show.argv_text(m["command"]))),
        *([("claimed", _code(show.argv_text(m.get("claimed_command") or [])))] if show.claimed_differs(m) else []),
        ("cwd", _code(m["cwd"])),
        ("time", f"{esc(m['started_at'])} .. {esc(m['finished_at'])}"
         + (f" ({esc(show.duration_text(s))})" if s.finished else "")),
        ("lost", f'<span class="bad">{esc(show.lost_text(m))}: what is absent may not have been recorded</span>'
         if m["lost"]["total"] else "none"),
        ("policy", "observe only" if m.get("policy") is None else "enforced"),
        ("detail", esc(m["detail"])),
        ("recorder", esc(" ".join(str(v) for v in m["producer"].values()))),
    ]  # fmt: skip
    out += ["<table>"] + [f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in facts] + ["</table>"]
    labels = m.get("labels") or {}
    out += ["<h2>Labels</h2>"] + _table(
        ["label", "value"], [[_code(k), _code(v)] for k, v in sorted(labels.items())]
    )
    if s.degradations:
        out += ["<h2>Degraded</h2>", "<ul>"] + [f"<li>{_code(d)}</li>" for d in s.degradations] + ["</ul>"]
    if s.namespaces:
        out += ["<h2>Namespaces, mounts and ptrace</h2>", "<ul>"]
        out += [f"<li>{_code(n)}</li>" for n in s.namespaces] + ["</ul>"]
    counts = {
        sev: sum(1 for f in linted.findings if f.rule.severity == sev) for sev in ("error", "warning", "note")
    }
    out.append(
        f'<p>Lint: <span class="{"bad" if counts["error"] else "ok"}">{counts["error"]} errors</span>, '
        f'<span class="{"warn" if counts["warning"] else "ok"}">{counts["warning"]} warnings</span>, '
        f"{counts['note']} notes.</p>"
    )
    return out


def render(s: show.Summary, linted: show.Linted, limit: int = 50, *, path: str = "") -> str:
    m = s.manifest
    out = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        '<meta name="referrer" content="no-referrer">',
        f"<title>evidence report: {esc(m['run_id'])}</title>",
        "<style>",
        *STYLE.strip().splitlines(),
        "</style>",
        "</head>",
        "<body>",
    ]
    out += _header(s, linted, path)
    n_exec = sum(len(v) for v in s.procs.values())
    out += [f"<h2>Processes ({n_exec} execs)</h2>"] + (tree(s, limit) if s.procs else ["<p>none</p>"])

    n_files = sum(len(g) for g in s.files.values())
    out.append(f"<h2>Files ({n_files} paths)</h2>")
    for klass in show.file_classes(s):
        entries = sorted(s.files[klass].items())
        out.append(
            f"<details{' open' if klass != 'read' else ''}><summary>{esc(klass)} ({len(entries)})</summary><ul>"
        )
        out += [f"<li>{_code(p)}{_times(c[0])}</li>" for p, c in _cut(entries, limit)]
        out += _more(len(entries), limit, "li") + ["</ul></details>"]
    if not s.files:
        out.append("<p>none</p>")

    out.append(f"<h2>Network ({len(s.network)} destinations)</h2>")
    rows = [[_code(d), _code(v[1] or "?"), str(v[0])] for d, v in _cut(sorted(s.network.items()), limit)]
    out += _table(["destination", "by", "count"], rows) + _more(len(s.network), limit)

    out.append(f"<h2>DNS ({len(s.dns)} queries)</h2>")
    rows = [[_code(q), _code(v[1] or "?"), str(v[0])] for q, v in _cut(sorted(s.dns.items()), limit)]
    out += _table(["query", "by", "count"], rows) + _more(len(s.dns), limit)

    out.append(f"<h2>Denials ({len(s.denials)})</h2>")
    rows = [[_code(k), str(v[0])] for k, v in _cut(sorted(s.denials.items()), limit)]
    out += _table(["denial", "count"], rows) + _more(len(s.denials), limit)
    if s.exec_denials or s.approvals or s.audits:  # a section only when the policy governed commands
        out.append(
            f"<h2>Commands ({len(s.exec_denials)} refused, {len(s.approvals)} approvals, "
            f"{len(s.audits)} audited)</h2>"
        )
        rows = [[_code(k), str(v[0])] for k, v in _cut(sorted(s.exec_denials.items()), limit)]
        out += _table(["refused exec (rule: program)", "count"], rows) + _more(len(s.exec_denials), limit)
        rows = [[_code(a)] for a in _cut(show.approval_lines(s), limit)]
        out += _table(["approval"], rows) + _more(len(s.approvals), limit)
        rows = [[_code(k), str(v[0])] for k, v in _cut(sorted(s.audits.items()), limit)]
        out += _table(["audited exec (rule: program)", "count"], rows) + _more(len(s.audits), limit)

    out.append("<h2>Loss</h2>")
    by_kind = {**m["lost"]["by_kind"], **{k: v for k, v in s.lost.items() if k not in m["lost"]["by_kind"]}}
    rows = [[_code(k), str(v)] for k, v in sorted(by_kind.items()) if v]
    out += _table(["kind", "events lost"], rows)

    out.append(f"<h2>Lint findings ({len(linted.findings)})</h2>")
    rows = [
        [f'<span class="{ {"error": "bad", "warning": "warn"}.get(f.rule.severity, "note") }">{f.rule.severity}</span>',
         f"{f.rule.code} {f.rule.name}", _code(f.message), str(f.count),
         "" if f.seq is None else str(f.seq)]
        for f in _cut(linted.findings, limit)
    ]  # fmt: skip
    out += _table(["severity", "rule", "finding", "count", "event"], rows) + _more(
        len(linted.findings), limit
    )
    if linted.dropped:
        out.append(f'<p class="note">{linted.dropped} more findings not listed.</p>')
    if s.untracked:
        out.append(
            f'<p class="note">{s.untracked} events beyond {show.MAX_TRACKED} distinct entries per section are not listed.</p>'
        )
    out += ["</body>", "</html>"]
    return join_lines(out)
