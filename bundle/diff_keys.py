"""A bundle reduced to behaviour keys, what `evidence diff` and `evidence baseline` compare (bundle/diff.py
compares two sides and renders the differences; bundle/baseline.py counts keys over many runs).

Each bundle is verified and reduced, in one streaming pass, to behaviour keys (only the keys and
their counts are kept, never the events); bundle/diff.py's docstring says which keys, how they are
normalised and how events in another mount namespace are kept apart.

Memory is bounded whatever the bundles hold (a valid bundle of 1.5M distinct execs took 3 GB): a
side keeps at most MAX_KEYS distinct keys (and MAX_KEY_CHARS characters of them); the events of keys
past that are counted by kind, not keyed (`Budget.past`), and diff makes each kind with such events
a difference of its own.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import ipaddress
import logging
import multiprocessing
import os
from collections.abc import Callable, Iterable
from typing import Any

from evidence.bundle import format as fmt
from evidence.bundle import reader
from evidence.bundle.normalize import Normalizer, ip_of
from evidence.bundle.read_types import ManifestJSON

logger = logging.getLogger(__name__)

# what a run did to a path: an open's access classes, then a file change's operation (on its path)
# and "<operation> to" (rename's and link's new name)
_CHANGE_OPS = ("rename", "unlink", "rmdir", "link", "symlink", "truncate", "chmod", "chown", "mkdir", "mknod")
ACCESS = ("read", "write", "create", "exec", *_CHANGE_OPS, "rename to", "link to")
_CACHE = 200_000  # entries per memo of normalised values
MAX_KEYS = 200_000  # distinct behaviour keys one side keeps (all kinds, both namespaces)
MAX_KEY_CHARS = 32 * 1024 * 1024  # ... and characters of their text (an argv can be 8 KiB)


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
    """Side keys of one kind of event source. Values are [count, ok, failed]."""

    execs: dict[tuple[str, ...], list[int]] = dataclasses.field(default_factory=dict)
    hashes: dict[str, set[str]] = dataclasses.field(default_factory=dict)  # program -> its sha256s
    files: dict[str, dict[str, list[int]]] = dataclasses.field(default_factory=dict)
    network: dict[NetKey, list[int]] = dataclasses.field(default_factory=dict)
    denials: dict[tuple[str, str, str, str], list[int]] = dataclasses.field(default_factory=dict)
    # a name key of `network` -> the ranges of its addresses (address_scope) -> the least address
    scopes: dict[NetKey, dict[str, str]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Side:
    """What one run did, reduced to normalised keys: one side (A or B) of a diff (not the run id's
    `Behaviour`, bundle/run_id.py). Values are [count, ok, failed]. `other` holds
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


def roots(manifest: ManifestJSON) -> dict[str, str]:
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


def behaviour(path: str, ignore: Iterable[str] = (), *, parallel: bool = True) -> Side:
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

    b = Side(path, m["run_id"], m["events"], m["lost"]["total"], dict(m["lost"]["by_kind"]), m["detail"])
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


def _exec(keys: Keys | Side, d: dict[str, Any], n: Callable[[str], str], budget: Budget) -> None:
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


def _connect(keys: Keys | Side, d: dict[str, Any], n: Callable[[str], str], budget: Budget) -> None:
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


def behaviours(a_path: str, b_path: str, ignore: list[str]) -> tuple[Side, Side]:
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
