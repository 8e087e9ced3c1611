"""The ring buffer's consumer: a poller thread and a correlator thread, from the kernel's records to
each run's spool.

- poller: waits on the ring buffer (wakeups are batched by the probes, and it polls on a short timer),
  lets records gather a few milliseconds after a wakeup (GATHER_SECONDS), reads the raw records in
  batches of at most READ_RECORDS and hands them to a queue: in memory up to HELD_RECORDS, past it
  written to a spill file and read back by the correlator in order. When that is full too
  (SPILL_BYTES) it stops reading, so back-pressure lands in the kernel's ring buffer, where every
  record that does not fit is counted as lost, per run and kind. Nothing is dropped in user space.
- correlator: takes the batches waiting in the queue together (COALESCE), decodes them (opens, the
  bulk of any run, in one unpack each), routes records to their run by slot, correlates them and appends
  the results to the run's zstandard spool on disk, so memory stays flat however long the run is.
  It flushes every spool with new records at least once a second (FLUSH_SECONDS), so a recorder
  killed outright loses at most about a second of records.

`Pipeline` is the base of agent/recorder/recording.py's `Recorder`, which starts and finishes runs.
"""

from __future__ import annotations

import array
import ctypes
import logging
import os
import queue
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import orjson

from evidence.agent.recorder import decode as dec
from evidence.agent.recorder import exe_hash
from evidence.agent.recorder.correlate import Correlated
from evidence.agent.recorder.session import Session
from evidence.bundle.record_types import SpoolRecord
from evidence.bundle.records import SUMMARY_KEYS, summary_key
from evidence.bundle.sink import compiled
from evidence.bundle.spool import SpoolWriter

if TYPE_CHECKING:
    from evidence.bundle.run_id import Behaviour
    from evidence.probes.loader import RecorderProbes

logger = logging.getLogger(__name__)

POLL_MS = 50
# batches (or spilled batches) read from the ring and not yet correlated, at most: what bounds their
# memory is HELD_RECORDS (the rest are on disk, a small _Spilled each) and SPILL_BYTES. (256 was
# reached by a 2 x 1M distinct flood on a busy machine, batches of ~3,000 records: the poller waited
# with the ring buffer filling, and it lost records while the spill file had room.)
QUEUE_BATCHES = 4096
# Raw records held in memory between the poller and the correlator, at most: past it, batches go to
# a file beside the spools (a _Spilled stands for each in the queue, in order) and come back when
# the correlator reaches them, so a flood the correlator is behind on costs disk, not memory. Past
# SPILL_BYTES on disk the poller waits (back-pressure goes to the ring buffer, which counts loss).
# (32,768: about 8 MB of bytes objects; 131,072 held 30 MB more of a flood's peak RSS, and reading a
# batch back costs the correlator a pread and a slice a record, about 1% of what it does with them)
HELD_RECORDS = int(os.environ.get("EVIDENCE_HELD_RECORDS", "32768"))
SPILL_BYTES = 4 * 1024 * 1024 * 1024
# Raw records the poller reads from the ring buffer at a time, at most: a poller that comes back to
# a full ring (64 MiB, ~300,000 opens) took 65,536 at a time, 15 MB of bytes objects and their spill
# written from a copy of them, the largest of a flood's peaks of memory
READ_RECORDS = 8192
GATHER_SECONDS = 0.005  # after a wakeup, the poller waits this long before it reads (see _poll_loop)
COALESCE = 8192  # records: the correlator processes the batches waiting in the queue together, up to this
# (a batch's records, their spool lines and event lines are in memory together, and its event lines
# twice more while they are compressed, one piece queued and one compressing (bundle/premade.py):
# 8,192 distinct opens are about 20 MB in all, 16,384 twice that; 65,536 made a flood's peak RSS
# 80 MB higher than 16,384, for no less CPU, and 8,192 costs no more CPU than 16,384 either)
# Each run's spool is flushed to disk at least this often while records arrive (and within this
# long after the last ones): a recorder killed with SIGKILL leaves at most about this much unwritten.
FLUSH_SECONDS = 1.0
# kinds under the cap on distinct summary keys (bundle/records.py: summary_key). File changes are not
# aggregated in the kernel (far rarer than opens): every one is a plain record, summarised by the
# writer, under the same cap on distinct keys (change_past_cap)
_CAPPED = ("open", "connect", "change", "dns")  # dns: plain records too (dns_past_cap)
# what is kept of a key's first record, to write its count when the run ends
_FIRST_FIELDS = {k: (*SUMMARY_KEYS[k], "k", "pid") for k in _CAPPED}
_FIRST_FIELDS["connect"] += ("names", "other_names")  # ---- dns: what the run's DNS answers named the address

