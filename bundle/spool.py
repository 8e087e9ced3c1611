"""The spool: correlated records streamed to disk as zstandard-compressed JSON lines.

The recorder appends records while the run goes on, so its memory stays flat however long the run;
the bundle writer reads the spool when the run ends (what the run id is made of is fed to it as the
records are written: `feed`). A record is a flat dict with "k" (kind)
and "t" (kernel time in ns since the epoch) plus the fields of its event's data: its type is one of
bundle/record_types.py's (`SpoolRecord`).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO

import orjson
import zstandard

from evidence.bundle.native import compiled
from evidence.bundle.record_types import SpoolRecord

_fast = compiled("evidence.bundle._fast")  # ZFile: the compressing thread that never takes the GIL


def spool_lines(records: Sequence[SpoolRecord | bytes]) -> bytes:
    """The spool's bytes of `records`: each record's JSON line (orjson's), an item that is bytes
    as it is (a spool line already, with its newline)."""
    dumps = orjson.dumps
    return b"".join(r if r.__class__ is bytes else dumps(r) + b"\n" for r in records)


class SpoolWriter:
    """`feed`, when given, is called with every batch of records as it is written (bytes items are
    spool lines already): the writer's Behaviour, so that the bundle's run id needs no pass here.

    Compressed on the writing thread while its batches are small; from the first batch of
    THREAD_AT bytes (a flood's), on a thread of its own, which zstandard's compression and the
    file's writes let go of the GIL for: 6-8% of the correlator's thread in a 2 x 1M distinct
    flood. One batch waits for it at most, and flush() waits until what was written before it is
    in the file. (zstandard's own thread, `threads=1`, took 0.1 s of 0.75 off the correlator's
    for 1M distinct records, and its wall grew by a third: it spins the writing thread while it
    waits.) An error of the thread's is raised by the next write, flush or close.

    With the compiled module, every batch is compressed and written by a C thread that never takes
    the GIL (src/fast/zfile.h ZFile, through a descriptor of its own): the Python thread took the
    GIL three times a batch from the correlator, which holds it all the while it works, and the
    correlator's thread was busy 72% of a flood's drain after its job, with most of a CPU idle."""

    THREAD_AT = 256 * 1024  # bytes of one batch's lines from which the compression is a thread's

    def __init__(
        self,
        path: str | Path,
        level: int = 1,  # (3 took a third more of the compressing thread for 6% fewer bytes)
        feed: Callable[[Sequence[SpoolRecord | bytes]], None] | None = None,
    ) -> None:
        self.path = Path(path)
        self.feed = feed
        # full detail's lines made as records are spooled (bundle/premade.py: Premade.add), if set:
        # given the records and their spool lines (bytes, joined)
        self.events: Callable[[Sequence[SpoolRecord | bytes], bytes], None] | None = None
        # a new file, never through a symlink or over one already there
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self._raw: IO[bytes] = os.fdopen(fd, "wb")
        self._c = None if _fast is None else _fast.ZFile(fd, level)
        self._level = level
        self._z: zstandard.ZstdCompressionWriter | None = None  # the Python path's (_zw)
        self.records = 0
        self._pieces: queue.Queue[bytes | threading.Event | None] = queue.Queue(maxsize=1)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def write(self, record: SpoolRecord) -> None:
        self.write_many([record])

    def write_many(self, records: Sequence[SpoolRecord | bytes]) -> None:
        """Append records; an item that is bytes is a record's line already (with its newline)."""
        if records:
            data = spool_lines(records)
            if self._c is not None:
                self._c.put([data])  # (waits while a batch is still queued; raises the thread's error)
            else:
                self._write(data)
            self.records += len(records)
            if self.feed is not None:
                self.feed(records)
            if self.events is not None:
                self.events(records, data)

    def _write(self, data: bytes) -> None:
        """The Python path's: compressed here while batches are small, then on `_compress`'s thread."""
        self._raise()
        if self._thread is None and len(data) >= self.THREAD_AT:
            self._thread = threading.Thread(target=self._compress, name="evidence-spool", daemon=True)
            self._thread.start()
        if self._thread is not None:
            self._pieces.put(data)  # (waits while a batch is still queued)
        else:
            self._zw().write(data)

    def _compress(self) -> None:
        while (piece := self._pieces.get()) is not None:
            try:
                if isinstance(piece, threading.Event):
                    if self._error is None:
                        self._zw().flush(zstandard.FLUSH_BLOCK)
                        self._raw.flush()
                    piece.set()
                elif self._error is None:
                    self._zw().write(piece)
            except Exception as e:  # noqa: BLE001 - raised on the writing thread (_raise)
                self._error = e
                if isinstance(piece, threading.Event):
                    piece.set()

    def _zw(self) -> zstandard.ZstdCompressionWriter:
        """The Python path's compressor, made when first used (the C thread's path needs none)."""
        if self._z is None:
            self._z = zstandard.ZstdCompressor(level=self._level).stream_writer(self._raw, closefd=False)
        return self._z

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def flush(self) -> None:
        if self._c is not None:
            self._c.flush()
            return
        if self._thread is not None:
            done = threading.Event()
            self._pieces.put(done)
            done.wait()
        else:
            self._zw().flush(zstandard.FLUSH_BLOCK)
            self._raw.flush()
        self._raise()

    def close(self) -> None:
        if self._c is not None:
            c, self._c = self._c, None  # (closed once: a second close does nothing)
            try:
                c.end()
            finally:
                c.close()
                self._raw.close()
            return
        if self._thread is not None:
            self._pieces.put(None)
            self._thread.join()
            self._thread = None
        if not self._raw.closed:
            self._zw().close()  # type: ignore[no-untyped-call]
            self._raw.close()
        error, self._error = self._error, None  # (said once)
        if error is not None:
            raise error

    def __enter__(self) -> SpoolWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_spool(path: str | Path) -> Iterator[SpoolRecord]:
    """The records of a spool, in order. Typed as what the recorder wrote (orjson gives untyped
    values: a spool is the recorder's own file, in a directory only it may write to)."""
    return map(orjson.loads, read_spool_lines(path))


def read_spool_lines(path: str | Path) -> Iterator[bytes]:
    """The lines of a spool, in order, each a record's JSON (what read_spool parses): for a reader
    that can tell lines apart without parsing them (the bundle writer's repeats, full detail)."""
    with open(path, "rb") as raw:
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_size=1 << 20)
        tail = b""
        while True:
            chunk = reader.read(1 << 20)
            if not chunk:
                break
            lines = (tail + chunk).split(b"\n")
            tail = lines.pop()
            yield from filter(None, lines)
        if tail.strip():
            yield tail
