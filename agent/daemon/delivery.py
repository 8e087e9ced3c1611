"""Getting bundles and live events off the node, without losing them.

BundleUploader: every finished bundle in the bundle directory is sent (PUT <url>/<name>, or POST
<url>) until the endpoint answers 2xx; only then is a `<name>.delivered` marker written next to it.
Failures are retried with exponential backoff (with jitter, capped), forever: a bundle never leaves
the disk undelivered, and a restarted agent picks up whatever has no marker yet.

EventStreamer: live CloudEvents, batched, over HTTP with the CloudEvents SDK's HTTP binding (batch
mode: one `application/cloudevents-batch+json` request per batch; structured mode: one request per
event). Submitting never blocks the recorder: events go into a bounded queue; a batch that cannot be
sent, and events that find the queue full, go to a spill directory on disk (one file per batch,
oldest sent first once the endpoint is back, also after a restart). Only when the spill directory
is over its size limit are events dropped, and then they are counted (evidence_stream_dropped_events_total)
and logged: never silently. The live stream is a convenience copy: every event is in the run's
bundle too. Delivery is at least once (a batch whose answer was lost is sent again); receivers
deduplicate by event id (`<session>:<seq>`).

Encoding (records to CloudEvents, CloudEvents to HTTP messages) is pure; only the classes do I/O.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as _dt
import hashlib
import http.client
import json
import logging
import os
import queue
import random
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

from cloudevents.core.bindings import http as ce_http
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent

from evidence.agent.daemon import metrics as m
from evidence.bundle import format as fmt
from evidence.bundle.record_types import SpoolRecord
from evidence.files import private_dir, write_atomic

logger = logging.getLogger(__name__)

BATCH_CONTENT_TYPE = "application/cloudevents-batch+json; charset=utf-8"
DELIVERED_SUFFIX = ".delivered"
_EXTENSION = re.compile(r"[a-z0-9]{1,20}")
_CE_CORE = ("specversion", "id", "source", "type", "subject", "time", "datacontenttype", "dataschema", "data")


@dataclasses.dataclass(frozen=True)
class Backoff:
    """Delay before attempt n+1 after n failures: initial * factor**(n-1), capped, +-jitter."""

    initial: float = 1.0
    maximum: float = 300.0
    factor: float = 2.0
    jitter: float = 0.1

    def delay(self, failures: int, rand: Callable[[], float] = random.random) -> float:
        base = min(self.maximum, self.initial * self.factor ** max(0, failures - 1))
        return max(0.0, base * (1 + self.jitter * (2 * rand() - 1)))


# --- encoding (pure) --------------------------------------------------------------------------------


def live_event(
    session_id: str, seq: int, record: SpoolRecord, extensions: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A spool record as a live CloudEvent dict (the bundle's event shape, with the session as source:
    the run id is only known once the run is finished). `extensions` (lowercase alphanumeric names,
    e.g. poduid, containerid) are added to the event's attributes."""
    from evidence.bundle import records  # the bundle's own mapping of a record to its event

    etype, subject, t_ns, data = records.to_event(record)
    event: dict[str, Any] = {
        "specversion": fmt.SPECVERSION,
        "id": f"{session_id}:{seq}",
        "source": f"urn:evidence:session:{session_id}",
        "type": etype,
        "subject": subject,
        "time": fmt.format_time(int(t_ns)),
        "datacontenttype": fmt.DATACONTENTTYPE,
        "sessionid": session_id,
        "seq": seq,
        "data": data,
    }
    for name, value in (extensions or {}).items():
        if not _EXTENSION.fullmatch(name) or name in event:
            raise ValueError(f"{name!r} is not a usable CloudEvents extension name")
        event[name] = value
    return event


def live_events(
    session_id: str, seq: int, recs: Iterable[SpoolRecord], extensions: Mapping[str, Any] | None = None
) -> tuple[list[dict[str, Any]], int]:
    """A run's records as live events, numbered from `seq` (a record that makes no event still takes
    its number), and the next number: what every live sink (the HTTP stream, the fleet) is given."""
    events = []
    for r in recs:
        try:
            events.append(live_event(session_id, seq, r, extensions))
        except (KeyError, ValueError) as e:
            logger.debug("no live event for a %s record: %s", r.get("k"), e)
        seq += 1
    return events, seq


