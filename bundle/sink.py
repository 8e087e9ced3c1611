"""Events as a bundle's lines: `EventSink` writes each as one canonical JSON line, with its content
hash into the root hash, under the bundle's caps (`Caps`); full detail's records become their
events a batch at a time (`FullWriter`), as the bundle writer (bundle/writer.py) reads them from a
spool or as the recorder spools them (`Premade`, bundle/premade.py).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, cast

import orjson

from evidence.bundle import canonical, native
from evidence.bundle import format as fmt
from evidence.bundle.record_types import SpoolRecord
from evidence.bundle.records import to_event

if TYPE_CHECKING:
    from evidence.bundle import runtime_trace


def compiled() -> Any:
    """Full detail's hot path in C (src/fast/_fast.c), or None (bundle/native.py): the Python path,
    which it matches byte for byte, then does it all."""
    return native.compiled("evidence.bundle._fast")


_fast = compiled()

_dumps = canonical.dumps_unchecked
Event = tuple[str, str, int, dict[str, Any]]  # type, subject, time (ns), data


class Out(Protocol):
    """Where a sink's lines go: the Deflater (bundle/deflate.py), or a premade file."""

    def feed(self, data: bytes) -> None: ...

    def compressed_bound(self) -> int: ...


class Roots(Protocol):
    """Where a sink's content hashes go: format.RootHasher, or a premade file."""

    def add(self, chash: str) -> None: ...

    def add_many(self, chashes: list[str]) -> None: ...

    def add_lines(self, lines: bytes) -> None: ...


# a batch's content hashes: 64 hex digits and a newline each, or their cores and ends as the C path
# defers them for a Roots that `defers` (src/fast/_fast.c hash_cores hashes them)
Hashed = bytes | tuple[bytes, bytes]


class Deferring(Roots, Protocol):
    """Roots that take hashes the C path deferred (bundle/premade.py: hashed on its own thread)."""

    defers: bool

    def add_deferred(self, pieces: list[Hashed]) -> None: ...


@dataclasses.dataclass(frozen=True)
class _Split:
    """An event's canonical data cut where its record's time stands (the quoted RFC 3339 time, as
    data's first_time and last_time hold it): for a record that repeats the one before it but for
    its time, the event's data is these parts joined by its own quoted time (_split_at_time)."""

    etype: str
    subject: str
    parts: tuple[bytes, ...]


# two times a record's event is made at, to find (and check) where its time stands in its data
_SAMPLE_NS = (0, 999_999_999_999)


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


def _hashes(cores: list[bytes]) -> bytes:
    """The content hashes of `cores`, each as 64 hex digits and a newline (RootHasher.add_lines)."""
    sha256 = hashlib.sha256
    return "".join([sha256(core).hexdigest() + "\n" for core in cores]).encode("ascii")


# full detail's events made at a time before they are checked against the caps together (FullWriter)
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


