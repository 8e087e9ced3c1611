"""`evidence diff A B`: compare what two runs did, not their bytes.

Each bundle is verified and reduced, in one streaming pass, to behaviour keys (only the keys and
their counts are kept, never the events):
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
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import ipaddress
import json
import logging
import multiprocessing
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from evidence.bundle import format as fmt
from evidence.bundle import reader
from evidence.bundle.normalize import Normalizer, ip_of
from evidence.bundle.text import join_lines
from evidence.errors import EXIT_FINDINGS, EXIT_OK, UsageError
from evidence.files import atomic_write

logger = logging.getLogger(__name__)

KINDS = ("exec", "file", "network", "denial", "exit")
FAIL_ON = ("added", "removed", "changed", "any", "none")
# what a run did to a path: an open's access classes, then a file change's operation (on its path)
# and "<operation> to" (rename's and link's new name)
_CHANGE_OPS = ("rename", "unlink", "rmdir", "link", "symlink", "truncate", "chmod", "chown", "mkdir", "mknod")
ACCESS = ("read", "write", "create", "exec", *_CHANGE_OPS, "rename to", "link to")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
BASELINE_SUFFIX = ".bundle.tar.gz"
_CACHE = 200_000  # entries per memo of normalised values
MAX_KEYS = 200_000  # distinct behaviour keys one side keeps (all kinds, both namespaces)
MAX_KEY_CHARS = 32 * 1024 * 1024  # ... and characters of their text (an argv can be 8 KiB)
MAX_CHANGES = 10_000  # differences listed; the rest are counted
PAST_CAP = "<past the cap>"  # the key of a difference that stands for the events past a side's cap


class Budget:
    """What one side may still keep (MAX_KEYS, MAX_KEY_CHARS), and the events it could not key:
    kind (exec, file, network, denial) -> events past the cap."""

    def __init__(self) -> None:
        self.keys = MAX_KEYS
        self.chars = MAX_KEY_CHARS
        self.past: dict[str, int] = {}

    def take(self, key: tuple[str, ...] | str, kind: str, count: int) -> bool:
        """Whether a new key may be kept; if not, its events are counted past the cap."""
        chars = len(key) if isinstance(key, str) else sum(map(len, key))
        if self.keys > 0 and self.chars >= chars:
            self.keys -= 1
            self.chars -= chars
            return True
        self.past[kind] = self.past.get(kind, 0) + count
        return False


# the ranges of address_scope; a name whose addresses move into one of LOCAL is a change
SCOPES = ("public", "private", "loopback", "link-local", "other")
LOCAL = ("private", "loopback", "link-local")
_SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT: not public either

NetKey = tuple[str, str, str]  # (family or "NAME", address or names, port)


def address_scope(address: str) -> str:
    """The range an address is in: "loopback" (127/8, ::1, and the unspecified 0.0.0.0 and ::, which
    connect to this host), "link-local" (169.254/16, fe80::/10), "private" (RFC 1918, 100.64/10,
    fc00::/7 and the other ranges Python calls private), "public", or "other" (multicast, not an
    address). An IPv4-mapped IPv6 address is its IPv4 address's."""
    addr = ip_of(address)
    if addr is None:
        return "other"
    if addr.is_loopback or addr.is_unspecified:
        return "loopback"
    if addr.is_link_local:
        return "link-local"
    if addr.is_multicast:
        return "other"
    if addr.is_private or (isinstance(addr, ipaddress.IPv4Address) and addr in _SHARED):
        return "private"
    return "public"