def to_cloudevent(event: Mapping[str, Any]) -> CloudEvent:
    """The SDK's CloudEvent for an event dict. `time` (RFC 3339, ns) becomes a datetime (us)."""
    attrs = {k: v for k, v in event.items() if k != "data"}
    if isinstance(attrs.get("time"), str):
        ns = fmt.parse_time(attrs["time"])
        attrs["time"] = _dt.datetime.fromtimestamp(ns // 1000 / 1e6, _dt.UTC)
    data = event.get("data")
    return CloudEvent(attributes=attrs, data=data)


def encode(
    events: Sequence[Mapping[str, Any]], mode: Literal["batch", "structured"]
) -> list[ce_http.HTTPMessage]:
    """HTTP messages for events: one batch message, or one structured message per event."""
    fmt_json = JSONFormat()
    ces = [to_cloudevent(e) for e in events]
    if mode == "structured":
        return [ce_http.to_structured(ce, fmt_json) for ce in ces]
    body = b"[" + b",".join(fmt_json.write(ce) for ce in ces) + b"]"
    return [ce_http.HTTPMessage(headers={"content-type": BATCH_CONTENT_TYPE}, body=body)]


def _post(url: str, message: ce_http.HTTPMessage, timeout: float) -> None:
    req = urllib.request.Request(url, data=message.body, method="POST", headers=dict(message.headers))
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - the configured endpoint
        resp.read()


def _describe(e: BaseException) -> str:
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code}"
    if isinstance(e, urllib.error.URLError):
        return str(e.reason)
    return str(e) or type(e).__name__


# --- bundles ----------------------------------------------------------------------------------------


class BundleUploader:
    """Uploads finished bundles from bundle_dir until each is acknowledged with a 2xx."""

    def __init__(
        self,
        bundle_dir: str | Path,
        url: str,
        *,
        method: Literal["PUT", "POST"] = "PUT",
        backoff: Backoff | None = None,
        timeout: float = 30.0,
        headers: Mapping[str, str] | None = None,
        registry: m.Registry | None = None,
    ) -> None:
        self.bundle_dir = Path(bundle_dir)
        self.url = url
        self.method = method
        self.backoff = backoff or Backoff()
        self.timeout = timeout
        self.headers = dict(headers or {})
        reg = self.registry = registry or m.Registry()
        self._attempts = reg.counter(
            "evidence_bundle_uploads", "Bundle upload attempts, by result.", ("result",)
        )
        self._pending_gauge = reg.gauge("evidence_bundles_pending", "Bundles on disk not yet delivered.")
        self._failures: dict[str, int] = {}
        self._next: dict[str, float] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def target_url(self, name: str) -> str:
        return f"{self.url.rstrip('/')}/{quote(name)}" if self.method == "PUT" else self.url

    def pending(self) -> list[Path]:
        """Bundles without a delivered marker, oldest first."""
        try:
            entries = list(os.scandir(self.bundle_dir))
        except FileNotFoundError:
            return []
        names = {e.name for e in entries}
        found = []
        for e in entries:
            if (
                e.name.endswith(".tar.gz")
                and not e.name.startswith(".")
                and e.name + DELIVERED_SUFFIX not in names
            ):
                try:
                    found.append((e.stat().st_mtime_ns, e.name))
                except FileNotFoundError:
                    continue
        return [self.bundle_dir / name for _, name in sorted(found)]

    def enqueue(self, path: str | Path) -> None:
        """Tell the uploader a new bundle is there (it would find it on its next scan anyway)."""
        self._next.pop(Path(path).name, None)
        self._wake.set()

    def deliver(self, path: Path) -> bool:
        """One attempt: True (and the marker written) on a 2xx."""
        sha = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                sha.update(chunk)
        digest = sha.hexdigest()
        headers = {
            "Content-Type": "application/gzip",
            "Content-Length": str(path.stat().st_size),
            "Digest": "sha-256=" + base64.b64encode(bytes.fromhex(digest)).decode(),
            "X-Evidence-Bundle": path.name,
            "X-Evidence-Sha256": digest,
            **self.headers,
        }
        url = self.target_url(path.name)
        try:
            with open(path, "rb") as body:
                req = urllib.request.Request(url, data=body, method=self.method, headers=headers)
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:  # noqa: S310
                    status = resp.status
                    resp.read()
        except (OSError, http.client.HTTPException, ValueError) as e:
            self._attempts.labels(result="error").inc()
            failures = self._failures.get(path.name, 0) + 1
            self._failures[path.name] = failures
            delay = self.backoff.delay(failures)
            self._next[path.name] = time.monotonic() + delay
            logger.warning(
                "upload of %s failed (%s, attempt %d); next try in %.1fs",
                path.name,
                _describe(e),
                failures,
                delay,
            )
            return False
        self._attempts.labels(result="ok").inc()
        marker = {
            "url": url,
            "status": status,
            "sha256": digest,
            "delivered_at": fmt.format_time(time.time_ns()),
        }
        write_atomic(
            path.with_name(path.name + DELIVERED_SUFFIX),
            json.dumps(marker, sort_keys=True).encode() + b"\n",
            mode=0o600,
        )
        self._failures.pop(path.name, None)
        self._next.pop(path.name, None)
        logger.info("delivered %s to %s (HTTP %d)", path.name, url, status)
        return True

    def run_once(self) -> int:
        """Try every pending bundle whose backoff has passed; the number delivered."""
        now = time.monotonic()
        pending = self.pending()
        delivered = 0
        for path in pending:
            if self._stop.is_set():
                break
            if self._next.get(path.name, 0.0) > now:
                continue
            try:
                delivered += self.deliver(path)
            except FileNotFoundError:
                continue  # removed by an operator meanwhile
        self._pending_gauge.set(len(pending) - delivered)
        return delivered

    def _sleep_time(self) -> float:
        if not self._next:
            return 5.0  # rescan now and then: bundles written by another process, or before we started
        return max(0.0, min(5.0, min(self._next.values()) - time.monotonic()))

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once()
            except Exception:
                logger.exception("bundle uploader pass failed")
            self._wake.wait(self._sleep_time())
            self._wake.clear()

    def start(self) -> None:
        pending = self.pending()
        if pending:
            logger.info("%d bundle(s) waiting for delivery from an earlier run", len(pending))
        self._thread = threading.Thread(target=self._loop, name="evidence-upload", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)


