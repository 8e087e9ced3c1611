"""The safe, streaming bundle reader: every byte of a bundle is untrusted until verified.

Nothing is extracted to disk and nothing is held whole in memory except the manifest: the gzip
stream is inflated chunk by chunk (counting decompressed bytes, so a gzip bomb stops at the limit),
tar headers are parsed by hand (only regular files, only `manifest.json` then `events.ndjson`), and
events are checked line by line as they stream past.

API:
- `open_bundle(path) -> Bundle`: reads and checks the manifest; `Bundle.events()` streams the
  events, verifying as it goes (structure, limits, every event's envelope and data, sequence, run
  id, hashes, counts). An integrity problem that can only be known at the end (a file hash, the
  root hash, the counts) raises when the iterator is exhausted, so a consumer that acts on events
  before that must be ready to throw its work away. `Bundle.verify()` runs the same pass, yielding
  nothing.
  `Bundle.fold(start)` makes the same pass, folding each piece's events into a fresh start(seq) in
  whichever process checks the piece (lint's rules run on both CPUs that way).
- `read_manifest(path) -> dict` and `read_events(path) -> Iterator[dict]`: verify the whole bundle
  first, then return the manifest / stream the events (in a second verifying pass).

Every failure is a `VerificationError` (a `BundleError`, exit code 2) whose message is one line;
`.problems` lists every reason found before the reader gave up (at most MAX_PROBLEMS).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as _dt
import hashlib
import json
import logging
import mmap
import multiprocessing
import os
import pickle
import queue
import re
import signal
import stat
import struct
import threading
import zlib
from collections.abc import Callable, Generator, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar

import orjson
import pydantic

from bundle import canonical, schemas
from bundle import format as fmt
from evidence.errors import BundleError

logger = logging.getLogger(__name__)

MAX_PROBLEMS = 20
MAX_MANIFEST = fmt.MAX_LINE  # manifest.json is one canonical JSON document, held in memory
_BLOCK = 512
_READ = 1 << 18  # compressed bytes read at a time
_CHUNK = 1 << 20  # decompressed bytes produced at a time (and about the size of a piece of events)
_PARALLEL_MIN = 1 << 20  # compressed bytes: a smaller bundle is checked in this process alone
_IN_FLIGHT = 4  # pieces with the helper process, not answered yet
_AHEAD = 12  # pieces read ahead of the consumer (bounds the memory)
_TRAILER_ZEROS = 64 * 1024  # zero bytes allowed after the tar end-of-archive marker (record padding)
_ENVELOPE_KEYS = frozenset(
    ("specversion", "id", "source", "type", "subject", "time", "datacontenttype", "runid", "seq", "data")
)
_TIME = schemas.py_regex(schemas.TIME_PATTERN).match
_RUN_ID = schemas.py_regex(schemas.RUN_ID_PATTERN).match
_HEX64 = schemas.py_regex(schemas.HEX64_PATTERN).match
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(rb"[\[\]{}]")
_TAR_TYPES = {
    b"1": "a hard link",
    b"2": "a symbolic link",
    b"3": "a character device",
    b"4": "a block device",
    b"5": "a directory",
    b"6": "a FIFO",
    b"7": "a contiguous file",
    b"x": "a pax extended header",
    b"g": "a pax global header",
    b"L": "a GNU long name",
    b"K": "a GNU long link name",
    b"S": "a GNU sparse file",
}


@dataclasses.dataclass(frozen=True)
class Limits:
    compressed: int = fmt.MAX_COMPRESSED
    decompressed: int = fmt.MAX_DECOMPRESSED
    events: int = fmt.MAX_EVENTS
    line: int = fmt.MAX_LINE
    depth: int = fmt.MAX_DEPTH
    manifest: int = MAX_MANIFEST


class VerificationError(BundleError):
    """The bundle is not a valid evidence bundle (or has been tampered with)."""

    def __init__(self, path: str, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        super().__init__(f"{path}: verification failed: {problems[0]}{more}")

    def __reduce__(self) -> tuple[Any, ...]:  # crosses process boundaries (diff reads A in a worker)
        return (VerificationError, (self.path, self.problems))


class _Fatal(Exception):
    """A problem after which nothing further can be read."""


class _Stop(Exception):
    """Ends the pass after problems were recorded (adds none of its own)."""


# --- gzip and tar ------------------------------------------------------------------------------


def _inflate(f: IO[bytes], limits: Limits) -> Generator[bytes, None, None]:
    """Decompressed chunks of one gzip member, counting both sides against the limits."""
    d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    read = 0
    produced = 0
    while not d.eof:
        chunk = f.read(_READ)
        if not chunk:
            raise _Fatal("truncated gzip stream (the file ends before the gzip trailer)")
        read += len(chunk)
        if read > limits.compressed:
            raise _Fatal(f"compressed size exceeds the limit of {limits.compressed} bytes")
        while chunk and not d.eof:
            try:
                out = d.decompress(chunk, _CHUNK)
            except zlib.error as e:
                raise _Fatal(f"corrupt gzip stream: {e}") from None
            chunk = d.unconsumed_tail
            produced += len(out)
            if produced > limits.decompressed:
                raise _Fatal(
                    f"decompressed size exceeds the limit of {limits.decompressed} bytes (gzip bomb?)"
                )
            if out:
                yield out
    if d.unused_data or f.read(1):
        raise _Fatal("unexpected data after the end of the gzip stream")


class _Ahead:
    """Runs a chunk generator in a thread, a few chunks ahead of the consumer: zlib releases the
    GIL, so inflating overlaps with checking events. Exceptions reach the consumer in order."""

    _END = object()

    def __init__(self, chunks: Iterator[bytes], depth: int = 8) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._ended = False
        self._thread = threading.Thread(target=self._run, args=(chunks,), name="bundle-inflate", daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, chunks: Iterator[bytes]) -> None:
        try:
            for chunk in chunks:
                if not self._put(chunk):
                    return
            self._put(self._END)
        except BaseException as e:  # handed to the consumer
            self._put(e)
        finally:
            closer = getattr(chunks, "close", None)
            if closer is not None:
                closer()

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        if self._ended:
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._ended = True
                    raise _Fatal("the decompressing thread stopped without a result") from None
        if item is self._END:
            self._ended = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        chunk: bytes = item
        return chunk

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class _Stream:
    """Exact reads over the decompressed chunks."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._buf = b""
        self._pos = 0

    def _fill(self) -> bool:
        for chunk in self._chunks:
            self._buf = self._buf[self._pos :] + chunk if self._pos < len(self._buf) else chunk
            self._pos = 0
            return True
        return False

    def read_some(self, n: int) -> bytes:
        """Up to n bytes (at least one unless the stream has ended)."""
        if self._pos >= len(self._buf) and not self._fill():
            return b""
        out = self._buf[self._pos : self._pos + n]
        self._pos += len(out)
        return out

    def read(self, n: int) -> bytes:
        """Exactly n bytes, fewer only at the end of the stream."""
        parts = []
        while n > 0:
            b = self.read_some(n)
            if not b:
                break
            parts.append(b)
            n -= len(b)
        return b"".join(parts)


