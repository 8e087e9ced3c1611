"""`evidence diff A B`: compare what two runs did, not their bytes.

Each bundle is verified and reduced, in one streaming pass, to behaviour keys (only the keys and
their counts are kept, never the events; bundle/diff_keys.py):
- exec: the program and its argv (normalised) -> count, successes, failures; and each program
  (normalised) -> the sha256 of its content (every one seen, from successful execs);
- file: the path (normalised) -> per access class (read, write, create, exec): count, successes,
  failures;
- network: (family, address, port) -> count, successes, failures; a connect whose address the run's
  configured resolvers named (its `names`: answers credited to the run's own queries, see
  bundle/format.py) is keyed by those names instead ("NAME", names, port), and a name key of A and
  one of B with a name in common are the same destination: a CDN answering with other addresses,
  or another CNAME chain to the same name, is not a change. A name key also keeps the ranges its
  addresses were in (address_scope): a name whose addresses move to a loopback, private or
  link-local range that A's did not use is an added destination, "NAME:PORT at a loopback address"
  (github.com answered with 127.0.0.77 by the run's own resolver). Names of other servers' answers
  (`other_names`) are never keys: such a connect is keyed by its address;
- denial: (operation, target, rule, enforced) -> count;
- exit: the run's exit code (and signal); loss: events lost, by kind.

Normalisation (bundle/normalize.py, applied to programs, argv, paths, addresses and targets): each
bundle's own roots become placeholders (its workspace, manifest.policy.workspace or else the cwd of
run.started, becomes ${WORKSPACE}; its manifest.policy.tmpdir, if any, becomes ${TMPDIR}); /proc/<n>
becomes /proc/<pid>; random temp names become <rand>; every `--ignore PATTERN` (a Python regular
expression) match becomes <ignored>.

Events of a process that left the run's mount namespace (`mntns: "other"`: it unshared, entered
another namespace, mounted or chrooted, or is a child of one) name paths as that process saw them,
which may be other files than the same paths in the run's namespace (a bind mount over
/etc/hostname). Their keys (exec, file, network, and the denials of their opens and execs, matched by
pid and path) are kept apart and compared only with the other side's keys of the same kind, and the
report shows them apart and says how many such events each side has.

Then keys only in B are "added", keys only in A "removed", and keys in both whose counts differ, that
gained an access class, or that went from success to failure are "changed", and so is a program run
on both sides whose content (sha256) differs. Absence in B means
that no event was observed: if either side lost events, the report says so, with both loss counts.

Memory is bounded as lint's is, whatever the bundles hold (a valid bundle of 1.5M distinct execs
took 3 GB): a side keeps at most MAX_KEYS distinct keys (and MAX_KEY_CHARS characters of them);
the events of keys past that are counted by kind, not keyed, and each kind with such events is a
difference of its own ("added" for B, "removed" for A: what they did is not known), so a side
cannot hide what it did behind a flood of keys. At most MAX_CHANGES differences are listed; the
report says how many more there are.

This module compares two sides and renders the differences; the command (its options, --baseline's
directory of named bundles) is bundle/commands/diff.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Any, TypedDict

from evidence.bundle import diff_keys
from evidence.bundle.diff_keys import ACCESS, LOCAL, SCOPES, Keys, NetKey, Side
from evidence.bundle.text import join_lines
from evidence.errors import EXIT_FINDINGS, EXIT_OK, UsageError

logger = logging.getLogger(__name__)

KINDS = ("exec", "file", "network", "denial", "exit")
FAIL_ON = ("added", "removed", "changed", "any", "none")
FORMATS = ("text", "json", "markdown")
BASELINE_SUFFIX = ".bundle.tar.gz"
MAX_CHANGES = 10_000  # differences listed; the rest are counted
PAST_CAP = "<past the cap>"  # the key of a difference that stands for the events past a side's cap


@dataclasses.dataclass(slots=True)  # a report can hold hundreds of thousands before it lists MAX_CHANGES
class Change:
    kind: str  # exec | file | network | denial | exit
    what: str  # added | removed | changed
    key: str
    detail: str
    mntns: str | None = None  # "other": keys of events in another mount namespace

    def as_dict(self) -> dict[str, str]:
        out = dataclasses.asdict(self)
        if self.mntns is None:
            del out["mntns"]
        return out


def fmt_counts(v: list[int]) -> str:
    if v[2] == 0:
        return f"x{v[0]}"
    if v[1] == 0:
        return f"x{v[0]}, all failed"
    return f"x{v[0]}, {v[2]} failed"


def _compare_simple(kind: str, a: dict[Any, list[int]], b: dict[Any, list[int]], show: Any) -> list[Change]:
    removed, changed = [], []
    for key, va in a.items():  # one pass over each side: no key sets, only the differences sorted
        vb = b.get(key)
        if vb is None:
            removed.append(key)
        elif va[1] > 0 and vb[1] == 0:
            changed.append((key, f"succeeded before, now fails ({fmt_counts(va)} -> {fmt_counts(vb)})"))
        elif va[0] != vb[0]:
            changed.append((key, f"count {va[0]} -> {vb[0]}"))
    added = [key for key in b if key not in a]
    out = [Change(kind, "added", show(k), fmt_counts(b[k])) for k in sorted(added, key=repr)]
    out += [Change(kind, "removed", show(k), fmt_counts(a[k])) for k in sorted(removed, key=repr)]
    changed.sort(key=lambda kd: repr(kd[0]))
    out += [Change(kind, "changed", show(k), detail) for k, detail in changed]
    return out


def _digests(hashes: set[str]) -> str:
    return ", ".join(h[:16] for h in sorted(hashes))


def show_exec(k: tuple[str, ...]) -> str:
    return " ".join([k[0], "--", *k[1:]]) if k[1:] else k[0]


def show_dest(k: tuple[str, str, str]) -> str:
    family, addr, port = k
    if family == "NAME":
        return f"{addr}:{port}" if port else addr
    host = f"[{addr}]" if family == "AF_INET6" else addr
    return f"{host}:{port}" if port else f"{addr} ({family})"


def show_denial(k: tuple[str, str, str, str]) -> str:
    return f"{k[0]} {k[1]} (rule {k[2]}, {k[3]})"


def _by_name(a: dict[NetKey, list[int]], b: dict[NetKey, list[int]]) -> dict[NetKey, NetKey]:
    """B's name keys that A lacks, each to A's name key (same port) that has a name in common with
    it, when B lacks that one: the same destination under another CNAME chain."""
    theirs: dict[tuple[str, str], list[NetKey]] = {}
    for key in a:
        if key[0] == "NAME" and key not in b:
            for name in key[1].split(" "):
                theirs.setdefault((name, key[2]), []).append(key)
    renamed: dict[NetKey, NetKey] = {}
    if not theirs:
        return renamed
    taken = set(b)
    for key in sorted(b):
        if key[0] != "NAME" or key in a:
            continue
        match = next(
            (k for name in key[1].split(" ") for k in theirs.get((name, key[2]), []) if k not in taken), None
        )
        if match is not None:
            renamed[key] = match
            taken.discard(key)
            taken.add(match)
    return renamed


def _moved(a: Keys, b: Keys, renamed: dict[NetKey, NetKey]) -> list[Change]:
    """Name keys on both sides whose addresses in B are in a loopback, private or link-local range
    that A's were not: the same name, somewhere else (a resolver that answers github.com with
    127.0.0.77). Added destinations (`github.com:443 at a loopback address`), as a baseline reports
    them, so that the default --fail-on added fails on them."""
    out = []
    for key, seen in sorted(b.scopes.items()):
        mine = renamed.get(key, key)
        if mine not in a.network:
            continue  # the name is added itself
        before = a.scopes.get(mine, {})
        was = ", ".join(s for s in SCOPES if s in before) or "none known"
        for scope in LOCAL:
            if scope in seen and scope not in before:
                where = f"{show_dest(mine)} at a {scope} address"
                out.append(
                    Change("network", "added", where, f"{seen[scope]}; the name's addresses in A: {was}")
                )
    return out


def compare(a: Side, b: Side) -> list[Change]:
    changes = compare_keys(a.own(), b.own())
    if a.exit != b.exit:
        changes.append(Change("exit", "changed", "exit code", f"{a.exit} -> {b.exit}"))
    for c in compare_keys(a.other, b.other):
        c.mntns = "other"
        changes.append(c)
    return past_cap(a, "removed") + past_cap(b, "added") + changes  # first: never cut from a report


def past_cap(x: Side, what: str) -> list[Change]:
    """A difference for each kind of which side `x` had events past its cap on keys (`what`: added
    for B, removed for A): what they did was not compared, so it may be anything."""
    return [
        Change(
            kind,
            what,
            PAST_CAP,
            f"{n} events past the {diff_keys.MAX_KEYS} distinct keys (or {diff_keys.MAX_KEY_CHARS} characters) a side keeps: "
            "not compared",
        )
        for kind, n in sorted(x.budget.past.items())
    ]


def compare_keys(a: Keys, b: Keys) -> list[Change]:
    """The differences between two sets of keys (exec, file, network, denial)."""
    changes = _compare_simple("exec", a.execs, b.execs, show_exec)
    for program in sorted(a.hashes.keys() & b.hashes.keys()):
        ha, hb = a.hashes[program], b.hashes[program]
        if ha != hb:
            detail = f"content changed: sha256 {_digests(ha)} -> {_digests(hb)}"
            changes.append(Change("exec", "changed", program, detail))
    for what, side, other in (("added", b.files, a.files), ("removed", a.files, b.files)):
        for path in sorted(side.keys() - other.keys()):
            per = side[path]
            detail = "; ".join(f"{acc} {fmt_counts(per[acc])}" for acc in ACCESS if acc in per)
            changes.append(Change("file", what, path, detail))
    for path in sorted(a.files.keys() & b.files.keys()):
        pa, pb = a.files[path], b.files[path]
        notes = []
        new = [acc for acc in ACCESS if acc in pb and acc not in pa]
        gone = [acc for acc in ACCESS if acc in pa and acc not in pb]
        if new:
            notes.append("new access " + "+".join(new))
        if gone:
            notes.append("no longer " + "+".join(gone))
        for acc in ACCESS:
            if acc in pa and acc in pb:
                if pa[acc][1] > 0 and pb[acc][1] == 0:
                    notes.append(f"{acc} succeeded before, now fails")
                elif pa[acc][0] != pb[acc][0]:
                    notes.append(f"{acc} count {pa[acc][0]} -> {pb[acc][0]}")
        if notes:
            changes.append(Change("file", "changed", path, "; ".join(notes)))

    renamed = _by_name(a.network, b.network)
    network_b = {renamed.get(k, k): v for k, v in b.network.items()} if renamed else b.network
    changes += _compare_simple("network", a.network, network_b, show_dest)
    changes += _moved(a, b, renamed)
    changes += _compare_simple("denial", a.denials, b.denials, show_denial)
    return changes


def reaches(changes: list[Change], fail_on: str) -> bool:
    if fail_on == "none":
        return False
    return any(fail_on == "any" or c.what == fail_on for c in changes)


# --- output --------------------------------------------------------------------------------------


def _loss_note(a: Side, b: Side) -> str | None:
    if not a.lost and not b.lost:
        return None
    return (
        f"events were lost (A: {a.lost}, B: {b.lost}): something absent from a side may have happened "
        "without being recorded"
    )


OTHER_NS = "in another mount namespace"


def _other_note(a: Side, b: Side) -> str | None:
    if not a.other_events and not b.other_events:
        return None
    return (
        f"events of processes {OTHER_NS} (mntns: other; A: {a.other_events}, B: {b.other_events}) "
        "name paths as those processes saw them, which may be other files than the same paths in "
        "the run's namespace: they are compared apart"
    )


def _not_listed(changes: list[Change]) -> str | None:
    more = len(changes) - MAX_CHANGES
    return f"{more} more differences are not listed (at most {MAX_CHANGES} are)" if more > 0 else None


def _groups(changes: list[Change]) -> list[tuple[str, list[Change]]]:
    """(heading, changes) by kind: the run's own, then each kind's keys in another namespace; the
    first MAX_CHANGES of the changes."""
    changes = changes[:MAX_CHANGES]
    out = []
    for mntns in (None, "other"):
        for kind in KINDS:
            group = [c for c in changes if c.kind == kind and c.mntns == mntns]
            if group:
                out.append((kind if mntns is None else f"{kind}, {OTHER_NS} (paths as named there)", group))
    return out


def _side(tag: str, x: Side) -> str:
    lost = f"{x.lost} lost" if x.lost else "none lost"
    return f"{tag}: {x.path} (run {x.run_id}, {x.events} events, {lost}, exit {x.exit})"


def render_text(a: Side, b: Side, changes: list[Change]) -> str:
    out = [_side("A", a), _side("B", b)]
    note = _loss_note(a, b)
    other = _other_note(a, b)
    if not changes:
        out.append("No behaviour differences observed." + (f" Note: {note}." if note else ""))
        if other:
            out.append(f"Note: {other}.")
        return join_lines(out)
    counts = {w: sum(1 for c in changes if c.what == w) for w in ("added", "removed", "changed")}
    out.append(f"{len(changes)} differences: " + ", ".join(f"{n} {w}" for w, n in counts.items()))
    out.append("Absence in B means no event was observed in B." + (f" Note: {note}." if note else ""))
    if other:
        out.append(f"Note: {other}.")
    sign = {"added": "+", "removed": "-", "changed": "~"}
    for heading, group in _groups(changes):
        out.append(f"{heading}:")
        out += [f"  {sign[c.what]} {c.key}  ({c.detail})" for c in group]
    more = _not_listed(changes)
    if more:
        out.append(f"Note: {more}.")
    return join_lines(out)


class SideJSON(TypedDict):
    """A side (`a`, `b`) in `diff --format json`."""

    bundle: str
    run_id: str
    events: int
    lost: int
    lost_by_kind: dict[str, int]
    exit: str
    events_other_mntns: int


def render_json(a: Side, b: Side, changes: list[Change], code: int, ignore: list[str]) -> str:
    def side(x: Side) -> SideJSON:
        return {
            "bundle": x.path,
            "run_id": x.run_id,
            "events": x.events,
            "lost": x.lost,
            "lost_by_kind": x.lost_by_kind,
            "exit": x.exit,
            "events_other_mntns": x.other_events,
        }

    doc = {
        "a": side(a),
        "b": side(b),
        "normalisation": {"roots": ["${WORKSPACE}", "${TMPDIR}"], "ignore": ignore},
        "note": "absence in B is absence of observed events"
        + (f"; {_loss_note(a, b)}" if _loss_note(a, b) else "")
        + (f"; {_other_note(a, b)}" if _other_note(a, b) else ""),
        "differences": len(changes),
        "added": [c.as_dict() for c in changes[:MAX_CHANGES] if c.what == "added"],
        "removed": [c.as_dict() for c in changes[:MAX_CHANGES] if c.what == "removed"],
        "changed": [c.as_dict() for c in changes[:MAX_CHANGES] if c.what == "changed"],
        "not_listed": max(0, len(changes) - MAX_CHANGES),
        "exit_code": code,
    }
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("`", "'")


def render_markdown(a: Side, b: Side, changes: list[Change]) -> str:
    out = ["## evidence diff", "", "| | bundle | run | events | lost | exit |", "|---|---|---|---|---|---|"]
    for tag, x in (("A", a), ("B", b)):
        out.append(f"| {tag} | `{_md(x.path)}` | `{x.run_id}` | {x.events} | {x.lost} | {x.exit} |")
    out.append("")
    note = _loss_note(a, b)
    if note:
        out += [f"> **Warning:** {note}.", ""]
    other = _other_note(a, b)
    if other:
        out += [f"> **Warning:** {_md(other)}.", ""]
    if not changes:
        out.append("No behaviour differences observed.")
        return join_lines(out)
    out += ["_Absence in B means no event was observed in B._", ""]
    for heading, group in _groups(changes):
        out += [f"### {heading}", "", "| | what | detail |", "|---|---|---|"]
        out += [f"| {c.what} | `{_md(c.key)}` | {_md(c.detail)} |" for c in group]
        out.append("")
    more = _not_listed(changes)
    if more:
        out += [f"_{more}._", ""]
    return join_lines(out).rstrip("\n") + "\n"


def check_patterns(patterns: list[str]) -> None:
    for p in patterns:
        try:
            re.compile(p)
        except re.error as e:
            raise UsageError(f"--ignore {p!r} is not a valid regular expression: {e}") from None


def is_baseline_file(target: Path) -> bool:
    """`--baseline` names a baseline file (not a directory of named bundles): an existing file, or a
    name ending in .json."""
    return target.is_file() or (not target.exists() and target.suffix == ".json")


def exit_code(changes: list[Change], fail_on: str) -> int:
    """The exit code --fail-on makes of the changes."""
    return EXIT_FINDINGS if reaches(changes, fail_on) else EXIT_OK


def render(a: Side, b: Side, changes: list[Change], output: str, code: int, ignore: list[str]) -> str:
    """The report in `output` (one of FORMATS); `code`, the exit code, goes into JSON."""
    if output == "json":
        return render_json(a, b, changes, code, ignore)
    if output == "markdown":
        return render_markdown(a, b, changes)
    return render_text(a, b, changes)
