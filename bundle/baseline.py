"""`evidence baseline build BUNDLE... > baseline.json`: what many runs of a job did, and how many of
them did it; `evidence diff --baseline baseline.json NEW` then reports only what is new.

Each bundle is verified and reduced to its behaviour keys exactly as `evidence diff` reduces it
(bundle/diff_keys.py: programs with argv, files by access class, network destinations, denials, the exit
code; normalised by bundle/normalize.py with each bundle's own roots and the `--ignore` patterns).
The baseline keeps every key any run showed, with `runs`: in how many of the runs it appeared.
`diff --baseline FILE --min-runs N NEW` counts a key as known when at least N of the baseline's runs
showed it (default 1: ever seen), and reports each key of NEW that is not known as *added*, saying
whether the baseline never saw it or in how few runs. A network destination keyed by name (the
names the run's configured resolvers gave its address) keeps in how many runs its addresses were in
each range (`scopes`, diff_keys.address_scope): a known name whose addresses in NEW are in a loopback,
private or link-local range that fewer than N runs showed for it is *added* too (github.com, known,
now at 127.0.0.77). Nothing is "removed" or "changed": a baseline
says what is usual, not what must happen. Keys of events in another mount namespace (mntns:
"other", bundle/diff.py) are items with `"mntns": "other"`, distinct from the same key in the run's
own namespace, and known only from items that carry it. The format is in docs/baseline.md.

Memory is bounded as diff's is: each bundle is reduced within diff's cap on keys, and the baseline
keeps at most diff_keys.MAX_KEYS keys (and diff_keys.MAX_KEY_CHARS characters of them) over all
its runs; what is past either cap is not counted (a warning says how many events), so a later diff
reports what those events did as never seen, and a bundle past its own cap is a difference of its
own. The commands are bundle/commands/baseline.py (build) and bundle/commands/diff.py (--baseline).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from evidence import __version__
from evidence.bundle import diff, diff_keys
from evidence.bundle.diff import Change
from evidence.bundle.diff_keys import Budget, Keys, Side
from evidence.errors import UsageError

logger = logging.getLogger(__name__)

FORMAT = "evidence-baseline"
FORMAT_VERSION = 1
MAX_SIZE = 64 * 1024 * 1024  # bytes of a baseline file

_MODEL = ConfigDict(extra="forbid", frozen=True, strict=True)
Runs = Field(ge=1)
# "other": the key of events in another mount namespace (absent from the file otherwise)
MntNs = Literal["other"] | None


class BundleRef(BaseModel):
    model_config = _MODEL
    run_id: str
    root_hash: str
    events: int = Field(ge=0)
    lost: int = Field(ge=0)
    exit: str
    events_other_mntns: int = Field(default=0, ge=0)  # events with mntns: "other" (absent: none)


class ExecItem(BaseModel):
    model_config = _MODEL
    program: str
    argv: list[str]
    runs: int = Runs
    mntns: MntNs = None


class FileItem(BaseModel):
    model_config = _MODEL
    path: str
    # an open's access class, or a file change's operation on the path ("rename to", "link to": on
    # the new name), as bundle/diff.py keys files
    access: Literal[
        "read", "write", "create", "exec",
        "rename", "unlink", "rmdir", "link", "symlink", "truncate", "chmod", "chown", "mkdir", "mknod",
        "rename to", "link to",
    ]  # fmt: skip
    runs: int = Runs
    mntns: MntNs = None


class NetworkItem(BaseModel):
    model_config = _MODEL
    family: str
    address: str
    port: int | None
    runs: int = Runs
    mntns: MntNs = None
    # family "NAME": in how many runs the name's addresses were in each range (absent: none known)
    scopes: dict[str, int] = Field(default_factory=dict)


class DenialItem(BaseModel):
    model_config = _MODEL
    operation: str
    target: str
    rule: str
    enforced: bool
    runs: int = Runs
    mntns: MntNs = None


class ExitItem(BaseModel):
    model_config = _MODEL
    exit: str
    runs: int = Runs


class Baseline(BaseModel):
    """A baseline file (docs/baseline.md). Built from `runs` bundles; every item says in how many of
    them it appeared (1 <= runs <= the baseline's runs); no item appears twice."""

    model_config = _MODEL
    format: Literal["evidence-baseline"]
    format_version: Literal[1]
    producer: dict[str, str]
    runs: int = Field(ge=1)
    bundles: list[BundleRef]
    ignore: list[str]
    exec: list[ExecItem]
    file: list[FileItem]
    network: list[NetworkItem]
    denial: list[DenialItem]
    exit: list[ExitItem]

    def model_post_init(self, _context: Any) -> None:
        if len(self.bundles) != self.runs:
            raise ValueError(f"runs is {self.runs} but {len(self.bundles)} bundles are listed")
        for kind in ("exec", "file", "network", "denial", "exit"):
            items: list[BaseModel] = getattr(self, kind)
            keys = set()
            for item in items:
                n = getattr(item, "runs")  # noqa: B009
                if n > self.runs:
                    raise ValueError(
                        f"a {kind} item was seen in {n} runs, more than the {self.runs} built from"
                    )
                key = json.dumps(item.model_dump(exclude={"runs", "scopes"}), sort_keys=True)
                ranges: dict[str, int] = getattr(item, "scopes", {})
                if any(not 1 <= r <= n or s not in diff_keys.SCOPES for s, r in ranges.items()):
                    raise ValueError(
                        f"a {kind} item has a range that is none, or seen in no or too many runs"
                    )
                if key in keys:
                    raise ValueError(f"a {kind} item is listed twice: {key}")
                keys.add(key)

    # the behaviour keys of bundle/diff.py, with how many runs showed each; `mntns`: those of the
    # run's own namespace (None) or of another ("other")
    def exec_keys(self, min_runs: int, mntns: MntNs = None) -> dict[tuple[str, ...], int]:
        return {(i.program, *i.argv): i.runs for i in self.exec if i.runs >= min_runs and i.mntns == mntns}

    def file_keys(self, min_runs: int, mntns: MntNs = None) -> dict[tuple[str, str], int]:
        return {(i.path, i.access): i.runs for i in self.file if i.runs >= min_runs and i.mntns == mntns}

    def network_keys(self, min_runs: int, mntns: MntNs = None) -> dict[tuple[str, str, str], int]:
        return {
            (i.family, i.address, "" if i.port is None else str(i.port)): i.runs
            for i in self.network
            if i.runs >= min_runs and i.mntns == mntns
        }

    def network_scopes(self, mntns: MntNs = None) -> dict[tuple[str, str, str], dict[str, int]]:
        """Name keys -> in how many runs their addresses were in each range."""
        return {
            (i.family, i.address, "" if i.port is None else str(i.port)): dict(i.scopes)
            for i in self.network
            if i.scopes and i.mntns == mntns
        }

    def denial_keys(self, min_runs: int, mntns: MntNs = None) -> dict[tuple[str, str, str, str], int]:
        return {
            (i.operation, i.target, i.rule, "enforced" if i.enforced else "would deny"): i.runs
            for i in self.denial
            if i.runs >= min_runs and i.mntns == mntns
        }


class _Counts:
    """In how many runs each key of one namespace (the run's own, or another) appeared; a new key
    only while `budget` (shared by both namespaces) allows it."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.execs: dict[tuple[str, ...], int] = {}
        self.files: dict[tuple[str, str], int] = {}
        self.network: dict[tuple[str, str, str], int] = {}
        self.scopes: dict[tuple[str, str, str], dict[str, int]] = {}
        self.denials: dict[tuple[str, str, str, str], int] = {}

    def add(self, keys: Keys) -> None:
        for e, v in keys.execs.items():
            self._count(self.execs, e, "exec", v[0])
        for p, per in keys.files.items():
            for acc, v in per.items():
                self._count(self.files, (p, acc), "file", v[0])
        for n, v in keys.network.items():
            self._count(self.network, n, "network", v[0])
        for n, seen in keys.scopes.items():
            if n not in self.network:  # a name past the cap keeps no scopes either
                continue
            ranges = self.scopes.setdefault(n, {})
            for scope in seen:
                ranges[scope] = ranges.get(scope, 0) + 1
        for d, v in keys.denials.items():
            self._count(self.denials, d, "denial", v[0])

    def _count(self, table: dict[Any, int], key: Any, kind: str, events: int) -> None:
        n = table.get(key)
        if n is not None:
            table[key] = n + 1
        elif self.budget.take(key, kind, events):
            table[key] = 1


def build(bundles: Iterable[str], ignore: list[str]) -> Baseline:
    """Verify and reduce each bundle; count in how many runs each behaviour key appears."""
    budget = Budget()
    own, other = _Counts(budget), _Counts(budget)
    exits: dict[str, int] = {}
    refs = []
    for path in bundles:
        b = diff_keys.behaviour(path, ignore)
        for kind, n in sorted(b.budget.past.items()):
            logger.warning(
                "%s: %d %s events past the %d distinct keys a bundle is reduced to are not in the "
                "baseline: a diff against it reports what they did as never seen",
                path,
                n,
                kind,
                diff_keys.MAX_KEYS,
            )
        refs.append(
            BundleRef(
                run_id=b.run_id,
                root_hash=b.root_hash,
                events=b.events,
                lost=b.lost,
                exit=b.exit,
                events_other_mntns=b.other_events,
            )
        )
        own.add(b.own())
        other.add(b.other)
        exits[b.exit] = exits.get(b.exit, 0) + 1
        del b  # its keys are counted: one bundle's are held at a time
    for kind, n in sorted(budget.past.items()):
        logger.warning(
            "%d %s events of keys past the %d distinct keys a baseline keeps are not in it: a diff "
            "against it reports what they did as never seen",
            n,
            kind,
            diff_keys.MAX_KEYS,
        )
    sides: tuple[tuple[_Counts, MntNs], ...] = ((own, None), (other, "other"))  # the run's own first
    return Baseline(
        format=FORMAT,
        format_version=FORMAT_VERSION,
        producer={"name": "evidence", "version": __version__},
        runs=len(refs),
        bundles=refs,
        ignore=list(ignore),
        exec=[
            ExecItem(program=k[0], argv=list(k[1:]), runs=n, mntns=ns)
            for c, ns in sides
            for k, n in sorted(c.execs.items())
        ],
        file=[
            FileItem(path=p, access=a, runs=n, mntns=ns)
            for c, ns in sides
            for (p, a), n in sorted(c.files.items())
        ],
        network=[
            NetworkItem(
                family=f,
                address=a,
                port=int(port) if port else None,
                runs=n,
                mntns=ns,
                scopes=c.scopes.get((f, a, port), {}),
            )
            for c, ns in sides
            for (f, a, port), n in sorted(c.network.items())
        ],
        denial=[
            DenialItem(operation=o, target=t, rule=r, enforced=e == "enforced", runs=n, mntns=ns)
            for c, ns in sides
            for (o, t, r, e), n in sorted(c.denials.items())
        ],
        exit=[ExitItem(exit=x, runs=n) for x, n in sorted(exits.items())],
    )


def dumps(bl: Baseline) -> str:
    """The file's text: JSON, keys sorted, two-space indents: the same bundles give the same bytes.
    `mntns` is written only where it is "other" (its default, None, is left out)."""
    return "".join(chunks(bl))


def chunks(bl: Baseline) -> Iterator[str]:
    """dumps' text in pieces, an item at a time: what json.dumps(indent=2, sort_keys=True) writes
    of the whole document, without the document as one dict and one string (a baseline of the
    200,000 keys the cap allows took 250 MB more so)."""

    def item(value: Any, depth: int) -> str:
        text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)
        return text.replace("\n", "\n" + "  " * depth)

    fields = sorted(Baseline.model_fields)
    yield "{"
    for i, name in enumerate(fields):
        value = getattr(bl, name)
        yield ("," if i else "") + f"\n  {json.dumps(name)}: "
        if isinstance(value, list) and value:
            yield "["
            for j, x in enumerate(value):
                dumped = x.model_dump(mode="json", exclude_defaults=True) if isinstance(x, BaseModel) else x
                yield ("," if j else "") + "\n    " + item(dumped, 2)
            yield "\n  ]"
        else:
            yield item(value, 1)
    yield "\n}\n"


def load(path: str | Path) -> Baseline:
    """A baseline file, checked; UsageError (exit 2, one line) when it is not one."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_SIZE + 1)
    except OSError as e:
        raise UsageError(f"cannot read baseline {p}: {e.strerror or e}") from None
    if len(raw) > MAX_SIZE:
        raise UsageError(f"{p} is not a baseline: larger than {MAX_SIZE} bytes")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise UsageError(
            f"{p} is not a baseline: not JSON", hint="make one with: evidence baseline build BUNDLE..."
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise UsageError(
            f'{p} is not a baseline (no "format": "{FORMAT}")',
            hint="make one with: evidence baseline build BUNDLE...",
        )
    if doc.get("format_version") != FORMAT_VERSION:
        raise UsageError(
            f"{p}: baseline format_version {doc.get('format_version')!r} is not supported "
            f"(this evidence reads version {FORMAT_VERSION})",
            hint="rebuild it with this version: evidence baseline build BUNDLE...",
        )
    try:
        bl = Baseline.model_validate(doc)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "top level"
        raise UsageError(f"{p} is not a valid baseline: {where}: {err['msg']}") from None
    for pattern in bl.ignore:
        try:
            re.compile(pattern)
        except re.error as e:
            raise UsageError(f"{p} is not a valid baseline: ignore pattern {pattern!r}: {e}") from None
    return bl


# --- diff against a baseline ---------------------------------------------------------------------


def _seen(n: int | None, bl: Baseline) -> str:
    return "never seen" if not n else f"seen in {n} of {bl.runs} baseline runs"


def new_behaviour(bl: Baseline, b: Side, min_runs: int) -> list[Change]:
    """What `b` did that fewer than min_runs of the baseline's runs did, as 'added' changes: the
    keys of the run's own namespace, the exit code, then those of another mount namespace."""
    out = diff.past_cap(b, "added") + _new_keys(bl, b.own(), min_runs, None)
    exits = {x.exit: x.runs for x in bl.exit}
    if exits.get(b.exit, 0) < min_runs:
        usual = ", ".join(f"{x} in {n}" for x, n in sorted(exits.items(), key=lambda xn: -xn[1]))
        out.append(
            Change(
                "exit", "added", "exit code", f"{b.exit}; {_seen(exits.get(b.exit), bl)} (baseline: {usual})"
            )
        )
    return out + _new_keys(bl, b.other, min_runs, "other")


def _new_keys(bl: Baseline, b: Keys, min_runs: int, mntns: MntNs) -> list[Change]:
    out: list[Change] = []
    execs, all_execs = bl.exec_keys(min_runs, mntns), bl.exec_keys(1, mntns)
    for k in sorted(set(b.execs) - set(execs), key=repr):
        out.append(
            Change(
                "exec",
                "added",
                diff.show_exec(k),
                f"{diff.fmt_counts(b.execs[k])}; {_seen(all_execs.get(k), bl)}",
            )
        )
    files, all_files = bl.file_keys(min_runs, mntns), bl.file_keys(1, mntns)
    for path in sorted(b.files):
        per = b.files[path]
        notes = [
            f"{acc} {diff.fmt_counts(per[acc])}, {_seen(all_files.get((path, acc)), bl)}"
            for acc in diff_keys.ACCESS
            if acc in per and (path, acc) not in files
        ]
        if notes:
            out.append(Change("file", "added", path, "; ".join(notes)))
    nets, all_nets = bl.network_keys(min_runs, mntns), bl.network_keys(1, mntns)
    for n in sorted(set(b.network) - set(nets), key=repr):
        out.append(
            Change(
                "network",
                "added",
                diff.show_dest(n),
                f"{diff.fmt_counts(b.network[n])}; {_seen(all_nets.get(n), bl)}",
            )
        )
    scopes = bl.network_scopes(mntns)
    for n, seen in sorted(b.scopes.items()):
        if n not in nets:
            continue  # not known: added above
        usual = scopes.get(n, {})
        for scope in diff_keys.LOCAL:
            if scope in seen and usual.get(scope, 0) < min_runs:
                known = ", ".join(f"{s} in {k}" for s, k in sorted(usual.items())) or "none known"
                out.append(
                    Change(
                        "network",
                        "added",
                        f"{diff.show_dest(n)} at a {scope} address",
                        f"{seen[scope]}; {_seen(usual.get(scope), bl)} for this name (its ranges: {known})",
                    )
                )
    dens, all_dens = bl.denial_keys(min_runs, mntns), bl.denial_keys(1, mntns)
    for d in sorted(set(b.denials) - set(dens), key=repr):
        out.append(
            Change(
                "denial",
                "added",
                diff.show_denial(d),
                f"{diff.fmt_counts(b.denials[d])}; {_seen(all_dens.get(d), bl)}",
            )
        )
    for c in out:
        c.mntns = mntns
    return out


def as_side(bl: Baseline, path: str, min_runs: int) -> Side:
    """The baseline as diff's side A, for its reports."""
    exits = sorted(bl.exit, key=lambda x: -x.runs)
    a = Side(
        path=path,
        run_id=f"baseline of {bl.runs} runs, known at --min-runs {min_runs}",
        events=sum(r.events for r in bl.bundles),
        lost=sum(r.lost for r in bl.bundles),
        lost_by_kind={},
        detail="summary",
    )
    a.exit = exits[0].exit if exits else "unknown"
    a.other_events = sum(r.events_other_mntns for r in bl.bundles)
    return a


@dataclasses.dataclass(frozen=True)
class Found:
    """What `diff --baseline FILE` found: the baseline as side A, the new run, what the new run did
    that the baseline had not seen, and the patterns both were normalised with (the baseline's own,
    then the caller's)."""

    baseline: Side
    new: Side
    changes: list[Change]
    ignore: list[str]


def diff_against(baseline_path: str, new: str, min_runs: int | None, ignore: list[str]) -> Found:
    """`evidence diff --baseline FILE [--min-runs N] NEW`: `min_runs` None is 1 (ever seen)."""
    bl = load(baseline_path)
    min_runs = min_runs if min_runs is not None else 1
    if not 1 <= min_runs <= bl.runs:
        raise UsageError(
            f"--min-runs {min_runs}: the baseline {baseline_path} has {bl.runs} runs (1 to {bl.runs})"
        )
    both = [*bl.ignore, *(p for p in ignore if p not in bl.ignore)]
    b = diff_keys.behaviour(new, both)
    return Found(as_side(bl, baseline_path, min_runs), b, new_behaviour(bl, b, min_runs), both)
