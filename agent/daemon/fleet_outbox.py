"""The fleet publisher's outbox on disk: what JetStream has not acknowledged yet. No network here.

    <outbox>/bundles/<node>.<session>.tar.gz   the bundle (a hard link to the agent's copy, or a copy)
    <outbox>/bundles/<node>.<session>.json     its job: key, sha256, size, when it was queued
    <outbox>/events/seg-<16 digits>.nats        live events, as the bytes that send them
    <outbox>/id                                 this outbox's name: its replies' inbox is under it

A segment holds its events framed once, as the wire writes them (agent/daemon/fleet_wire.py
`Segment`: `HPUB` frames whose reply subjects name the segment and the event's place in it), so
neither sending it nor sending it again after a restart encodes anything. (`seg-*.ndjson`, one
event's JSON a line, is what an older agent left: read, framed by the publisher, and rewritten in
the new form if some of it must wait again.)

A bundle's job is written after its file, atomically: a job names a whole bundle; a file without a
job (the agent died between the two) is queued again at the next start. A segment is written whole
(a temporary file renamed) before any of its events is published, and removed (or rewritten with
what is left) once JetStream acknowledged them: a `kill -9` leaves whole segments only. Segments are
sent oldest first. Events past `max_bytes` are refused (the caller counts them dropped: every event
is in its run's bundle too); bundles are never refused. What is in the outbox is known in memory
(read from the directory once, at the start), so the backlog's figures cost nothing to read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from evidence.agent.daemon.fleet_wire import Segment, parse
from evidence.files import file_sha256, private_dir, write_atomic

logger = logging.getLogger(__name__)

BUNDLE_SUFFIX = ".tar.gz"
JOB_SUFFIX = ".json"
SEGMENT_SUFFIX = ".nats"
OLD_SEGMENT_SUFFIX = ".ndjson"
CACHE_BYTES = 32 * 1024 * 1024  # segments written by this process kept in memory, up to this


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


@dataclasses.dataclass
class _Segment:
    count: int
    size: int
    since: float  # when it was written (its file's mtime for one found at the start)


class Outbox:
    def __init__(
        self,
        path: str | Path,
        max_bytes: int,
        frame: Callable[[Sequence[Mapping[str, Any]], int], Segment] | None = None,
    ) -> None:
        """`frame(events, no)`: live events (an older agent's segment) as segment `no`."""
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.frame = frame
        private_dir(self.path)  # the runs' bundles and events: the agent's alone
        self.bundle_dir = private_dir(self.path / "bundles")
        self.event_dir = private_dir(self.path / "events")
        self.id = self._id()
        self._lock = threading.Lock()
        self._segs: dict[str, _Segment] = {}
        self._cache: dict[str, Segment] = {}
        self._cached = 0
        self._event_bytes = 0
        self._event_count = 0
        for p in sorted(self.event_dir.glob("seg-*")):
            if p.suffix not in (SEGMENT_SUFFIX, OLD_SEGMENT_SUFFIX) or p.name.startswith("."):
                continue
            st = p.stat()
            count = _count(p)
            self._segs[p.name] = _Segment(count, st.st_size, st.st_mtime)
            self._event_bytes += st.st_size
            self._event_count += count
        last = max(self._segs, default=None)
        self._seq = int(last[4:20]) + 1 if last else 0
        self._jobs: dict[str, BundleJob] = {}
        self._load_jobs()

    def _id(self) -> str:
        """A name for this outbox, made once: the inbox its segments' replies go to is under it."""
        p = self.path / "id"
        with contextlib.suppress(OSError, UnicodeDecodeError):
            got = p.read_text().strip()
            if got.isalnum() and len(got) <= 32:
                return got
        new = secrets.token_hex(8)
        write_atomic(p, new.encode() + b"\n", mode=0o600)
        return new

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
        with self._lock:
            self._jobs[key] = job
        return job

    def _load_jobs(self) -> None:
        """The jobs on disk (a job that cannot be read is logged and left for an operator); a bundle
        without its job (the agent stopped between the two) is queued again."""
        for p in self.bundle_dir.glob(f"*{JOB_SUFFIX}"):
            try:
                d = orjson.loads(p.read_bytes())
                key = str(d["key"])
                job = BundleJob(
                    key,
                    self.bundle_dir / f"{key}{BUNDLE_SUFFIX}",
                    str(d["sha256"]),
                    int(d["size"]),
                    int(d["queued_ns"]),
                )
            except (OSError, ValueError, KeyError, TypeError) as e:
                logger.error("fleet outbox: unreadable job %s: %s", p, e)
                continue
            self._jobs[key] = job
        for p in self.bundle_dir.glob(f"*{BUNDLE_SUFFIX}"):
            key = p.name[: -len(BUNDLE_SUFFIX)]
            if key not in self._jobs and not (self.bundle_dir / f"{key}{JOB_SUFFIX}").exists():
                logger.info("fleet outbox: bundle %s had no job (the agent stopped between); queued", key)
                self._write_job(key, p)

    def bundle_jobs(self) -> list[BundleJob]:
        """Jobs, oldest first."""
        with self._lock:
            jobs = list(self._jobs.values())
        return sorted(jobs, key=lambda j: (j.queued_ns, j.key))

    def remove_bundle(self, job: BundleJob) -> None:
        (self.bundle_dir / f"{job.key}{JOB_SUFFIX}").unlink(missing_ok=True)
        job.path.unlink(missing_ok=True)
        with self._lock:
            self._jobs.pop(job.key, None)

    # --- events ----------------------------------------------------------------------------------

    def segments(self) -> list[Path]:
        with self._lock:
            names = sorted(self._segs)
        return [self.event_dir / n for n in names]

    def reserve(self) -> int:
        """The next segment's number (its frames' replies name it)."""
        with self._lock:
            self._seq += 1
            return self._seq - 1

    def add(self, seg: Segment) -> bool:
        """Write a segment; False (nothing written) when it would pass max_bytes."""
        if not len(seg):
            return True
        size = len(seg.data)
        name = f"seg-{seg.no:016d}{SEGMENT_SUFFIX}"
        with self._lock:
            if self._event_bytes + size > self.max_bytes:
                return False
            self._event_bytes += size
            self._event_count += len(seg)
        try:
            write_atomic(self.event_dir / name, seg.data, mode=0o600, fsync=False)
        except BaseException:
            with self._lock:
                self._event_bytes -= size
                self._event_count -= len(seg)
            raise
        with self._lock:
            self._segs[name] = _Segment(len(seg), size, time.time())
            if self._cached + size <= CACHE_BYTES:
                self._cache[name] = seg
                self._cached += size
        return True

    def read(self, path: Path, inbox: str) -> Segment:
        """A segment, its replies under `inbox` (framed again if it was written under another)."""
        with self._lock:
            cached = self._cache.get(path.name)
        if cached is not None:
            return cached
        no = int(path.name[4:20])
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return Segment(no, b"", [0], [])
        if path.suffix == OLD_SEGMENT_SUFFIX:
            return self._read_old(path, data, no)
        seg, problem = parse(data, no, inbox)
        if problem:
            logger.error("fleet outbox: %s: %s; the %d event(s) before it are kept", path, problem, len(seg))
        return seg

    def _read_old(self, path: Path, data: bytes, no: int) -> Segment:
        events = []
        for line in data.splitlines():
            if not line.strip():
                continue
            try:
                events.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                logger.error("fleet outbox: skipping a corrupt line in %s", path)
        if self.frame is None:
            return Segment(no, b"", [0], [])
        return self.frame(events, no)

    def done(self, path: Path, seg: Segment, rest: Sequence[int] = ()) -> None:
        """The segment's events were acknowledged but those at `rest`: rewrite it with those, or
        remove it."""
        with self._lock:
            old = self._segs.pop(path.name, None)
            if self._cache.pop(path.name, None) is not None and old is not None:
                self._cached -= old.size
            if old is not None:
                self._event_bytes -= old.size
                self._event_count -= old.count
        if not rest:
            path.unlink(missing_ok=True)
            return
        left = seg.only(rest)
        name = f"seg-{seg.no:016d}{SEGMENT_SUFFIX}"
        write_atomic(self.event_dir / name, left.data, mode=0o600, fsync=False)
        if name != path.name:
            path.unlink(missing_ok=True)  # an older agent's segment, now in the new form
        with self._lock:
            self._segs[name] = _Segment(len(left), len(left.data), old.since if old else time.time())
            self._event_bytes += len(left.data)
            self._event_count += len(left)
            if self._cached + len(left.data) <= CACHE_BYTES:
                self._cache[name] = left
                self._cached += len(left.data)

    # --- what waits --------------------------------------------------------------------------------

    def backlog(self) -> Backlog:
        now = time.time()
        with self._lock:
            jobs = list(self._jobs.values())
            oldest = min((s.since for s in self._segs.values()), default=None)
            events, event_bytes = self._event_count, self._event_bytes
        return Backlog(
            bundles=len(jobs),
            bundle_bytes=sum(j.size for j in jobs),
            bundle_age=max(0.0, now - min(j.queued_ns for j in jobs) / 1e9) if jobs else 0.0,
            events=events,
            event_bytes=event_bytes,
            event_age=max(0.0, now - oldest) if oldest is not None else 0.0,
        )


def _count(p: Path) -> int:
    """Events in a segment found at the start."""
    with contextlib.suppress(FileNotFoundError):
        data = p.read_bytes()
        if p.suffix == OLD_SEGMENT_SUFFIX:
            return sum(1 for line in data.splitlines() if line.strip())
        return len(parse(data, int(p.name[4:20]), "")[0])
    return 0
