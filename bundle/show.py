"""`evidence show BUNDLE`: a readable summary of a verified bundle: plain text, Markdown or HTML.

The process tree (from process.exec pid/ppid), files grouped by access, network destinations,
denials, loss and the exit code. Sections list at most --limit entries (0: all). This module sums
the bundle up and writes the text; `show_markdown` (for $GITHUB_STEP_SUMMARY) and `show_html` (one
self-contained page, with lint's findings) render the same summary; the command is
bundle/commands/show.py.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any, cast

from evidence.bundle import format as fmt
from evidence.bundle import lint, reader
from evidence.bundle.lint_rules import Finding
from evidence.bundle.read_types import EventJSON, ManifestJSON
from evidence.bundle.text import join_lines

logger = logging.getLogger(__name__)

MAX_TRACKED = 100_000  # distinct processes / paths / destinations kept in memory


@dataclasses.dataclass
class Summary:
    """What show reports. As a fold (reader.Bundle.fold) it sums up a piece of the events, and
    `take` adds the pieces that follow, in order: a capped section keeps the entries first seen in
    the whole run, whichever process summed up which piece."""

    manifest: ManifestJSON
    started: dict[str, Any] | None = None
    finished: dict[str, Any] | None = None
    procs: dict[int, list[Exec]] = dataclasses.field(default_factory=dict)  # pid -> its execs
    # entries are [count, ..., events]: the operations' count (summary events count many), and the
    # events behind them (what "not listed" counts when a section is full)
    files: dict[str, dict[str, list[int]]] = dataclasses.field(
        default_factory=dict
    )  # class -> path -> [count, events]
    network: dict[str, list[Any]] = dataclasses.field(default_factory=dict)  # dest -> [count, exe, events]
    denials: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # what -> [count, events]
    dns: dict[str, list[Any]] = dataclasses.field(default_factory=dict)  # query -> [count, exe, events]
    # commands: execs refused by rule ("rule: refused PROGRAM" -> [count, events]); approvals by id,
    # the last event of each (a resolution repeats its request's fields) and its time
    exec_denials: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    approvals: dict[str, tuple[dict[str, Any], str]] = dataclasses.field(default_factory=dict)
    # execs an `audit` rule matched ("rule: ran PROGRAM" -> [count, events])
    audits: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    degradations: list[str] = dataclasses.field(default_factory=list)
    namespaces: list[str] = dataclasses.field(default_factory=list)  # namespace, mount, ptrace calls
    lost: dict[str, int] = dataclasses.field(default_factory=dict)
    untracked: int = 0

    def part(self, seq: int) -> Summary:
        """An empty summary for the events from `seq` on (what Bundle.fold folds into)."""
        return Summary(cast("ManifestJSON", {}))  # a part's manifest is never read: take() keeps its own

    def feed(self, ev: EventJSON) -> None:
        t, d = ev["type"], ev["data"]
        if t == fmt.FILE_OPEN:
            failed = d["result"] != 0
            klass = "failed" if failed else "+".join(sorted(set(d["access"]) - {"read"})) or "read"
            group = self.files.get(klass)
            if group is None:
                group = self.files[klass] = {}
            key = f"{d['path']} ({d['result']})" if failed else d["path"]
            entry = group.get(key)
            if entry is None:
                group[key] = [d.get("count", 1), 1]
            else:
                entry[0] += d.get("count", 1)
                entry[1] += 1
        elif t == fmt.FILE_CHANGE:
            failed = d["result"] != 0
            klass = "failed" if failed else d["operation"]
            group = self.files.setdefault(klass, {})
            name = d["path"] if d.get("target") is None else f"{d['path']} -> {d['target']}"
            key = f"{d['operation']} {name} ({d['result']})" if failed else name
            entry = group.get(key)
            if entry is None:
                group[key] = [d.get("count", 1), 1]
            else:
                entry[0] += d.get("count", 1)
                entry[1] += 1
        elif t == fmt.PROCESS_EXEC:
            self.procs.setdefault(d["pid"], []).append(
                (d["ppid"], _shown(d["filename"], d["argv"]), d["result"])
            )
        elif t == fmt.NETWORK_CONNECT:
            dest = ev["subject"] + ("" if d["result"] == 0 else f" ({d['result']})")
            if d.get("names"):  # what the run's configured resolvers named the address
                dest += f" [{' '.join(d['names'])}]"
            if d.get("other_names"):  # ... and other servers (never a key of diff)
                dest += f" [by another server: {' '.join(d['other_names'])}]"
            entry = self.network.setdefault(dest, [0, d.get("exe"), 0])
            entry[0] += d.get("count", 1)
            entry[2] += 1
        elif t == fmt.NETWORK_DNS:
            key = dns_text(d)
            entry = self.dns.setdefault(key, [0, d.get("exe"), 0])
            entry[0] += d.get("count", 1)
            entry[2] += 1
        elif t == fmt.POLICY_DENIAL:
            how = "denied" if d["enforced"] else "would deny"
            key = f"{how} {d['operation']} {d['target']} (rule {d['rule']}, by {d.get('exe') or '?'})"
            entry = self.denials.setdefault(key, [0, 0])
            entry[0] += d.get("count", 1)
            entry[1] += 1
            if d["operation"] == "exec":
                how = "refused" if d["enforced"] else "would refuse"
                entry = self.exec_denials.setdefault(f"{d['rule']}: {how} {d['target']}", [0, 0])
                entry[0] += d.get("count", 1)
                entry[1] += 1
        elif t == fmt.POLICY_APPROVAL:
            if d["id"] in self.approvals or len(self.approvals) < MAX_TRACKED:
                self.approvals[d["id"]] = (d, ev["time"])
            else:
                self.untracked += 1
        elif t == fmt.POLICY_AUDIT:
            entry = self.audits.setdefault(f"{d['rule']}: ran {d['program']}", [0, 0])
            entry[0] += 1
            entry[1] += 1
        elif t == fmt.POLICY_VIOLATION:  # the exec check: listed with the denials
            how = "killed" if d["killed"] else "could not kill"
            key = f"{how} exec {d.get('exe') or '?'}: not as decided ({', '.join(d['reasons'])}; rule {d['rule']})"
            entry = self.denials.setdefault(key, [0, 0])
            entry[0] += 1
            entry[1] += 1
        elif t == fmt.LOSS:
            self.lost[d["kind"]] = self.lost.get(d["kind"], 0) + d["count"]
        elif t == fmt.PROCESS_NAMESPACE:
            if len(self.namespaces) < MAX_TRACKED:
                flags = ",".join(d["flags"])
                what = " ".join(x for x in (d["operation"], flags, *d["paths"]) if x)
                if d.get("target_pid") is not None and d["operation"] != "clone":
                    what += f" pid {d['target_pid']}" + (
                        "" if d.get("target_in_run") else " (outside the run)"
                    )
                self.namespaces.append(f"{d.get('exe') or '?'} (pid {d['pid']}): {what} ({d['result']})")
        elif t == fmt.DEGRADATION:
            self.degradations.append(f"{d['component']}: {d['reason']} (impact: {d['impact']})")
        elif t == fmt.RUN_STARTED:
            self.started = d
        elif t == fmt.RUN_FINISHED:
            self.finished = d

    def take(self, part: Summary) -> None:
        """Adds the summary of the events that come next."""
        for pid, execs in part.procs.items():
            mine = self.procs.get(pid)
            if mine is not None:
                mine += execs
            elif len(self.procs) < MAX_TRACKED:
                self.procs[pid] = execs
            else:
                self.untracked += len(execs)
        for klass, group in part.files.items():
            self.untracked += _add_counts(self.files.setdefault(klass, {}), group)
        self.untracked += _add_counts(self.network, part.network)
        self.untracked += _add_counts(self.denials, part.denials)
        self.untracked += _add_counts(self.dns, part.dns)
        self.untracked += _add_counts(self.exec_denials, part.exec_denials)
        self.untracked += _add_counts(self.audits, part.audits)
        for aid, last in part.approvals.items():
            if aid in self.approvals or len(self.approvals) < MAX_TRACKED:
                self.approvals[aid] = last
            else:
                self.untracked += 1
        for kind, n in part.lost.items():
            self.lost[kind] = self.lost.get(kind, 0) + n
        self.degradations += part.degradations
        self.namespaces += part.namespaces[: max(0, MAX_TRACKED - len(self.namespaces))]
        self.started = part.started or self.started
        self.finished = part.finished or self.finished


Exec = tuple[int, str, Any]  # (ppid, command line as shown, result)


def dns_text(d: dict[str, Any]) -> str:
    """A DNS event in one line: "name TYPE -> addresses (result) via server", an answer credited to
    no query "... from source (unsolicited: why)", one of a server that is not the run's resolver
    marked so."""
    via = f"via {d['server']}" + (f":{d['port']}" if d.get("port") not in (None, 53) else "")
    if d.get("malformed"):
        what = "received" if d.get("received") else "sent"
        return f"malformed message {what} ({d.get('size', 0)} bytes) {via}"
    got = " ".join(d.get("addresses") or []) or "no address"
    result = "" if d["result"] == "NOERROR" else f" ({d['result']})"
    asked = f"{d.get('name') or '?'} {d.get('type') or '?'} -> {got}{result}"
    if d.get("unsolicited"):
        source = d.get("source")
        port = d.get("source_port")
        where = "an unknown source" if source is None else source + ("" if port is None else f":{port}")
        return f"{asked} from {where} (unsolicited: {d['unsolicited']}, names nothing)"
    if "configured_resolver" in d and not d["configured_resolver"]:
        via += " (not a configured resolver)"
    return f"{asked} {via}"


def _add_counts(mine: dict[str, list[Any]], theirs: dict[str, list[Any]]) -> int:
    """Adds their [count, ..., events] entries to mine (at most MAX_TRACKED keys); returns how many
    events were not kept."""
    dropped = 0
    for key, entry in theirs.items():
        have = mine.get(key)
        if have is not None:
            have[0] += entry[0]
            have[-1] += entry[-1]
        elif len(mine) < MAX_TRACKED:
            mine[key] = entry
        else:
            dropped += entry[-1]
    return dropped


def summarise(path: str) -> Summary:
    """Verify the bundle and sum it up (raises reader.VerificationError)."""
    bundle = reader.open_bundle(path)
    s = Summary(bundle.manifest)
    for part in bundle.fold(s.part):
        s.take(part)
    return s


@dataclasses.dataclass
class _Both:
    """show's fold and lint's over the same piece of events."""

    summary: Summary
    lint: Any  # what lint.Linter.start makes

    def feed(self, ev: EventJSON) -> None:
        self.summary.feed(ev)
        self.lint.feed(ev)


@dataclasses.dataclass
class _BothStart:
    summary: Callable[[int], Summary]
    lint: Callable[[int], Any]

    def __call__(self, seq: int) -> _Both:
        return _Both(self.summary(seq), self.lint(seq))


@dataclasses.dataclass
class Linted:
    """lint's verdict, found in the same pass as the summary."""

    findings: list[Finding]
    dropped: int
    keyids: tuple[str, ...] = ()  # the keys the bundle is signed by (its signature not checked here)