DRAIN_SECONDS = 30  # how long finish waits for a consumer that finishes no batch (stuck) to spool the rest


class _Spilled:
    """A batch of raw records written to the spill file (`count` of them, at `offset`: their
    lengths, 4 bytes each, then their bytes), in its place in the queue."""

    __slots__ = ("count", "offset", "size")

    def __init__(self, offset: int, count: int, size: int) -> None:
        self.offset, self.count, self.size = offset, count, size


def _split(data: bytes, count: int) -> list[bytes]:
    """A spilled batch's records: `count` lengths (array "I"), then their bytes. In C when built
    (src/fast/_fast.c: spilled; 0.2 us a record here, on the correlator's thread)."""
    if _fast is not None:
        return cast("list[bytes]", _fast.spilled(data, count))
    if not 0 <= count <= len(data) // 4:
        raise ValueError("fewer lengths than records")
    lengths = array.array("I")
    lengths.frombytes(data[: 4 * count])
    out: list[bytes] = []
    at = 4 * count
    for n in lengths:
        out.append(data[at : at + n])
        at += n
    return out


class _Spill:
    """The poller's overflow: batches of raw records in a file, read back in order by the
    correlator. The file is emptied whenever every batch in it has been read back."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self.file: int | None = None
        self.end = 0  # where the next batch goes
        self.waiting = 0  # batches written and not read back
        self.lock = threading.Lock()

    def write(self, batch: list[bytes]) -> _Spilled:
        lengths = array.array("I", map(len, batch))
        data = b"".join(batch)
        size = len(lengths) * lengths.itemsize + len(data)
        with self.lock:
            if self.file is None:
                if self.directory is not None:
                    self.directory.mkdir(parents=True, exist_ok=True)
                fd, name = tempfile.mkstemp(prefix=".evidence-spill-", dir=self.directory)
                os.unlink(name)  # (the recorder's alone, gone with it)
                self.file = fd
            offset = self.end
            self.end += size
            self.waiting += 1
            fd = self.file
        # (the lengths and the records not joined again: the batch is in memory once more, not twice)
        os.pwritev(fd, [lengths, data], offset)
        return _Spilled(offset, len(batch), size)

    def read(self, item: _Spilled) -> list[bytes]:
        assert self.file is not None
        data = os.pread(self.file, item.size, item.offset)
        out = _split(data, item.count)
        with self.lock:
            self.waiting -= 1
            if not self.waiting:  # every batch read back: the file starts again
                self.end = 0
                os.ftruncate(self.file, 0)
        return out

    def close(self) -> None:
        with self.lock:
            if self.file is not None:
                os.close(self.file)
                self.file = None


class Pipeline:
    """The consumer's threads and the table of runs they route records to (by slot)."""

    probes: RecorderProbes
    spool_dir: Path

    def _start_pipeline(self) -> None:
        self._sessions: dict[int, Session] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[list[bytes] | _Spilled | threading.Event | None] = queue.Queue(QUEUE_BATCHES)
        self._held = 0  # raw records in the queue's batches (not spilled)
        self._held_lock = threading.Lock()
        self._spill = _Spill(getattr(self, "spool_dir", None))
        self._barriers: queue.SimpleQueue[threading.Event] = queue.SimpleQueue()
        self._stop = threading.Event()
        self.stats = {"records": 0, "batches": 0, "stray": 0, "decode_errors": 0, "failed_batches": 0}
        self._ring = self.probes.ring()
        if _fast is not None and hasattr(self._ring, "fast_read"):  # (a test's ring may be another)
            self._ring.fast_read = _fast.ring_read
        self._poller = threading.Thread(target=self._poll_loop, name="evidence-poller", daemon=True)
        self._worker = threading.Thread(target=self._work_loop, name="evidence-correlator", daemon=True)
        self._poller.start()
        self._worker.start()

    def drain(self, timeout: float = DRAIN_SECONDS) -> bool:
        """Return once every record the kernel had written before this call is in its spool: True,
        or False when the consumer did not get there within `timeout` (stuck, or dead)."""
        ev = threading.Event()
        self._barriers.put(ev)
        self._ring.wake()
        # a consumer that is behind but correlating (a flood) is waited for: `timeout` is how long
        # it may go without finishing a batch
        done = self.stats["batches"]
        deadline = time.monotonic() + timeout
        while not ev.wait(timeout=min(1.0, max(0.0, deadline - time.monotonic()))):
            if self.stats["batches"] != done:
                done = self.stats["batches"]
                deadline = time.monotonic() + timeout
            elif time.monotonic() >= deadline:
                logger.warning("drain timed out: the consumer is stuck")
                return False
        return True

    def _stop_pipeline(self) -> None:
        self._stop.set()
        self._ring.wake()
        self._poller.join(timeout=2)
        try:  # (a full queue and a correlator that is gone must not hang the end of a run)
            self._queue.put(None, timeout=5)
        except queue.Full:
            logger.warning("the correlator does not take its queue: not waiting for it")
        self._worker.join(timeout=5)
        if not self._worker.is_alive():
            self._spill.close()

    def queue_depth(self) -> int:
        """Batches read from the ring buffer and not yet correlated (consumer lag)."""
        return self._queue.qsize()

    def _drain_ring(self) -> None:
        while True:
            batch = self._ring.read(READ_RECORDS)
            if not batch:
                return
            item: list[bytes] | _Spilled = batch
            if self._held + len(batch) > HELD_RECORDS and self._spill.end < SPILL_BYTES:
                try:
                    item = self._spill.write(batch)
                except OSError as e:  # (a full disk: held in memory, as before)
                    logger.warning("cannot spill raw records to disk: %s", e)
            if item is batch:
                with self._held_lock:
                    self._held += len(batch)
            self._queue.put(item)  # blocks when full: back-pressure goes to the ring buffer

    def _taken(self, item: list[bytes] | _Spilled) -> list[bytes]:
        """A batch the correlator took from the queue, read back if it was spilled."""
        if isinstance(item, _Spilled):
            return self._spill.read(item)
        with self._held_lock:
            self._held -= len(item)
        return item

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            try:
                if self._barriers.empty():
                    self._ring.wait(POLL_MS)
                    # let records gather: one read of many, not many reads of a few (a kernel wakeup
                    # comes every WAKEUP_EVERY records, and each read and batch has a cost of its own)
                    self._stop.wait(GATHER_SECONDS)
                self._drain_ring()
                if not self._barriers.empty():
                    barriers = []
                    while not self._barriers.empty():
                        barriers.append(self._barriers.get())
                    self._drain_ring()  # everything written before the barrier was asked for
                    for b in barriers:
                        self._queue.put(b)
            except Exception:  # pragma: no cover - keep recording whatever happens
                logger.exception("ring buffer poll failed")
                time.sleep(0.1)

    def _work_loop(self) -> None:
        next_flush = time.monotonic() + FLUSH_SECONDS
        while True:
            try:
                item = self._queue.get(timeout=FLUSH_SECONDS / 2)
            except queue.Empty:
                pass
            else:
                waiting = (
                    self._process_waiting(self._taken(item)) if isinstance(item, list | _Spilled) else [item]
                )
                for after in waiting:
                    if after is None:
                        return
                    after.set()
            now = time.monotonic()
            if now >= next_flush:
                self._flush_spools()
                next_flush = now + FLUSH_SECONDS

    def _process_waiting(self, batch: list[bytes]) -> list[threading.Event | None]:
        """Process `batch` together with the batches queued behind it (up to COALESCE records): a
        consumer that keeps up reads the ring buffer often, a few records at a time, and each batch
        has a cost of its own. Returns the barrier or stop that ended the run of batches, if one
        did, for the caller to handle after them (a barrier still follows every record read
        before it)."""
        after: list[threading.Event | None] = []
        while len(batch) < COALESCE:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if not isinstance(item, list | _Spilled):
                after.append(item)
                break
            batch += self._taken(item)
        try:
            self._process(batch)
        except Exception:  # a bug must not stop the recording, nor hang the run at its end
            logger.exception("correlating a batch of %d records failed: they are not recorded", len(batch))
            self.stats["failed_batches"] += 1
            with self._lock:
                for session in self._sessions.values():  # whose they were is not known: every live run's
                    if not session.finished:
                        session.failed += len(batch)
        return after

    def _flush_spools(self) -> None:
        """Flush the spools written to since the last flush (on the correlator thread, the only one
        that writes to a live run's spool; a finished run's spool is closed by finish()), and hand
        the allocator's free pages back (release_free_memory)."""
        written = False
        with self._lock:  # finish() marks a run finished under it before it touches the spool
            for session in self._sessions.values():
                written = written or session.dirty
                if session.held and not session.finished:
                    self._write(session, [])
                if session.dirty and not session.finished:
                    session.dirty = False
                    try:
                        session.spool.flush()
                    except (OSError, ValueError) as e:
                        logger.warning("flush of %s failed: %s", session.spool.path, e)
        if written:
            release_free_memory()

    def _process(self, batch: list[bytes]) -> None:
        """Decode, correlate and spool a batch. Opens, by far the most frequent records, take one
        unpack and go to the correlator as fields (Correlator.open_record), not as a decoded dict."""
        self.stats["batches"] += 1
        self.stats["records"] += len(batch)
        out: dict[int, list[SpoolRecord | bytes]] = {}  # records, and spool lines of lined runs
        hashing: set[int] = set()  # runs whose records may carry an exe hash still being computed
        sessions = self._sessions
        errors = stray = 0
        unpack = dec.OPEN_REC.unpack_from
        path_off = dec.OPEN_PATH_OFF
        open_kind = dec.OPEN_KIND
        kind_off = dec.KIND_OFF
        ts_of = _TS.unpack_from
        # The last open that made one record: its bytes after the time, and that record. An open whose
        # bytes after the time are the same (same run, cgroup, thread, flags, result, path) right after
        # it makes the same record at its own time: nothing between them changed what it depends on
        # (the process's exe and tables change only through other records, which reset this).
        # A repeat of a run whose spool takes lines (_takes_lines) is its spool line, made from the
        # last record's line with its own time: no dict, no serialisation (`lined`: such runs).
        last_tail = b""
        last_rec = cast("Correlated", {})  # read only once last_tail (empty now) has matched
        last_line: tuple[bytes, bytes] | None = None
        lined: set[int] = set()
        session = None
        run = flags = 0
        first: tuple[int, ...] = ()  # the kernel's aggregation key of a record marked F_FIRST
        at, count = 0, len(batch)
        while at < count:
            raw = batch[at]
            at += 1
            plain = False  # an open that made one record, neither a repeat nor marked
            recs: Sequence[Correlated | bytes]
            if raw[kind_off : kind_off + 2] == open_kind and len(raw) >= path_off:
                tail = raw[8:]
                if tail == last_tail and session is not None and not session.finished:
                    t = ts_of(raw)[0] + session.correlator.wall_offset_ns
                    if last_line is None and _takes_lines(session, flags):
                        last_line = _line_around_time(last_rec)
                    if last_line is not None:
                        recs = [last_line[0] + b"%d" % t + last_line[1]]
                        lined.add(run)
                    else:
                        rec = last_rec.copy()
                        rec["t"] = t
                        recs = [rec]
                else:
                    (
                        ts,
                        cgid,
                        run,
                        tgid,
                        _,
                        _,
                        flags,
                        ret,
                        exe_tok,
                        tok,
                        dfd,
                        oflags,
                        mode,
                        nlink,
                        _,
                        plen,
                        dino,
                        rino,
                    ) = unpack(raw)
                    session = sessions.get(run)
                    if session is None or session.finished:
                        stray += 1
                        last_tail = b""
                        continue
                    recs = session.correlator.open_record(
                        ts,
                        cgid,
                        tgid,
                        flags,
                        ret,
                        dfd,
                        oflags,
                        mode,
                        raw[path_off : path_off + plen],
                        dino,
                        rino,
                        kname=raw[path_off + plen :] if flags & dec.F_KNAME else b"",
                        nlink=nlink,
                    )
                    if len(recs) == 1 and not flags & dec.F_STATE:
                        # (not copied: nothing changes a record before this batch is spooled, and a
                        # repeat copies it or reads it)
                        last_tail, last_rec, last_line = tail, recs[0], None
                        plain = not flags & dec.F_FIRST
                    else:
                        last_tail = b""
                if flags & dec.F_FIRST:
                    first = (
                        exe_tok,
                        tok,
                        cgid,
                        dec.EV_OPEN,
                        oflags & dec.ACCESS_BITS,
                        min(ret, 0),
                        rino if ret >= 0 else 0,
                    )
            else:
                last_tail = b""
                try:
                    ev = dec.decode(raw)
                except (dec.DecodeError, ValueError, struct.error):
                    errors += 1
                    continue
                run = ev["run"]
                session = sessions.get(run)
                if session is None or session.finished:
                    stray += 1
                    continue
                correlated = session.correlator.feed(ev)
                if not correlated:
                    continue
                recs = correlated
                hashing.add(run)
                flags = ev["flags"]
                if flags & dec.F_FIRST and ev["kind"] in ("open", "connect"):  # the kernel's only
                    first = dec.agg_key(ev)
            if flags & dec.F_STATE:  # counted by the kernel already: it only updated the tables
                if not recs:
                    continue
                # what is left is a degradation (a write to another cgroup's procs): kept
            elif flags & dec.F_FIRST:
                self._first(session, first, recs)
            elif session.max_distinct:
                recs = _capped_batch(session, recs)
            got = out.get(run)
            if got is None:
                out[run] = got = []
            got += recs
            if plain and at < count and _fast is not None and not session.max_distinct:
                # the plain opens of this run that follow, in C as far as they go (the same records
                # as this loop's: tests/unit/test_fast.py), the rest here
                corr = session.correlator
                if corr.fast:
                    # (as spool lines, not dicts, where only readers of lines read them, their
                    # run id items added as the lines are made: no dict, no orjson)
                    files = _opens_as_lines(session)
                    at, made, tail_after, rec_after, added = _fast.process_opens(
                        batch,
                        at,
                        last_tail,
                        run,
                        unpack,
                        kind_off,
                        open_kind,
                        path_off,
                        _NOT_PLAIN,
                        corr.procs,
                        corr.wall_offset_ns,
                        None if corr.cgroup_name is None else corr._cgroups,
                        *(files or (None, ())),
                        *corr.fast_caches(),
                    )
                    if added:
                        cast("Behaviour", session.behaviour).took(added)
                    if made:
                        got += made
                        if rec_after.__class__ is bytes:  # its repeats: its line around their times
                            last_tail, last_line = tail_after, _line_split_at_time(rec_after)
                        else:
                            last_tail, last_rec, last_line = tail_after, rec_after, None
                        if files is not None:
                            lined.add(run)
        self.stats["decode_errors"] += errors
        self.stats["stray"] += stray
        for slot, spooled in out.items():
            session = sessions.get(slot)
            if session is not None and not session.finished:
                self._write(session, spooled, settle=slot in hashing, lines=slot in lined)

    @staticmethod
    def _first(session: Session, key: tuple[int, ...], recs: Sequence[Correlated | bytes]) -> None:
        """Keep what the first record of a key the kernel aggregates said (its count comes later).
        (No line among `recs`: a first is never a repeat.)"""
        for r in recs:
            # the fields are named at run time (_FIRST_FIELDS): read through a plain mapping
            rec = cast(Mapping[str, object], r)
            fields = _FIRST_FIELDS.get(cast(str, rec["k"]))
            if fields is not None:
                session.firsts[key] = {f: rec[f] for f in fields if f in rec}

    def _write(
        self, session: Session, recs: Sequence[SpoolRecord | bytes], settle: bool = True, lines: bool = False
    ) -> None:
        """Spool `recs` after the records held back (in order), up to the first exec whose hash is
        still being computed (exe_hash.settle). `settle=False`: no record of `recs` is an exec (none
        can wait for a hash), so only records held back before need it. `lines`: some of `recs` are
        spool lines already (bytes), for a SpoolWriter; they become records again if anything else
        is to look at them (an exec's hash not ready, records held back, an observer set meanwhile)."""
        if (
            lines
            and not session.held
            and session.observer is None
            and (
                not settle or exe_hash.settle(recs) == len(recs)  # (settle passes lines by: opens)
            )
        ):
            # spool lines, only ever for a plain SpoolWriter (_takes_lines), and nothing to look at
            # them but an exec's hash, which was ready
            cast(SpoolWriter, session.spool).write_many(recs)
            session.records += len(recs)
            session.dirty = True
            return
        records: list[SpoolRecord]
        if lines:
            records = [orjson.loads(r) if isinstance(r, bytes) else r for r in recs]
        else:
            records = cast("list[SpoolRecord]", recs)  # no line among them: records only
        if session.held:
            session.held.extend(records)
            records = session.held
            settle = True
        if settle:
            ready = exe_hash.settle(records)  # returns at the first hash not ready: 0 while still held
            if ready == 0:
                session.held = records
                return
            records, session.held = (
                (records, []) if ready == len(records) else (records[:ready], records[ready:])
            )
        if session.observer is not None:
            records += session.observer(records)
        session.spool.write_many(records)
        session.records += len(records)
        session.dirty = True


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim  # glibc's (not musl's)
    except (OSError, AttributeError):
        return None
    return trim


