"""Full detail's event lines made while the run records, so that its end has little left to do.

A full-detail bundle has one event per spooled record, in the spool's order, and an event's line
depends on the record, its sequence number and the run's constants: its labels and its run id. The
run id is known only when the run ends (it is made of everything the run did, bundle/run_id.py), and
so is the number of events before the records' (run.started and the run's degradations). `Premade`
is fed the records as the recorder spools them (SpoolWriter's `events`) and makes their lines as
the writer would (bundle/sink.py's FullWriter: the same batches, the same caps), numbered from the
count of head events known when the run started, with PLACEHOLDER where the run id goes. Their
content hashes, which depend on neither, go to a second file. Both are temporary files beside the
spool (bounded by the caps: at most Caps.decompressed bytes of lines).

With the compiled module, and unless the bundle is signed, the lines are made on a thread of the
Premade's own (`evidence-premade`) from the records' spool lines, which the spool hands over as it
takes them: bytes, which nothing changes, whose plain opens' events C makes with the GIL let go
(src/fast/lines.h), beside the correlator. The same batches and the same bytes as from the records
(tests/unit/test_premade.py); one batch waits for the thread at most. A signed bundle's trace reads
the records themselves: its lines are made on the correlator's thread, from them.

When the bundle is written (bundle/writer.py), the premade lines are used if what they assumed
holds: the same labels, the same number of head events, no cap reached (a signed bundle's trace,
which sees every event's data, is fed the spool's records again: sink.feed_trace). The run id replaces PLACEHOLDER (bytes no canonical JSON
line holds: orjson escapes every control character, and UTF-8 has no 0xff), by one translation of
each piece, and the lines go to the Deflater as they are; else the writer makes the events from the
spool, as it always did. Both give the same bytes (tests/unit/test_premade.py).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, cast

import orjson
import zstandard

from evidence.bundle.record_types import SpoolRecord
from evidence.bundle.sink import Caps, EventSink, FullWriter, Hashed, compiled
from evidence.bundle.spool import spool_lines

if TYPE_CHECKING:
    from evidence.bundle import runtime_trace

_fast = compiled()  # the C hot path: _marked, put_run_id

logger = logging.getLogger(__name__)

# Where a line's run id goes ("run-" and 32 hex digits: run_id.Behaviour.run_id): "run-" and 32
# distinct bytes that no canonical JSON line holds (the control characters but the newline, which
# orjson escapes, and 0xff, never in UTF-8), so that one bytes.translate puts the run's digits in:
# byte k of the placeholder becomes digit k, every other byte stays (translation_for).
_DIGITS = bytes(b for b in range(32) if b != 0x0A) + b"\xff"
PLACEHOLDER = b"run-" + _DIGITS
RUN_ID_LENGTH = len(PLACEHOLDER)


def translation_for(run_id: str) -> bytes | None:
    """The bytes.translate table that puts `run_id` in the placeholders; None for a run id of
    another form."""
    digits = run_id.removeprefix("run-").encode("ascii", "replace")
    if (
        not run_id.startswith("run-")
        or len(digits) != len(_DIGITS)
        or not all(c in b"0123456789abcdef" for c in digits)
    ):
        return None
    table = bytearray(range(256))
    for k, b in enumerate(_DIGITS):
        table[b] = digits[k]
    return bytes(table)


def put_run_id(lines: bytes, table: bytes) -> bytes:
    """`lines` with the run id in its placeholders (bytes.translate by `table`, translation_for's),
    in C without the GIL when built (src/fast/_fast.c: translate, a word at a time where it has no
    placeholder byte; 1.3 GB of a 2 x 1M flood's lines in 0.2 s, not 0.9)."""
    if _fast is not None:
        return cast(bytes, _fast.translate(lines, table))
    return lines.translate(table)


_STANDIN = "R" * RUN_ID_LENGTH  # the run id the sink is made with, then replaced by PLACEHOLDER
_OPEN_HEAD = b'{"k":"open","t":'  # a repeated open's spool line (agent/recorder/pipeline.py)
_WRITE_AT = 1 << 20  # bytes of lines gathered before a write to the file
_LEVEL = -3  # the files' zstandard level


class _File:
    """A temporary file written in large pieces: the sink's `out` (lines) or its `root` (the
    content hashes, one hex digest and a newline each, as format.RootHasher takes them). Stored as
    zstandard at level -3: a flood's lines are most of a full run's bytes (650 bytes an event, the
    run's constants in each, 1.3 GB for 2 x 1M opens), and written raw into the page cache they
    cost the correlator's thread up to 1.5 s for 600 MB where the pages had to be found (2 s of the
    10 s it spent on a 2 x 1M flood); compressed, about 19x, at 2.3 GB/s (level 1: 27x at 1.7
    GB/s, and the correlator waited 1.8 s of a 2 x 1M flood for this thread, which shares the CPUs
    with the job: 1.6 s at -3, the flood's whole run 9.1-9.3 -> 8.6 s). The compression and the
    writes are a thread's of their own, one piece queued at most, so that they run beside the
    correlator: with the compiled module a C thread that never takes the GIL (src/fast/zfile.h
    ZFile, through a descriptor of its own: a file closed under it never takes its bytes); else
    `_compress`, whose zstandard and writes let go of the GIL but which took it four times a piece
    from a correlator holding it (it waited 2.5 s of a 2 x 1M flood for it, and the correlator 1.6 s
    for it). Read back at 3 GB/s. (zstandard's own thread, `threads=1`, spins the writing one while
    it waits.)"""

    def __init__(self, tmp_dir: Path | None, defers: bool = False) -> None:
        self.file: IO[bytes] = tempfile.TemporaryFile(dir=tmp_dir)  # noqa: SIM115 - closed by close()
        # the C writer: a thread that never takes the GIL (src/fast/zfile.h); else `_compress`'s
        self._c = None if _fast is None else _fast.ZFile(self.file.fileno(), _LEVEL)
        self._z: zstandard.ZstdCompressionObj | None = None  # the Python path's (_zo)
        # the content hashes' file: the C path's hashes are taken unhashed (sink.Hashed) and hashed
        # on this file's thread, without the GIL (src/fast/_fast.c hash_cores), not the correlator's
        self.defers = defers and _fast is not None
        self._buf: list[Hashed] = []
        self._size = 0
        self._queue: queue.Queue[list[Hashed] | None] = queue.Queue(maxsize=1)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._ended = False

    def _zo(self) -> zstandard.ZstdCompressionObj:
        """The Python path's compressor, made when first used (the C thread's path needs none)."""
        if self._z is None:
            self._z = zstandard.ZstdCompressor(level=_LEVEL).compressobj()
        return self._z

    def feed(self, data: bytes) -> None:
        self._buf.append(data)
        self._size += len(data)
        if self._size >= _WRITE_AT:
            self.flush()

    def compressed_bound(self) -> int:
        """0: the compressed cap is checked on the real bytes when the bundle is written."""
        return 0

    def add(self, chash: str) -> None:
        self.feed(chash.encode("ascii") + b"\n")

    def add_many(self, chashes: list[str]) -> None:
        chashes.append("")
        self.feed("\n".join(chashes).encode("ascii"))
        chashes.pop()

    def add_lines(self, lines: bytes) -> None:
        self.feed(lines)

    def add_deferred(self, pieces: list[Hashed]) -> None:
        """Content hashes, as lines or as the C path deferred them (a batch's cores and ends)."""
        self._buf += pieces
        self._size += sum(len(p) if isinstance(p, bytes) else len(p[1]) // 8 * 65 for p in pieces)
        if self._size >= _WRITE_AT:
            self.flush()

    def flush(self) -> None:
        """What was fed handed to the compressing thread (started with the first piece)."""
        if self._buf:
            if self._ended:
                raise ValueError("written after it was read")
            if self._c is not None:
                self._c.put(self._buf)  # (waits while a piece is still queued; raises its thread's error)
                self._buf = []
                self._size = 0
                return
            if self._error is not None:
                raise self._error
            if self._thread is None:
                self._thread = threading.Thread(target=self._compress, name="evidence-premade", daemon=True)
                self._thread.start()
            self._queue.put(self._buf)  # (waits while a piece is still queued)
            self._buf = []
            self._size = 0

    def _compress(self) -> None:
        while (pieces := self._queue.get()) is not None:
            if self._error is None:
                try:
                    piece = b"".join(
                        p if isinstance(p, bytes) else _fast.hash_cores(*p)  # (deferred: the GIL let go)
                        for p in pieces
                    )
                    self.file.write(self._zo().compress(piece))
                except Exception as e:  # noqa: BLE001 - said by flush or end, on the feeding thread
                    self._error = e

    def _stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def end(self) -> None:
        """Nothing is written after: the last bytes compressed and written (an error raised here,
        not when the bundle reads it)."""
        if self._ended:
            return
        self.flush()
        self._ended = True
        if self._c is not None:
            self._c.end()  # the frame ended
            if self.file.closed:  # (written through a descriptor of its own: not read back now)
                raise ValueError("the premade file was closed")
            return
        self._stop()
        if self._error is not None:
            raise self._error
        self.file.write(self._zo().flush())  # the frame ended (the file stays open)
        self.file.flush()

    def read(self, size: int) -> Iterator[bytes]:
        """The file from its start, in pieces of `size` bytes (the last: what is left)."""
        self.end()
        self.file.seek(0)
        reader = zstandard.ZstdDecompressor().stream_reader(self.file, read_size=1 << 20, closefd=False)
        while True:
            chunk = reader.read(size)
            while chunk and len(chunk) < size:  # (a read may return less: filled to its size)
                more = reader.read(size - len(chunk))
                if not more:
                    break
                chunk += more
            if not chunk:
                return
            yield chunk

    def close(self) -> None:
        self._buf.clear()
        self._ended = True
        if self._c is not None:
            self._c.close()
        self._stop()
        self.file.close()


@dataclasses.dataclass
class Made:
    """What a Premade made, for the writer: its lines and content hashes (files), the events'
    size, next seq and counts, and what they assumed (`usable` checks it)."""

    labels: dict[str, str]
    head: int
    caps: Caps
    size: int
    seq: int
    counts: dict[str, int]
    largest: int  # the most bytes of lines one batch took in (the writer's margin on the compressed cap)
    ok: bool  # nothing failed, no cap reached
    lines: _File
    hashes: _File
    # a signed bundle's runtime trace, fed the records' events as they came (None: not signed)
    trace: runtime_trace.Trace | None = None

    def usable(self, labels: Mapping[str, str], head: int, caps: Caps | None) -> bool:
        """Whether the lines are the bundle's: what they assumed holds."""
        why = (
            "it failed or reached a cap"
            if not self.ok
            else "its labels changed"
            if dict(labels) != self.labels
            else f"{head} events before its records, not {self.head}"
            if head != self.head
            else "other caps"
            if (caps or Caps()) != self.caps
            else None
        )
        if why is not None:
            logger.info(
                "full detail's lines made as the run went are not used (%s): made from the spool", why
            )
        return why is None

    def close(self) -> None:
        self.lines.close()
        self.hashes.close()


class Premade:
    """A full-detail run's event lines, made as its records are spooled (`add`)."""

    def __init__(
        self,
        tmp_dir: Path | None,
        labels: Mapping[str, str],
        head: int,
        caps: Caps | None = None,
        *,
        signed: bool = False,
    ) -> None:
        self.caps = caps or Caps()
        self.signed = signed  # the bundle will be signed: its trace is fed as the lines are made
        self.lines = _File(tmp_dir)
        self.hashes = _File(tmp_dir, defers=True)
        self.capped: dict[str, int] = {}
        self.failed = False
        self.ended = False
        self._lock = threading.Lock()  # the lines made on one thread, restart() on others
        # the spool lines' batches to make lines of, on `_thread` (one queued at most), or None:
        # made on the correlator's (no compiled module, or a signed bundle's trace to feed)
        self._queue: queue.Queue[bytes | None] | None = None if signed or _fast is None else queue.Queue(1)
        self._thread: threading.Thread | None = None
        self._start(labels, head)

    @property
    def from_lines(self) -> bool:
        """Whether the lines are made from the spool's lines alone (on the Premade's thread), so
        that a plain open may be spooled as its line, never a dict (agent/recorder/pipeline.py)."""
        return self._queue is not None

    def _start(self, labels: Mapping[str, str], head: int) -> None:
        self.labels = dict(labels)
        self.head = head  # events before the records' (run.started, degradations): their seq start
        self.sink = EventSink(self.lines, _STANDIN, self.labels, self.caps, self.hashes)
        standin = _STANDIN.encode()
        self.sink._id = self.sink._id.replace(standin, PLACEHOLDER)
        self.sink._runid = self.sink._runid.replace(standin, PLACEHOLDER)
        self.sink._source = self.sink._source.replace(standin, PLACEHOLDER)
        self.sink.seq = head
        if self.signed:  # (FullWriter feeds it each batch's records: sink.feed_trace)
            from evidence.bundle import runtime_trace

            self.sink.trace = runtime_trace.Trace()
        self._full = FullWriter(self.sink, self.capped)
        self._made = False  # whether any record came

    def restart(self, labels: Mapping[str, str], head: int) -> None:
        """The run's labels or its head events changed (a degradation said, labels set): the
        lines are made with them if no record came yet (the usual case: a run's set-up degrades
        before its command runs); else the lines stay as they are, and the writer will not use them."""
        with self._lock:
            if not self._made and not self.failed and (dict(labels) != self.labels or head != self.head):
                self._start(labels, head)

    def add(self, recs: Sequence[SpoolRecord | bytes], lines: bytes | None = None) -> None:
        """Records as they are spooled, in order; an item that is bytes is a spool line that repeats
        the record before it but for its time (agent/recorder/pipeline.py: a repeated open).
        `lines`: their spool lines, joined (SpoolWriter's), made here when not given."""
        if self.failed or self.ended or not recs:
            return
        if self._queue is None:
            self._add(recs, marked=False)
            return
        if lines is None:
            lines = spool_lines(recs)
        with self._lock:
            self._made = True
        if self._thread is None:
            self._thread = threading.Thread(target=self._make, name="evidence-premade", daemon=True)
            self._thread.start()
        self._queue.put(lines)  # (waits while a batch is still queued)

    def _add(self, items: Sequence[SpoolRecord | int | bytes], marked: bool = True) -> None:
        """`items` made into lines (FullWriter's items; else records and repeats' lines as the
        spool took them, marked here): whatever fails gives the lines up, never the recording."""
        with self._lock:
            self._made = True
            try:
                self._full.add(items if marked else _marked(cast("Sequence[SpoolRecord | bytes]", items)))
            except Exception:  # never in the way of the recording: the writer reads the spool instead
                logger.exception("full detail's lines could not be made as the run went: made at its end")
                self.fail()

    def _make(self) -> None:
        """The thread's: the lines' batches made in order (a spool line a record: FullWriter's items)."""
        assert self._queue is not None
        while (lines := self._queue.get()) is not None:
            if self.failed:
                continue  # (taken off the queue all the same: add() and end() never wait on it)
            try:
                items = lines.split(b"\n")
                if not items[-1]:
                    items.pop()  # (after the last newline)
                self._add(items)
            except BaseException:  # (what _add does not catch, MemoryError: given up, the queue still read)
                logger.exception("full detail's lines could not be made as the run went: made at its end")
                self.fail()

    def _stop(self) -> None:
        """The thread's batches made, and the thread gone (not called on it)."""
        if self._thread is not None and self._thread is not threading.current_thread():
            assert self._queue is not None
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def fail(self) -> None:
        self.close()

    def end(self) -> bool:
        """No record comes after: write the last batch. Whether the lines can be used (no cap
        reached, nothing failed)."""
        if not self.failed and not self.ended:
            self.ended = True
            self._stop()
            if self.failed:  # (on the thread)
                return False
            try:
                self._full.end()
                self.lines.end()
                self.hashes.end()
            except Exception:
                logger.exception("full detail's last lines could not be made: made at the run's end")
                self.fail()
        return not self.failed and not self.capped

    def made(self) -> Made:
        """What it made, for the writer (after end())."""
        ok = self.end()
        return Made(
            self.labels,
            self.head,
            self.caps,
            self.sink.size,
            self.sink.seq,
            dict(self.sink.counts),
            self._full.largest,
            ok,
            self.lines,
            self.hashes,
            self.sink.trace,
        )

    def close(self) -> None:
        self.failed = True  # its files are gone: never used after
        self._stop()  # (the thread makes nothing more: failed)
        self.lines.close()
        self.hashes.close()


def _marked(recs: Sequence[SpoolRecord | bytes]) -> list[SpoolRecord | int]:
    """The records as FullWriter takes them: a repeated open's line as its time alone (the digits
    after its kind; int() refuses anything else, and any other line is parsed). In C when built
    (src/fast/_fast.c: marked, digits alone; any other line goes to _line_marked)."""
    if _fast is not None and recs.__class__ is list:
        return cast("list[SpoolRecord | int]", _fast.marked(recs, _OPEN_HEAD, _line_marked))
    head = len(_OPEN_HEAD)
    return [
        (int(r[head : r.find(b",", head)]) if r.startswith(_OPEN_HEAD) else orjson.loads(r))
        if isinstance(r, bytes)
        else r
        for r in recs
    ]


def _line_marked(line: bytes) -> SpoolRecord | int:
    """_marked of one line."""
    head = len(_OPEN_HEAD)
    if line.startswith(_OPEN_HEAD):
        return int(line[head : line.find(b",", head)])
    return cast(SpoolRecord, orjson.loads(line))