def summarise_and_lint(path: str) -> tuple[Summary, Linted]:
    """Verify the bundle, sum it up and lint it, in one pass (raises reader.VerificationError)."""
    bundle = reader.open_bundle(path)
    s = Summary(bundle.manifest)
    linter = lint.Linter(bundle.manifest)
    for part in bundle.fold(_BothStart(s.part, linter.start)):
        s.take(part.summary)
        linter.take(part.lint)
    att = bundle.attestation
    return s, Linted(linter.findings(), linter.dropped, tuple(att.keyids) if att is not None else ())


def walk(s: Summary) -> Iterator[tuple[int, int]]:
    """(depth, pid) of every process of the tree, parents first, children by pid; iterative (a
    hostile bundle may nest a million deep) and safe from loops (pid reuse)."""
    children, roots = _family(s)
    seen: set[int] = set()
    stack = [(0, r) for r in reversed(roots)]
    while stack:
        depth, pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        yield depth, pid
        kids = sorted(children.get(pid, []))
        stack += [(depth + 1, k) for k in reversed(kids)]


def _family(s: Summary) -> tuple[dict[int, list[int]], list[int]]:
    """ppid -> pids, and the roots (processes whose parent did not exec here)."""
    children: dict[int, list[int]] = {}
    for pid, execs in s.procs.items():
        children.setdefault(execs[0][0], []).append(pid)
    roots = sorted(pid for pid, execs in s.procs.items() if execs[0][0] not in s.procs)
    roots += sorted(set(s.procs) - set(roots) - {k for v in children.values() for k in v})
    return children, roots