@dataclasses.dataclass
class Keys:
    """Behaviour keys of one kind of event source. Values are [count, ok, failed]."""

    execs: dict[tuple[str, ...], list[int]] = dataclasses.field(default_factory=dict)
    hashes: dict[str, set[str]] = dataclasses.field(default_factory=dict)  # program -> its sha256s
    files: dict[str, dict[str, list[int]]] = dataclasses.field(default_factory=dict)
    network: dict[NetKey, list[int]] = dataclasses.field(default_factory=dict)
    denials: dict[tuple[str, str, str, str], list[int]] = dataclasses.field(default_factory=dict)
    # a name key of `network` -> the ranges of its addresses (address_scope) -> the least address
    scopes: dict[NetKey, dict[str, str]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Behaviour:
    """What one run did, reduced to normalised keys. Values are [count, ok, failed]. `other` holds
    the keys of events in another mount namespace (mntns: "other"), `other_events` their number."""

    path: str
    run_id: str
    events: int
    lost: int
    lost_by_kind: dict[str, int]
    detail: str
    execs: dict[tuple[str, ...], list[int]] = dataclasses.field(default_factory=dict)
    hashes: dict[str, set[str]] = dataclasses.field(default_factory=dict)  # program -> its sha256s
    files: dict[str, dict[str, list[int]]] = dataclasses.field(default_factory=dict)
    network: dict[NetKey, list[int]] = dataclasses.field(default_factory=dict)
    denials: dict[tuple[str, str, str, str], list[int]] = dataclasses.field(default_factory=dict)
    scopes: dict[NetKey, dict[str, str]] = dataclasses.field(default_factory=dict)
    exit: str = "unknown"
    root_hash: str = ""
    other: Keys = dataclasses.field(default_factory=Keys)
    other_events: int = 0
    budget: Budget = dataclasses.field(default_factory=Budget)  # both namespaces' keys

    def own(self) -> Keys:
        """The keys of the run's own mount namespace (the same tables, not copies)."""
        return Keys(self.execs, self.hashes, self.files, self.network, self.denials, self.scopes)


def roots(manifest: dict[str, Any]) -> dict[str, str]:
    policy = manifest.get("policy") or {}
    out = {"${WORKSPACE}": str(policy.get("workspace") or manifest["cwd"])}
    if policy.get("tmpdir"):
        out["${TMPDIR}"] = str(policy["tmpdir"])
    return out


def _bump(table: dict[Any, list[int]], key: Any, count: int, ok: bool, budget: Budget, kind: str) -> None:
    v = table.get(key)
    if v is None:
        if budget.take(key, kind, count):
            table[key] = [count, count if ok else 0, 0 if ok else count]
    else:
        v[0] += count
        v[1 if ok else 2] += count


def _access(
    files: dict[str, dict[str, list[int]]], key: str, acc: str, count: int, ok: bool, budget: Budget
) -> None:
    per = files.get(key)
    if per is None:
        if not budget.take(key, "file", count):
            return
        per = files[key] = {}
    v = per.get(acc)
    if v is None:
        per[acc] = [count, count, 0] if ok else [count, 0, count]
    else:
        v[0] += count
        v[1 if ok else 2] += count


def behaviour(path: str, ignore: Iterable[str] = (), *, parallel: bool = True) -> Behaviour:
    """Verify the bundle at `path` and reduce it to its behaviour (raises VerificationError).
    `parallel`: the reader may check the events on a second CPU (reader.Bundle)."""
    bundle = reader.open_bundle(path, parallel=parallel)
    m = bundle.manifest
    norm = Normalizer(roots(m), ignore)
    text = norm.text
    cache: dict[str, str] = {}

    def n(value: str) -> str:
        out = cache.get(value)
        if out is None:
            out = text(value)
            if len(cache) < _CACHE:
                cache[value] = out
        return out

    b = Behaviour(path, m["run_id"], m["events"], m["lost"]["total"], dict(m["lost"]["by_kind"]), m["detail"])
    b.root_hash = m["root_hash"]
    loss_events = 0
    files = b.files
    file_of: dict[str, dict[str, list[int]]] = {}  # a path as recorded -> its entry in b.files
    file_open, process_exec, network_connect = fmt.FILE_OPEN, fmt.PROCESS_EXEC, fmt.NETWORK_CONNECT
    file_change = fmt.FILE_CHANGE
    policy_denial, run_finished, loss = fmt.POLICY_DENIAL, fmt.RUN_FINISHED, fmt.LOSS
    other = b.other
    budget = b.budget
    # (pid, path) of opens and execs in another namespace, at most MAX_KEYS (past that, a denial of
    # one is keyed with the run's own)
    other_paths: set[tuple[int, str]] = set()
    # the denials' keys, until the pass is done: a denial is keyed by the namespace of the open or
    # exec it refused (pid, target), which may come later
    denials: dict[tuple[int, str, tuple[str, str, str, str]], int] = {}
    for ev in bundle.events():
        t = ev["type"]
        d = ev["data"]
        if "mntns" in d and t in _MARKED:  # another mount namespace: apart, never on the fast path
            _other(other, t, d, n, other_paths, budget)
            b.other_events += d.get("count", 1)
        elif t == file_open:  # most events: _bump inlined
            raw = d["path"]
            per = file_of.get(raw)
            if per is None:
                key = n(raw)
                per = files.get(key)
                if per is None:
                    if not budget.take(key, "file", d.get("count", 1)):
                        continue
                    per = files[key] = {}
                if len(file_of) < _CACHE:
                    file_of[raw] = per
            count = d.get("count", 1)
            ok = d["result"] == 0
            for a in d["access"]:
                v = per.get(a)
                if v is None:
                    per[a] = [count, count, 0] if ok else [count, 0, count]
                else:
                    v[0] += count
                    v[1 if ok else 2] += count
        elif t == file_change:
            count, ok, op = d.get("count", 1), d["result"] == 0, d["operation"]
            named = [(d["path"], op)]
            if d.get("target") is not None and op in ("rename", "link"):
                named.append((d["target"], op + " to"))
            for raw_name, acc in named:
                _access(files, n(raw_name), acc, count, ok, budget)
        elif t == process_exec:
            _exec(b, d, n, budget)
        elif t == network_connect:
            _connect(b, d, n, budget)
        elif t == policy_denial:
            key4 = (d["operation"], n(d["target"]), d["rule"], "enforced" if d["enforced"] else "would deny")
            k = (d["pid"], d["target"], key4)
            if k in denials:
                denials[k] += d.get("count", 1)
            elif budget.take(key4, "denial", d.get("count", 1)):  # kept until the end: paid now
                denials[k] = d.get("count", 1)
        elif t == run_finished:
            b.exit = f"signal {d['signal']}" if d.get("signal") else str(d["exit_code"])
        elif t == loss:
            loss_events += d.get("count", 1)
    budget.keys += len(denials)  # paid for already: the keys below take it again
    budget.chars += sum(sum(map(len, key4)) for _, _, key4 in denials)
    for (
        pid,
        target,
        key4,
    ), count in denials.items():  # a denial of an open or exec in another namespace is too
        _bump(
            other.denials if (pid, target) in other_paths else b.denials, key4, count, True, budget, "denial"
        )
    b.lost = max(b.lost, loss_events)
    return b


# events that may carry mntns: "other" and that diff keys (namespace events are not keyed)
_MARKED = frozenset((fmt.FILE_OPEN, fmt.FILE_CHANGE, fmt.PROCESS_EXEC, fmt.NETWORK_CONNECT))


def _exec(keys: Keys | Behaviour, d: dict[str, Any], n: Callable[[str], str], budget: Budget) -> None:
    cmd = (n(d["filename"]), *map(n, d["argv"]))
    count = d.get("count", 1)
    _bump(keys.execs, cmd, count, d["result"] == 0, budget, "exec")
    digest = d.get("sha256")
    if digest is not None:
        seen = keys.hashes.get(cmd[0])
        if seen is None:
            if not budget.take((cmd[0], digest), "exec", count):
                return
            seen = keys.hashes[cmd[0]] = set()
        elif digest not in seen and not budget.take(digest, "exec", count):
            return
        seen.add(digest)


def _connect(keys: Keys | Behaviour, d: dict[str, Any], n: Callable[[str], str], budget: Budget) -> None:
    port = "" if d.get("port") is None else str(d["port"])
    names = d.get("names")
    key: NetKey = ("NAME", " ".join(sorted(names)), port) if names else (d["family"], n(d["address"]), port)
    _bump(keys.network, key, d.get("count", 1), d["result"] == 0, budget, "network")
    if names and key in keys.network:  # (a key past the cap keeps no scopes either)
        address = d["address"]
        seen = keys.scopes.setdefault(key, {})
        scope = address_scope(address)
        if scope not in seen or address < seen[scope]:
            seen[scope] = address


def _other(
    keys: Keys,
    t: str,
    d: dict[str, Any],
    n: Callable[[str], str],
    paths: set[tuple[int, str]],
    budget: Budget,
) -> None:
    """An event of a process in another mount namespace, into that namespace's keys."""
    count, ok = d.get("count", 1), d["result"] == 0
    if t in (fmt.FILE_OPEN, fmt.PROCESS_EXEC) and len(paths) < MAX_KEYS:
        paths.add((d["pid"], d["path"] if t == fmt.FILE_OPEN else d["filename"]))
    if t == fmt.FILE_OPEN:
        for a in d["access"]:
            _access(keys.files, n(d["path"]), a, count, ok, budget)
    elif t == fmt.FILE_CHANGE:
        op = d["operation"]
        _access(keys.files, n(d["path"]), op, count, ok, budget)
        if d.get("target") is not None and op in ("rename", "link"):
            _access(keys.files, n(d["target"]), op + " to", count, ok, budget)
    elif t == fmt.PROCESS_EXEC:
        _exec(keys, d, n, budget)
    else:
        _connect(keys, d, n, budget)


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


def compare(a: Behaviour, b: Behaviour) -> list[Change]:
    changes = compare_keys(a.own(), b.own())
    if a.exit != b.exit:
        changes.append(Change("exit", "changed", "exit code", f"{a.exit} -> {b.exit}"))
    for c in compare_keys(a.other, b.other):
        c.mntns = "other"
        changes.append(c)
    return past_cap(a, "removed") + past_cap(b, "added") + changes  # first: never cut from a report


def past_cap(x: Behaviour, what: str) -> list[Change]:
    """A difference for each kind of which side `x` had events past its cap on keys (`what`: added
    for B, removed for A): what they did was not compared, so it may be anything."""
    return [
        Change(
            kind,
            what,
            PAST_CAP,
            f"{n} events past the {MAX_KEYS} distinct keys (or {MAX_KEY_CHARS} characters) a side keeps: "
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


def behaviours(a_path: str, b_path: str, ignore: list[str]) -> tuple[Behaviour, Behaviour]:
    """Both sides, A in a forked worker process while this one reads B when there is a spare CPU
    (each side is a long single-threaded pass). A's verification error is reported first."""
    if (os.cpu_count() or 1) < 2 or "fork" not in multiprocessing.get_all_start_methods():
        return behaviour(a_path, ignore), behaviour(b_path, ignore)
    ctx = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        future = pool.submit(behaviour, a_path, ignore, parallel=False)
        try:
            b = behaviour(b_path, ignore, parallel=False)
        except Exception:
            future.result()  # A's error, if any, comes first
            raise
        return future.result(), b


def reaches(changes: list[Change], fail_on: str) -> bool:
    if fail_on == "none":
        return False
    return any(fail_on == "any" or c.what == fail_on for c in changes)


# --- output --------------------------------------------------------------------------------------


def _loss_note(a: Behaviour, b: Behaviour) -> str | None:
    if not a.lost and not b.lost:
        return None
    return (
        f"events were lost (A: {a.lost}, B: {b.lost}): something absent from a side may have happened "
        "without being recorded"
    )


OTHER_NS = "in another mount namespace"


def _other_note(a: Behaviour, b: Behaviour) -> str | None:
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


def _side(tag: str, x: Behaviour) -> str:
    lost = f"{x.lost} lost" if x.lost else "none lost"
    return f"{tag}: {x.path} (run {x.run_id}, {x.events} events, {lost}, exit {x.exit})"


def render_text(a: Behaviour, b: Behaviour, changes: list[Change]) -> str:
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


def render_json(a: Behaviour, b: Behaviour, changes: list[Change], code: int, ignore: list[str]) -> str:
    def side(x: Behaviour) -> dict[str, Any]:
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


def render_markdown(a: Behaviour, b: Behaviour, changes: list[Change]) -> str:
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


# --- command -------------------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "bundles", nargs="+", metavar="BUNDLE", help="A B (or, with --baseline, just the new bundle)"
    )
    parser.add_argument("--format", choices=("text", "json", "markdown"), default="text")
    parser.add_argument(
        "--fail-on", choices=FAIL_ON, default="added",
        help="exit 1 when a difference of this kind exists (default: added; any; none)",
    )  # fmt: skip
    parser.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="PATTERN",
        help="regular expression replaced by <ignored> before comparing (repeatable)",
    )
    parser.add_argument(
        "--baseline",
        metavar="FILE|DIR",
        help="a baseline file (evidence baseline build): report only what it has not seen; or a DIR "
        "where a named bundle is kept (stored on first use) to compare against",
    )
    parser.add_argument(
        "--min-runs",
        type=int,
        metavar="N",
        help="with a baseline file: known means seen in at least N of its runs (default 1: ever seen)",
    )
    parser.add_argument("--name", default="default", help="baseline name (default: default)")
    parser.add_argument(
        "--update", action="store_true", help="store the bundle as the baseline (replacing it)"
    )


def _store(bundle: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(target, mode=0o600) as out, open(bundle, "rb") as src:  # as every bundle
        shutil.copyfileobj(src, out)


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


def report(
    a: Behaviour, b: Behaviour, changes: list[Change], args: argparse.Namespace, ignore: list[str]
) -> int:
    """Writes the report in --format; the exit code --fail-on makes of the changes."""
    code = EXIT_FINDINGS if reaches(changes, args.fail_on) else EXIT_OK
    if args.format == "json":
        sys.stdout.write(render_json(a, b, changes, code, ignore))
    elif args.format == "markdown":
        sys.stdout.write(render_markdown(a, b, changes))
    else:
        sys.stdout.write(render_text(a, b, changes))
    return code


def run(args: argparse.Namespace) -> int:
    check_patterns(args.ignore)
    if args.baseline and is_baseline_file(Path(args.baseline)):
        if len(args.bundles) != 1 or args.update:
            raise UsageError("with a baseline file, diff takes one bundle (the new run) and no --update")
        from evidence.bundle import baseline

        return baseline.diff_against(args.baseline, args.bundles[0], args)
    if args.min_runs is not None:
        raise UsageError("--min-runs needs --baseline FILE (a file made by evidence baseline build)")
    if args.baseline:
        if len(args.bundles) != 1:
            raise UsageError("with --baseline, diff takes one bundle (the new run)")
        if not _NAME.fullmatch(args.name):
            raise UsageError(f"baseline name {args.name!r} must be letters, digits, '.', '_' or '-'")
        new = args.bundles[0]
        stored = Path(args.baseline) / (args.name + BASELINE_SUFFIX)
        if args.update or not stored.exists():
            reader.open_bundle(new).verify()
            _store(new, stored)
            print(f"stored {new} as baseline {args.name!r} ({stored})")
            return EXIT_OK
        a_path, b_path = str(stored), new
    else:
        if len(args.bundles) != 2:
            raise UsageError("diff takes two bundles: A B (or one with --baseline FILE|DIR)")
        a_path, b_path = args.bundles
    a, b = behaviours(a_path, b_path, args.ignore)
    return report(a, b, compare(a, b), args, args.ignore)
