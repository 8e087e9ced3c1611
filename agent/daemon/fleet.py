"""The agent's fleet publisher: live events, bundles and index entries to NATS JetStream.

    sink:
      nats:
        servers: [nats://nats-0:4222, nats://nats-1:4222, nats://nats-2:4222]
        node: runner-17
        creds: /etc/evidence/node.creds      # or nkey_seed: FILE
        tls_ca: /etc/evidence/nats-ca.pem

Nothing here is on a run's path to the network. `submit` (the recorder's observer thread) puts an
event in a bounded queue, or past it in a list that goes to disk; `bundle_written` (the finishing
thread) links the bundle into the outbox (agent/daemon/fleet_outbox.py). A thread of its own runs an
asyncio loop with two NATS connections that reconnect for good, nats-py's for bundles, the index and
the layout, and the events' own:

- events: every batch is framed once (bundle/fleet/binding.py `encode`: ce-* headers, `Nats-Msg-Id`
  = the event's id; subject `evidence.events.<node>.<session>`; fleet_wire.py `frame`, in C when
  built), written to the outbox as a segment of
  those frames, then sent on a connection of the events' own (agent/daemon/fleet_wire.py: a write a
  few hundred messages, JetStream's answers read in bulk, at most `ack_window` unanswered); the
  segment goes when JetStream acknowledged every event in it. What was not acknowledged is sent
  again, oldest first, with backoff: JetStream drops a message whose id it stored within the
  stream's duplicate window (10 minutes when the agent made the stream).
- bundles: put into the node's object store bucket (`evidence-bundles-<node>`) under
  `<node>.<session>` unless it has it already (the name looked up first: bundle/fleet/client.py
  `put_new` writes the chunks and the meta nats-py's put writes, without its own look-up or a read
  back: the meta JetStream acknowledged names the SHA-256 of the bytes sent, which must be the
  job's); only when the bucket holds it with the bundle's size and SHA-256 is the index entry
  written and the bundle removed from the outbox. An object of that name with another digest is an
  error (logged, counted, retried with backoff): nothing is overwritten.

A restarted agent sends what its outbox holds. Refusals (a permission violation, a full stream) are
errors in the log and in `evidence_fleet_errors_total`, never a crash.

The outbox is agent/daemon/fleet_outbox.py, the events' connection agent/daemon/fleet_wire.py.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from evidence.agent.daemon import metrics as m
from evidence.agent.daemon.delivery import Backoff
from evidence.agent.daemon.fleet_outbox import BundleJob, Outbox
from evidence.agent.daemon.fleet_wire import (
    DUPLICATE,
    STORED,
    TOO_LARGE,
    EventWire,
    Segment,
    frame,
    frame_known,
)
from evidence.bundle.fleet import names

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.js import JetStreamContext
    from nats.js.kv import KeyValue
    from nats.js.object_store import ObjectStore

    from evidence.agent.daemon.settings import NatsSink
    from evidence.bundle.fleet.models import IndexEntry

logger = logging.getLogger(__name__)

SMALL_BUNDLE = 8 * 1024 * 1024  # bundles up to this are read whole to be stored


class FleetPublisher:
    def __init__(
        self,
        sink: NatsSink,
        outbox_dir: str | Path,
        *,
        registry: m.Registry | None = None,
        backoff: Backoff | None = None,
        queue_size: int = 20_000,
        replicas: int = 1,
        inbox_prefix: str | None = None,
    ) -> None:
        self.sink = sink
        self.node = sink.node
        self.inbox_prefix = inbox_prefix or names.inbox_prefix(sink.node)
        self._subjects: dict[str, bytes] = {}
        self.outbox = Outbox(outbox_dir, sink.outbox_max_bytes, self._segment)
        self.inbox = f"{self.inbox_prefix}.{self.outbox.id}"  # the events' replies
        self.backoff = backoff or Backoff(0.5, 30.0)
        self.replicas = replicas
        self._wire: EventWire | None = None
        self._up = {"events": False, "nats": False}
        self._store: ObjectStore | None = None
        self._kv: KeyValue | None = None
        self.metrics = m.FleetMetrics.of(registry or m.Registry())
        # a deque, not a queue.Queue: append and popleft are atomic, without a lock and a condition
        # an event (the bound is checked before the append: a few past it at worst)
        self._pending: collections.deque[Mapping[str, Any]] = collections.deque()
        self._queue_size = queue_size
        self._overflow: list[Mapping[str, Any]] = []
        self._overflow_lock = threading.Lock()
        self._collect_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._said: dict[str, float] = {}
        self._nc: NATS | None = None
        self._common: asyncio.Task[None] | None = None
        self._event_failures = 0
        self._event_retry_at = 0.0
        self._bundle_failures: dict[str, int] = {}
        self._bundle_retry_at: dict[str, float] = {}
        self.update_backlog()

    # --- producer side (never blocks, never touches the network) --------------------------------

    def submit(self, event: Mapping[str, Any]) -> None:
        """Hand a live event over (not copied: the caller, who made it, does not change it after)."""
        if len(self._pending) < self._queue_size:
            self._pending.append(event)
        else:
            with self._overflow_lock:
                self._overflow.append(event)
                if len(self._overflow) < self.sink.batch_size:
                    return
                batch, self._overflow = self._overflow, []
            self._to_outbox(batch)

    def submit_many(self, events: Sequence[Mapping[str, Any]]) -> None:
        """Hand a batch of live events over (the recorder's: each run's records as it observes
        them), as `submit` each, in one call while the queue has room for them all."""
        pending = self._pending
        if len(pending) + len(events) <= self._queue_size:
            pending.extend(events)
        else:
            for event in events:
                self.submit(event)

    def bundle_written(self, path: Path, manifest: Mapping[str, Any] | None = None) -> None:
        """A finished bundle: into the outbox (a hard link, or a copy), to be sent when it can."""
        try:
            if manifest is None:
                from evidence.bundle.reader import read_manifest

                manifest = read_manifest(path)
            key = names.run_key(self.node, str(manifest["session_id"]))
            self.outbox.add_bundle(key, Path(path))
        except Exception as e:  # never fail the run's finish over the fleet copy
            self.metrics.errors.labels(what="outbox").inc()
            logger.error("fleet: cannot put bundle %s in the outbox: %s", path, e)
            return
        self.update_backlog()
        self._poke()

    def _subject(self, session: str) -> bytes | None:
        subject = self._subjects.get(session)
        if subject is None:
            try:
                subject = names.event_subject(self.node, session).encode()
            except Exception as err:  # not ours to send: an event without a session
                logger.error("fleet: an event without a usable session id is not sent: %s", err)
                return None
            if len(self._subjects) > 1024:
                self._subjects.clear()
            self._subjects[session] = subject
        return subject

    def _named(self, session: Any) -> bytes | None:
        return self._subject(session) if type(session) is str else None

    def _segment(self, batch: Sequence[Mapping[str, Any]], no: int) -> Segment:
        """Events framed as segment `no` (an event without a usable session is left out)."""
        known = self._subjects
        if type(batch) is list:  # the usual batch: all of it in C (new sessions named on the way)
            made = frame_known(no, self.inbox, known, batch, self._named)
            if made is not None:
                return made
        subjects: list[bytes] = []
        events: list[Mapping[str, Any]] = []
        for event in batch:
            subject = known.get(event.get("sessionid"))  # type: ignore[arg-type]
            if subject is None:
                subject = self._subject(str(event.get("sessionid") or ""))
                if subject is None:
                    continue
            subjects.append(subject)
            events.append(event)
        return frame(no, self.inbox, subjects, events)

    def _to_outbox(self, batch: list[Mapping[str, Any]]) -> bool:
        try:
            if self.outbox.add(self._segment(batch, self.outbox.reserve())):
                return True
        except OSError as e:  # a full or broken disk: said, counted, and the agent goes on
            self.metrics.events_dropped.inc(len(batch))
            self._error("outbox", f"cannot write live events to the outbox {self.outbox.path}: {e}")
            return False
        self.metrics.events_dropped.inc(len(batch))
        logger.error(
            "fleet outbox %s is full (%d bytes of events): dropped %d live events (they are in the bundles)",
            self.outbox.path,
            self.outbox.max_bytes,
            len(batch),
        )
        return False

    def _poke(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # its loop ended (closed): nothing to wake
                loop.call_soon_threadsafe(wake.set)

    # --- the thread ---------------------------------------------------------------------------------

    def start(self) -> None:
        b = self.outbox.backlog()
        if b.bundles or b.events:
            logger.info(
                "fleet: %d bundle(s) and %d event(s) waiting from an earlier run", b.bundles, b.events
            )
        self._thread = threading.Thread(target=self._run, name="evidence-fleet", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop: what is queued goes to the outbox (sent by the next start if not now)."""
        self._stop.set()
        self._poke()
        if self._thread is not None:
            self._thread.join(timeout)
        self._collect_to_outbox(wait=0.0)
        self.update_backlog()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception:
            logger.exception("fleet publisher stopped")

    def _collect(self, wait: float) -> list[Mapping[str, Any]]:
        """Up to a batch: after `wait` seconds unless a whole batch is there already."""
        if wait > 0 and len(self._pending) < self.sink.batch_size:
            self._stop.wait(wait)
        pending = self._pending
        with self._collect_lock:  # one taker at a time: the deque holds at least what it counted
            take = min(self.sink.batch_size, len(pending))
            batch: list[Mapping[str, Any]] = list(
                itertools.starmap(pending.popleft, itertools.repeat((), take))
            )
        with self._overflow_lock:
            if self._overflow and len(batch) < self.sink.batch_size:
                take = self.sink.batch_size - len(batch)
                batch += self._overflow[:take]
                self._overflow = self._overflow[take:]
        return batch

    def _collect_to_outbox(self, wait: float) -> int:
        n = 0
        while True:
            batch = self._collect(wait)
            if not batch:
                return n
            self._to_outbox(batch)
            n += len(batch)
            wait = 0.0

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        batcher = asyncio.create_task(self._batcher())
        from evidence.bundle.fleet.client import signer, tls_context
        from evidence.errors import UsageError

        try:
            self._wire = EventWire(
                self.sink.servers,
                inbox=self.inbox,
                name=f"evidence-agent {self.node} events",
                tls=tls_context(self.sink.tls_ca),
                ca=self.sink.tls_ca,
                sign=signer(self.sink.creds, self.sink.nkey_seed),
                on_error=self._error,
                on_state=lambda up: self._state("events", up),
            )
        except UsageError as e:
            self._error("connect", e.message)
            await batcher
            return
        wire = asyncio.create_task(self._wire.run(self._stop.is_set, self.backoff.delay))
        try:
            nc = await self._connect()
        except Exception as e:
            logger.error("fleet: cannot connect: %s", e)
            self.metrics.errors.labels(what="connect").inc()
            await batcher
            await asyncio.gather(wire, return_exceptions=True)
            return
        try:
            self._nc = nc
            js = nc.jetstream(timeout=self.sink.ack_timeout)
            self._common = asyncio.create_task(self._layout(js, None))
            sender = asyncio.create_task(self._events_loop())
            bundles = asyncio.create_task(self._bundles_loop(js))
            await batcher
            # a last try to send what was queued before stopping, bounded
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._send_segments(), timeout=2.0)
            for t in (sender, bundles, self._common):
                t.cancel()
            await asyncio.gather(sender, bundles, return_exceptions=True)
        finally:
            self._wire.close()
            await asyncio.gather(wire, return_exceptions=True)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), timeout=2.0)

    def _state(self, which: str, up: bool) -> None:
        """`evidence_fleet_connected` is 1 while both connections are up."""
        self._up[which] = up
        self.metrics.connected.set(1 if all(self._up.values()) else 0)
        if up:
            self._poke()

    async def _connect(self) -> NATS:
        from evidence.bundle.fleet.client import connect

        async def on_error(e: Exception) -> None:
            self._error("nats", _describe(e))

        async def on_disconnect() -> None:
            self._state("nats", False)
            logger.warning("fleet: disconnected from NATS")

        async def on_reconnect() -> None:
            self._state("nats", True)
            logger.info("fleet: reconnected to NATS")

        connecting = asyncio.create_task(
            connect(
                self.sink.servers,
                creds=self.sink.creds,
                nkey_seed=self.sink.nkey_seed,
                tls_ca=self.sink.tls_ca,
                name=f"evidence-agent {self.node}",
                forever=True,
                inbox_prefix=self.inbox_prefix,
                error_cb=on_error,
                disconnected_cb=on_disconnect,
                reconnected_cb=on_reconnect,
            )
        )
        stopping = asyncio.create_task(self._stopped())
        done, _ = await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if connecting not in done:
            connecting.cancel()
            raise RuntimeError("stopped before the servers answered")
        stopping.cancel()
        self._state("nats", True)
        logger.info("fleet: connected to %s as node %s", ", ".join(self.sink.servers), self.node)
        return connecting.result()

    async def _stopped(self) -> None:
        while not self._stop.is_set():
            await asyncio.sleep(0.1)

    async def _sleep(self, seconds: float) -> None:
        assert self._wake is not None
        self._wake.clear()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._wake.wait(), timeout=max(0.0, seconds))

    def _error(self, what: str, message: str) -> None:
        """Count it; log it, the same message at most once a minute (a refusal repeats at each retry)."""
        self.metrics.errors.labels(what=what).inc()
        now = time.monotonic()
        if now - self._said.get(message, -1e9) >= 60.0:
            logger.error("fleet: %s", message)
            self._said[message] = now
            if len(self._said) > 256:
                self._said = {m: t for m, t in self._said.items() if now - t < 60.0}

    def update_backlog(self) -> None:
        b = self.outbox.backlog()
        self.metrics.backlog_items.labels(kind="bundle").set(b.bundles)
        self.metrics.backlog_items.labels(kind="event").set(b.events)
        self.metrics.backlog_bytes.labels(kind="bundle").set(b.bundle_bytes)
        self.metrics.backlog_bytes.labels(kind="event").set(b.event_bytes)
        self.metrics.backlog_age.labels(kind="bundle").set(b.bundle_age)
        self.metrics.backlog_age.labels(kind="event").set(b.event_age)

    async def _batcher(self) -> None:
        """Memory queue -> outbox segments, every batch_interval, until stopped."""
        loop = asyncio.get_running_loop()
        last_backlog = 0.0
        while not self._stop.is_set():
            n = await loop.run_in_executor(None, self._collect_to_outbox, self.sink.batch_interval)
            if n:
                self._poke()
            if time.monotonic() - last_backlog >= 1.0:
                self.update_backlog()
                last_backlog = time.monotonic()
        await loop.run_in_executor(None, self._collect_to_outbox, 0.0)

    # --- events ---------------------------------------------------------------------------------------

    async def _events_loop(self) -> None:
        assert self._common is not None
        await asyncio.shield(self._common)  # an event sent before its stream exists is refused
        while True:
            if time.monotonic() >= self._event_retry_at:
                try:
                    await self._send_segments()
                except Exception as e:  # an outbox that cannot be read or rewritten: said, tried again
                    self._event_failures += 1
                    self._event_retry_at = time.monotonic() + self.backoff.delay(self._event_failures)
                    self._error("outbox", f"cannot send the outbox's events: {_describe(e)}")
            wait = max(0.05, self._event_retry_at - time.monotonic()) if self._event_retry_at else 1.0
            await self._sleep(wait)

    async def _send_segments(self) -> None:
        wire = self._wire
        if wire is None or not wire.connected:
            return  # sent when it is back (the wire pokes)
        for path in self.outbox.segments():
            seg = self.outbox.read(path, self.inbox)
            answers = await wire.publish(seg, self.sink.ack_window, self.sink.ack_timeout)
            rest = self._count(answers)
            self.outbox.done(path, seg, rest)
            if rest:
                self._event_failures += 1
                delay = self.backoff.delay(self._event_failures)
                self._event_retry_at = time.monotonic() + delay
                logger.warning("fleet: %d event(s) not acknowledged; retrying in %.1fs", len(rest), delay)
                if wire.connected and None in answers:
                    await wire.ping(self.sink.ack_timeout)  # a server that reads nothing: reconnect
                return
            self._event_failures = 0
            self._event_retry_at = 0.0

    def _count(self, answers: list[Any]) -> list[int]:
        """Count a segment's answers; the places of its events to send again (refused or not
        answered), in order."""
        acked = answers.count(STORED)
        dup = answers.count(DUPLICATE)
        large = answers.count(TOO_LARGE)
        rest: list[int] = []
        problem = ""
        if acked + dup + large < len(answers):
            for k, answer in enumerate(answers):
                if answer not in (STORED, DUPLICATE, TOO_LARGE):
                    problem = problem or (answer if isinstance(answer, str) else "no acknowledgement in time")
                    rest.append(k)
        self.metrics.events_published.inc(acked)
        if dup:
            self.metrics.events_duplicate.inc(dup)
        if large:
            self.metrics.events_dropped.inc(large)
            self._error(
                "publish", f"{large} event(s) larger than the server takes: dropped (they are in the bundles)"
            )
        if rest:
            self._error("publish", f"{len(rest)} event(s) refused or not acknowledged: {problem}")
        return rest

    # --- bundles --------------------------------------------------------------------------------------

    async def _layout(self, js: JetStreamContext, node: str | None) -> None:
        """Until it is done: the stream and the index (node None), or the node's bucket."""
        failures = 0
        what = f"bucket {names.bundle_bucket(node)}" if node else "the stream and the index"
        while True:
            try:
                await names_layout(js, self.replicas, node)
                return
            except Exception as e:
                failures += 1
                self._error("layout", f"cannot find or make {what}: {_describe(e)}")
                await self._sleep(self.backoff.delay(failures))

    async def _bundles_loop(self, js: JetStreamContext) -> None:
        assert self._common is not None
        await asyncio.shield(self._common)
        await self._layout(js, self.node)
        while True:
            now = time.monotonic()
            for job in self.outbox.bundle_jobs():
                if self._bundle_retry_at.get(job.key, 0.0) > now:
                    continue
                ok = await self._send_bundle(js, job)
                if ok:
                    self._bundle_failures.pop(job.key, None)
                    self._bundle_retry_at.pop(job.key, None)
                else:
                    n = self._bundle_failures[job.key] = self._bundle_failures.get(job.key, 0) + 1
                    self._bundle_retry_at[job.key] = time.monotonic() + self.backoff.delay(n)
                self.update_backlog()
            waits = [t - time.monotonic() for t in self._bundle_retry_at.values()]
            await self._sleep(max(0.05, min([5.0, *waits])))

    async def _send_bundle(self, js: JetStreamContext, job: BundleJob) -> bool:
        from nats.js.errors import ObjectNotFoundError

        from evidence.bundle.fleet.client import object_digest, put_new

        digest = object_digest(job.sha256)
        try:
            if self._store is None:  # looked up once a connection (each look-up is a stream info)
                self._store = await js.object_store(names.bundle_bucket(self.node))
            store = self._store
            try:
                info = await store.get_info(job.key)
            except ObjectNotFoundError:
                info = None
            if info is None:  # not there: put (else it is ours already, or another's, said below)
                bucket = names.bundle_bucket(self.node)
                if job.size <= SMALL_BUNDLE:  # in one read, not a thread hop a 128 KiB chunk
                    await put_new(js, bucket, job.key, job.path.read_bytes(), job.sha256, job.size)
                else:
                    with open(job.path, "rb") as f:
                        await put_new(js, bucket, job.key, f, job.sha256, job.size)
            elif info.digest != digest or info.size != job.size:
                self._error(
                    "bundle",
                    f"the bucket holds another bundle under {job.key} ({info.size} bytes, {info.digest}); "
                    f"ours ({job.size} bytes, {digest}) stays in the outbox",
                )
                return False
            entry = await asyncio.get_running_loop().run_in_executor(None, self._entry, job)
            if self._kv is None:
                self._kv = await js.key_value(names.INDEX_BUCKET)
            await self._kv.put(job.key, entry.to_json())
        except FileNotFoundError:
            logger.error("fleet: bundle %s vanished from the outbox", job.key)
            self.outbox.remove_bundle(job)
            return True
        except Exception as e:
            self._store = self._kv = None  # looked up again: the bucket may have been made since
            self._error("bundle", f"bundle {job.key} not stored yet: {_describe(e)}")
            return False
        self.outbox.remove_bundle(job)
        self.metrics.bundles_stored.inc()
        self.metrics.bundle_bytes_stored.inc(job.size)
        logger.info("fleet: bundle %s stored (%d bytes) and indexed", job.key, job.size)
        return True

    def _entry(self, job: BundleJob) -> IndexEntry:
        """The index entry of a bundle in the outbox: its manifest, lint's counts, its signer."""
        from evidence.bundle import lint, reader
        from evidence.bundle.fleet.models import LintCounts, entry_from_manifest
        from evidence.errors import Error

        try:
            # in this thread alone: the least CPU (no inflating thread, no helper process)
            manifest, findings, _dropped, signature = lint.lint_signed(str(job.path), parallel=False)
        except (Error, OSError) as e:
            problem = e.diagnostics() if isinstance(e, Error) else str(e)
            manifest = reader.read_manifest(job.path)
            return entry_from_manifest(
                manifest, node=self.node, sha256=job.sha256, size=job.size, lint=None, lint_problem=problem
            )
        counts = {"error": 0, "warning": 0, "note": 0}
        for f in findings:
            sev = f.rule.severity
            counts[sev if sev in counts else "note"] += 1
        return entry_from_manifest(
            manifest,
            node=self.node,
            sha256=job.sha256,
            size=job.size,
            lint=LintCounts(**counts),
            signer_keyid=signature.keyids[0] if signature.keyids else None,
        )


async def names_layout(js: JetStreamContext, replicas: int, node: str | None) -> None:
    from evidence.bundle.fleet.client import ensure_layout

    await ensure_layout(js, replicas, node)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