class EventSink:
    """Writes events as canonical JSON lines, keeping counts, file hash and root hash.

    An event's line is its canonical JSON (sorted keys, bundle/canonical.py), put together from the
    canonical bytes of its data and subject and the run's constant parts: one orjson call per event
    instead of a dict of ten keys sorted per event (tests/unit/test_writer.py checks that the bytes
    are the same as canonical.dumps of the event). Its content hash is made the same way."""

    def __init__(
        self,
        out: Out,
        run_id: str,
        labels: dict[str, str] | None = None,
        caps: Caps | None = None,
        root: Roots | None = None,
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
        self.root: Roots = fmt.RootHasher() if root is None else root
        self.trace: runtime_trace.Trace | None = None  # a signed bundle's: fed every event written
        # full detail's plain opens and repeats made in C (_full_batch): the same bytes (the Python
        # path stays the reference: tests/unit/test_fast.py)
        self.use_fast = _fast is not None

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

    def write_full(self, marked: Iterable[SpoolRecord | int | bytes], capped: dict[str, int]) -> None:
        """Full detail: an event per record, under the caps (what they leave out counted by type
        in `capped`). `marked` (_FullDetail.marked): the records, a record that repeats the one
        before it but for its time (a loop opening one file: the recorder spools each repeat as the
        same line with its own time) as its time alone. Such a repeat makes the same event but for
        its times, so its data is put together from the canonical bytes of the first one's, cut at
        its time (_split_at_time), instead of made and serialised again: a flood of one open is
        written about three times as fast. The bytes are the same. An item may also be a record's
        spool line (bytes, bundle/premade.py), whose event C makes without the GIL where it can.

        The events are made _FULL_BATCH at a time and, when the whole batch fits under the caps
        (which is then true of each of its events: the checks of _put pass for every one), taken in
        at once: one hand-over to the deflater, one to the root hash, the counts once. A batch that
        does not fit is made again event by event, each checked as _put checks it, and so is all
        that follows (past a cap, every event is counted, none written). A signed bundle's trace
        sees every event's data: fed each batch's records once the batch is taken (feed_trace), or
        each event as _full_each writes it. Either way the bytes are the same."""
        full = FullWriter(self, capped)
        full.add(marked)
        full.end()

    def _full_batch(self, items: list[SpoolRecord | int | bytes], state: _Repeats) -> bool:
        """Make the events of `items` and take them in if all fit under the caps (True); else take
        in none and leave `state` as it was (False), for _full_each to make them one by one."""
        before = (state.prev, state.split, state.tried)
        seq = self.seq
        lines: list[bytes] = []
        cores: list[bytes] = []  # what each content hash is taken over
        etypes: list[str] = []
        format_time = fmt.format_time
        join = b"".join
        id_, runid = self._id, self._runid
        prev, split, tried = before
        dumps = _dumps
        fast = _fast if self.use_fast else None
        # the C path's content hashes left to the Roots' own thread, if it has one
        defer = fast is not None and getattr(self.root, "defers", False)
        pieces: list[bytes] = []  # lines made in C, and the Python path's joined, in order
        hashed: list[Hashed] = []  # their content hashes (Hashed), in order
        longest = 0
        made: dict[str, int] = {}  # events made in C, by type
        after_source = self._source + b',"subject":'
        core_mid = self._core_mid
        open_type = self._type(fmt.FILE_OPEN)
        open_end = b'"' + open_type + b"\n"
        second: int | None = None  # the last time's second, and its text (format_time's, without a call each)
        text = ""
        i, count = 0, len(items)
        while i < count:
            item = items[i]
            if fast is not None:
                # the C path (src/fast/_fast.c) from here, as far as it goes: plain opens (as spool
                # lines, made without the GIL: src/fast/lines.h; or as records), or repeats with their
                # data cut at their time; what it does not take is made below
                if item.__class__ is bytes:
                    done = fast.open_lines(
                        items, i, seq, id_, runid, after_source, core_mid, open_type, defer
                    )
                elif item.__class__ is not int:
                    done = fast.opens(items, i, seq, id_, runid, after_source, core_mid, open_type, defer)
                elif tried and split is not None:
                    etype, parts, after_seq, end, core_end = split
                    done = fast.repeats(items, i, seq, parts, id_, runid, after_seq, end, core_end, defer)
                else:
                    done = (i, b"", b"", 0)
                if done[0] > i:
                    if lines:  # the Python path's, before these
                        longest = max(longest, *map(len, lines))
                        pieces.append(join(lines))
                        hashed.append(_hashes(cores))
                        lines.clear()
                        cores.clear()
                    n = done[0] - i
                    if item.__class__ is int:
                        made[etype] = made.get(etype, 0) + n
                    else:
                        prev = cast(SpoolRecord, _record(items[done[0] - 1]))
                        split, tried = None, False
                        made[fmt.FILE_OPEN] = made.get(fmt.FILE_OPEN, 0) + n
                    pieces.append(done[1])
                    hashed.append(done[2])
                    longest = max(longest, done[3])
                    seq += n
                    i = done[0]
                    continue
            i += 1
            if item.__class__ is bytes:  # a spool line the C path did not take: its record
                item = _record(item)
            if item.__class__ is int:
                t = item
                assert prev is not None  # a repeat follows a record
                if not tried:
                    split, tried = self._prepare(prev), True
                if split is not None:
                    # this repeat and those right after it (a loop opening one file), a step at a time
                    start = i - 1
                    while i < count and items[i].__class__ is int:
                        i += 1
                    etype, parts, after_seq, end, core_end = split
                    times: list[bytes] = []
                    for t in cast("list[int]", items[start:i]):
                        if t // 1_000_000_000 != second:
                            second = t // 1_000_000_000
                            text = format_time(second * 1_000_000_000)[:-11]
                        times.append(f"{text}.{t % 1_000_000_000:09d}Z".encode())
                    datas = [(b'"' + time + b'"').join(parts) for time in times]
                    numbers = [b"%d" % n for n in range(seq, seq + len(times))]
                    lines += [
                        join((b'{"data":', d, id_, q, runid, q, after_seq, time, end))
                        for d, q, time in zip(datas, numbers, times, strict=True)
                    ]
                    cores += [join((b'{"data":', d, core_end)) for d in datas]
                    etypes += [etype] * len(times)
                    seq += len(times)
                    continue
                else:
                    rec = prev.copy()
                    rec["t"] = t
                    etype, subject, t_ns, data = to_event(rec)
                    line, core = self._line(etype, subject, t_ns, data, seq)
                    lines.append(line)
                    cores.append(core)
            else:
                rec = prev = cast(SpoolRecord, item)
                split, tried = None, False
                if rec["k"] == "open" and "n" not in rec and "tl" not in rec and rec["path"].__class__ is str:
                    # to_event and _line in one for the most frequent record (records.data: an open
                    # that stands for itself has count 1 and its own time as first and last time,
                    # the event's time too: formatted once)
                    data = cast("dict[str, Any]", rec.copy())
                    del data["k"], data["t"]
                    t = rec["t"]
                    if t // 1_000_000_000 != second:
                        second = t // 1_000_000_000
                        text = format_time(second * 1_000_000_000)[:-11]
                    when = f"{text}.{t % 1_000_000_000:09d}Z"
                    data["count"] = 1
                    data["first_time"] = data["last_time"] = when
                    d = dumps(data)
                    path = rec["path"]
                    if path is not self._subject:
                        # the path's JSON is in the data's already, between its key and the next
                        # (",\"path\":" and ",\"pid\":" are never inside a JSON string: a quote there
                        # follows a backslash)
                        at = d.find(b',"path":')
                        to = d.find(b',"pid":', at)
                        self._subject_json = d[at + 8 : to] if at > 0 and to > 0 else dumps(path)
                        self._subject = path
                    s = self._subject_json
                    digits = b"%d" % seq
                    etype = fmt.FILE_OPEN
                    lines.append(
                        join(
                            (b'{"data":', d, id_, digits, runid, digits, after_source, s,
                             b',"time":"', when.encode(), open_end)
                        )
                    )  # fmt: skip
                    cores.append(join((b'{"data":', d, core_mid, s, open_type)))
                else:
                    etype, subject, t_ns, data = to_event(rec)
                    line, core = self._line(etype, subject, t_ns, data, seq)
                    lines.append(line)
                    cores.append(core)
            etypes.append(etype)
            seq += 1
        if lines:
            longest = max(longest, *map(len, lines))
            pieces.append(join(lines))
            hashed.append(_hashes(cores))
        size = sum(map(len, pieces))
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
        if defer:
            cast(Deferring, self.root).add_deferred(hashed)
        else:
            self.root.add_lines(join(cast("list[bytes]", hashed)))
        self.out.feed(join(pieces))
        self.size += size
        self.seq = seq
        for etype, n in collections.Counter(etypes).items():
            self.counts[etype] = self.counts.get(etype, 0) + n
        for etype, n in made.items():
            self.counts[etype] = self.counts.get(etype, 0) + n
        return True

    def _full_each(
        self, marked: Iterable[SpoolRecord | int | bytes], state: _Repeats, capped: dict[str, int]
    ) -> None:
        """write_full's events one by one, each under the caps (_put)."""
        prev, split, tried = state.prev, state.split, state.tried
        for item in marked:
            if item.__class__ is bytes:
                item = _record(item)
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


def _record(item: SpoolRecord | int | bytes) -> SpoolRecord | int:
    """write_full's item, a spool line (bytes: the record's JSON, bundle/premade.py) parsed."""
    return (
        cast(SpoolRecord, orjson.loads(item)) if item.__class__ is bytes else cast("SpoolRecord | int", item)
    )


_WRITES = frozenset(("write", "create"))  # an open with these: the provenance tie reads its time


def feed_trace(
    trace: runtime_trace.Trace, marked: Iterable[SpoolRecord | int | bytes], prev: SpoolRecord | None
) -> SpoolRecord | None:
    """A signed bundle's trace fed the events of `marked` (write_full's items, all written), as
    emit and _full_each feed it; `prev`: the record before them (the one a first repeat repeats).
    Returns the last record. An open that neither writes nor creates is taken as its record: the
    trace reads its path, result and access, which its event's data holds as they are (a repeat:
    the same), and not its time."""
    open_data = trace.open_data
    for item in marked:
        if item.__class__ is bytes:
            item = _record(item)
        if item.__class__ is int:
            assert prev is not None  # a repeat follows a record
            rec = prev
        else:
            rec = prev = cast(SpoolRecord, item)
        if rec["k"] == "open" and _WRITES.isdisjoint(rec.get("access") or ()):
            open_data(rec)
            continue
        if item.__class__ is int:
            rec = rec.copy()
            rec["t"] = item
        etype, _, t_ns, data = to_event(rec)
        trace.feed_at(etype, t_ns, data)
    return prev


class FullWriter:
    """EventSink.write_full fed a part at a time (the recorder's records as it spools them:
    bundle/premade.py): the same batches of _FULL_BATCH, cut at the same records, so the same caps
    decisions and the same bytes as one write_full over all of them. `end` writes the last batch."""

    def __init__(self, sink: EventSink, capped: dict[str, int]) -> None:
        self.sink = sink
        self.capped = capped
        self.state = _Repeats()
        self.batch: list[SpoolRecord | int | bytes] = []
        self.near_cap = False
        self.largest = 0  # the most bytes of lines one batch took in

    def add(self, marked: Iterable[SpoolRecord | int | bytes]) -> None:
        batch = self.batch
        items = marked if marked.__class__ is list else list(marked)
        at, count = 0, len(items)
        while at < count:  # cut where an item at a time would be: every _FULL_BATCH items
            room = _FULL_BATCH - len(batch)
            batch += items[at : at + room]
            at += room
            if len(batch) >= _FULL_BATCH:
                self._take()

    def _take(self) -> None:
        before, prev = self.sink.size, self.state.prev
        if self.near_cap or not self.sink._full_batch(self.batch, self.state):
            self.near_cap = True
            self.sink._full_each(self.batch, self.state, self.capped)  # (feeds a trace as it writes)
        elif self.sink.trace is not None:  # a signed bundle's: every event of the batch was written
            feed_trace(self.sink.trace, self.batch, prev)
        self.largest = max(self.largest, self.sink.size - before)
        self.batch.clear()

    def end(self) -> None:
        if self.batch:
            self._take()
