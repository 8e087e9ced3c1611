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
asyncio loop with one NATS connection that reconnects for good:

- events: every batch is written to the outbox as a segment, then published to
  `evidence.events.<node>.<session>` (bundle/fleet/binding.py: ce-* headers, `Nats-Msg-Id` = the
  event's id), pipelined; the segment goes when JetStream acknowledged every event in it. What was not
  acknowledged is sent again, oldest first, with backoff: JetStream drops a message whose id it
  stored within the stream's duplicate window (10 minutes when the agent made the stream).
- bundles: put into the node's object store bucket (`evidence-bundles-<node>`) under
  `<node>.<session>` unless it has it already; its info read
  back; only when the server's size and SHA-256 are the bundle's is the index entry written and the
  bundle removed from the outbox. An object of that name with another digest is an error (logged,
  counted, retried with backoff): nothing is overwritten.

A restarted agent sends what its outbox holds. Refusals (a permission violation, a full stream) are
errors in the log and in `evidence_fleet_errors_total`, never a crash.

(Over 600 lines on purpose: the publisher's sender thread, its event loop and the ack window are one
state machine over the outbox; the outbox itself is agent/daemon/fleet_outbox.py.)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from evidence.agent.daemon import metrics as m
from evidence.agent.daemon.delivery import Backoff
from evidence.agent.daemon.fleet_outbox import BundleJob, Outbox
from evidence.bundle.fleet import binding, names

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.js import JetStreamContext

    from evidence.agent.daemon.settings import NatsSink
    from evidence.bundle.fleet.models import IndexEntry

logger = logging.getLogger(__name__)


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
        publish_mode: str = "inbox",
    ) -> None:
        self.sink = sink
        self.node = sink.node
        self.inbox_prefix = inbox_prefix or names.inbox_prefix(sink.node)
        self.outbox = Outbox(outbox_dir, sink.outbox_max_bytes)
        self.backoff = backoff or Backoff(0.5, 30.0)
        self.replicas = replicas
        self.publish_mode = publish_mode  # "inbox"; "publish_async" only for the bench's comparison
        self._ack_sub: _Acks | None = None
        self.metrics = m.FleetMetrics.of(registry or m.Registry())
        # a deque, not a queue.Queue: append and popleft are atomic, without a lock and a condition
        # an event (the bound is checked before the append: a few past it at worst)
        self._pending: collections.deque[dict[str, Any]] = collections.deque()
        self._queue_size = queue_size
        self._overflow: list[dict[str, Any]] = []
        self._overflow_lock = threading.Lock()
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
        if len(self._pending) < self._queue_size:
            self._pending.append(dict(event))
        else:
            with self._overflow_lock:
                self._overflow.append(dict(event))
                if len(self._overflow) < self.sink.batch_size:
                    return
                batch, self._overflow = self._overflow, []
            self._to_outbox(batch)

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

    def _to_outbox(self, batch: list[dict[str, Any]]) -> bool:
        if self.outbox.add_events(batch):
            return True
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

    def _collect(self, wait: float) -> list[dict[str, Any]]:
        """Up to a batch: after `wait` seconds unless a whole batch is there already."""
        if wait > 0 and len(self._pending) < self.sink.batch_size:
            self._stop.wait(wait)
        batch: list[dict[str, Any]] = []
        pending = self._pending
        with contextlib.suppress(IndexError):
            for _ in range(min(self.sink.batch_size, len(pending))):
                batch.append(pending.popleft())
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
        try:
            nc = await self._connect()
        except Exception as e:
            logger.error("fleet: cannot connect: %s", e)
            self.metrics.errors.labels(what="connect").inc()
            await batcher
            return
        try:
            self._nc = nc
            js = nc.jetstream(timeout=self.sink.ack_timeout)
            self._common = asyncio.create_task(self._layout(js, None))
            sender = asyncio.create_task(self._events_loop(js))
            bundles = asyncio.create_task(self._bundles_loop(js))
            await batcher
            # a last try to send what was queued before stopping, bounded
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._send_segments(js), timeout=2.0)
            for t in (sender, bundles, self._common):
                t.cancel()
            await asyncio.gather(sender, bundles, return_exceptions=True)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), timeout=2.0)

    async def _connect(self) -> NATS:
        from evidence.bundle.fleet.client import connect

        async def on_error(e: Exception) -> None:
            self._error("nats", _describe(e))

        async def on_disconnect() -> None:
            self.metrics.connected.set(0)
            logger.warning("fleet: disconnected from NATS")

        async def on_reconnect() -> None:
            self.metrics.connected.set(1)
            logger.info("fleet: reconnected to NATS")
            self._poke()

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
        self.metrics.connected.set(1)
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

    async def _events_loop(self, js: JetStreamContext) -> None:
        assert self._common is not None
        await asyncio.shield(self._common)  # an event sent before its stream exists is refused
        while True:
            if time.monotonic() >= self._event_retry_at:
                await self._send_segments(js)
            wait = max(0.05, self._event_retry_at - time.monotonic()) if self._event_retry_at else 1.0
            await self._sleep(wait)

    async def _send_segments(self, js: JetStreamContext) -> None:
        # not while disconnected: nats-py would hold the messages and send them on reconnect, after
        # their acknowledgements were given up on (sent twice, the second dropped by its id, but
        # out of order with what is sent meanwhile)
        if self._nc is not None and not self._nc.is_connected:
            return
        for seg in self.outbox.segments():
            events = self.outbox.read(seg)
            rest = await self._publish(js, events)
            self.outbox.done(seg, rest)
            if rest:
                self._event_failures += 1
                delay = self.backoff.delay(self._event_failures)
                self._event_retry_at = time.monotonic() + delay
                logger.warning("fleet: %d event(s) not acknowledged; retrying in %.1fs", len(rest), delay)
                return
            self._event_failures = 0
            self._event_retry_at = 0.0

    async def _publish(self, js: JetStreamContext, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Publish pipelined; the events JetStream did not acknowledge, in order."""
        if self.publish_mode == "publish_async":
            return await self._publish_async(js, events)
        return await self._publish_inbox(events)

    async def _acks(self) -> _Acks:
        """The one subscription JetStream's acknowledgements come back on (made once a connection)."""
        nc = self._nc
        assert nc is not None
        if self._ack_sub is None:  # nats-py subscribes it again after a reconnect
            acks = _Acks(nc.new_inbox(), self.sink.ack_window)
            acks.sub = await nc.subscribe(acks.prefix + ".*", cb=acks.on_msg, pending_msgs_limit=-1)
            self._ack_sub = acks
        return self._ack_sub

    async def _publish_inbox(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Core publishes with a reply subject of ours (`<inbox>.<n>`), at most `ack_window` without
        an answer; one subscription takes JetStream's PubAcks. Each message keeps its Nats-Msg-Id, so
        a retry of one that was stored is a duplicate JetStream drops, not a second copy."""
        nc = self._nc
        assert nc is not None
        acks = await self._acks()
        subjects: dict[str, str] = {}
        tokens: list[int | None] = []
        problem = ""
        for e in events:
            session = str(e.get("sessionid") or "")
            subject = subjects.get(session)
            if subject is None:
                try:
                    subject = subjects[session] = names.event_subject(self.node, session)
                except Exception as err:  # not ours to send: an event without a session
                    logger.error("fleet: an event without a usable session id is not sent: %s", err)
                    tokens.append(None)
                    continue
            if acks.outstanding >= acks.window and not await acks.until(
                acks.window // 2, self.sink.ack_timeout
            ):
                problem = "no acknowledgement in time"
                break
            headers, payload = binding.to_message(e)
            token = acks.expect()
            try:
                await nc.publish(subject, payload, reply=f"{acks.prefix}.{token}", headers=headers)
            except Exception as err:
                acks.forget(token)
                problem = f"cannot publish events: {_describe(err)}"
                break
            tokens.append(token)
        # one batch at a time: what still waits is this batch's (take() forgets the ones given up on)
        await acks.until(0, self.sink.ack_timeout)
        rest: list[dict[str, Any]] = []
        acked = dup = 0
        for i, e in enumerate(events):
            t = tokens[i] if i < len(tokens) else -1
            if t is None:
                continue
            answer = acks.take(t) if t >= 0 else None
            if answer is _STORED or answer is _DUPLICATE:
                acked += 1
                dup += answer is _DUPLICATE
                continue
            if isinstance(answer, str):
                problem = problem or answer
            elif t >= 0:
                problem = problem or "no acknowledgement in time"
            rest.append(e)
        self._count(acked, dup, rest, problem)
        return rest

    def _count(self, acked: int, dup: int, rest: list[dict[str, Any]], problem: str) -> None:
        self.metrics.events_published.inc(acked - dup)
        if dup:
            self.metrics.events_duplicate.inc(dup)
        if rest:
            self._error("publish", f"{len(rest)} event(s) refused or not acknowledged: {problem}")

    async def _publish_async(
        self, js: JetStreamContext, events: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """The first way (round 1), kept for bench/fleet.py's side by side: nats-py's
        `publish_async`, a future and a PubAck object a message."""
        futures: list[asyncio.Future[Any] | None] = []
        problem = ""
        for e in events:
            try:
                subject = names.event_subject(self.node, str(e.get("sessionid") or ""))
            except Exception as err:
                logger.error("fleet: an event without a usable session id is not sent: %s", err)
                futures.append(None)
                continue
            headers, payload = binding.to_message(e)
            try:
                futures.append(
                    await js.publish_async(
                        subject, payload, headers=headers, wait_stall=self.sink.ack_timeout
                    )
                )
            except Exception as err:
                problem = f"cannot publish events: {_describe(err)}"
                break
        pending = [f for f in futures if f is not None]
        if pending:
            await asyncio.wait(pending, timeout=self.sink.ack_timeout)
        rest = []
        acked = dup = 0
        for i, e in enumerate(events):
            f = futures[i] if i < len(futures) else None
            if i < len(futures) and f is None:
                continue
            if f is not None and f.done() and not f.cancelled() and f.exception() is None:
                acked += 1
                dup += bool(getattr(f.result(), "duplicate", False))
                continue
            if f is not None and not f.done():
                f.cancel()
                problem = problem or "no acknowledgement in time"
            elif f is not None and not f.cancelled() and f.exception() is not None:
                problem = problem or _describe(f.exception())  # type: ignore[arg-type]
            rest.append(e)
        self._count(acked, dup, rest, problem)
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

        from evidence.bundle.fleet.client import object_digest

        digest = object_digest(job.sha256)
        try:
            store = await js.object_store(names.bundle_bucket(self.node))
            try:
                info = await store.get_info(job.key)
            except ObjectNotFoundError:
                info = None
            if info is None:
                with open(job.path, "rb") as f:
                    await store.put(job.key, f)
                info = await store.get_info(job.key)  # what the server holds, not what we sent
            if info.digest != digest or info.size != job.size:
                self._error(
                    "bundle",
                    f"the bucket holds another bundle under {job.key} ({info.size} bytes, {info.digest}); "
                    f"ours ({job.size} bytes, {digest}) stays in the outbox",
                )
                return False
            entry = await asyncio.get_running_loop().run_in_executor(None, self._entry, job)
            kv = await js.key_value(names.INDEX_BUCKET)
            await kv.put(job.key, entry.to_json())
        except FileNotFoundError:
            logger.error("fleet: bundle %s vanished from the outbox", job.key)
            self.outbox.remove_bundle(job)
            return True
        except Exception as e:
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
            manifest, findings, _dropped, signature = lint.lint_signed(str(job.path))
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


_STORED = object()
_DUPLICATE = object()


class _Acks:
    """JetStream's answers to our publishes, by the token of their reply subject: a PubAck
    (`{"stream":..,"seq":..}`, `"duplicate":true` when the id was stored already) or an error
    (`{"error":{"code":..,"description":..}}`). Answers to tokens no longer expected (given up on,
    then sent again) are ignored."""

    def __init__(self, prefix: str, window: int) -> None:
        self.prefix = prefix
        self.window = window
        self.sub: Any = None
        self._next = 0
        self._waiting: set[int] = set()
        self._answers: dict[int, object] = {}
        self._changed = asyncio.Event()
        self._wake_at = -1  # the waiter's: set _changed when at most this many are waiting

    @property
    def outstanding(self) -> int:
        return len(self._waiting)

    def expect(self) -> int:
        self._next += 1
        self._waiting.add(self._next)
        return self._next

    def forget(self, token: int) -> None:
        self._waiting.discard(token)
        self._answers.pop(token, None)

    def take(self, token: int) -> object | None:
        self._waiting.discard(token)
        return self._answers.pop(token, None)

    async def on_msg(self, msg: Any) -> None:
        try:
            token = int(msg.subject.rpartition(".")[2])
        except ValueError:
            return
        if token not in self._waiting:
            return
        self._waiting.discard(token)
        data: bytes = msg.data
        if b'"error"' not in data and b'"seq"' in data:
            # the server writes `"duplicate": true` (a space): parsed when the word is there at all
            dup = b'"duplicate"' in data and orjson.loads(data).get("duplicate") is True
            self._answers[token] = _DUPLICATE if dup else _STORED
        else:
            self._answers[token] = _problem(data, msg)
        if len(self._waiting) <= self._wake_at:
            self._changed.set()

    async def until(self, at_most: int, timeout: float) -> bool:
        """Until at most `at_most` publishes wait for their answer; False if that took too long."""
        if len(self._waiting) <= at_most:
            return True
        self._wake_at = at_most
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout=timeout)
            return True
        except TimeoutError:
            return len(self._waiting) <= at_most
        finally:
            self._wake_at = -1


def _problem(data: bytes, msg: Any) -> str:
    """What an answer that is not a PubAck says (an error, or a no-responders status)."""
    headers = getattr(msg, "headers", None) or {}
    if not data and headers.get("Status") == "503":
        return "no responders (the stream is not there)"
    try:
        err = orjson.loads(data).get("error") or {}
        return f"JetStream refused it: {err.get('description', data[:200])} ({err.get('err_code', '')})"
    except (orjson.JSONDecodeError, AttributeError):
        return f"an answer that is not a PubAck: {data[:200]!r}"


async def names_layout(js: JetStreamContext, replicas: int, node: str | None) -> None:
    from evidence.bundle.fleet.client import ensure_layout

    await ensure_layout(js, replicas, node)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