_PATH_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


def _on_path(name: str) -> tuple[str, ...]:
    """Where a bare argv[0] usually names a program: the standard PATH directories."""
    return tuple(f"{d}/{name}" for d in _PATH_DIRS)


def _shown(filename: str, argv: list[str]) -> str:
    """An exec as shown: its argv, and the program too when argv[0] does not name it (argv is the
    caller's to choose: `exec -a make id` runs /usr/bin/id as "make")."""
    text = argv_text(argv)
    if not text:
        return filename
    if argv[0] == filename or ("/" not in argv[0] and filename in _on_path(argv[0])):
        return text
    return f"{filename} (argv: {text})"


def claimed_differs(manifest: ManifestJSON) -> bool:
    """Whether the manifest's claimed command is another than the one the kernel executed (a
    `#!` script's differs in form: bundle/command.py decides, and lint's EV014 says which)."""
    claimed = manifest.get("claimed_command")
    return claimed is not None and claimed != manifest["command"]


def argv_text(argv: list[str], width: int = 160) -> str:
    text = " ".join(a if a and " " not in a else repr(a) for a in argv)
    return text if len(text) <= width else text[: width - 3] + "..."


def _limited(lines: list[str], limit: int) -> list[str]:
    if limit and len(lines) > limit:
        return lines[:limit] + [f"  ... {len(lines) - limit} more (--limit 0 shows all)"]
    return lines


