"""The fast path over pieces of events, and the forked helper process that runs it on a second CPU."""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import logging
import mmap
import multiprocessing
import os
import pickle
import signal
import struct
import sys
import threading
import types
import typing
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any, Protocol

import orjson

from evidence.bundle import container, native, schemas
from evidence.bundle import format as fmt
from evidence.bundle.read_types import EventJSON

logger = logging.getLogger(__name__)

_IN_FLIGHT = 4  # pieces with the helper process, not answered yet
TIME = schemas.py_regex(schemas.TIME_PATTERN).match  # a valid event time (verify.py checks with it too)

# --- the fast path -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Context:
    """What the fast path needs to know about a bundle (picklable, small)."""

    run_id: str
    source: str
    line: int  # the line length limit
    labels: str | None = None  # the `labels` attribute every event carries, when the run has labels

    @property
    def id_prefix(self) -> str:
        return self.run_id + ":"


@dataclasses.dataclass
class Passed:
    """What passed the fast path, in order: the root hash and the counts take it in."""

    hashes: list[str] = dataclasses.field(default_factory=list)  # their content hashes (hex)
    counts: dict[str, int] = dataclasses.field(default_factory=dict)  # by type

    @property
    def n(self) -> int:
        """Events (each has its content hash)."""
        return len(self.hashes)

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


def _envelope_parts(ctx: Context) -> tuple[bytes, bytes, bytes]:
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


_ERRORS = (orjson.JSONDecodeError, orjson.JSONEncodeError, AttributeError, KeyError, TypeError)
_verify = native.compiled("evidence.bundle._verify")  # `fast`'s loop in C (src/fast/_verify.c)

# the data checks of the C path: each type's model as a spec _verify.valid reads, the same tests as
# schemas.compile_checker's (exact types, literals of the same type, unions, lists, dicts of str
# keys, the time pattern on the time fields); a model with a field it cannot say: its Python check
_T_STR, _T_INT, _T_BOOL, _T_NONE, _T_LIT, _T_UNION, _T_LIST, _T_DICT = range(8)
_Spec = tuple[Any, ...]


def _test(ann: Any) -> _Spec | None:
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if ann is str:
        return (_T_STR,)
    if ann is int:
        return (_T_INT,)
    if ann is bool:
        return (_T_BOOL,)
    if ann is type(None):
        return (_T_NONE,)
    if origin is typing.Literal:
        return (_T_LIT, args) if all(type(a) in (str, int, bool) for a in args) else None
    if origin in (typing.Union, types.UnionType):
        parts = [_test(a) for a in args]
        return None if None in parts else (_T_UNION, tuple(parts))
    if origin is list and len(args) == 1:
        item = _test(args[0])
        return None if item is None else (_T_LIST, item)
    if origin is dict and len(args) == 2 and args[0] is str:
        value = _test(args[1])
        return None if value is None else (_T_DICT, value)
    return None


def _spec(model: Any) -> _Spec | None:
    fields = []
    for name, field in model.model_fields.items():
        test = _test(field.annotation)
        if test is None or (name in schemas.TIME_FIELDS and field.annotation is not str):
            return None
        fields.append((name, field.is_required(), name in schemas.TIME_FIELDS, test))
    return tuple(fields)


_SPECS = {etype: spec for etype, model in fmt.DATA_MODELS.items() if (spec := _spec(model)) is not None}


def fast(lines: list[bytes] | bytes, seq: int, ctx: Context, passed: Passed) -> Iterator[EventJSON]:
    """The fast path over `lines` (a list, or a piece: bytes of lines each ending with a newline,
    which the C reads in place), the first of which is event `seq`: makes every check the careful
    path makes, yields each event that passes (adding it to `passed`) and stops at the first that
    does not, without saying why; and at the first event whose place in the run needs checking (the
    first event, run.started, run.finished). The caller goes on from there with the careful path.
    In C when built (src/fast/_verify.c: the same steps, in the same order, with the same
    functions); `fast_python`, the reference, otherwise."""
    if _verify is None:
        return fast_python(split(lines) if isinstance(lines, bytes) else lines, seq, ctx, passed)
    return _fast_c(lines, seq, ctx, passed)


def split(piece: bytes) -> list[bytes]:
    """A piece's lines (each ends with a newline; what follows the last is no line)."""
    lines = piece.split(b"\n")
    lines.pop()
    return lines


def shape(piece: bytes) -> tuple[int, int]:
    """A piece's (lines, the longest line's length), without a list of its lines when built."""
    if _verify is None:
        lines = split(piece)
        return len(lines), max(map(len, lines), default=0)
    n, most = _verify.shape(piece)
    return int(n), int(most)


def _fast_c(lines: list[bytes] | bytes, seq: int, ctx: Context, passed: Passed) -> Iterator[EventJSON]:
    if seq == 0:
        return iter(())
    if seq + len(lines) > sys.maxsize:  # seqs past what the C counts in (no bundle has as many)
        return fast_python(split(lines) if isinstance(lines, bytes) else lines, seq, ctx, passed)
    it: Iterator[EventJSON] = _verify.lines(
        lines if type(lines) in (list, bytes) else list(lines),
        seq,
        *_envelope_parts(ctx),
        _CORE_MIDDLE,
        _TYPES,
        _SPECS,
        orjson.loads,
        orjson.dumps,
        orjson.OPT_SORT_KEYS,
        TIME,
        passed.hashes,
        passed.counts,
        _ERRORS,
        (fmt.DATACONTENTTYPE, ctx.id_prefix, ctx.labels, ctx.run_id, ctx.source, fmt.SPECVERSION),
    )
    return it