_TRIM = _malloc_trim()


def release_free_memory() -> None:
    """Give the pages of memory freed since back to the system (glibc's malloc_trim(0): about 1 ms).
    A batch's buffers are freed on the threads that made them (the correlator's, the premade
    lines' compressor's), whose malloc arenas keep their free pages resident; a flood's batches
    left 30-45 MB of them, counted in the recorder's RSS until the run's end and under the bundle
    writer's own. Called by the correlator once a second while records come, and before a bundle
    is written."""
    if _TRIM is not None:
        _TRIM(0)


_TS = struct.Struct("<Q")  # struct hdr: ts
# what makes an open other than plain for the C path (correlate.py's, and the kernel's aggregation)
_NOT_PLAIN = dec.F_FNAME_FAULT | dec.F_KNAME | dec.F_STATE | dec.F_IN_ROOT | dec.F_OTHER_NS | dec.F_FIRST

_fast = compiled()  # the C hot path: process_opens, spilled
_OPEN_LINE_HEAD = b'{"k":"open","t":'


def _takes_lines(session: Session, flags: int) -> bool:
    """Whether a repeated open of `session` may go to its spool as a line (bytes), not a record:
    every operation is kept (full detail: nothing to cap or count first), nothing looks at the
    records on their way (no observer), and the spool is a plain SpoolWriter (a wrapper passes
    records on)."""
    return (
        session.max_distinct == 0
        and not flags & (dec.F_FIRST | dec.F_STATE)
        and session.observer is None
        and type(session.spool) is SpoolWriter
    )