@dataclasses.dataclass
class _Member:
    name: str
    size: int


def _octal(field: bytes, what: str) -> int:
    if field[:1] and field[0] & 0x80:
        raise _Fatal(f"tar header {what} uses base-256 encoding")
    text = field.split(b"\0", 1)[0].strip(b" ")
    if not text:
        return 0
    if not re.fullmatch(rb"[0-7]+", text):
        raise _Fatal(f"tar header {what} is not an octal number")
    return int(text, 8)


def _header(block: bytes) -> _Member | None:
    """The member a 512-byte header describes, or None for an all-zero (end-of-archive) block."""
    if len(block) < _BLOCK:
        raise _Fatal("truncated tar archive (a header is cut short)")
    if block == bytes(_BLOCK):
        return None
    stored = _octal(block[148:156], "checksum")
    if stored != sum(block[:148]) + 8 * 32 + sum(block[156:]):
        raise _Fatal("tar header checksum mismatch (not a tar archive, or corrupt)")
    if block[257:262] != b"ustar":
        raise _Fatal("not a ustar tar archive")
    raw_name = block[0:100].split(b"\0", 1)[0]
    prefix = block[345:500].split(b"\0", 1)[0]
    if prefix:
        raw_name = prefix + b"/" + raw_name
    try:
        name = raw_name.decode("utf-8")
    except UnicodeDecodeError:
        raise _Fatal(f"member name {raw_name!r} is not valid UTF-8") from None
    shown = json.dumps(name)
    if name.startswith("/"):
        raise _Fatal(f"member name {shown} is an absolute path")
    if ".." in name.replace("\\", "/").split("/"):
        raise _Fatal(f"member name {shown} escapes the archive ('..')")
    kind = block[156:157]
    if kind not in (b"0", b"\0"):
        what = _TAR_TYPES.get(kind, f"of unsupported type {kind!r}")
        raise _Fatal(f"member {shown} is {what}; a bundle holds only regular files")
    return _Member(name, _octal(block[124:136], "size"))


# --- JSON ----------------------------------------------------------------------------------------


def _depth(line: bytes) -> int:
    depth = top = 0
    for m in _BRACKETS.finditer(_STRING.sub(b"", line)):
        depth += 1 if m.group() in (b"[", b"{") else -1
        top = max(top, depth)
    return top


