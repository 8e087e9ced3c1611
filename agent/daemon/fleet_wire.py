"""The live events' own NATS connection: the few verbs of the NATS client protocol the fleet
publisher needs, with the events framed in bulk and JetStream's answers read in bulk.

Why not nats-py's connection (which the publisher keeps for bundles, the index and the layout):
every message through its public `publish` costs ~16 us of CPU here, and every answer through a
subscription another few us (a parser state, a `Msg`, a queue, a callback); an agent streaming
3,333 events/s would spend a tenth of a core on that alone. Here a batch of events is one write
(each event its own `HPUB` with its own `Nats-Msg-Id` and its own reply subject `<inbox>.<n>`), and
the answers that arrive together are parsed together, one list slot a token: ~1 us an event.

What it speaks (the documented client protocol): INFO, then TLS when the URL is `tls://`, a CA is
given or the server requires it (`loop.start_tls`), CONNECT (headers and no-responders on; an NKey
seed or a credentials file's JWT signs the server's nonce; user and password or a token from the
URL), PING/PONG both ways, SUB on the reply inbox, HPUB, MSG/HMSG, +OK and -ERR. A -ERR is handed
to `on_error` (a permission violation among them: the message was not delivered, so it goes
unanswered and stays in the outbox). The connection is remade for good, server after server, with
backoff; the servers a cluster announces are not used, the configured ones are.

A segment (`Segment`, made by `build`) is a batch of events framed once, back to back, exactly as
they are written to the socket: `HPUB <subject> <inbox>.<segment>.<token> <header bytes> <total
bytes>\\r\\n<headers><payload>\\r\\n`, each with a reply subject of its own that names its segment
and its place in it. The outbox keeps those bytes as they are, so sending a segment, now or after a
restart, is writing slices of it; JetStream's answers that are plain PubAcks are recognised a whole
read at a time by one regular expression (in C when built: `_wire.stored`, the same checks and
marks). Nothing here touches the outbox's files or the metrics.

`frame` makes a segment of live events: bundle/fleet/binding.py `encode_many`, then `build`. Its
common case (every header value a plain printable string or integer) is done in C when built
(src/fast/_wire.c, evidence.agent.daemon._wire: ~4x less CPU an event), byte for byte what the
Python path makes (tests/unit/test_wire_fast.py); the Python path is the reference and does the
rest. EVIDENCE_PURE_PYTHON=1 leaves the C path unused.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import ssl
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import orjson

from evidence.bundle import native
from evidence.bundle.fleet import binding

logger = logging.getLogger(__name__)


def compiled() -> Any:
    """The framing in C (src/fast/_wire.c), or None (bundle/native.py): the Python path, which it
    matches byte for byte, then does it all."""
    return native.compiled("evidence.agent.daemon._wire")


_wire = compiled()

# an answer: JetStream stored it, had it already (its id within the duplicate window), the message
# is larger than the server takes (never sent), or the server's words (a refusal); None: no answer
STORED = 1
DUPLICATE = 2
TOO_LARGE = 3
Answer = int | str | None

_MAX_LINE = 64 * 1024  # a control line longer than this (INFO is the longest) is a broken stream
_WRITE_AT_ONCE = 256  # frames in one write
_NAMED_AT_ONCE = 16  # sessions frame_known names in one batch, at most (more: event by event)


@dataclasses.dataclass(frozen=True)
class Segment:
    """Frames back to back (`data`); frame k is data[offsets[k]:offsets[k + 1]], its reply token is
    tokens[k] (None: k itself) and its message's size (headers and payload) sizes[k]."""

    no: int
    data: bytes
    offsets: list[int]
    sizes: list[int]
    tokens: list[int] | None = None

    def __len__(self) -> int:
        return len(self.sizes)

    def token(self, k: int) -> int:
        return k if self.tokens is None else self.tokens[k]

    def only(self, keep: Sequence[int]) -> Segment:
        """The segment with the frames at `keep` only (their reply subjects as they were)."""
        data, offsets = self.data, self.offsets
        parts = [data[offsets[k] : offsets[k + 1]] for k in keep]
        new_offsets = [0]
        for part in parts:
            new_offsets.append(new_offsets[-1] + len(part))
        return Segment(
            self.no,
            b"".join(parts),
            new_offsets,
            [self.sizes[k] for k in keep],
            [self.token(k) for k in keep],
        )