def _opens_as_lines(session: Session) -> tuple[Any, tuple[bytes, ...]] | None:
    """Where process_opens adds the run id's items of `session`'s plain opens that it hands over as
    their spool lines (Behaviour.fast_files), or None: they are dicts. Lines when its spool takes lines
    (_takes_lines, a plain SpoolWriter, which feeds this Behaviour), the Behaviour takes items in C,
    and full detail's Premade, if any, makes its events from the spool's lines (not a signed
    bundle's, whose trace reads the records)."""
    if not _takes_lines(session, 0) or session.behaviour is None:
        return None
    if session.premade is not None and not session.premade.from_lines:
        return None
    return session.behaviour.fast_files()


def _line_split_at_time(line: bytes) -> tuple[bytes, bytes]:
    """An open's spool line (with its newline) without its time: (before, after), the line being
    before + the time in decimal + after."""
    if not line.startswith(
        _OPEN_LINE_HEAD
    ):  # pragma: no cover - open_line and correlate.py make "k", then "t"
        raise ValueError("an open's line that does not start with its kind and time")
    return _OPEN_LINE_HEAD, line[line.index(b",", len(_OPEN_LINE_HEAD)) :]


def _line_around_time(rec: Correlated) -> tuple[bytes, bytes]:
    """_line_split_at_time of an open record's spool line."""
    return _line_split_at_time(orjson.dumps(rec) + b"\n")


def _capped(session: Session, recs: Sequence[Correlated]) -> list[Correlated | bytes]:
    """Plain records of a summary run (not aggregated in the kernel: an unknown dirfd, a long path,
    a full map) under the same cap on distinct keys: past it, counted by kind and not kept."""
    out: list[Correlated | bytes] = []
    for r in recs:
        key = summary_key(r) if r["k"] in _CAPPED else None
        if key is not None and key not in session.plain_keys:
            if len(session.plain_keys) >= session.max_distinct:
                kind = f"{r['k']}_past_cap"
                session.past_cap[kind] = session.past_cap.get(kind, 0) + 1
                continue
            session.plain_keys.add(key)
        out.append(r)
    return out


# _process calls _capped with what its variable `recs` holds, records and spool lines to mypy; for a
# summary run (the only one capped) records only, as a summary run's spool takes no lines
# (_takes_lines). Said once here, not with a cast per record.
_capped_batch = cast("Callable[[Session, Sequence[Correlated | bytes]], list[Correlated | bytes]]", _capped)