# --- live events ------------------------------------------------------------------------------------


class SpillDir:
    """Batches waiting for the endpoint: seg-<seq>.ndjson files, one event dict per line, oldest
    first. Bounded by max_bytes; add() refuses (returns False) rather than grow past it."""

    def __init__(self, path: str | Path, max_bytes: int) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        private_dir(self.path)  # the runs' events, undelivered: the agent's alone
        self._lock = threading.Lock()
        segs = self.segments()
        self._seq = int(segs[-1].name[4:20]) + 1 if segs else 0
        self._bytes = sum(_size(p) for p in segs)

    def segments(self) -> list[Path]:
        return sorted(p for p in self.path.glob("seg-*.ndjson"))

    @property
    def bytes(self) -> int:
        return self._bytes

    def add(self, events: Sequence[Mapping[str, Any]]) -> bool:
        if not events:
            return True
        data = b"".join(json.dumps(e, sort_keys=True, separators=(",", ":")).encode() + b"\n" for e in events)
        with self._lock:
            if self._bytes + len(data) > self.max_bytes:
                return False
            name = f"seg-{self._seq:016d}.ndjson"
            self._seq += 1
            write_atomic(self.path / name, data, mode=0o600)
            self._bytes += len(data)
        return True

    def read(self, seg: Path) -> list[dict[str, Any]]:
        out = []
        for line in seg.read_bytes().splitlines():
            if line.strip():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    logger.error("skipping a corrupt line in %s", seg)
        return out

    def remove(self, seg: Path) -> None:
        with self._lock:
            size = _size(seg)
            seg.unlink(missing_ok=True)
            self._bytes = max(0, self._bytes - size)


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except FileNotFoundError:
        return 0


