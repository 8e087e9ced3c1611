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

An event's line, its content hash and the caps are bundle/sink.py's; a full-detail run's lines
may be made while it records (bundle/premade.py), and then this puts its run id in them; the run
id's sets are bundle/run_id.py's; the tar.gz is bundle/deflate.py's.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
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
from evidence.bundle.deflate import CHUNK, IN_FLIGHT, Deflater, write_tar_gz
from evidence.bundle.premade import Made, put_run_id, translation_for
from evidence.bundle.record_types import SpoolRecord
from evidence.bundle.records import Key, occurrences, summary_key, to_event

# the run id's Behaviour and the memory budget it shares with the writer (agent/recorder/recording.py
# imports them from here)
from evidence.bundle.run_id import MEMORY_ITEMS as MEMORY_ITEMS
from evidence.bundle.run_id import RECORDING_ITEMS as RECORDING_ITEMS
from evidence.bundle.run_id import Behaviour as Behaviour
from evidence.bundle.sink import Caps as Caps
from evidence.bundle.sink import Event, feed_trace
from evidence.bundle.sink import EventSink as _EventSink
from evidence.files import atomic_write

if TYPE_CHECKING:
    from evidence.bundle import attestation
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


Body = Iterable[Event]  # a _FullDetail for full detail


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
    premade: Made | None = None,
) -> dict[str, Any]:
    """Write the bundle atomically (temp file + rename) and return its manifest. Records past the
    caps are counted by kind (`over_cap:<type>` in the manifest's lost), never silently dropped.
    With a `signer` (signing.load_signer(key_path)), the bundle is signed: its third member is the
    attestation. `behaviour`: the run id's Behaviour, fed with every one of `records` as they were
    spooled (used only when made with the run's roots and not used before; else it is rebuilt).
    `lines`: the same records as the spool's lines (spool.read_spool_lines), which full detail
    reads instead: a repeat of the line before it but for its time is not parsed. `premade`: full
    detail's lines made as the run was recorded (bundle/premade.py), used when they hold (the same
    bytes as made from the spool)."""
    out_path = Path(out_path)
    if behaviour is not None and (behaviour.closed or behaviour.roots != dict(meta.roots)):
        behaviour.close()
        behaviour = None
    with no_cycle_collection():
        if premade is not None:
            try:
                return _write_bundle(out_path, meta, records, caps, signer, behaviour, lines, premade)
            except _FromSpool:
                logger.info("full detail's events near the compressed cap: made again from the spool")
                premade.close()
                behaviour = None  # made into the run id already: the spool's pass makes it again
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


class _FromSpool(Exception):
    """The premade lines cannot be used after all (near the compressed cap): made from the spool."""


# what Deflater.compressed_bound adds at most to the bytes deflated: the chunks in flight and the
# one being gathered, as they are, and its margins
_IN_FLIGHT_BOUND = (IN_FLIGHT + 1) * CHUNK * 65 // 64 + 64 * (IN_FLIGHT + 1)
_PREMADE_READ = 4 * CHUNK


def _take_premade(sink: _EventSink, root: fmt.RootHasher, premade: Made, run_id: str) -> None:
    """The premade lines, the run id in place of their placeholder, after the head events."""
    table = translation_for(run_id)
    if table is None or sink.seq != premade.head:  # pragma: no cover - run ids have one form
        raise _FromSpool
    for piece in premade.lines.read(_PREMADE_READ):  # whole chunks: handed to the deflater as they are
        sink.out.feed(put_run_id(piece, table))
    for piece in premade.hashes.read(_PREMADE_READ):
        root.add_lines(piece)
    sink.size += premade.size
    sink.seq = premade.seq
    for etype, n in premade.counts.items():
        sink.counts[etype] = sink.counts.get(etype, 0) + n


def _write_bundle(
    out_path: Path,
    meta: RunMeta,
    records: Records,
    caps: Caps | None,
    signer: attestation.Signer | None,
    behaviour: Behaviour | None,
    lines: Lines | None,
    premade: Made | None = None,
) -> dict[str, Any]:
    out_dir = out_path.parent if str(out_path.parent) else Path(".")
    run_id, body = _read(meta, records, tmp_dir=out_dir, behaviour=behaviour, lines=lines)
    heads = list(_head(meta))
    if premade is not None and not (
        isinstance(body, _FullDetail) and premade.usable(meta.labels, len(heads), caps)
    ):
        premade = None
    with tempfile.TemporaryFile(dir=out_dir) as deflated:
        deflater = Deflater(deflated)  # the events, deflated on threads of their own as they come
        try:
            root = fmt.RootHasher()
            sink = _EventSink(deflater, run_id, meta.labels, caps, root)
            # a signed bundle's trace fed the records' events as they came (Premade): the head
            # events, fed after them, change nothing of it (run.started and degradations: no
            # exec, open, connect or DNS answer)
            fed = (
                premade.trace
                if premade is not None and {h[0] for h in heads} <= {fmt.RUN_STARTED, fmt.DEGRADATION}
                else None
            )
            if signer is not None:  # only a signed bundle needs the trace (and its imports)
                from evidence.bundle import runtime_trace

                sink.trace = fed if fed is not None else runtime_trace.Trace()
            for head in heads:
                sink.emit(*head)
            capped: dict[str, int] = {}
            if premade is not None:
                _take_premade(sink, root, premade, run_id)
                if sink.trace is not None and fed is None:  # signed: the records read again for it
                    feed_trace(sink.trace, cast(_FullDetail, body).marked(), None)
            elif isinstance(body, _FullDetail):
                sink.write_full(body.marked(), capped)
            else:
                for event in body:
                    if not sink.emit(*event, capped=True):
                        kind = "over_cap:" + event[0].removeprefix("dev.evidence.")
                        capped[kind] = capped.get(kind, 0) + 1
            for end in _tail(meta, capped):
                sink.emit(*end)
            events_sha = deflater.finish()
            # the premade lines were made without the compressed cap: used if, made from the spool,
            # they would not have reached it either (its estimate is at most the bytes deflated,
            # the chunks in flight and a batch over them)
            if premade is not None and (
                deflater.compressed + _IN_FLIGHT_BOUND + premade.largest * 65 // 64 + 4096
                > sink.caps.compressed
            ):
                raise _FromSpool
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
            "root_hash": root.hexdigest(),
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