def reply_prefix(inbox: str, no: int) -> bytes:
    return b"%s.%d." % (inbox.encode(), no)


def build(no: int, inbox: str, messages: Iterable[tuple[bytes, bytes, bytes]]) -> Segment:
    """The segment `no` of (subject, header block, payload) messages, replies under `inbox`."""
    prefix = reply_prefix(inbox, no)
    frames: list[bytes] = []
    sizes: list[int] = []
    for i, (subject, headers, payload) in enumerate(messages):
        hl = len(headers)
        tl = hl + len(payload)
        frames.append(b"HPUB %s %s%d %d %d\r\n%s%s\r\n" % (subject, prefix, i, hl, tl, headers, payload))
        sizes.append(tl)
    offsets = [0]
    for f in frames:
        offsets.append(offsets[-1] + len(f))
    return Segment(no, b"".join(frames), offsets, sizes)


def frame(
    no: int, inbox: str, subjects: list[bytes], events: list[Mapping[str, Any]], *, fast: bool = True
) -> Segment:
    """The segment `no` of live events, each published to its subject, replies under `inbox`:
    `build` of binding.encode_many's messages (in C when built and `fast`, the same bytes)."""
    if fast and _wire is not None:
        made = _wire.frames(subjects, events, reply_prefix(inbox, no), orjson.dumps, orjson.OPT_SORT_KEYS)
        if made is not None:
            data, offsets, sizes = made
            return Segment(no, data, offsets, sizes)
    encoded = binding.encode_many(events)
    return build(no, inbox, ((s, h, p) for s, (h, p) in zip(subjects, encoded, strict=True)))


def frame_known(
    no: int,
    inbox: str,
    subjects: dict[Any, bytes],
    events: list[Mapping[str, Any]],
    name: Callable[[Any], bytes | None],
) -> Segment | None:
    """`frame` of events each published to the subject of its `sessionid` in `subjects`, in C when
    built (`name(session id)` puts a session not in `subjects` yet there, or says None: not one to
    send). None (nothing made) when it is not built, or does not take the whole batch (a session
    `name` does not name, any case `frame`'s C path hands back): the caller then names the subjects
    event by event and calls `frame`."""
    if _wire is None:
        return None
    prefix = reply_prefix(inbox, no)
    for _ in range(_NAMED_AT_ONCE):
        made = _wire.frames(subjects, events, prefix, orjson.dumps, orjson.OPT_SORT_KEYS)
        if made is None:
            return None
        if len(made) == 1:  # (a session not in subjects,)
            if name(made[0]) is None or made[0] not in subjects:
                return None
            continue
        data, offsets, sizes = made
        return Segment(no, data, offsets, sizes)
    return None


def parse(data: bytes, no: int, inbox: str) -> tuple[Segment, str]:
    """A segment's bytes as written (by `build`, or `only`), and what is wrong past the last whole
    frame ("" when nothing). Frames whose replies are not under `inbox` (the node was renamed) are
    framed again."""
    prefix = reply_prefix(inbox, no)
    offsets: list[int] = []
    sizes: list[int] = []
    tokens: list[int] = []
    foreign = False
    pos, n = 0, len(data)
    problem = ""
    while pos < n:
        eol = data.find(b"\r\n", pos)
        line = data[pos:eol].split(b" ") if eol > 0 else []
        if len(line) != 5 or line[0] != b"HPUB" or not (line[3].isdigit() and line[4].isdigit()):
            problem = f"not a frame at byte {pos}"
            break
        end = eol + 2 + int(line[4]) + 2
        if end > n or data[end - 2 : end] != b"\r\n" or int(line[3]) > int(line[4]):
            problem = f"a frame cut short at byte {pos}"
            break
        reply, _, token = line[2].rpartition(b".")
        foreign |= reply + b"." != prefix or not token.isdigit()
        offsets.append(pos)
        sizes.append(int(line[4]))
        tokens.append(int(token) if token.isdigit() else len(tokens))
        pos = end
    offsets.append(pos)
    seg = Segment(no, data[:pos], offsets, sizes, tokens)
    if foreign:
        seg = build(no, inbox, (_message(seg, k) for k in range(len(seg))))
    return seg, problem