MAX_INDENT = 32  # deeper levels are drawn at this indentation (a hostile bundle may nest 1M deep)


def tree_lines(s: Summary, limit: int) -> list[str]:
    """The process tree, drawn iteratively (no recursion: depth is attacker-controlled)."""
    children, roots = _family(s)
    out: list[str] = []
    seen: set[int] = set()
    # (pid, prefix, last, top)
    stack = [(r, "  ", True, True) for r in reversed(roots)]
    while stack:
        if limit and len(out) > limit:
            return out[:limit] + ["  ... more (--limit 0 shows all)"]
        pid, prefix, last, top = stack.pop()
        if pid in seen:  # pid reuse can make a loop
            continue
        seen.add(pid)
        branch = "" if top else ("`- " if last else "|- ")
        for i, (_, shown, result) in enumerate(s.procs[pid]):
            status = "" if result == 0 else f"  [failed: {result}]"
            lead = prefix + branch if i == 0 else prefix + ("   " if last or top else "|  ") + "-> exec "
            out.append(f"{lead}{pid} {shown}{status}")
        kids = sorted(children.get(pid, []))
        inner = prefix if top else prefix + ("   " if last else "|  ")
        if len(inner) > 2 + 3 * MAX_INDENT:
            inner = prefix
        for j in range(len(kids) - 1, -1, -1):
            stack.append((kids[j], inner, j == len(kids) - 1, False))
    return out


def exit_text(s: Summary) -> str:
    if s.finished is None:
        return "unknown (no run.finished event)"
    if s.finished.get("signal"):
        return f"killed by {s.finished['signal']}"
    return str(s.finished["exit_code"])


def duration_text(s: Summary) -> str:
    return f"{s.finished['duration_ns'] / 1e9:.3f} s" if s.finished else ""


def lost_text(m: ManifestJSON) -> str:
    """'none', or how many events were lost, by kind."""
    lost = m["lost"]["total"]
    kinds = ", ".join(f"{k} {v}" for k, v in m["lost"]["by_kind"].items() if v)
    return f"{lost} events ({kinds})" if lost else "none"


def approval_text(d: dict[str, Any], time: str) -> str:
    """One approval request as it ended: what was asked, by which rule, who answered, when, why."""
    what = f"{d['id']} exec of {d['program']} ({argv_text(d['argv'], 120)}) by {d['rule']}"
    via = d.get("via")
    if via is None:
        return f"{what}: requested {d['requested_at']}, no answer recorded"
    state = "allowed" if d["state"] == "allowed" else "denied"
    if via == "timeout":
        return f"{what}: timed out at {time}, {state} (approvals.on_timeout)"
    if via == "withdrawn":
        return f"{what}: withdrawn at {time} ({d.get('reason') or 'no reason'}): it did not run"
    return f"{what}: {state} by uid {d.get('by_uid')} via {via} at {time}: {d.get('reason') or 'no reason given'}"


def approval_lines(s: Summary) -> list[str]:
    """The approvals in the order they were requested."""
    ordered = sorted(s.approvals.values(), key=lambda v: (v[0]["requested_at"], v[0]["id"]))
    return [approval_text(d, time) for d, time in ordered]