class EventStreamer:
    """Batches submitted events and posts them; spills what cannot be sent; counts what is dropped."""

    def __init__(
        self,
        url: str,
        spill_dir: str | Path,
        *,
        mode: Literal["batch", "structured"] = "batch",
        batch_size: int = 100,
        batch_interval: float = 1.0,
        queue_size: int = 10_000,
        spill_max_bytes: int = 64 * 1024 * 1024,
        backoff: Backoff | None = None,
        timeout: float = 10.0,
        registry: m.Registry | None = None,
        headers: Mapping[str, str] | None = None,
        send: Callable[[str, ce_http.HTTPMessage, float], None] = _post,
    ) -> None:
        self.url = url
        self.headers = dict(headers or {})
        self.mode: Literal["batch", "structured"] = mode
        self.batch_size = batch_size
        self.batch_interval = batch_interval
        self.backoff = backoff or Backoff()
        self.timeout = timeout
        self.spill = SpillDir(spill_dir, spill_max_bytes)
        self._send = send
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=queue_size)
        self._overflow: list[dict[str, Any]] = []
        self._overflow_lock = threading.Lock()
        self._failures = 0
        self._retry_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        reg = self.registry = registry or m.Registry()
        self.sent = reg.counter("evidence_stream_sent_events", "Live events delivered.")
        self.spilled = reg.counter(
            "evidence_stream_spilled_events", "Live events written to the spill directory."
        )
        self.dropped = reg.counter(
            "evidence_stream_dropped_events", "Live events dropped: spill directory full."
        )
        self._spill_bytes = reg.gauge("evidence_stream_spill_bytes", "Bytes waiting in the spill directory.")

    # producer side

    def submit(self, event: Mapping[str, Any]) -> None:
        """Never blocks: a full queue sends the event to the spill directory (in batches)."""
        try:
            self._queue.put_nowait(dict(event))
        except queue.Full:
            with self._overflow_lock:
                self._overflow.append(dict(event))
                if len(self._overflow) < self.batch_size:
                    return
                batch, self._overflow = self._overflow, []
            self._to_spill(batch)

    def submit_records(
        self, session_id: str, seq: int, recs: Iterable[SpoolRecord], extensions: Mapping[str, str]
    ) -> int:
        """A run's records as live events, numbered from `seq`; the next number."""
        events, seq = live_events(session_id, seq, recs, extensions)
        self.submit_many(events)
        return seq

    def submit_many(self, events: Iterable[Mapping[str, Any]]) -> None:
        for e in events:
            self.submit(e)

    # sender side

    def _to_spill(self, batch: list[dict[str, Any]]) -> None:
        if self.spill.add(batch):
            self.spilled.inc(len(batch))
        else:
            self.dropped.inc(len(batch))
            logger.error(
                "spill directory %s is full (%d bytes): dropped %d live events (they are still in the bundles)",
                self.spill.path,
                self.spill.max_bytes,
                len(batch),
            )
        self._spill_bytes.set(self.spill.bytes)

    def _deliver(self, batch: Sequence[Mapping[str, Any]]) -> int:
        """Send a batch; the number of events delivered (all of them, or a prefix in structured mode)."""
        done = 0
        try:
            for msg in encode(batch, self.mode):
                if self.headers:
                    msg = ce_http.HTTPMessage(headers={**msg.headers, **self.headers}, body=msg.body)
                self._send(self.url, msg, self.timeout)
                done += 1 if self.mode == "structured" else len(batch)
        except (OSError, http.client.HTTPException, ValueError) as e:
            self._failures += 1
            delay = self.backoff.delay(self._failures)
            self._retry_at = time.monotonic() + delay
            logger.warning("live events: %s failed (%s); retrying in %.1fs", self.url, _describe(e), delay)
            return done
        self._failures = 0
        self._retry_at = 0.0
        return done

    def _drain_spill(self) -> bool:
        """Send spilled batches oldest first; True when the spill directory is empty."""
        for seg in self.spill.segments():
            if self._stop.is_set() or time.monotonic() < self._retry_at:
                return False
            events = self.spill.read(seg)
            done = self._deliver(events)
            self.sent.inc(done)
            if done < len(events):
                if done:  # structured mode got part way: keep the rest, in order
                    self.spill.remove(seg)
                    self.spill.add(events[done:])
                    # re-added at the end: a rare reordering, which ids and seq make harmless
                return False
            self.spill.remove(seg)
            self._spill_bytes.set(self.spill.bytes)
        return True

    def _collect(self, wait: float) -> list[dict[str, Any]]:
        batch: list[dict[str, Any]] = []
        deadline = time.monotonic() + wait
        while len(batch) < self.batch_size:
            remaining = deadline - time.monotonic()
            try:
                batch.append(
                    self._queue.get(timeout=max(0.0, remaining))
                    if remaining > 0
                    else self._queue.get_nowait()
                )
            except queue.Empty:
                break
        with self._overflow_lock:
            if self._overflow and len(batch) < self.batch_size:
                take = self.batch_size - len(batch)
                batch += self._overflow[:take]
                self._overflow = self._overflow[take:]
        return batch

    def _handle(self, batch: list[dict[str, Any]]) -> None:
        if not batch:
            return
        # Anything already spilled goes first; while the endpoint is down, new batches queue behind it.
        if self.spill.segments() or time.monotonic() < self._retry_at:
            self._to_spill(batch)
            return
        done = self._deliver(batch)
        self.sent.inc(done)
        if done < len(batch):
            self._to_spill(batch[done:])

    def run_once(self, wait: float = 0.0) -> None:
        if time.monotonic() >= self._retry_at:
            self._drain_spill()
        self._handle(self._collect(wait))

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once(self.batch_interval)
                if self._retry_at and self._queue.empty():
                    self._stop.wait(min(self.batch_interval, max(0.0, self._retry_at - time.monotonic())))
            except Exception:
                logger.exception("live event sender pass failed")
                self._stop.wait(self.batch_interval)

    def start(self) -> None:
        if self.spill.segments():
            logger.info("%d spilled batch(es) of live events from an earlier run", len(self.spill.segments()))
        self._thread = threading.Thread(target=self._loop, name="evidence-stream", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop; one last try to send what is queued, then spill the rest for the next start."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        deadline = time.monotonic() + timeout
        self._stop.clear()
        try:
            while time.monotonic() < deadline and (not self._queue.empty() or self._overflow):
                batch = self._collect(0.0)
                if time.monotonic() >= self._retry_at and not self.spill.segments():
                    self._handle(batch)
                else:
                    self._to_spill(batch)
        finally:
            self._stop.set()
        rest = self._collect(0.0)
        while rest:
            self._to_spill(rest)
            rest = self._collect(0.0)