def _message(seg: Segment, k: int) -> tuple[bytes, bytes, bytes]:
    frame = seg.data[seg.offsets[k] : seg.offsets[k + 1]]
    eol = frame.index(b"\r\n")
    line = frame[:eol].split(b" ")
    hl = int(line[3])
    return line[1], frame[eol + 2 : eol + 2 + hl], frame[eol + 2 + hl : -2]


def _acks(inbox: str) -> tuple[re.Pattern[bytes], re.Pattern[bytes]]:
    """(a run of plain PubAcks to replies under `inbox`, one of them with its segment and token as
    groups 1 and 2)."""
    one = (
        rb"MSG " + re.escape(inbox.encode()) + rb"\.(\d+)\.(\d+) \d+ \d+\r\n"
        rb'\{"stream":"[^"\r\n]*",(?:"domain":"[^"\r\n]*",)?"seq":\d+\}\r\n'
    )
    return re.compile(b"(?:" + one.replace(b"(\\d+)", b"\\d+") + b")+"), re.compile(one)


# --- the connection ------------------------------------------------------------------------------------


class Lost(Exception):
    """The connection went (or never came) while a publish waited."""


class _Conn(asyncio.Protocol):
    """One TCP (or TLS) connection of the wire's: hands what it reads to the wire while it is the
    wire's current one (a connection given up on may still say something before it goes)."""

    def __init__(self, wire: EventWire) -> None:
        self.wire = wire
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.lines: asyncio.Queue[bytes] = asyncio.Queue()  # control lines while connecting
        self.ready = False
        self.gone = asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone.set()
        if self.wire.conn is self:
            self.wire.lost(self, exc)

    def data_received(self, data: bytes) -> None:
        if self.wire.conn is not self:
            return
        try:
            self._parse(data)
        except (ValueError, IndexError) as e:
            self.wire.broken(self, f"cannot parse what the server sent: {e}")

    def _parse(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        wire = self.wire
        pos = 0
        fast = wire.fast
        if fast is not None and buf.startswith(b"MSG "):
            # the common case: nothing but PubAcks of the segment in flight, checked and read by two
            # passes of a regular expression over the whole read, not one message at a time
            end = buf.rfind(b"}\r\n") + 3
            if end > 3 and _wire is not None and wire.c_acks:
                got = _wire.stored(buf, end, wire.inbox_bytes, wire._seg, wire._answers, wire._place, STORED)
                if got >= 0:
                    wire.marked(got)
                    pos = end
            elif end > 3 and fast[0].fullmatch(buf, 0, end):
                wire.stored(fast[1].findall(buf, 0, end))
                pos = end
        n = len(buf)
        while pos < n:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                if n - pos > _MAX_LINE:
                    raise ValueError("a control line too long")
                break
            if buf.startswith(b"MSG ", pos):  # MSG <subject> <sid> [reply] <size>
                parts = bytes(buf[pos + 4 : eol]).split(b" ")
                end = eol + 2 + int(parts[-1])
                if end + 2 > n:
                    break
                wire.answer(parts[0], b"", bytes(buf[eol + 2 : end]))
                pos = end + 2
            elif buf.startswith(b"HMSG ", pos):  # HMSG <subject> <sid> [reply] <hdr size> <size>
                parts = bytes(buf[pos + 5 : eol]).split(b" ")
                hl, total = int(parts[-2]), int(parts[-1])
                end = eol + 2 + total
                if end + 2 > n:
                    break
                wire.answer(parts[0], bytes(buf[eol + 2 : eol + 2 + hl]), bytes(buf[eol + 2 + hl : end]))
                pos = end + 2
            else:
                self._control(bytes(buf[pos:eol]))
                pos = eol + 2
        del buf[:pos]

    def _control(self, line: bytes) -> None:
        if line == b"PING":
            if self.transport is not None:
                self.transport.write(b"PONG\r\n")
        elif not self.ready:
            self.lines.put_nowait(line)
        elif line == b"PONG":
            self.wire.pong()
        elif line.startswith(b"-ERR"):
            text = line[4:].strip().strip(b"'").decode(errors="replace")
            self.wire.on_error("nats", f"the server says: {text}")
        elif line.startswith(b"INFO "):
            with contextlib.suppress(ValueError, AttributeError):
                self.wire.max_payload = int(json.loads(line[5:]).get("max_payload", self.wire.max_payload))

    def write(self, data: bytes | memoryview) -> None:
        if self.transport is None or self.transport.is_closing():
            raise Lost("not connected")
        self.transport.write(data)

    async def line(self, timeout: float) -> bytes:
        try:
            return await asyncio.wait_for(self.lines.get(), timeout)
        except TimeoutError:
            raise TimeoutError("the server said nothing in time") from None


class EventWire:
    def __init__(
        self,
        servers: Sequence[str],
        *,
        inbox: str,
        name: str,
        tls: ssl.SSLContext | None = None,
        ca: Path | None = None,
        sign: Callable[[str], dict[str, str]] = lambda nonce: {},
        on_error: Callable[[str, str], None] = lambda what, message: None,
        on_state: Callable[[bool], None] = lambda up: None,
        connect_timeout: float = 5.0,
    ) -> None:
        self.servers = list(servers)
        self.name = name
        self.tls = tls
        self.ca = ca  # the file `tls` was made from, for the messages
        self.sign = sign
        self.on_error = on_error
        self.on_state = on_state
        self.connect_timeout = connect_timeout
        self.inbox = inbox  # the segments' replies are under it (fixed: they are framed with them)
        self.inbox_bytes = inbox.encode()
        self.c_acks = True  # plain PubAcks read in C when built (False: the regular expressions)
        self.max_payload = 1024 * 1024
        self.conn: _Conn | None = None
        self._up = asyncio.Event()
        self._pongs: list[asyncio.Future[None]] = []
        # the segment in flight: its replies' prefix, its plain PubAcks' patterns, the place of each
        # token (None: a token is its place), its answers, how many came, when to wake its waiter
        self._prefix = b""
        self.fast: tuple[re.Pattern[bytes], re.Pattern[bytes]] | None = None
        self._fast = _acks(inbox)
        self._seg = b""
        self._place: dict[int, int] | None = None
        self._answers: list[Answer] = []
        self._answered = 0
        self._wake_at = -1
        self._changed = asyncio.Event()

    @property
    def connected(self) -> bool:
        c = self.conn
        return c is not None and c.ready and c.transport is not None and not c.transport.is_closing()

    # --- what the connection says ---------------------------------------------------------------------

    def lost(self, conn: _Conn, exc: Exception | None) -> None:
        was = conn.ready
        conn.ready = False
        self.conn = None
        self._up.clear()
        self._changed.set()  # a waiter sees the loss now, not at its timeout
        for f in self._pongs:
            if not f.done():
                f.set_exception(Lost("connection lost"))
        self._pongs.clear()
        if was:
            self.on_state(False)
            logger.warning("fleet: the events' connection to NATS was lost%s", f": {exc}" if exc else "")

    def broken(self, conn: _Conn, why: str) -> None:
        self.on_error("nats", f"the events' connection is broken ({why}); reconnecting")
        if conn.transport is not None:
            conn.transport.abort()

    def pong(self) -> None:
        if self._pongs:
            f = self._pongs.pop(0)
            if not f.done():
                f.set_result(None)

    def stored(self, acks: list[tuple[bytes, bytes]]) -> None:
        """PubAcks (not duplicates) by (segment, token): those of the segment in flight count."""
        answers, place, size, seg = self._answers, self._place, len(self._answers), self._seg
        got = 0
        for s, t in acks:
            if s != seg:
                continue
            k = int(t) if place is None else place.get(int(t), -1)
            if 0 <= k < size and answers[k] is None:
                answers[k] = STORED
                got += 1
        self.marked(got)

    def marked(self, got: int) -> None:
        """`got` more answers of the segment in flight (by `stored`, or the C path's)."""
        self._answered += got
        if self._answered >= self._wake_at >= 0:
            self._changed.set()

    def answer(self, subject: bytes, headers: bytes, data: bytes) -> None:
        if not subject.startswith(self._prefix) or not self._prefix:
            return  # not the segment in flight's (a late answer to one given up on)
        try:
            t = int(subject[len(self._prefix) :])
        except ValueError:
            return
        k = t if self._place is None else self._place.get(t, -1)
        answers = self._answers
        if k < 0 or k >= len(answers) or answers[k] is not None:
            return
        if b'"error"' not in data and b'"seq"' in data:
            # the server writes `"duplicate": true` (a space): parsed when the word is there at all
            dup = b'"duplicate"' in data and json.loads(data).get("duplicate") is True
            answers[k] = DUPLICATE if dup else STORED
        else:
            answers[k] = _problem(headers, data)
        self._answered += 1
        if self._answered >= self._wake_at >= 0:
            self._changed.set()

    # --- connecting ------------------------------------------------------------------------------------

    async def run(self, stopped: Callable[[], bool], delay: Callable[[int], float]) -> None:
        """Connect, and connect again whenever the connection goes, until `stopped()`: each server in
        turn, `delay(failures)` seconds after every server failed once."""
        failures = 0
        i = 0
        try:
            while not stopped():
                url = self.servers[i % len(self.servers)]
                i += 1
                conn = _Conn(self)
                self.conn = conn
                try:
                    await self._connect(conn, url)
                except Exception as e:  # refused, unreachable, or a server we cannot make sense of
                    self.conn = None
                    if conn.transport is not None:
                        conn.transport.abort()
                    self.on_error("connect", f"cannot connect the events to {url}: {self._why(e)}")
                    if i % len(self.servers) == 0:
                        failures += 1
                        await _sleep_unless(stopped, delay(failures))
                    continue
                failures = 0
                self.on_state(True)
                logger.info("fleet: events connected to %s", url)
                while not conn.gone.is_set() and not stopped():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(conn.gone.wait(), timeout=0.5)
        finally:
            self.close()

    def _why(self, e: BaseException) -> str:
        if isinstance(e, ssl.SSLCertVerificationError):
            ca = f"the CA given ({self.ca})" if self.ca else "the system's CAs (no tls_ca given)"
            return f"its TLS certificate does not verify against {ca}: {e.verify_message}"
        return _describe(e)

    async def _connect(self, conn: _Conn, url: str) -> None:
        loop = asyncio.get_running_loop()
        u = urlsplit(url)
        host, port = u.hostname or "127.0.0.1", u.port or 4222
        await asyncio.wait_for(loop.create_connection(lambda: conn, host, port), self.connect_timeout)
        info = json.loads((await conn.line(self.connect_timeout)).removeprefix(b"INFO "))
        if not isinstance(info, dict):
            raise ValueError("the server's INFO is not an object")
        self.max_payload = int(info.get("max_payload", self.max_payload))
        if u.scheme == "tls" or self.tls is not None or info.get("tls_required"):
            assert conn.transport is not None
            ctx = self.tls or ssl.create_default_context()
            new = await asyncio.wait_for(
                loop.start_tls(conn.transport, conn, ctx, server_hostname=host), self.connect_timeout
            )
            assert isinstance(new, asyncio.Transport)
            conn.transport = new
        fields: dict[str, object] = {
            "verbose": False,
            "pedantic": False,
            "lang": "python3-evidence",
            "version": "1",
            "protocol": 1,
            "headers": True,
            "no_responders": True,
            "name": self.name,
        }
        if "nonce" in info:
            fields.update(self.sign(str(info["nonce"])))
        if u.username and u.password is not None:
            fields.update(user=unquote(u.username), **{"pass": unquote(u.password)})
        elif u.username:
            fields["auth_token"] = unquote(u.username)
        conn.write(b"CONNECT " + json.dumps(fields).encode() + b"\r\nPING\r\n")
        answer = await conn.line(self.connect_timeout)
        if answer != b"PONG":
            text = answer.removeprefix(b"-ERR").strip().strip(b"'").decode(errors="replace")
            raise Lost(f"refused: {text}")
        conn.write(f"SUB {self.inbox}.> 1\r\n".encode())
        conn.ready = True
        self._up.set()

    def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None and conn.transport is not None:
            conn.transport.close()
        self._up.clear()

    async def wait_connected(self, timeout: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._up.wait(), timeout)
        return self.connected

    async def ping(self, timeout: float) -> bool:
        """True if the server answers a PING within `timeout`; else the connection is dropped (to be
        made again): a server that reads nothing is not one to wait on."""
        conn = self.conn
        if conn is None or not self.connected:
            return False
        f: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pongs.append(f)
        try:
            conn.write(b"PING\r\n")
            await asyncio.wait_for(f, timeout)
            return True
        except (TimeoutError, Lost):
            if conn.transport is not None:
                conn.transport.abort()
            return False

    # --- publishing --------------------------------------------------------------------------------------

    async def publish(self, seg: Segment, window: int, timeout: float) -> list[Answer]:
        """Send a segment's frames, at most `window` unanswered at once; their answers, in order
        (None: not sent, or no answer within `timeout` of the one before). One segment at a time."""
        n = len(seg)
        self._prefix = reply_prefix(self.inbox, seg.no)
        self._seg = b"%d" % seg.no
        self.fast = self._fast
        self._place = None if seg.tokens is None else {t: k for k, t in enumerate(seg.tokens)}
        self._answers, self._answered = [None] * n, 0
        answers = self._answers
        data, offsets, sizes = memoryview(seg.data), seg.offsets, seg.sizes
        sent = 0
        try:
            while sent < n:
                conn = self.conn
                if conn is None or not self.connected:
                    return answers
                if sent - self._answered >= window and not await self._until(sent - window // 2, timeout):
                    return answers
                take = min(n - sent, _WRITE_AT_ONCE, window - (sent - self._answered))
                limit = self.max_payload
                if max(sizes[sent : sent + take]) <= limit:
                    conn.write(data[offsets[sent] : offsets[sent + take]])
                else:  # one too large would make the server close the connection: never sent
                    for k in range(sent, sent + take):
                        if sizes[k] > limit:
                            answers[k] = TOO_LARGE
                            self._answered += 1
                        else:
                            conn.write(data[offsets[k] : offsets[k + 1]])
                sent += take
            await self._until(sent, timeout)
        except Lost:
            pass
        finally:
            self._answers, self._prefix, self.fast = [], b"", None  # later answers are ignored
        return answers

    async def _until(self, answered: int, timeout: float) -> bool:
        """Until `answered` answers of this batch came; False if none came for `timeout`, or the
        connection went."""
        while self._answered < answered:
            if not self.connected:
                return False
            before = self._answered
            self._wake_at = answered
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout)
            except TimeoutError:
                if self._answered == before:
                    return False
            finally:
                self._wake_at = -1
        return True


def _problem(headers: bytes, data: bytes) -> str:
    """What an answer that is not a PubAck says (an error, or a no-responders status)."""
    if headers.startswith(b"NATS/1.0 503"):
        return "no responders (the stream is not there)"
    try:
        err = json.loads(data).get("error") or {}
        return f"JetStream refused it: {err.get('description', data[:200])} ({err.get('err_code', '')})"
    except (ValueError, AttributeError):
        return f"an answer that is not a PubAck: {data[:200]!r}"


async def _sleep_unless(stopped: Callable[[], bool], seconds: float) -> None:
    end = asyncio.get_running_loop().time() + seconds
    while not stopped() and asyncio.get_running_loop().time() < end:
        await asyncio.sleep(min(0.1, max(0.0, end - asyncio.get_running_loop().time())))


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
