"""The fleet publisher's outbox on disk: what JetStream has not acknowledged yet. No network here.

    <outbox>/bundles/<node>.<session>.tar.gz   the bundle (a hard link to the agent's copy, or a copy)
    <outbox>/bundles/<node>.<session>.json     its job: key, sha256, size, when it was queued
    <outbox>/events/seg-<16 digits>.ndjson      live events, one canonical JSON object a line

A bundle's job is written after its file, atomically: a job names a whole bundle; a file without a
job (the agent died between the two) is queued again at the next start. A segment is written whole
before any of its events is published and removed (or rewritten with what is left) once JetStream
acknowledged them. Segments are sent oldest first. Events past `max_bytes` are refused (the caller
counts them dropped: every event is in its run's bundle too); bundles are never refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from evidence.files import file_sha256, private_dir, write_atomic

logger = logging.getLogger(__name__)

BUNDLE_SUFFIX = ".tar.gz"
JOB_SUFFIX = ".json"


@dataclasses.dataclass(frozen=True)
class BundleJob:
    key: str
    path: Path
    sha256: str
    size: int
    queued_ns: int


@dataclasses.dataclass(frozen=True)
class Backlog:
    """What waits in the outbox, for the metrics: items, bytes, age of the oldest (seconds)."""

    bundles: int = 0
    bundle_bytes: int = 0
    bundle_age: float = 0.0
    events: int = 0
    event_bytes: int = 0
    event_age: float = 0.0


class Outbox:
    def __init__(self, path: str | Path, max_bytes: int) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        private_dir(self.path)  # the runs' bundles and events: the agent's alone
        self.bundle_dir = private_dir(self.path / "bundles")
        self.event_dir = private_dir(self.path / "events")
        self._lock = threading.Lock()
        segs = self.segments()
        self._seq = int(segs[-1].name[4:20]) + 1 if segs else 0
        self._event_bytes = sum(_size(p) for p in segs)
        self._event_count = sum(_lines(p) for p in segs)
        # events of segments written by this process, kept so they are not read back
        self._cache: dict[str, list[dict[str, Any]]] = {}
        self._requeue_orphans()

    # --- bundles ---------------------------------------------------------------------------------

    def add_bundle(self, key: str, source: Path) -> BundleJob:
        """Put a finished bundle in the outbox (hard link, else copy), then its job. Disk only."""
        target = self.bundle_dir / f"{key}{BUNDLE_SUFFIX}"
        tmp = self.bundle_dir / f".{key}.{os.getpid()}.tmp"
        tmp.unlink(missing_ok=True)
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copyfile(source, tmp)
            os.chmod(tmp, 0o600)
        os.replace(tmp, target)
        return self._write_job(key, target)

    def _write_job(self, key: str, target: Path) -> BundleJob:
        sha, size = file_sha256(target)
        job = BundleJob(key, target, sha, size, time.time_ns())
        body = {"key": key, "sha256": sha, "size": size, "queued_ns": job.queued_ns}
        write_atomic(self.bundle_dir / f"{key}{JOB_SUFFIX}", orjson.dumps(body), mode=0o600)
        return job

    def _requeue_orphans(self) -> None:
        for p in self.bundle_dir.glob(f"*{BUNDLE_SUFFIX}"):
            key = p.name[: -len(BUNDLE_SUFFIX)]
            if not (self.bundle_dir / f"{key}{JOB_SUFFIX}").exists():
                logger.info("fleet outbox: bundle %s had no job (the agent stopped between); queued", key)
                self._write_job(key, p)

    def bundle_jobs(self) -> list[BundleJob]:
        """Jobs, oldest first. A job that cannot be read, or whose bundle is gone, is logged and
        skipped (left for an operator)."""
        jobs = []
        for p in self.bundle_dir.glob(f"*{JOB_SUFFIX}"):
            try:
                d = orjson.loads(p.read_bytes())
                key = str(d["key"])
                jobs.append(
                    BundleJob(
                        key,
                        self.bundle_dir / f"{key}{BUNDLE_SUFFIX}",
                        str(d["sha256"]),
                        int(d["size"]),
                        int(d["queued_ns"]),
                    )
                )
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError) as e:
                logger.error("fleet outbox: unreadable job %s: %s", p, e)
        return sorted(jobs, key=lambda j: (j.queued_ns, j.key))

    def remove_bundle(self, job: BundleJob) -> None:
        (self.bundle_dir / f"{job.key}{JOB_SUFFIX}").unlink(missing_ok=True)
        job.path.unlink(missing_ok=True)

    # --- events ----------------------------------------------------------------------------------

    def segments(self) -> list[Path]:
        return sorted(self.event_dir.glob("seg-*.ndjson"))

    def add_events(self, events: Sequence[dict[str, Any]]) -> bool:
        """Write a segment; False (nothing written) when it would pass max_bytes."""
        if not events:
            return True
        data = b"".join(orjson.dumps(e, option=orjson.OPT_SORT_KEYS) + b"\n" for e in events)
        with self._lock:
            if self._event_bytes + len(data) > self.max_bytes:
                return False
            name = f"seg-{self._seq:016d}.ndjson"
            self._seq += 1
            write_atomic(self.event_dir / name, data, mode=0o600, fsync=False)
            self._event_bytes += len(data)
            self._event_count += len(events)
            self._cache[name] = list(events)  # the caller's batch, not copied: it hands it over
        return True

    def read(self, seg: Path) -> list[dict[str, Any]]:
        with self._lock:
            cached = self._cache.get(seg.name)
        if cached is not None:
            return cached
        out = []
        for line in seg.read_bytes().splitlines():
            if line.strip():
                try:
                    out.append(orjson.loads(line))
                except orjson.JSONDecodeError:
                    logger.error("fleet outbox: skipping a corrupt line in %s", seg)
        return out

    def done(self, seg: Path, rest: Sequence[dict[str, Any]] = ()) -> None:
        """The segment's events were acknowledged but `rest`: rewrite it with those, or remove it."""
        with self._lock:
            size, count = _size(seg), len(self._cache.get(seg.name) or []) or _lines(seg)
            if rest:
                data = b"".join(orjson.dumps(e, option=orjson.OPT_SORT_KEYS) + b"\n" for e in rest)
                write_atomic(seg, data, mode=0o600, fsync=False)
                self._cache[seg.name] = list(rest)
                self._event_bytes += len(data) - size
                self._event_count += len(rest) - count
                return
            seg.unlink(missing_ok=True)
            self._cache.pop(seg.name, None)
            self._event_bytes = max(0, self._event_bytes - size)
            self._event_count = max(0, self._event_count - count)

    # --- what waits --------------------------------------------------------------------------------

    def backlog(self) -> Backlog:
        now = time.time()
        jobs = self.bundle_jobs()
        segs = self.segments()
        event_age = 0.0
        if segs:
            with contextlib.suppress(FileNotFoundError):
                event_age = max(0.0, now - segs[0].stat().st_mtime)
        with self._lock:
            events, event_bytes = self._event_count, self._event_bytes
        return Backlog(
            bundles=len(jobs),
            bundle_bytes=sum(j.size for j in jobs),
            bundle_age=max(0.0, now - jobs[0].queued_ns / 1e9) if jobs else 0.0,
            events=events,
            event_bytes=event_bytes,
            event_age=event_age,
        )


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except FileNotFoundError:
        return 0


def _lines(p: Path) -> int:
    try:
        return p.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0
