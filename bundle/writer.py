"""Build a deterministic evidence bundle from a run's metadata and its spooled records.

Two passes over the records: the first aggregates (summary mode) and computes the content-addressed
run id; the second writes events in the order of their first occurrence in the spool. The same
records and metadata always give the same bytes: fixed tar metadata (mtime 0, uid/gid 0, mode 0644,
no user names), gzip header mtime 0 and no file name, canonical JSON everywhere. A signed bundle
(`signer`) adds its attestation as a third member; ed25519 signatures are deterministic too.
"""

from __future__ import annotations

import copy
import dataclasses
import gzip
import hashlib
import io
import logging
import tarfile
import tempfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from pydantic import Field

from evidence.bundle import attestation, canonical
from evidence.bundle import format as fmt
from evidence.bundle.normalize import Normalizer
from evidence.files import atomic_write

logger = logging.getLogger(__name__)

Records = Callable[[], Iterable[dict[str, Any]]]


class RunMeta(fmt.RunInfo):
    """A run's metadata for the writer: the manifest's own fields about the run (`format.RunInfo`),
    and what the writer turns into events, times and the run id."""

    pid: int
    cgroup: str
    started_ns: int
    finished_ns: int
    lost: dict[str, int] = Field(default_factory=dict)
    degradations: list[dict[str, str]] = Field(default_factory=list)
    roots: dict[str, str] = Field(default_factory=dict)  # placeholder -> path, for the run id


# Kinds aggregated in summary mode, with the fields that make a record distinct.
_SUMMARY_KEYS: dict[str, tuple[str, ...]] = {
    "open": ("exe", "path", "access", "result", "cgroup", "container", "mntns"),
    "change": (
        "exe",
        "operation",
        "path",
        "target",
        "mode",
        "uid",
        "gid",
        "result",
        "cgroup",
        "container",
        "mntns",
    ),
    "connect": ("exe", "family", "address", "port", "result", "cgroup", "container", "mntns"),
    "denial": ("exe", "operation", "target", "rule", "enforced", "result"),
}
_KIND_TYPE = {
    "exec": fmt.PROCESS_EXEC,
    "exit": fmt.PROCESS_EXIT,
    "open": fmt.FILE_OPEN,
    "change": fmt.FILE_CHANGE,
    "connect": fmt.NETWORK_CONNECT,
    "denial": fmt.POLICY_DENIAL,
    "inventory": fmt.INVENTORY,
    "degradation": fmt.DEGRADATION,
    "namespace": fmt.PROCESS_NAMESPACE,
}


