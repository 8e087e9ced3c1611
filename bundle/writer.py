"""Build a deterministic evidence bundle from a run's metadata and its spooled records.

One pass over the records: what the content-addressed run id is made of (`Behaviour`,
bundle/run_id.py) is fed by the
recorder as it spools them, so a summary bundle's pass aggregates and a full bundle's pass streams the
events (without it, as for a spool recovered after a crash, the pass feeds it too, and full detail
takes a second pass). Events are written in the order of their first occurrence in the spool
(bundle/records.py maps a record to its event). The same
records and metadata always give the same bytes: fixed tar metadata (mtime 0, uid/gid 0, mode 0644,
no user names), gzip header mtime 0 and no file name, canonical JSON everywhere. A signed bundle
(`signer`) adds its attestation as a third member; ed25519 signatures are deterministic too. The
bundle file itself is 0600 whatever the umask: it holds the run's argv, file names and peers.

(Over 600 lines on purpose: one pass over the spool makes the events, their hashes, the manifest
and the tar.gz together, in the order the bytes come out; the run id's sets are bundle/run_id.py's.)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import hashlib
import logging
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import orjson
from pydantic import Field

from evidence.bundle import canonical
from evidence.bundle import format as fmt
from evidence.bundle.deflate import Deflater, write_tar_gz
from evidence.bundle.record_types import SpoolRecord
from evidence.bundle.records import Key, occurrences, summary_key, to_event

# the run id's Behaviour and the memory budget it shares with the writer (agent/recorder/recording.py
# imports them from here)
from evidence.bundle.run_id import MEMORY_ITEMS as MEMORY_ITEMS
from evidence.bundle.run_id import RECORDING_ITEMS as RECORDING_ITEMS
from evidence.bundle.run_id import Behaviour as Behaviour
from evidence.files import atomic_write

if TYPE_CHECKING:
    from evidence.bundle import attestation, runtime_trace
    from evidence.bundle.read_types import ManifestJSON

logger = logging.getLogger(__name__)

Records = Callable[[], Iterable[SpoolRecord]]
Lines = Callable[[], Iterable[bytes]]  # the same records as the spool's lines (spool.read_spool_lines)
# occurrences() takes a record of a kind the writer sums up (record_types.SummaryRecord), which is
# what a record whose summary_key() is not None is: mypy cannot follow that, so _read calls it
# through this alias (a cast once, not one per record)
_occurrences = cast("Callable[[SpoolRecord], tuple[int, int, int]]", occurrences)
_dumps = canonical.dumps_unchecked


class RunMeta(fmt.RunInfo):
    """A run's metadata for the writer: the manifest's own fields about the run (`format.RunInfo`),
    and what the writer turns into events, times and the run id."""

    pid: int
    cgroup: str
    started_ns: int
    finished_ns: int
    lost: dict[str, int] = Field(default_factory=dict)
    degradations: list[dict[str, str]] = Field(default_factory=list)
    roots: dict[str, str] = Field(default_factory=dict)  # placeholder -> path, for the run id


@dataclasses.dataclass(frozen=True)
class _Split:
    """An event's canonical data cut where its record's time stands (the quoted RFC 3339 time, as
    data's first_time and last_time hold it): for a record that repeats the one before it but for
    its time, the event's data is these parts joined by its own quoted time (_split_at_time)."""

    etype: str
    subject: str
    parts: tuple[bytes, ...]


@dataclasses.dataclass(frozen=True)
class _FullDetail:
    """Full detail's body: the records themselves, one event each, in order (_EventSink.write_full
    writes them; iterated, the events as to_event makes them)."""

    records: Records
    lines: Lines | None = None  # the same records as the spool's lines: repeats are told apart unparsed

    def __iter__(self) -> Iterator[Event]:
        return (to_event(rec) for rec in self.records())

    def marked(self) -> Iterator[SpoolRecord | int]:
        """The records, each repeat of the one before it but for its time as that time (an int)."""
        return _marked_lines(self.lines()) if self.lines is not None else _marked(self.records())


def _marked(records: Iterable[SpoolRecord]) -> Iterator[SpoolRecord | int]:
    """`records`, a record that is the one before it but for its time as its time alone."""
    prev: SpoolRecord | None = None
    for rec in records:
        if prev is not None:
            t = rec["t"]
            rec["t"] = prev["t"]
            same = rec == prev
            rec["t"] = t
            if same:
                yield t
                continue
        prev = rec
        yield rec


def _marked_lines(lines: Iterable[bytes]) -> Iterator[SpoolRecord | int]:
    """_marked over the spool's lines: a line that is the line before it but for the digits of its
    time ({"k":"KIND","t":DIGITS,...: the kind first and the time second, as the recorder writes
    every record) is that time, not parsed; any other line is parsed."""
    head = tail = b""  # the last line parsed, before and after its time ("": not of that form)
    for line in lines:
        i = line.find(b'","t":', 6)
        if i > 0 and head:
            j = line.find(b",", i + 6)
            if j > 0 and line[:i] == head and line[j:] == tail:
                digits = line[i + 6 : j]
                if digits.isdigit() and (digits[0] != 0x30 or len(digits) == 1):  # JSON: no leading zero
                    yield int(digits)
                    continue
        rec: SpoolRecord = orjson.loads(line)
        j = line.find(b",", i + 6) if i > 0 else -1
        if j > 0 and line.startswith(b'{"k":"') and b'"' not in line[6:i] and line[i + 6 : j].isdigit():
            head, tail = line[:i], line[j:]
        else:
            head = tail = b""
        yield rec


Event = tuple[str, str, int, dict[str, Any]]  # type, subject, time (ns), data
Body = Iterable[Event]  # a _FullDetail for full detail
# two times a record's event is made at, to find (and check) where its time stands in its data
_SAMPLE_NS = (0, 999_999_999_999)


def _read(
    meta: RunMeta,
    records: Records,
    memory: int | None = None,
    tmp_dir: Path | None = None,
    behaviour: Behaviour | None = None,
    lines: Lines | None = None,
) -> tuple[str, Body]:
    """The run id and the run's events in the order of their first occurrence in the spool.

    Summary: one pass over the records, keeping the first record of each summary key with its totals
    (and the records that are not aggregated: execs, exits, ...), so the cost is the spool's length
    once and the memory is what the bundle will hold; past `memory` records kept (MEMORY_ITEMS), they
    are dropped and a second pass streams the events instead, so memory stays bounded. Full detail
    keeps every record: one pass streams the events (memory stays flat however long the run). The
    run id's sets are bounded the same way (_SpillSet). `behaviour`: fed with every record already
    (by the recorder, as it spooled them); without it, the pass feeds one, and full detail takes a
    first pass of its own for it."""
    memory = MEMORY_ITEMS if memory is None else memory
    fed = behaviour is not None
    if behaviour is None:
        behaviour = Behaviour(meta.roots, memory, tmp_dir)
    if meta.detail != "summary":
        if not fed:
            for rec in records():
                behaviour.add(rec)
        return behaviour.run_id(meta.command), _FullDetail(records, lines)
    kept: list[tuple[SpoolRecord, list[int] | None]] | None = []
    totals: dict[Key, list[int]] = {}
    for rec in records():
        if not fed:
            behaviour.add(rec)
        key = summary_key(rec)
        if key is None:
            if kept is not None:
                kept.append((rec, None))
        else:
            n, first, last = _occurrences(rec)
            t = totals.get(key)
            if t is None:
                totals[key] = t = [n, first, last]
                if kept is not None:
                    kept.append((rec, t))
            else:
                t[0] += n
                t[1] = min(t[1], first)
                t[2] = max(t[2], last)
        if kept is not None and len(kept) > memory:
            kept = None  # too many to hold: the events are streamed by a second pass
    if kept is not None:
        return behaviour.run_id(meta.command), (to_event(rec, t) for rec, t in kept)
    return behaviour.run_id(meta.command), _second_pass(records, totals)


def _split_at_time(rec: SpoolRecord) -> _Split | None:
    """`rec`'s event's canonical data cut where its time stands, if that is the only place where
    the event depends on the record's time: made at one sample time, cut at its quoted RFC 3339
    form, then checked by putting together the data at the record's own time and at the other
    sample, against to_event's. None when anything differs (a field that holds the sample's text,
    a time in another form), and the records are written as they are."""
    etype, subj, _, data = to_event(rec)
    cut: list[bytes] | None = None
    for at in (rec["t"], *_SAMPLE_NS):
        sample = rec.copy()
        sample["t"] = at
        e = to_event(sample)
        if e[0] != etype or e[1] != subj or e[2] != at:
            return None
        canon = canonical.dumps(e[3], check=False)
        quoted = b'"' + fmt.format_time(at).encode() + b'"'
        if cut is None:
            cut = canon.split(quoted)
        elif quoted.join(cut) != canon:
            return None
    assert cut is not None
    return _Split(etype, subj, tuple(cut))


def _second_pass(records: Records, totals: dict[Key, list[int]]) -> Iterator[Event]:
    """The summary's events from a second read of the records: each key's first record with its
    totals (taken out as it is written: memory shrinks as the events go)."""
    for rec in records():
        key = summary_key(rec)
        if key is None:
            yield to_event(rec)
            continue
        t = totals.pop(key, None)
        if t is not None:
            yield to_event(rec, t)


# full detail's events made at a time before they are checked against the caps together (_EventSink.write_full)
_FULL_BATCH = 1024
# a repeat's record's data cut at its time, with its line's and content hash's constant parts (_prepare)
_Prepared = tuple[str, tuple[bytes, ...], bytes, bytes, bytes]


@dataclasses.dataclass
class _Repeats:
    """Where write_full is in its records: the last record (which the repeats that follow it repeat),
    its _Prepared once made (None: it cannot be cut at its time), and whether that was tried."""

    prev: SpoolRecord | None = None
    split: _Prepared | None = None
    tried: bool = False


@dataclasses.dataclass(frozen=True)
class Caps:
    """What one bundle may hold, below the reader's limits (bundle/format.py MAX_*) with room kept
    for the events that close a run (loss, run.finished), so that every bundle the writer makes is
    one that lint, show and diff accept. Past a cap, records are counted by kind, not written: the
    manifest's `lost` and a `dev.evidence.loss` event (where: writer) say how many."""

    events: int = fmt.MAX_EVENTS - 10_000
    decompressed: int = fmt.MAX_DECOMPRESSED - 64 * 1024 * 1024
    compressed: int = fmt.MAX_COMPRESSED - 8 * 1024 * 1024  # estimated with a fast deflate: an upper bound
    line: int = fmt.MAX_LINE - 1  # one event (a path under a deep working directory can be huge)


class _EventSink:
    """Writes events as canonical JSON lines, keeping counts, file hash and root hash.

    An event's line is its canonical JSON (sorted keys, bundle/canonical.py), put together from the
    canonical bytes of its data and subject and the run's constant parts: one orjson call per event
    instead of a dict of ten keys sorted per event (tests/unit/test_writer.py checks that the bytes
    are the same as canonical.dumps of the event). Its content hash is made the same way."""

    def __init__(
        self,
        out: Deflater,
        run_id: str,
        labels: dict[str, str] | None = None,
        caps: Caps | None = None,
    ) -> None:
        self.caps = caps or Caps()
        self.out = out
        self.run_id = run_id
        self.labels = fmt.labels_attribute(labels)
        self.source = fmt.source_for(run_id)
        self.seq = 0
        self.size = 0
        self.counts: dict[str, int] = {}
        dumps = canonical.dumps
        labels_part = b"" if self.labels is None else b'"labels":' + dumps(self.labels) + b","
        self._id = b',"datacontenttype":' + dumps(fmt.DATACONTENTTYPE) + b',"id":' + dumps(run_id + ":")[:-1]
        self._runid = b'",' + labels_part + b'"runid":' + dumps(run_id) + b',"seq":'
        self._source = b',"source":' + dumps(self.source) + b',"specversion":' + dumps(fmt.SPECVERSION)
        self._core_mid = b',"datacontenttype":' + dumps(fmt.DATACONTENTTYPE) + b',"specversion":'
        self._core_mid += dumps(fmt.SPECVERSION) + b',"subject":'
        self._types: dict[str, bytes] = {}
        self._subject: str | None = None  # the last subject, and its canonical JSON
        self._subject_json = b""
        self._sha = hashlib.sha256()  # copied for each content hash: cheaper than a new one
        self.root = fmt.RootHasher()
        self.trace: runtime_trace.Trace | None = None  # a signed bundle's: fed every event written

    def _line(
        self, etype: str, subject: str, t_ns: int, data: dict[str, Any], seq_no: int | None = None
    ) -> tuple[bytes, bytes]:
        """(the event's canonical JSON line as event `seq_no` (default: the next), the canonical
        JSON its content hash is taken over)."""
        d = _dumps(data)
        if subject is self._subject:  # the same string object: runs of one path
            s = self._subject_json
        else:
            s = self._subject_json = _dumps(subject)
            self._subject = subject
        ty = self._type(etype)
        seq = b"%d" % (self.seq if seq_no is None else seq_no)
        line = b"".join(
            (
                b'{"data":',
                d,
                self._id,
                seq,
                self._runid,
                seq,
                self._source,
                b',"subject":',
                s,
                b',"time":"',
                fmt.format_time(t_ns).encode(),
                b'"',
                ty,
                b"\n",
            )
        )
        return line, b"".join((b'{"data":', d, self._core_mid, s, ty))

    def _type(self, etype: str) -> bytes:
        """The end of an event of type `etype` (and of its content hash's core): its type and '}'."""
        ty = self._types.get(etype)
        if ty is None:
            ty = self._types[etype] = b',"type":' + _dumps(etype) + b"}"
        return ty

    def emit(self, etype: str, subject: str, t_ns: int, data: dict[str, Any], capped: bool = False) -> bool:
        """Write one event; with `capped`, only if the bundle's caps leave room (False: not written)."""
        line, core = self._line(etype, subject, t_ns, data)
        if not self._put(etype, line, core, capped):
            return False
        if self.trace is not None:
            self.trace.feed_at(etype, t_ns, data)
        return True

    def _put(self, etype: str, line: bytes, core: bytes, capped: bool) -> bool:
        n = len(line)
        if capped and (
            n > self.caps.line
            or self.seq >= self.caps.events
            or self.size + n > self.caps.decompressed
            or self.out.compressed_bound() + n + n // 64 > self.caps.compressed
        ):
            return False
        h = self._sha.copy()
        h.update(core)
        self.root.add(h.hexdigest())
        self.out.feed(line)
        self.size += n
        self.counts[etype] = self.counts.get(etype, 0) + 1
        self.seq += 1
        return True

    def write_full(self, marked: Iterable[SpoolRecord | int], capped: dict[str, int]) -> None:
        """Full detail: an event per record, under the caps (what they leave out counted by type
        in `capped`). `marked` (_FullDetail.marked): the records, a record that repeats the one
        before it but for its time (a loop opening one file: the recorder spools each repeat as the
        same line with its own time) as its time alone. Such a repeat makes the same event but for
        its times, so its data is put together from the canonical bytes of the first one's, cut at
        its time (_split_at_time), instead of made and serialised again: a flood of one open is
        written about three times as fast. The bytes are the same.

        The events are made _FULL_BATCH at a time and, when the whole batch fits under the caps
        (which is then true of each of its events: the checks of _put pass for every one), taken in
        at once: one hand-over to the deflater, one to the root hash, the counts once. A batch that
        does not fit is made again event by event, each checked as _put checks it, and so is all
        that follows (past a cap, every event is counted, none written). A signed bundle's trace
        sees every event's data: its events are made one by one. Either way the bytes are the same."""
        state = _Repeats()
        if self.trace is not None:
            self._full_each(marked, state, capped)
            return
        batch: list[SpoolRecord | int] = []
        add = batch.append
        near_cap = False
        for item in marked:
            add(item)
            if len(batch) >= _FULL_BATCH:
                if near_cap or not self._full_batch(batch, state):
                    near_cap = True
                    self._full_each(batch, state, capped)
                batch.clear()
        if batch and (near_cap or not self._full_batch(batch, state)):
            self._full_each(batch, state, capped)

    def _full_batch(self, items: list[SpoolRecord | int], state: _Repeats) -> bool:
        """Make the events of `items` and take them in if all fit under the caps (True); else take
        in none and leave `state` as it was (False), for _full_each to make them one by one."""
        before = (state.prev, state.split, state.tried)
        seq = self.seq
        lines: list[bytes] = []
        hashes: list[str] = []
        counts: dict[str, int] = {}
        size = longest = 0
        base = self._sha
        format_time = fmt.format_time
        join = b"".join
        id_, runid = self._id, self._runid
        prev, split, tried = before
        dumps = _dumps
        after_source = self._source + b',"subject":'
        core_mid = self._core_mid
        open_type = self._type(fmt.FILE_OPEN)
        open_end = b'"' + open_type + b"\n"
        for item in items:
            if item.__class__ is int:
                t = item
                assert prev is not None  # a repeat follows a record
                if not tried:
                    split, tried = self._prepare(prev), True
                if split is not None:
                    etype, parts, after_seq, end, core_end = split
                    time = format_time(t).encode()
                    d = (b'"' + time + b'"').join(parts)
                    digits = b"%d" % seq
                    line = join((b'{"data":', d, id_, digits, runid, digits, after_seq, time, end))
                    core = join((b'{"data":', d, core_end))
                else:
                    rec = prev.copy()
                    rec["t"] = t
                    etype, subject, t_ns, data = to_event(rec)
                    line, core = self._line(etype, subject, t_ns, data, seq)
            else:
                rec = prev = cast(SpoolRecord, item)
                split, tried = None, False
                if rec["k"] == "open" and "n" not in rec and "tl" not in rec and rec["path"].__class__ is str:
                    # to_event and _line in one for the most frequent record (records.data: an open
                    # that stands for itself has count 1 and its own time as first and last time,
                    # the event's time too: formatted once)
                    data = cast("dict[str, Any]", rec.copy())
                    del data["k"], data["t"]
                    when = format_time(rec["t"])
                    data["count"] = 1
                    data["first_time"] = data["last_time"] = when
                    d = dumps(data)
                    path = rec["path"]
                    if path is not self._subject:
                        self._subject_json = dumps(path)
                        self._subject = path
                    s = self._subject_json
                    digits = b"%d" % seq
                    etype = fmt.FILE_OPEN
                    line = join(
                        (b'{"data":', d, id_, digits, runid, digits, after_source, s,
                         b',"time":"', when.encode(), open_end)
                    )  # fmt: skip
                    core = join((b'{"data":', d, core_mid, s, open_type))
                else:
                    etype, subject, t_ns, data = to_event(rec)
                    line, core = self._line(etype, subject, t_ns, data, seq)
            n = len(line)
            if n > longest:
                longest = n
            size += n
            h = base.copy()
            h.update(core)
            hashes.append(h.hexdigest())
            lines.append(line)
            counts[etype] = counts.get(etype, 0) + 1
            seq += 1
        caps = self.caps
        if (
            longest > caps.line
            or seq > caps.events
            or self.size + size > caps.decompressed
            # each event's own check adds its line to the bound after those before it: at most this
            or self.out.compressed_bound() + size + size // 64 + 1 > caps.compressed
        ):
            state.prev, state.split, state.tried = before
            return False
        state.prev, state.split, state.tried = prev, split, tried
        self.root.add_many(hashes)
        self.out.feed(join(lines))
        self.size += size
        self.seq = seq
        for etype, n in counts.items():
            self.counts[etype] = self.counts.get(etype, 0) + n
        return True

    def _full_each(
        self, marked: Iterable[SpoolRecord | int], state: _Repeats, capped: dict[str, int]
    ) -> None:
        """write_full's events one by one, each under the caps (_put)."""
        prev, split, tried = state.prev, state.split, state.tried
        for item in marked:
            if item.__class__ is int:
                t = item
                assert prev is not None  # a repeat follows a record
                if not tried:
                    split, tried = self._prepare(prev), True
                if split is not None:
                    etype, parts, after_seq, end, core_end = split
                    time = fmt.format_time(t).encode()
                    d = b'"' + time + b'"'
                    d = d.join(parts)
                    seq = b"%d" % self.seq
                    line = b"".join((b'{"data":', d, self._id, seq, self._runid, seq, after_seq, time, end))
                    if not self._put(etype, line, b"".join((b'{"data":', d, core_end)), True):
                        kind = "over_cap:" + etype.removeprefix("dev.evidence.")
                        capped[kind] = capped.get(kind, 0) + 1
                    elif self.trace is not None:  # a signed bundle: the trace sees the repeat too
                        again = prev.copy()
                        again["t"] = t
                        etype_, _, t_ns, data = to_event(again)
                        self.trace.feed_at(etype_, t_ns, data)
                    continue
                rec = prev.copy()
                rec["t"] = t
            else:
                rec = prev = cast(SpoolRecord, item)
                split, tried = None, False
            event = to_event(rec)
            if not self.emit(*event, capped=True):
                kind = "over_cap:" + event[0].removeprefix("dev.evidence.")
                capped[kind] = capped.get(kind, 0) + 1
        state.prev, state.split, state.tried = prev, split, tried

    def _prepare(self, rec: SpoolRecord) -> _Prepared | None:
        """For write_full: `rec`'s event type, its data cut at its time, and its line's and
        content hash's constant parts (after the seq up to the time, after the time, after the
        data); None when its data cannot be cut so."""
        split = _split_at_time(rec)
        if split is None:
            return None
        s = _dumps(split.subject)
        ty = b',"type":' + _dumps(split.etype) + b"}"
        after_seq = self._source + b',"subject":' + s + b',"time":"'
        return split.etype, split.parts, after_seq, b'"' + ty + b"\n", self._core_mid + s + ty


def _head(meta: RunMeta) -> Iterator[Event]:
    argv0 = meta.command[0] if meta.command else ""
    yield (
        fmt.RUN_STARTED,
        argv0,
        meta.started_ns,
        {
            "session_id": meta.session_id,
            "command": list(meta.command),
            "cwd": meta.cwd,
            "pid": meta.pid,
            "cgroup": meta.cgroup,
            "detail": meta.detail,
            "labels": dict(meta.labels),
        },
    )
    for d in meta.degradations:
        yield fmt.DEGRADATION, d["component"], meta.started_ns, dict(d)


def _tail(meta: RunMeta, capped: dict[str, int]) -> Iterator[Event]:
    argv0 = meta.command[0] if meta.command else ""
    for kind in sorted(meta.lost):
        if meta.lost[kind]:
            yield (
                fmt.LOSS,
                kind,
                meta.finished_ns,
                {"kind": kind, "count": meta.lost[kind], "where": "kernel"},
            )
    for kind in sorted(capped):
        yield fmt.LOSS, kind, meta.finished_ns, {"kind": kind, "count": capped[kind], "where": "writer"}
    yield (
        fmt.RUN_FINISHED,
        argv0,
        meta.finished_ns,
        {
            "exit_code": meta.exit_code,
            "signal": meta.signal,
            "duration_ns": max(0, meta.finished_ns - meta.started_ns),
            "cut_short": meta.cut_short,
        },
    )


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size = size
    ti.mtime = 0
    ti.mode = 0o644
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    ti.type = tarfile.REGTYPE
    return ti


def write_bundle(
    out_path: str | Path,
    meta: RunMeta,
    records: Records,
    caps: Caps | None = None,
    *,
    signer: attestation.Signer | None = None,
    behaviour: Behaviour | None = None,
    lines: Lines | None = None,
) -> dict[str, Any]:
    """Write the bundle atomically (temp file + rename) and return its manifest. Records past the
    caps are counted by kind (`over_cap:<type>` in the manifest's lost), never silently dropped.
    With a `signer` (signing.load_signer(key_path)), the bundle is signed: its third member is the
    attestation. `behaviour`: the run id's Behaviour, fed with every one of `records` as they were
    spooled (used only when made with the run's roots and not used before; else it is rebuilt).
    `lines`: the same records as the spool's lines (spool.read_spool_lines), which full detail
    reads instead: a repeat of the line before it but for its time is not parsed."""
    out_path = Path(out_path)
    if behaviour is not None and (behaviour.closed or behaviour.roots != dict(meta.roots)):
        behaviour.close()
        behaviour = None
    with no_cycle_collection():
        return _write_bundle(out_path, meta, records, caps, signer, behaviour, lines)


@contextlib.contextmanager
def no_cycle_collection() -> Iterator[None]:
    """The cyclic garbage collector off while a bundle is written: the writer makes one dict per
    record and per event, none in a cycle, and each collection walks every object still alive (the
    recorder's too): a fifth of the writer's time on 100k distinct records. Back on afterwards."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _write_bundle(
    out_path: Path,
    meta: RunMeta,
    records: Records,
    caps: Caps | None,
    signer: attestation.Signer | None,
    behaviour: Behaviour | None,
    lines: Lines | None,
) -> dict[str, Any]:
    out_dir = out_path.parent if str(out_path.parent) else Path(".")
    run_id, body = _read(meta, records, tmp_dir=out_dir, behaviour=behaviour, lines=lines)
    with tempfile.TemporaryFile(dir=out_dir) as deflated:
        deflater = Deflater(deflated)  # the events, deflated on a thread of their own as they come
        try:
            sink = _EventSink(deflater, run_id, meta.labels, caps)
            if signer is not None:  # only a signed bundle needs the trace (and its imports)
                from evidence.bundle import runtime_trace

                sink.trace = runtime_trace.Trace()
            for head in _head(meta):
                sink.emit(*head)
            capped: dict[str, int] = {}
            if isinstance(body, _FullDetail):
                sink.write_full(body.marked(), capped)
            else:
                for event in body:
                    if not sink.emit(*event, capped=True):
                        kind = "over_cap:" + event[0].removeprefix("dev.evidence.")
                        capped[kind] = capped.get(kind, 0) + 1
            for end in _tail(meta, capped):
                sink.emit(*end)
            events_sha = deflater.finish()
        except BaseException:
            deflater.abort()
            raise
        if capped:
            logger.warning("the bundle's caps were reached: %s not written (counted as lost)", capped)
        lost = {**meta.lost, **capped}
        lost_total = sum(lost.values())
        manifest = {
            "format": fmt.FORMAT_NAME,
            "format_version": fmt.FORMAT_VERSION,
            "producer": {"name": "evidence", "version": _version()},
            "run_id": run_id,
            "source": sink.source,
            **{
                name: copy.copy(getattr(meta, name))
                for name in fmt.RunInfo.model_fields
                if name != "artifacts"
            },
            # the run's subjects: only when asked for (a bundle without keeps its bytes)
            **({} if meta.artifacts is None else {"artifacts": meta.artifacts.model_dump()}),
            "started_at": fmt.format_time(meta.started_ns),
            "finished_at": fmt.format_time(meta.finished_ns),
            "counts": dict(sorted(sink.counts.items())),
            "events": sink.seq,
            "lost": {"total": lost_total, "by_kind": {k: v for k, v in sorted(lost.items())}},
            "files": {fmt.EVENTS_NAME: {"sha256": events_sha, "size": sink.size}},
            "root_hash": sink.root.hexdigest(),
        }
        manifest_bytes = canonical.dumps(manifest)
        tail = []
        if signer is not None:
            from evidence.bundle import attestation  # only a signed bundle needs it (its import costs ~60 ms)

            # the manifest just made has the shape the reader's checks guarantee (read_types)
            assert sink.trace is not None
            signed = attestation.member(
                cast("ManifestJSON", manifest), manifest_bytes, events_sha, signer, sink.trace
            )
            tail.append((_tarinfo(fmt.ATTESTATION_NAME, len(signed)), signed))
        with atomic_write(out_path, mode=0o600) as raw:  # argv, file names, peers: the owner's alone
            write_tar_gz(
                raw,
                [(_tarinfo(fmt.MANIFEST_NAME, len(manifest_bytes)), manifest_bytes)],
                _tarinfo(fmt.EVENTS_NAME, sink.size),
                deflated,
                deflater,
                tail,
            )
    logger.info("wrote %s: %d events, run id %s", out_path, sink.seq, run_id)
    return manifest


def _version() -> str:
    from evidence import __version__

    return __version__