def file_classes(s: Summary) -> list[str]:
    """The access classes of files, in the order shown: writes first, then reads, then failures."""
    return sorted(s.files, key=lambda k: (k == "failed", k == "read", k))


def render(s: Summary, limit: int = 50) -> str:
    m = s.manifest
    out = [
        f"Run {m['run_id']}  ({m['detail']} detail, {m['events']} events, evidence {m['producer'].get('version', '?')})"
    ]
    out.append(f"  command: {argv_text(m['command'])}")
    if claimed_differs(m):
        out.append(f"  claimed: {argv_text(m.get('claimed_command') or [])}")
    out.append(f"  cwd:     {m['cwd']}")
    duration = f"  ({duration_text(s)})" if s.finished else ""
    out.append(f"  time:    {m['started_at']} .. {m['finished_at']}{duration}")
    out.append(f"  exit:    {exit_text(s)}" + ("  (cut short)" if m.get("cut_short") else ""))
    lost = lost_text(m)
    out.append(
        f"  lost:    {lost}: what is absent may not have been recorded"
        if m["lost"]["total"]
        else "  lost:    none"
    )
    out.append(f"  policy:  {'observe only' if m.get('policy') is None else 'enforced'}")
    artifacts = m.get("artifacts")
    if artifacts:  # `run --subject`: what was attested (`lint` and `verify --artifact` tie each to the run)
        refused = len(artifacts["refused"]) + artifacts.get("refused_more", 0)
        out.append(f"  subjects: {len(artifacts['files'])}" + (f" ({refused} refused)" if refused else ""))
        out += _limited([f"    {f['name']}  sha256 {f['sha256']}" for f in artifacts["files"]], limit)
    for d in s.degradations:
        out.append(f"  degraded: {d}")
    n_exec = sum(len(v) for v in s.procs.values())
    out += ["", f"Processes ({n_exec} execs):"] + (tree_lines(s, limit) or ["  none"])
    if s.namespaces:
        out += ["", f"Namespaces, mounts and ptrace ({len(s.namespaces)}):"]
        out += _limited([f"  {n}" for n in s.namespaces], limit)
    out += ["", f"Files ({sum(len(g) for g in s.files.values())} paths):"]
    for klass in file_classes(s):
        group = s.files[klass]
        out.append(f"  {klass}:")
        lines = [f"    {p}" + (f" (x{c[0]})" if c[0] > 1 else "") for p, c in sorted(group.items())]
        out += _limited(lines, limit)
    if not s.files:
        out.append("  none")
    out += ["", f"Network ({len(s.network)} destinations):"]
    lines = [
        f"  {dest}  by {v[1] or '?'}" + (f" (x{v[0]})" if v[0] > 1 else "")
        for dest, v in sorted(s.network.items())
    ]
    out += _limited(lines, limit) or ["  none"]
    out += ["", f"DNS ({len(s.dns)} queries):"]
    lines = [
        f"  {q}  by {v[1] or '?'}" + (f" (x{v[0]})" if v[0] > 1 else "") for q, v in sorted(s.dns.items())
    ]
    out += _limited(lines, limit) or ["  none"]
    out += ["", f"Denials ({len(s.denials)}):"]
    lines = [f"  {k}" + (f" (x{v[0]})" if v[0] > 1 else "") for k, v in sorted(s.denials.items())]
    out += _limited(lines, limit) or ["  none"]
    if s.exec_denials or s.approvals or s.audits:
        out += [
            "",
            f"Commands ({len(s.exec_denials)} refused execs by rule, {len(s.approvals)} approvals, "
            f"{len(s.audits)} audited by rule):",
        ]
        lines = [f"  {k}" + (f" (x{v[0]})" if v[0] > 1 else "") for k, v in sorted(s.exec_denials.items())]
        out += _limited(lines, limit)
        out += _limited([f"  approval {line}" for line in approval_lines(s)], limit)
        lines = [f"  audit {k}" + (f" (x{v[0]})" if v[0] > 1 else "") for k, v in sorted(s.audits.items())]
        out += _limited(lines, limit)
    if s.untracked:
        out += [
            "",
            f"({s.untracked} events beyond {MAX_TRACKED} distinct entries per section are not listed)",
        ]
    return join_lines(out)