def _freeze(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _key(rec: dict[str, Any]) -> tuple[Any, ...] | None:
    fields = _SUMMARY_KEYS.get(rec["k"])
    if fields is None:
        return None
    return (rec["k"],) + tuple(_freeze(rec.get(f)) for f in fields)


def _subject(rec: dict[str, Any]) -> str:
    k = rec["k"]
    if k == "exec":
        return str(rec["filename"])
    if k == "exit":
        return str(rec.get("exe") or f"pid:{rec['pid']}")
    if k in ("open", "change"):
        return str(rec["path"])
    if k == "connect":
        if rec["family"] == "AF_INET6":
            return f"[{rec['address']}]:{rec['port']}"
        if rec.get("port") is not None:
            return f"{rec['address']}:{rec['port']}"
        return str(rec["address"])
    if k == "denial":
        return str(rec["target"])
    if k == "inventory":
        return str(rec.get("exe") or f"pid:{rec['pid']}")
    if k == "degradation":
        return str(rec["component"])
    if k == "namespace":
        if rec.get("target_pid") is not None and rec["operation"] != "clone":
            return f"{rec['operation']} pid:{rec['target_pid']}"
        return " ".join((rec["operation"], *rec["paths"]))
    raise ValueError(f"unknown record kind {k!r}")


def behaviour_digest(
    meta: RunMeta, records: Iterable[dict[str, Any]]
) -> tuple[str, dict[tuple[Any, ...], list[int]]]:
    """First pass: (run id, summary aggregates {key: [count, first_t, last_t]})."""
    norm = Normalizer(meta.roots)
    execs: set[tuple[Any, ...]] = set()
    files: set[tuple[Any, ...]] = set()
    nets: set[tuple[Any, ...]] = set()
    denials: set[tuple[Any, ...]] = set()
    changes: set[tuple[Any, ...]] = set()
    namespaces: set[tuple[Any, ...]] = set()
    agg: dict[tuple[Any, ...], list[int]] = {}
    for rec in records:
        k = rec["k"]
        if k == "exec":
            execs.add((norm.text(rec["filename"]), tuple(norm.argv(rec["argv"])), rec["result"]))
        elif k == "open":
            files.add((norm.text(rec["path"]), tuple(rec["access"]), rec["result"]))
        elif k == "connect":
            nets.add((rec["family"], norm.text(rec["address"]), rec.get("port"), rec["result"]))
        elif k == "change":
            target = rec.get("target")
            changes.add(
                (
                    rec["operation"],
                    norm.text(rec["path"]),
                    norm.text(target) if target else None,
                    rec["result"],
                )
            )
        elif k == "namespace":
            namespaces.add(
                (
                    rec["operation"],
                    tuple(rec["flags"]),
                    tuple(norm.text(p) for p in rec["paths"]),
                    rec["result"],
                )
            )
        elif k == "denial":
            denials.add((rec["operation"], norm.text(rec["target"]), rec["rule"], rec["enforced"]))
        key = _key(rec) if meta.detail == "summary" else None
        if key is not None:
            # a record may stand for n occurrences up to time tl (counted by the recorder's kernel)
            n, tl = rec.get("n", 1), rec.get("tl", rec["t"])
            a = agg.get(key)
            if a is None:
                agg[key] = [n, rec["t"], tl]
            else:
                a[0] += n
                a[1] = min(a[1], rec["t"])
                a[2] = max(a[2], tl)
    behaviour = {
        "command": norm.argv(meta.command),
        "execs": sorted(execs, key=repr),
        "files": sorted(files, key=repr),
        "connects": sorted(nets, key=repr),
        "denials": sorted(denials, key=repr),
    }
    if changes:  # only when there are some: a run id made before file changes were recorded holds
        behaviour["changes"] = sorted(changes, key=repr)
    if namespaces:  # the same: only when there are some
        behaviour["namespaces"] = sorted(namespaces, key=repr)
    digest = hashlib.sha256(canonical.dumps(behaviour)).hexdigest()
    return "run-" + digest[:32], agg


def _data(rec: dict[str, Any], agg: list[int] | None) -> dict[str, Any]:
    data = {k: v for k, v in rec.items() if k not in ("k", "t", "n", "tl")}
    if rec["k"] in ("open", "change", "connect"):
        # a record may stand for n occurrences up to tl (the live stream shows such a record alone)
        count, first, last = agg if agg else (rec.get("n", 1), rec["t"], rec.get("tl", rec["t"]))
        data["count"] = count
        data["first_time"] = fmt.format_time(first)
        data["last_time"] = fmt.format_time(last)
    elif rec["k"] == "denial" and agg:
        data["count"] = agg[0]
    return data


@dataclasses.dataclass(frozen=True)
class Caps:
    """What one bundle may hold, below the reader's limits (bundle/format.py MAX_*) with room kept
    for the events that close a run (loss, run.finished), so that every bundle the writer makes is
    one that lint, show and diff accept. Past a cap, records are counted by kind, not written: the
    manifest's `lost` and a `dev.evidence.loss` event (where: writer) say how many."""

    events: int = fmt.MAX_EVENTS - 10_000
    decompressed: int = fmt.MAX_DECOMPRESSED - 64 * 1024 * 1024
    compressed: int = fmt.MAX_COMPRESSED - 8 * 1024 * 1024  # estimated with a fast deflate: an upper bound
    line: int = fmt.MAX_LINE - 1  # one event (a path under a deep working directory can be huge)


class _EventSink:
    """Writes events as canonical JSON lines, keeping counts, file hash and root hash."""

    def __init__(
        self,
        out: io.BufferedWriter,
        run_id: str,
        labels: dict[str, str] | None = None,
        caps: Caps | None = None,
    ) -> None:
        self.caps = caps or Caps()
        self._deflate = zlib.compressobj(1)
        self.compressed = 0
        self.out = out
        self.run_id = run_id
        self.labels = fmt.labels_attribute(labels)
        self.source = fmt.source_for(run_id)
        self.seq = 0
        self.size = 0
        self.sha = hashlib.sha256()
        self.root = fmt.RootHasher()
        self.counts: dict[str, int] = {}

    def emit(self, etype: str, subject: str, t_ns: int, data: dict[str, Any], capped: bool = False) -> bool:
        """Write one event; with `capped`, only if the bundle's caps leave room (False: not written)."""
        event = {
            "specversion": fmt.SPECVERSION,
            "id": fmt.event_id(self.run_id, self.seq),
            "source": self.source,
            "type": etype,
            "subject": subject,
            "time": fmt.format_time(t_ns),
            "datacontenttype": fmt.DATACONTENTTYPE,
            "runid": self.run_id,
            "seq": self.seq,
            "data": data,
        }
        if self.labels is not None:
            event["labels"] = self.labels
        line = canonical.dumps(event, check=False) + b"\n"
        packed = len(self._deflate.compress(line))
        if capped and (
            len(line) > self.caps.line
            or self.seq >= self.caps.events
            or self.size + len(line) > self.caps.decompressed
            or self.compressed + packed + len(line) // 2 > self.caps.compressed  # what deflate still holds
        ):
            return False
        self.compressed += packed
        self.root.add(fmt.content_hash(event))
        self.out.write(line)
        self.sha.update(line)
        self.size += len(line)
        self.counts[etype] = self.counts.get(etype, 0) + 1
        self.seq += 1
        return True


def _head(meta: RunMeta) -> Iterator[tuple[str, str, int, dict[str, Any]]]:
    argv0 = meta.command[0] if meta.command else ""
    yield (
        fmt.RUN_STARTED,
        argv0,
        meta.started_ns,
        {
            "session_id": meta.session_id,
            "command": list(meta.command),
            "cwd": meta.cwd,
            "pid": meta.pid,
            "cgroup": meta.cgroup,
            "detail": meta.detail,
            "labels": dict(meta.labels),
        },
    )
    for d in meta.degradations:
        yield fmt.DEGRADATION, d["component"], meta.started_ns, dict(d)


def _body(
    meta: RunMeta, records: Iterable[dict[str, Any]], agg: dict[tuple[Any, ...], list[int]]
) -> Iterator[tuple[str, str, int, dict[str, Any]]]:
    emitted: set[tuple[Any, ...]] = set()
    for rec in records:
        key = _key(rec) if meta.detail == "summary" else None
        if key is not None:
            if key in emitted:
                continue
            emitted.add(key)
        yield _KIND_TYPE[rec["k"]], _subject(rec), rec["t"], _data(rec, agg.get(key) if key else None)


def _tail(meta: RunMeta, capped: dict[str, int]) -> Iterator[tuple[str, str, int, dict[str, Any]]]:
    argv0 = meta.command[0] if meta.command else ""
    for kind in sorted(meta.lost):
        if meta.lost[kind]:
            yield (
                fmt.LOSS,
                kind,
                meta.finished_ns,
                {"kind": kind, "count": meta.lost[kind], "where": "kernel"},
            )
    for kind in sorted(capped):
        yield fmt.LOSS, kind, meta.finished_ns, {"kind": kind, "count": capped[kind], "where": "writer"}
    yield (
        fmt.RUN_FINISHED,
        argv0,
        meta.finished_ns,
        {
            "exit_code": meta.exit_code,
            "signal": meta.signal,
            "duration_ns": max(0, meta.finished_ns - meta.started_ns),
            "cut_short": meta.cut_short,
        },
    )


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size = size
    ti.mtime = 0
    ti.mode = 0o644
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    ti.type = tarfile.REGTYPE
    return ti


def write_bundle(
    out_path: str | Path,
    meta: RunMeta,
    records: Records,
    caps: Caps | None = None,
    *,
    signer: attestation.Signer | None = None,
) -> dict[str, Any]:
    """Write the bundle atomically (temp file + rename) and return its manifest. Records past the
    caps are counted by kind (`over_cap:<type>` in the manifest's lost), never silently dropped.
    With a `signer` (signing.load_signer(key_path)), the bundle is signed: its third member is the
    attestation."""
    out_path = Path(out_path)
    run_id, agg = behaviour_digest(meta, records())
    out_dir = out_path.parent if str(out_path.parent) else Path(".")
    with tempfile.TemporaryFile(dir=out_dir) as events_tmp:
        sink = _EventSink(events_tmp, run_id, meta.labels, caps)  # type: ignore[arg-type]
        for event in _head(meta):
            sink.emit(*event)
        capped: dict[str, int] = {}
        for event in _body(meta, records(), agg):
            if not sink.emit(*event, capped=True):
                kind = "over_cap:" + event[0].removeprefix("dev.evidence.")
                capped[kind] = capped.get(kind, 0) + 1
        for event in _tail(meta, capped):
            sink.emit(*event)
        if capped:
            logger.warning("the bundle's caps were reached: %s not written (counted as lost)", capped)
        lost = {**meta.lost, **capped}
        lost_total = sum(lost.values())
        manifest = {
            "format": fmt.FORMAT_NAME,
            "format_version": fmt.FORMAT_VERSION,
            "producer": {"name": "evidence", "version": _version()},
            "run_id": run_id,
            "source": sink.source,
            **{name: copy.copy(getattr(meta, name)) for name in fmt.RunInfo.model_fields},
            "started_at": fmt.format_time(meta.started_ns),
            "finished_at": fmt.format_time(meta.finished_ns),
            "counts": dict(sorted(sink.counts.items())),
            "events": sink.seq,
            "lost": {"total": lost_total, "by_kind": {k: v for k, v in sorted(lost.items())}},
            "files": {fmt.EVENTS_NAME: {"sha256": sink.sha.hexdigest(), "size": sink.size}},
            "root_hash": sink.root.hexdigest(),
        }
        manifest_bytes = canonical.dumps(manifest)
        signed = b""
        if signer is not None:
            signed = attestation.member(manifest, manifest_bytes, sink.sha.hexdigest(), signer)
        with (
            atomic_write(out_path) as raw,
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6) as gz,
            tarfile.open(fileobj=gz, mode="w", format=tarfile.USTAR_FORMAT) as tar,
        ):
            tar.addfile(_tarinfo(fmt.MANIFEST_NAME, len(manifest_bytes)), io.BytesIO(manifest_bytes))
            events_tmp.seek(0)
            tar.addfile(_tarinfo(fmt.EVENTS_NAME, sink.size), events_tmp)
            if signer is not None:
                tar.addfile(_tarinfo(fmt.ATTESTATION_NAME, len(signed)), io.BytesIO(signed))
    logger.info("wrote %s: %d events, run id %s", out_path, sink.seq, run_id)
    return manifest


def _version() -> str:
    from evidence import __version__

    return __version__