def fast_python(lines: list[bytes], seq: int, ctx: Context, passed: Passed) -> Iterator[EventJSON]:
    """`fast` in Python: the reference the C path matches."""
    before_id, before_seq, before_subject = _envelope_parts(ctx)
    types = _TYPES
    loads = orjson.loads
    dumps = orjson.dumps
    sort = orjson.OPT_SORT_KEYS
    is_time = TIME
    sha256 = hashlib.sha256
    join = b"".join
    add_hash = passed.hashes.append
    counts = passed.counts
    errors = _ERRORS
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
        seq += 1
        yield ev


class Fold(Protocol):
    """What `Bundle.fold` folds the events of one piece of the stream into."""

    def feed(self, ev: EventJSON, /) -> None: ...


Start = Callable[[int], Fold]  # the fold for the events from seq on


def check_piece(lines: list[bytes], seq: int, ctx: Context, start: Start | None) -> _Answer | None:
    """The fast path over all of `lines`, folding the events into start(seq) when given: the answer
    if every event passed, else None (the careful path then says why)."""
    if lines and max(map(len, lines)) > ctx.line:
        return None
    passed = Passed()
    events = fast(lines, seq, ctx, passed)
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


def serve(inbox: Connection, outbox: Connection, parent_ends: list[Connection], shared: mmap.mmap) -> None:
    """The helper process: runs the fast path (and the fold, if any) on the pieces it is sent,
    answers each in order. A piece's bytes are in `shared`; the pipe says where."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles ^C and closes the pipes
    for end in parent_ends:
        end.close()
    try:
        ctx = Context(*orjson.loads(inbox.recv_bytes()))  # run_id, source, line, labels
        start = pickle.loads(inbox.recv_bytes())  # noqa: S301 - our parent's own object, not the bundle's
        while True:
            seq, offset, size = _WHERE.unpack(inbox.recv_bytes())
            lines = shared[offset : offset + size].split(b"\n")
            lines.pop()
            outbox.send((seq, check_piece(lines, seq, ctx, start)))
    except (EOFError, OSError):  # the parent is done, or gone
        return
    except Exception as e:  # a fold that fails, an answer that does not pickle: the parent checks
        logger.debug("bundle-verify helper: %r", e)  # the piece itself (and raises in order)
        return


_ANSWERS_PIPE = 1 << 20  # bytes: an answer carries a piece's content hashes (about 100 KiB)
_WHERE = struct.Struct("<QQQ")  # a piece for the helper: its seq, its offset and size in the shared map


class Helper:
    """A forked process that runs the fast path over some of the pieces, on another CPU. Only an
    accelerator: the parent keeps every piece it hands over and checks it itself if the helper
    fails in any way.

    A piece travels through a memory map shared with the helper (a slot per piece in flight), and
    the pipe carries only where it is: copying a gigabyte through a pipe costs more CPU than
    checking a good part of it. The messages to the helper are that small and there are at most
    _IN_FLIGHT of them unread, so sending never waits for the helper (which may be waiting for this
    process to take an answer)."""

    def __init__(self) -> None:
        self._slot = container.CHUNK + fmt.MAX_LINE  # a piece is at most a chunk and the rest of a line
        self._shared = mmap.mmap(-1, self._slot * _IN_FLIGHT)  # shared with the child after fork
        self._free = list(range(_IN_FLIGHT))
        mp = multiprocessing.get_context("fork")
        inbox, self._send = mp.Pipe(duplex=False)
        self._recv, outbox = mp.Pipe(duplex=False)
        self._proc = mp.Process(
            target=serve,
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
        self.in_flight: collections.deque[tuple[Piece, int]] = collections.deque()  # with its slot
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

    def start(self, ctx: Context, start: bytes) -> None:
        """What the helper checks against (sent once the manifest is known), and the pickled
        start of the fold it runs (a pickled None: none)."""
        if self._message(orjson.dumps([ctx.run_id, ctx.source, ctx.line, ctx.labels])):
            self._message(start)

    def takes(self, piece: Piece) -> bool:
        """Whether the helper can take this piece now."""
        return bool(self._free) and not self.broken and piece.fatal is None and len(piece.data) <= self._slot

    def submit(self, piece: Piece) -> None:
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
class Piece:
    """Whole lines of events.ndjson (or a problem found while reading them), on their way."""

    data: bytes
    seq: int  # line number of the first line (0-based)
    fatal: container.Fatal | None = None
    remote: bool = False  # with the helper, not answered yet
    checked: bool = False  # the fast path has run over it (in the helper or here)
    answer: _Answer | None = None  # the fast path's, if all lines passed
    _lines: list[bytes] | None = None

    @property
    def lines(self) -> list[bytes]:
        """Its lines as a list (made when first asked: the C reads them in the piece itself)."""
        if self._lines is None:
            self._lines = split(self.data)
        return self._lines

    @functools.cached_property
    def shape(self) -> tuple[int, int]:
        """(its lines, the longest line's length) (bytes.count alone costs more than split)."""
        return shape(self.data)

    def drop_lines(self) -> None:
        self._lines = None