def _duplicate_key(line: bytes) -> str | None:
    found: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen = set()
        for k, _ in items:
            if k in seen and not found:
                found.append(k)
            seen.add(k)
        return dict(items)

    try:
        json.loads(line, object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return None
    return found[0] if found else None


def _parse(line: bytes, what: str, limits: Limits) -> Any:
    """Decode one canonical JSON document; raises _Fatal with the reason."""
    if line.count(b"[") + line.count(b"{") > limits.depth and _depth(line) > limits.depth:
        raise _Fatal(f"{what}: JSON nested deeper than {limits.depth} levels")
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as u:
            raise _Fatal(f"{what}: invalid UTF-8 at byte {u.start}") from None
        raise _Fatal(f"{what}: invalid JSON: {e}") from None
    try:
        again = canonical.dumps(value)
    except canonical.CanonicalError as e:
        raise _Fatal(f"{what}: not canonical JSON: {e}") from None
    if again != line:
        dup = _duplicate_key(line)
        if dup is not None:
            raise _Fatal(f"{what}: duplicate JSON key {json.dumps(dup)}")
        raise _Fatal(f"{what}: not canonical JSON (sorted keys, no whitespace, minimal escapes)")
    return value


# --- the fast path -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Context:
    """What the fast path needs to know about a bundle (picklable, small)."""

    run_id: str
    source: str
    line: int  # the line length limit
    labels: str | None = None  # the `labels` attribute every event carries, when the run has labels

    @property
    def id_prefix(self) -> str:
        return self.run_id + ":"


@dataclasses.dataclass
class _Passed:
    """What passed the fast path, in order: the root hash and the counts take it in."""

    n: int = 0  # events
    hashes: list[str] = dataclasses.field(default_factory=list)  # their content hashes (hex)
    counts: dict[str, int] = dataclasses.field(default_factory=dict)  # by type

    def root_bytes(self) -> bytes:
        return ("\n".join(self.hashes) + "\n").encode() if self.hashes else b""


# a piece all of whose events passed the fast path: what they add to the root hash, their counts by
# type, and the fold of them (None when the pass folds nothing)
_Answer = tuple[bytes, dict[str, int], Any]


# In a canonical event line the keys come sorted, so the line is
#   {"data":D,"datacontenttype":"application/json","id":"<runid>:<seq>"[,"labels":"<labels>"],
#    "runid":"<runid>","seq":<seq>,"source":"<source>","specversion":"1.0","subject":S,
#    "time":"<time>","type":"<type>"}
# Everything but D, S, <seq>, <time> and <type> is known from the manifest, so the fast path puts
# the line it expects together from constants, orjson's canonical dump of D and of S, the seq's
# digits, the time (once it matches TIME_PATTERN it needs no escaping) and the type (one of the
# known types), and compares it with the line: equal means canonical with exactly the envelope
# attributes and values the careful path demands. The content hash covers the canonical
# {"data":D,"datacontenttype":...,"specversion":"1.0","subject":S,"type":"<type>"}, put together
# from the same pieces. tests/unit/test_reader_fast.py checks that this agrees with
# format.content_hash and with the careful path.
_CORE_MIDDLE = b',"datacontenttype":"application/json","specversion":"1.0","subject":'


def _envelope_parts(ctx: _Context) -> tuple[bytes, bytes, bytes]:
    """The constant bytes of an event line: before the seq's digits in the id, between those and
    the seq, and between the seq and S."""
    dumps = orjson.dumps
    labels = b',"labels":' + dumps(ctx.labels) if ctx.labels is not None else b""
    return (
        b',"datacontenttype":' + dumps(fmt.DATACONTENTTYPE) + b',"id":' + dumps(ctx.id_prefix)[:-1],
        b'"' + labels + b',"runid":' + dumps(ctx.run_id) + b',"seq":',
        b',"source":' + dumps(ctx.source) + b',"specversion":' + dumps(fmt.SPECVERSION) + b',"subject":',
    )


# the tail of an event line and of its hashed core after S, by type (run.started and run.finished
# are left to the careful path, which checks their place in the run)
_TYPES = {
    etype: (b'","type":' + orjson.dumps(etype) + b"}", b',"type":' + orjson.dumps(etype) + b"}", check)
    for etype, check in schemas.DATA_CHECKERS.items()
    if etype not in (fmt.RUN_STARTED, fmt.RUN_FINISHED)
}


def _fast(lines: list[bytes], seq: int, ctx: _Context, passed: _Passed) -> Iterator[dict[str, Any]]:
    """The fast path over `lines`, the first of which is event `seq`: makes every check the careful
    path makes, yields each event that passes (adding it to `passed`) and stops at the first that
    does not, without saying why; and at the first event whose place in the run needs checking (the
    first event, run.started, run.finished). The caller goes on from there with the careful path."""
    before_id, before_seq, before_subject = _envelope_parts(ctx)
    types = _TYPES
    loads = orjson.loads
    dumps = orjson.dumps
    sort = orjson.OPT_SORT_KEYS
    is_time = _TIME
    sha256 = hashlib.sha256
    join = b"".join
    add_hash = passed.hashes.append
    counts = passed.counts
    errors = (orjson.JSONDecodeError, orjson.JSONEncodeError, AttributeError, KeyError, TypeError)
    if seq == 0:
        return
    for line in lines:
        try:
            ev = loads(line)
            etype = ev["type"]
            line_tail, core_tail, check = types[etype]  # a known type, not run.started/finished
            data = ev["data"]
            time = ev["time"]
            subject = ev["subject"]
            if not (
                type(subject) is str
                and check(data) is None
                and type(time) is str
                # a valid time (so ASCII, nothing to escape): often the data's last_time, checked
                and (time == data.get("last_time") or is_time(time) is not None)
            ):
                return
            digits = str(seq).encode()
            d = dumps(data, option=sort)
            s = dumps(subject)
            # canonical, exactly the envelope's attributes, each with the value it must have
            if line != join(
                (b'{"data":', d, before_id, digits, before_seq, digits, before_subject, s,
                 b',"time":"', time.encode(), line_tail)
            ):  # fmt: skip
                return
        except errors:
            return
        add_hash(sha256(join((b'{"data":', d, _CORE_MIDDLE, s, core_tail))).hexdigest())
        counts[etype] = counts.get(etype, 0) + 1
        passed.n += 1
        seq += 1
        yield ev


class Fold(Protocol):
    """What `Bundle.fold` folds the events of one piece of the stream into."""

    def feed(self, ev: dict[str, Any], /) -> None: ...


F = TypeVar("F", bound=Fold)
Start = Callable[[int], Fold]  # the fold for the events from seq on


def _check_piece(lines: list[bytes], seq: int, ctx: _Context, start: Start | None) -> _Answer | None:
    """The fast path over all of `lines`, folding the events into start(seq) when given: the answer
    if every event passed, else None (the careful path then says why)."""
    if lines and max(map(len, lines)) > ctx.line:
        return None
    passed = _Passed()
    events = _fast(lines, seq, ctx, passed)
    folded = None
    if start is None:
        collections.deque(events, maxlen=0)
    else:
        folded = start(seq)
        collections.deque(map(folded.feed, events), maxlen=0)
    if passed.n != len(lines):
        return None
    return passed.root_bytes(), passed.counts, folded


# --- a second core -------------------------------------------------------------------------------


def _serve(inbox: Connection, outbox: Connection, parent_ends: list[Connection], shared: mmap.mmap) -> None:
    """The helper process: runs the fast path (and the fold, if any) on the pieces it is sent,
    answers each in order. A piece's bytes are in `shared`; the pipe says where."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles ^C and closes the pipes
    for end in parent_ends:
        end.close()
    try:
        ctx = _Context(*orjson.loads(inbox.recv_bytes()))  # run_id, source, line, labels
        start = pickle.loads(inbox.recv_bytes())  # noqa: S301 - our parent's own object, not the bundle's
        while True:
            seq, offset, size = _WHERE.unpack(inbox.recv_bytes())
            lines = shared[offset : offset + size].split(b"\n")
            lines.pop()
            outbox.send((seq, _check_piece(lines, seq, ctx, start)))
    except (EOFError, OSError):  # the parent is done, or gone
        return
    except Exception as e:  # a fold that fails, an answer that does not pickle: the parent checks
        logger.debug("bundle-verify helper: %r", e)  # the piece itself (and raises in order)
        return


_ANSWERS_PIPE = 1 << 20  # bytes: an answer carries a piece's content hashes (about 100 KiB)
_WHERE = struct.Struct("<QQQ")  # a piece for the helper: its seq, its offset and size in the shared map


class _Helper:
    """A forked process that runs the fast path over some of the pieces, on another CPU. Only an
    accelerator: the parent keeps every piece it hands over and checks it itself if the helper
    fails in any way.

    A piece travels through a memory map shared with the helper (a slot per piece in flight), and
    the pipe carries only where it is: copying a gigabyte through a pipe costs more CPU than
    checking a good part of it. The messages to the helper are that small and there are at most
    _IN_FLIGHT of them unread, so sending never waits for the helper (which may be waiting for this
    process to take an answer)."""

    def __init__(self) -> None:
        self._slot = _CHUNK + fmt.MAX_LINE  # a piece is at most a chunk and the rest of a line
        self._shared = mmap.mmap(-1, self._slot * _IN_FLIGHT)  # shared with the child after fork
        self._free = list(range(_IN_FLIGHT))
        mp = multiprocessing.get_context("fork")
        inbox, self._send = mp.Pipe(duplex=False)
        self._recv, outbox = mp.Pipe(duplex=False)
        self._proc = mp.Process(
            target=_serve,
            args=(inbox, outbox, [self._send, self._recv], self._shared),
            name="bundle-verify",
            daemon=True,
        )
        try:  # room for every answer in flight, so that the helper never waits for this process
            import fcntl  # noqa: PLC0415 - POSIX only; the reader also runs where there is none

            fcntl.fcntl(self._recv.fileno(), fcntl.F_SETPIPE_SZ, _ANSWERS_PIPE)
        except (ImportError, OSError, AttributeError):  # not Linux, or over /proc/sys/fs/pipe-max-size
            pass
        self._proc.start()
        inbox.close()
        outbox.close()
        self.in_flight: collections.deque[tuple[_Piece, int]] = collections.deque()  # with its slot
        self.broken = False

    @staticmethod
    def usable() -> bool:
        """A second CPU, fork, and no other thread in this process (forking a threaded process can
        leave the child with a lock that is never released)."""
        affinity = getattr(os, "sched_getaffinity", None)  # Linux
        cpus = len(affinity(0)) if affinity is not None else os.cpu_count() or 1
        return (
            cpus >= 2 and "fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1
        )

    def _message(self, message: bytes) -> bool:
        try:
            self._send.send_bytes(message)
        except OSError:  # the helper is gone
            self._fail()
            return False
        return True

    def start(self, ctx: _Context, start: bytes) -> None:
        """What the helper checks against (sent once the manifest is known), and the pickled
        start of the fold it runs (a pickled None: none)."""
        if self._message(orjson.dumps([ctx.run_id, ctx.source, ctx.line, ctx.labels])):
            self._message(start)

    def takes(self, piece: _Piece) -> bool:
        """Whether the helper can take this piece now."""
        return bool(self._free) and not self.broken and piece.fatal is None and len(piece.data) <= self._slot

    def submit(self, piece: _Piece) -> None:
        slot = self._free.pop()
        offset = slot * self._slot
        self._shared[offset : offset + len(piece.data)] = piece.data
        if self._message(_WHERE.pack(piece.seq, offset, len(piece.data))):
            piece.remote = True
            piece.drop_lines()  # the helper has its own, and this process may never need them
            self.in_flight.append((piece, slot))
        else:
            self._free.append(slot)

    def collect(self) -> None:
        """Takes in the answers that have come."""
        while self.in_flight and not self.broken and self._recv.poll(0):
            self.wait()

    def wait(self) -> None:
        """Takes in the next answer, waiting for it."""
        try:
            while not self._recv.poll(1.0):
                if not self._proc.is_alive():
                    raise EOFError
            seq, result = self._recv.recv()
            if seq != self.in_flight[0][0].seq:
                raise EOFError
        except (EOFError, OSError, IndexError, TypeError, ValueError, pickle.UnpicklingError):
            self._fail()
            return
        piece, slot = self.in_flight.popleft()
        self._free.append(slot)
        piece.remote = False
        piece.checked = True
        piece.answer = result

    def _fail(self) -> None:
        """The helper is gone: the pieces it had are checked here."""
        if not self.broken:
            logger.debug("bundle-verify helper failed; checking in this process")
        self.broken = True
        for piece, _ in self.in_flight:
            piece.remote = False
        self.in_flight.clear()
        self.close()

    def close(self) -> None:
        self.broken = True
        self._send.close()  # the helper ends when it has read all
        self._recv.close()  # and a helper blocked answering gets EPIPE
        self._proc.join(2.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._shared.close()


@dataclasses.dataclass
class _Piece:
    """Whole lines of events.ndjson (or a problem found while reading them), on their way."""

    data: bytes
    seq: int  # line number of the first line (0-based)
    fatal: _Fatal | None = None
    remote: bool = False  # with the helper, not answered yet
    checked: bool = False  # the fast path has run over it (in the helper or here)
    answer: _Answer | None = None  # the fast path's, if all lines passed
    _lines: list[bytes] | None = None

    @property
    def lines(self) -> list[bytes]:
        if self._lines is None:
            self._lines = self.data.split(b"\n")
            self._lines.pop()
        return self._lines

    def drop_lines(self) -> None:
        self._lines = None


# --- the verifier --------------------------------------------------------------------------------

_epoch_days: dict[str, int] = {}


def time_ns(text: str) -> int:
    """ns since the epoch of a canonical bundle time (format.format_time); ValueError if it is not one."""
    if not isinstance(text, str) or not _TIME(text):
        raise ValueError(f"not an RFC 3339 UTC time with nine fraction digits: {text!r}")
    day = text[:10]
    days = _epoch_days.get(day)
    if days is None:
        days = (_dt.date.fromisoformat(day) - _dt.date(1970, 1, 1)).days
        if len(_epoch_days) > 4096:
            _epoch_days.clear()
        _epoch_days[day] = days
    h, m, s = int(text[11:13]), int(text[14:16]), int(text[17:19])
    if h > 23 or m > 59 or s > 60:
        raise ValueError(f"time out of range: {text!r}")
    return ((days * 86400 + h * 3600 + m * 60 + s) * 1_000_000_000) + int(text[20:29])


def _check_manifest(m: Any) -> list[str]:
    problems = []
    try:
        fmt.Manifest.model_validate(m, strict=True)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "(top)"
        return [f"manifest.json: {loc}: {err['msg']}"]
    if m["format_version"] != fmt.FORMAT_VERSION:
        problems.append(
            f"manifest.json: unsupported format_version {m['format_version']} (this reader: {fmt.FORMAT_VERSION})"
        )
    if not _RUN_ID(m["run_id"]):
        problems.append(f"manifest.json: run_id {json.dumps(m['run_id'])} is not a valid run id")
    if m["source"] != fmt.source_for(m["run_id"]):
        problems.append("manifest.json: source does not match run_id")
    for field in ("started_at", "finished_at"):
        try:
            time_ns(m[field])
        except ValueError as e:
            problems.append(f"manifest.json: {field}: {e}")
    if not _HEX64(m["root_hash"]):
        problems.append("manifest.json: root_hash is not a lowercase hex sha256")
    if set(m["files"]) != {fmt.EVENTS_NAME}:
        problems.append(
            f"manifest.json: files must list exactly {fmt.EVENTS_NAME}, found {sorted(m['files'])}"
        )
    else:
        entry = m["files"][fmt.EVENTS_NAME]
        if not _HEX64(entry["sha256"]):
            problems.append(f"manifest.json: files.{fmt.EVENTS_NAME}.sha256 is not a lowercase hex sha256")
        if entry["size"] < 0:
            problems.append(f"manifest.json: files.{fmt.EVENTS_NAME}.size is negative")
    if m["events"] < 0 or any(v < 0 for v in m["counts"].values()):
        problems.append("manifest.json: negative event count")
    if m["lost"]["total"] != sum(m["lost"]["by_kind"].values()) or m["lost"]["total"] < 0:
        problems.append("manifest.json: lost.total is not the sum of lost.by_kind")
    return problems


class _Verifier:
    """One pass over a bundle. `events()` yields each event once it has been checked."""

    def __init__(
        self, path: str, limits: Limits, *, parallel: bool = False, start: Start | None = None
    ) -> None:
        self.path = path
        self.limits = limits
        self.problems: list[str] = []
        self.manifest: dict[str, Any] = {}
        self.parallel = parallel
        self.helper: _Helper | None = None
        self.start = start  # the pass folds each piece's events into start(seq), and yields the folds
        self._start_pickled = b""
        if parallel:
            try:
                self._start_pickled = pickle.dumps(start)
            except Exception as e:  # PicklingError, TypeError, RecursionError...
                logger.debug("the fold cannot go to a helper process (%s); one process checks all", e)
                self.parallel = False
        # the state of the pass over the events
        self.seq = 0  # the next event's expected seq
        self.ok = True  # no problem so far: events are yielded
        self.finished_at = -1  # seq of run.finished, once seen
        self.counts: dict[str, int] = {}
        self.root = hashlib.sha256()
        self.file_hash = hashlib.sha256()

    def fail(self, why: str) -> None:
        self.problems.append(why)
        if len(self.problems) >= MAX_PROBLEMS:
            raise _Stop()

    def _open(self) -> IO[bytes]:
        try:
            if not stat.S_ISREG(os.stat(self.path).st_mode):  # never block on a FIFO or a device
                raise BundleError(f"cannot read bundle {self.path}: not a regular file")
            f = open(self.path, "rb")  # noqa: SIM115 - closed by the caller
            size = os.fstat(f.fileno()).st_size
        except OSError as e:
            raise BundleError(f"cannot read bundle {self.path}: {e.strerror or e}") from None
        if not Path(self.path).is_file():
            f.close()
            raise BundleError(f"cannot read bundle {self.path}: not a regular file")
        if size > self.limits.compressed:
            f.close()
            raise VerificationError(
                self.path, [f"file size {size} exceeds the limit of {self.limits.compressed} bytes"]
            )
        return f

    def run(self, *, manifest_only: bool = False) -> Generator[Any, None, None]:
        """The pass: yields the events (or, with a start, the folds) once checked; raises
        VerificationError at the end if anything was wrong."""
        f = self._open()
        if (
            self.parallel
            and not manifest_only
            and os.fstat(f.fileno()).st_size >= _PARALLEL_MIN
            and _Helper.usable()
        ):
            self.helper = _Helper()  # forked before the inflating thread starts
        chunks = _Ahead(_inflate(f, self.limits)) if not manifest_only else _inflate(f, self.limits)
        try:
            yield from self._walk(_Stream(chunks), manifest_only)
        except _Stop:
            pass
        except _Fatal as e:
            self.problems.append(str(e))
        except RecursionError:
            self.problems.append("JSON nested too deeply")
        finally:
            chunks.close()
            f.close()
            if self.helper is not None:
                self.helper.close()
        if self.problems:
            raise VerificationError(self.path, self.problems)

    def _walk(self, s: _Stream, manifest_only: bool) -> Iterator[dict[str, Any]]:
        first = _header(s.read(_BLOCK))
        if first is None:
            raise _Fatal("empty archive: no manifest.json")
        if first.name != fmt.MANIFEST_NAME:
            if first.name == fmt.EVENTS_NAME:
                raise _Fatal(f"{fmt.MANIFEST_NAME} must be the first member, found {fmt.EVENTS_NAME}")
            raise _Fatal(
                f"unexpected member {json.dumps(first.name)} (a bundle holds only {', '.join(fmt.MEMBERS)})"
            )
        if first.size > self.limits.manifest:
            raise _Fatal(f"{fmt.MANIFEST_NAME} is larger than the limit of {self.limits.manifest} bytes")
        raw = s.read(first.size)
        if len(raw) < first.size:
            raise _Fatal(f"truncated tar archive (inside {fmt.MANIFEST_NAME})")
        s.read((-first.size) % _BLOCK)
        manifest = _parse(raw, fmt.MANIFEST_NAME, self.limits)
        bad = _check_manifest(manifest)
        if bad:
            self.problems.extend(bad)
            raise _Stop()
        self.manifest = manifest
        if manifest_only:
            return
        second = _header(s.read(_BLOCK))
        if second is None:
            raise _Fatal(f"archive has no {fmt.EVENTS_NAME}")
        if second.name != fmt.EVENTS_NAME:
            if second.name == fmt.MANIFEST_NAME:
                raise _Fatal(f"duplicate member {fmt.MANIFEST_NAME}")
            raise _Fatal(
                f"unexpected member {json.dumps(second.name)} (a bundle holds only {', '.join(fmt.MEMBERS)})"
            )
        declared = manifest["files"][fmt.EVENTS_NAME]["size"]
        if second.size > self.limits.decompressed:
            raise _Fatal(f"{fmt.EVENTS_NAME} is larger than the limit of {self.limits.decompressed} bytes")
        if second.size != declared:
            raise _Fatal(f"{fmt.EVENTS_NAME} is {second.size} bytes, the manifest says {declared}")
        yield from self._events(s, second.size)
        s.read((-second.size) % _BLOCK)
        self._trailer(s)

    def _trailer(self, s: _Stream) -> None:
        zeros = 0
        while True:
            block = s.read(_BLOCK)
            if not block:
                break
            if block != bytes(len(block)):
                if zeros < 2 * _BLOCK and len(block) == _BLOCK:
                    member = _header(block)
                    name = json.dumps(member.name) if member else "?"
                    if member and member.name in fmt.MEMBERS:
                        raise _Fatal(f"duplicate member {name}")
                    raise _Fatal(f"unexpected member {name} (a bundle holds only {', '.join(fmt.MEMBERS)})")
                raise _Fatal("unexpected data after the end of the tar archive")
            zeros += len(block)
            if zeros > _TRAILER_ZEROS:
                raise _Fatal("unexpected data after the end of the tar archive (too much padding)")
        if zeros < 2 * _BLOCK:
            raise _Fatal("truncated tar archive (no end-of-archive marker)")

    def _pieces(self, s: _Stream, size: int) -> Iterator[bytes]:
        """events.ndjson in pieces of whole lines, hashing its bytes as they pass."""
        limits = self.limits
        leftover = b""
        remaining = size
        while remaining:
            chunk = s.read_some(min(remaining, _CHUNK))
            if not chunk:
                raise _Fatal(f"truncated tar archive (inside {fmt.EVENTS_NAME})")
            remaining -= len(chunk)
            self.file_hash.update(chunk)
            cut = chunk.rfind(b"\n") + 1
            if cut:
                piece = leftover + chunk[:cut] if leftover or cut < len(chunk) else chunk
                leftover = chunk[cut:]
            else:
                piece, leftover = b"", leftover + chunk
            if len(leftover) > limits.line:
                raise _Fatal(f"{fmt.EVENTS_NAME}: a line is longer than {limits.line} bytes")
            if piece:
                yield piece
        if leftover:
            raise _Fatal(f"{fmt.EVENTS_NAME} does not end with a newline")

    def _events(self, s: _Stream, size: int) -> Iterator[Any]:
        """Stream, check and yield the events (or the folds), a piece (about _CHUNK bytes of whole
        lines) at a time.

        Each event goes through the fast path (_fast), which passes it or gives up at it, and from
        there the careful path (_careful) takes over, which explains. Once a problem was found or
        run.finished seen, only the careful path is taken. With a helper process, the fast path
        runs on two CPUs: pieces read ahead go to the helper while it has room, the others are
        checked here, in order. When folding, this process does not wait idle for the helper's
        answer about the next piece in line: it checks (and folds) a later piece meanwhile, the
        results then taken in order. A problem found while reading waits in line, so that the
        events before it are checked first, as in one pass."""
        m = self.manifest
        ctx = _Context(m["run_id"], m["source"], self.limits.line, fmt.labels_attribute(m.get("labels")))
        start = self.start
        helper = self.helper
        if helper is not None:
            helper.start(ctx, self._start_pickled)
        pieces = self._pieces(s, size)
        pending: collections.deque[_Piece] = collections.deque()
        lines_read = 0

        def take() -> _Piece | None:
            nonlocal pieces, lines_read
            try:
                data = next(pieces)
            except StopIteration:
                return None
            except _Fatal as e:
                piece = _Piece(b"", lines_read, fatal=e)
                pieces = iter(())
            else:
                piece = _Piece(data, lines_read)
                lines_read += len(piece.lines)  # (bytes.count is slower than split)
            pending.append(piece)
            return piece

        while True:
            if helper is not None and not helper.broken and self._fast():
                helper.collect()
                while len(pending) < _AHEAD and take() is not None:
                    pass
                for piece in pending:  # the helper is kept busy: this process has more to do
                    if not piece.remote and not piece.checked and helper.takes(piece):
                        helper.submit(piece)
            if not pending and take() is None:
                break
            piece = pending[0]
            if piece.remote and start is not None and self._fast():
                ahead = next((p for p in pending if not p.remote and not p.checked and p.fatal is None), None)
                if ahead is not None:  # rather than wait for the helper
                    ahead.answer = _check_piece(ahead.lines, ahead.seq, ctx, start)
                    ahead.checked = True
                    continue
            pending.popleft()
            while piece.remote:
                assert helper is not None
                helper.wait()
            if piece.fatal is not None:
                raise piece.fatal
            if self._fast() and piece.answer is not None:  # every event passed the fast path
                root, counts, folded = piece.answer
                n = sum(counts.values())
                if self.seq + n > self.limits.events:
                    raise _Fatal(f"{fmt.EVENTS_NAME}: more than {self.limits.events} events")
                self.root.update(root)
                self._count(counts)
                self.seq += n
                if start is None:
                    yield from map(orjson.loads, piece.lines)
                else:
                    yield folded
                continue
            lines = piece.lines
            if lines and max(map(len, lines)) > self.limits.line:
                raise _Fatal(f"{fmt.EVENTS_NAME}: a line is longer than {self.limits.line} bytes")
            if self.seq + len(lines) > self.limits.events:
                raise _Fatal(f"{fmt.EVENTS_NAME}: more than {self.limits.events} events")
            events = self._checked(lines, ctx)
            if start is None:
                yield from events
            else:
                folded = start(piece.seq)
                collections.deque(map(folded.feed, events), maxlen=0)
                yield folded
        self._finish()

    def _checked(self, lines: list[bytes], ctx: _Context) -> Iterator[dict[str, Any]]:
        """The events of `lines` that pass, in order: the fast path while it can, then the careful."""
        done = 0
        if self._fast():
            passed = _Passed()
            yield from _fast(lines, self.seq, ctx, passed)
            self.root.update(passed.root_bytes())
            self._count(passed.counts)
            self.seq += passed.n
            done = passed.n
        if done < len(lines):
            yield from self._careful(lines[done:] if done else lines)

    def _fast(self) -> bool:
        """Whether the fast path may be taken: no problem so far and no run.finished yet."""
        return self.ok and self.finished_at < 0

    def _count(self, counts: dict[str, int]) -> None:
        for etype, n in counts.items():
            self.counts[etype] = self.counts.get(etype, 0) + n

    def _careful(self, lines: list[bytes]) -> Iterator[dict[str, Any]]:
        """The careful path: line by line, saying what is wrong with each bad event."""
        m = self.manifest
        run_id = m["run_id"]
        id_prefix = run_id + ":"
        labels = fmt.labels_attribute(m.get("labels"))
        envelope_keys = _ENVELOPE_KEYS | {"labels"} if labels is not None else _ENVELOPE_KEYS
        for line in lines:
            seq = self.seq
            why = None
            try:
                ev = orjson.loads(line)
                good = (
                    orjson.dumps(ev, option=orjson.OPT_SORT_KEYS) == line
                    and ev.keys() == envelope_keys
                    and ev.get("labels") == labels
                    and ev["id"] == id_prefix + str(seq)
                    and ev["seq"] == seq
                    and type(ev["seq"]) is int
                    and ev["runid"] == run_id
                    and ev["source"] == m["source"]
                    and ev["specversion"] == fmt.SPECVERSION
                    and ev["datacontenttype"] == fmt.DATACONTENTTYPE
                    and type(ev["subject"]) is str
                    and type(ev["time"]) is str
                    and _TIME(ev["time"]) is not None
                    and schemas.DATA_CHECKERS[ev["type"]](ev["data"]) is None
                )
            except (orjson.JSONDecodeError, orjson.JSONEncodeError, AttributeError, KeyError, TypeError):
                good = False
            if good:
                etype = ev["type"]
                if seq == 0 or etype in (fmt.RUN_STARTED, fmt.RUN_FINISHED) or self.finished_at >= 0:
                    why = self._position(ev, seq)
            else:
                why = self._reason(line, seq)  # raises _Fatal if the line cannot be parsed
            if why is not None:
                self.fail(f"event {seq}: {why}")
                self.ok = False
                got = ev.get("seq") if good or type(ev) is dict else None
                if type(got) is int and got > seq:
                    seq = got  # report a gap once, not on every later event
                self.seq = seq + 1
                continue
            self.root.update(fmt.content_hash(ev).encode() + b"\n")
            self.counts[etype] = self.counts.get(etype, 0) + 1
            self.seq = seq + 1
            if self.ok:
                yield ev

    def _finish(self) -> None:
        """The checks that can only be made at the end of the events."""
        m = self.manifest
        if self.file_hash.hexdigest() != m["files"][fmt.EVENTS_NAME]["sha256"]:
            self.fail(f"{fmt.EVENTS_NAME}: sha256 does not match the manifest (tampered?)")
        if self.ok and self.root.hexdigest() != m["root_hash"]:
            self.fail("root hash over the event content hashes does not match the manifest (tampered?)")
        if self.ok and self.seq != m["events"]:
            self.fail(f"manifest says {m['events']} events, the bundle holds {self.seq}")
        if self.ok and self.counts != m["counts"]:
            self.fail(f"manifest counts {m['counts']} do not match the events {self.counts}")

    def _reason(self, line: bytes, seq: int) -> str:
        """Why line `seq` is not a valid event (the slow path). Raises _Fatal for lines that are not
        canonical JSON at all: after such a line nothing can be trusted."""
        where = f"{fmt.EVENTS_NAME} line {seq + 1}"
        ev = _parse(line, where, self.limits)
        if type(ev) is not dict:
            return "is not a JSON object"
        keys = ev.keys()
        labels = fmt.labels_attribute(self.manifest.get("labels"))
        expected = _ENVELOPE_KEYS | {"labels"} if labels is not None else _ENVELOPE_KEYS
        if keys != expected:
            missing = expected - keys
            if missing:
                return f"lacks attribute {sorted(missing)[0]!r}"
            return f"has unknown attribute {json.dumps(sorted(keys - expected)[0])}"
        if labels is not None and ev["labels"] != labels:
            return f"labels {_show(ev['labels'])} differ from the manifest's labels"
        got = ev["seq"]
        if type(got) is not int:
            return f"seq is {_show(got)}, not an integer"
        if got < seq:
            return f"seq {got} repeats or goes back (expected {seq})"
        if got > seq:
            return f"seq {got} leaves a gap (expected {seq})"
        run_id = self.manifest["run_id"]
        if ev["runid"] != run_id:
            return f"runid {_show(ev['runid'])} differs from the manifest's run_id"
        if ev["id"] != fmt.event_id(run_id, seq):
            return f"id {_show(ev['id'])} is not '{run_id}:{seq}'"
        if ev["source"] != self.manifest["source"]:
            return f"source {_show(ev['source'])} differs from the manifest's source"
        if ev["specversion"] != fmt.SPECVERSION:
            return f"specversion {_show(ev['specversion'])} is not '1.0'"
        if ev["datacontenttype"] != fmt.DATACONTENTTYPE:
            return f"datacontenttype {_show(ev['datacontenttype'])} is not {fmt.DATACONTENTTYPE!r}"
        if type(ev["subject"]) is not str:
            return "subject is not a string"
        if type(ev["time"]) is not str or not _TIME(ev["time"]):
            return f"time {_show(ev['time'])} is not an RFC 3339 UTC time with nine fraction digits"
        etype = ev["type"]
        check = schemas.DATA_CHECKERS.get(etype) if type(etype) is str else None
        if check is None:
            return f"unknown event type {_show(etype)}"
        bad = check(ev["data"])
        if bad is not None:
            return f"{etype} data {bad}"
        return self._position(ev, seq) or "is not a valid event"

    def _position(self, ev: dict[str, Any], seq: int) -> str | None:
        """run.started first and only once; nothing after run.finished."""
        etype = ev["type"]
        if seq == 0:
            if etype != fmt.RUN_STARTED:
                return f"the first event must be {fmt.RUN_STARTED}, not {etype}"
            return self._match_started(ev["data"])
        if etype == fmt.RUN_STARTED:
            return f"a second {fmt.RUN_STARTED}"
        if self.finished_at >= 0:
            return f"event after {fmt.RUN_FINISHED} (event {self.finished_at})"
        if etype == fmt.RUN_FINISHED:
            self.finished_at = seq
        return None

    def _match_started(self, data: dict[str, Any]) -> str | None:
        m = self.manifest
        for field in ("session_id", "command", "cwd", "detail"):
            if data[field] != m[field]:
                return f"{fmt.RUN_STARTED} {field} differs from the manifest"
        return None


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= 80 else text[:77] + "..."


class Bundle:
    """An opened bundle: its checked manifest, and a verifying event stream.

    `parallel`: the events may be checked on two CPUs, by a helper process forked for each pass
    (only for bundles of at least _PARALLEL_MIN compressed bytes, with a second CPU, and when this
    process runs no other thread). Pass False when the caller keeps the CPUs busy itself."""

    def __init__(
        self, path: str | os.PathLike[str], limits: Limits | None = None, *, parallel: bool = True
    ) -> None:
        self.path = str(path)
        self.limits = limits or Limits()
        self.parallel = parallel
        v = _Verifier(self.path, self.limits)
        for _ in v.run(manifest_only=True):
            pass
        self.manifest: dict[str, Any] = v.manifest

    def events(self) -> Generator[dict[str, Any], None, None]:
        """Every event, in sequence order, verifying as it goes; raises VerificationError (at the
        latest when exhausted) if anything is wrong. Close it to stop early."""
        return _Verifier(self.path, self.limits, parallel=self.parallel).run()

    def fold(self, start: Callable[[int], F]) -> Generator[F, None, None]:
        """The events, verified as by events(), folded a piece at a time: each piece's events go,
        in order, to the `feed` of a fresh start(seq) (seq: the piece's first event), which is then
        yielded; the folds come in order and together cover every event once. The pieces may be
        folded in a helper process (when `start` pickles and the pass is parallel): `start` and the
        folds it makes must then pickle, and must not depend on anything but the events they are
        fed. Raises VerificationError as events() does: a fold that came before it is worthless."""
        return _Verifier(self.path, self.limits, parallel=self.parallel, start=start).run()

    def verify(self) -> None:
        for _ in self.events():
            pass

    @property
    def run_id(self) -> str:
        return str(self.manifest["run_id"])


def open_bundle(
    path: str | os.PathLike[str], limits: Limits | None = None, *, parallel: bool = True
) -> Bundle:
    return Bundle(path, limits, parallel=parallel)


def read_manifest(path: str | os.PathLike[str], limits: Limits | None = None) -> dict[str, Any]:
    """The manifest of a bundle that passes full verification."""
    b = Bundle(path, limits)
    b.verify()
    return b.manifest


def read_events(path: str | os.PathLike[str], limits: Limits | None = None) -> Iterator[dict[str, Any]]:
    """The events of a bundle that passes full verification (checked in a first pass, then streamed
    in a second pass that verifies again, so a file changed in between is caught too)."""
    b = Bundle(path, limits)
    b.verify()
    return b.events()
