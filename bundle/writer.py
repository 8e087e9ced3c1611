"""Build a deterministic evidence bundle from a run's metadata and its spooled records.

Two passes over the records: the first aggregates (summary mode) and computes the content-addressed
run id; the second writes events in the order of their first occurrence in the spool. The same
records and metadata always give the same bytes: fixed tar metadata (mtime 0, uid/gid 0, mode 0644,
no user names), gzip header mtime 0 and no file name, canonical JSON everywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import hashlib
import io
import logging
import os
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from bundle import canonical
from bundle import format as fmt
from bundle.normalize import Normalizer

logger = logging.getLogger(__name__)

Records = Callable[[], Iterable[dict[str, Any]]]


@dataclasses.dataclass(frozen=True)
class RunMeta:
    session_id: str
    command: list[str]
    cwd: str
    pid: int
    cgroup: str
    started_ns: int
    finished_ns: int
    exit_code: int | None
    signal: str | None = None
    cut_short: bool = False
    attached_late: bool = False
    detail: str = "summary"
    host: dict[str, str] = dataclasses.field(default_factory=dict)
    capabilities: dict[str, Any] = dataclasses.field(default_factory=dict)
    headers: dict[str, Any] = dataclasses.field(default_factory=dict)
    lost: dict[str, int] = dataclasses.field(default_factory=dict)
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    policy: dict[str, Any] | None = None
    degradations: list[dict[str, str]] = dataclasses.field(default_factory=list)
    roots: dict[str, str] = dataclasses.field(default_factory=dict)  # placeholder -> path, for the run id


# Kinds aggregated in summary mode, with the fields that make a record distinct.
_SUMMARY_KEYS: dict[str, tuple[str, ...]] = {
    "open": ("exe", "path", "access", "result", "cgroup", "container"),
    "connect": ("exe", "family", "address", "port", "result", "cgroup", "container"),
    "denial": ("exe", "operation", "target", "rule", "enforced", "result"),
}
_KIND_TYPE = {
    "exec": fmt.PROCESS_EXEC,
    "exit": fmt.PROCESS_EXIT,
    "open": fmt.FILE_OPEN,
    "connect": fmt.NETWORK_CONNECT,
    "denial": fmt.POLICY_DENIAL,
    "inventory": fmt.INVENTORY,
    "degradation": fmt.DEGRADATION,
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
    if k == "open":
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
    agg: dict[tuple[Any, ...], list[int]] = {}
    for rec in records:
        k = rec["k"]
        if k == "exec":
            execs.add((norm.text(rec["filename"]), tuple(norm.argv(rec["argv"])), rec["result"]))
        elif k == "open":
            files.add((norm.text(rec["path"]), tuple(rec["access"]), rec["result"]))
        elif k == "connect":
            nets.add((rec["family"], norm.text(rec["address"]), rec.get("port"), rec["result"]))
        elif k == "denial":
            denials.add((rec["operation"], norm.text(rec["target"]), rec["rule"], rec["enforced"]))
        key = _key(rec) if meta.detail == "summary" else None
        if key is not None:
            a = agg.get(key)
            if a is None:
                agg[key] = [1, rec["t"], rec["t"]]
            else:
                a[0] += 1
                a[1] = min(a[1], rec["t"])
                a[2] = max(a[2], rec["t"])
    behaviour = {
        "command": norm.argv(meta.command),
        "execs": sorted(execs, key=repr),
        "files": sorted(files, key=repr),
        "connects": sorted(nets, key=repr),
        "denials": sorted(denials, key=repr),
    }
    digest = hashlib.sha256(canonical.dumps(behaviour)).hexdigest()
    return "run-" + digest[:32], agg


def _data(rec: dict[str, Any], agg: list[int] | None) -> dict[str, Any]:
    data = {k: v for k, v in rec.items() if k not in ("k", "t")}
    if rec["k"] in ("open", "connect"):
        count, first, last = agg if agg else (1, rec["t"], rec["t"])
        data["count"] = count
        data["first_time"] = fmt.format_time(first)
        data["last_time"] = fmt.format_time(last)
    elif rec["k"] == "denial" and agg:
        data["count"] = agg[0]
    return data


class _EventSink:
    """Writes events as canonical JSON lines, keeping counts, file hash and root hash."""

    def __init__(self, out: io.BufferedWriter, run_id: str, labels: dict[str, str] | None = None) -> None:
        self.out = out
        self.run_id = run_id
        self.labels = fmt.labels_attribute(labels)
        self.source = fmt.source_for(run_id)
        self.seq = 0
        self.size = 0
        self.sha = hashlib.sha256()
        self.root = fmt.RootHasher()
        self.counts: dict[str, int] = {}

    def emit(self, etype: str, subject: str, t_ns: int, data: dict[str, Any]) -> None:
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
        self.root.add(fmt.content_hash(event))
        line = canonical.dumps(event, check=False) + b"\n"
        self.out.write(line)
        self.sha.update(line)
        self.size += len(line)
        self.counts[etype] = self.counts.get(etype, 0) + 1
        self.seq += 1


def _iter_events(
    meta: RunMeta, records: Iterable[dict[str, Any]], agg: dict[tuple[Any, ...], list[int]]
) -> Iterator[tuple[str, str, int, dict[str, Any]]]:
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
    emitted: set[tuple[Any, ...]] = set()
    for rec in records:
        key = _key(rec) if meta.detail == "summary" else None
        if key is not None:
            if key in emitted:
                continue
            emitted.add(key)
        yield _KIND_TYPE[rec["k"]], _subject(rec), rec["t"], _data(rec, agg.get(key) if key else None)
    for kind in sorted(meta.lost):
        if meta.lost[kind]:
            yield (
                fmt.LOSS,
                kind,
                meta.finished_ns,
                {"kind": kind, "count": meta.lost[kind], "where": "kernel"},
            )
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


def write_bundle(out_path: str | Path, meta: RunMeta, records: Records) -> dict[str, Any]:
    """Write the bundle atomically (temp file + rename) and return its manifest."""
    out_path = Path(out_path)
    run_id, agg = behaviour_digest(meta, records())
    out_dir = out_path.parent if str(out_path.parent) else Path(".")
    with tempfile.TemporaryFile(dir=out_dir) as events_tmp:
        sink = _EventSink(events_tmp, run_id, meta.labels)  # type: ignore[arg-type]
        for etype, subject, t_ns, data in _iter_events(meta, records(), agg):
            sink.emit(etype, subject, t_ns, data)
        lost_total = sum(meta.lost.values())
        manifest = {
            "format": fmt.FORMAT_NAME,
            "format_version": fmt.FORMAT_VERSION,
            "producer": {"name": "evidence", "version": _version()},
            "run_id": run_id,
            "session_id": meta.session_id,
            "source": sink.source,
            "command": list(meta.command),
            "cwd": meta.cwd,
            "started_at": fmt.format_time(meta.started_ns),
            "finished_at": fmt.format_time(meta.finished_ns),
            "exit_code": meta.exit_code,
            "signal": meta.signal,
            "cut_short": meta.cut_short,
            "attached_late": meta.attached_late,
            "detail": meta.detail,
            "host": dict(meta.host),
            "capabilities": dict(meta.capabilities),
            "headers": dict(meta.headers),
            "counts": dict(sorted(sink.counts.items())),
            "events": sink.seq,
            "lost": {"total": lost_total, "by_kind": {k: v for k, v in sorted(meta.lost.items())}},
            "labels": dict(meta.labels),
            "policy": meta.policy,
            "files": {fmt.EVENTS_NAME: {"sha256": sink.sha.hexdigest(), "size": sink.size}},
            "root_hash": sink.root.hexdigest(),
        }
        manifest_bytes = canonical.dumps(manifest)
        fd, tmp_name = tempfile.mkstemp(prefix=".evidence-", suffix=".tmp", dir=out_dir)
        try:
            with (
                os.fdopen(fd, "wb") as raw,
                gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6) as gz,
                tarfile.open(fileobj=gz, mode="w", format=tarfile.USTAR_FORMAT) as tar,
            ):
                tar.addfile(_tarinfo(fmt.MANIFEST_NAME, len(manifest_bytes)), io.BytesIO(manifest_bytes))
                events_tmp.seek(0)
                tar.addfile(_tarinfo(fmt.EVENTS_NAME, sink.size), events_tmp)
                tar.close()
                gz.close()
                raw.flush()
                os.fsync(raw.fileno())
            os.chmod(tmp_name, 0o644)
            os.replace(tmp_name, out_path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)
            raise
    logger.info("wrote %s: %d events, run id %s", out_path, sink.seq, run_id)
    return manifest


def _version() -> str:
    from evidence import __version__

    return __version__
