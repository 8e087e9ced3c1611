"""Verification of a bundle: the manifest, then every event, in one pass that says what is wrong."""

from __future__ import annotations

import collections
import datetime as _dt
import hashlib
import json
import logging
import os
import pickle
import stat
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import IO, Any, cast

import orjson
import pydantic

from evidence.bundle import attestation, schemas
from evidence.bundle import format as fmt
from evidence.bundle.container import (
    BLOCK,
    Ahead,
    Fatal,
    Limits,
    Stream,
    check_trailer,
    header,
    inflate,
    parse,
    unexpected,
    whole_lines,
)
from evidence.bundle.fastpath import TIME, Context, Helper, Passed, Piece, Start, check_piece, fast
from evidence.bundle.read_types import EventJSON, ManifestJSON
from evidence.errors import BundleError

logger = logging.getLogger(__name__)

MAX_PROBLEMS = 20
PARALLEL_MIN = 1 << 20  # compressed bytes: a smaller bundle is checked in this process alone
# decompressed bytes inflated at a time (so a piece's size) when no helper process takes pieces:
# below glibc's threshold for a buffer of its own (128 KiB), so that the chunk, its lines and their
# copies reuse the heap's memory; megabyte pieces took fresh pages for each bundle, ~500 page
# faults and ~1.5 ms of a 2,000-event bundle's ~12 ms lint (issue 25: the fleet publisher)
_PIECE = 120 << 10
_AHEAD = 12  # pieces read ahead of the consumer (bounds the memory)
_ENVELOPE_KEYS = frozenset(
    ("specversion", "id", "source", "type", "subject", "time", "datacontenttype", "runid", "seq", "data")
)
_RUN_ID = schemas.py_regex(schemas.RUN_ID_PATTERN).match
_HEX64 = schemas.py_regex(schemas.HEX64_PATTERN).match


class VerificationError(BundleError):
    """The bundle is not a valid evidence bundle (or has been tampered with)."""

    def __init__(self, path: str, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        super().__init__(f"{path}: verification failed: {problems[0]}{more}")

    def __reduce__(self) -> tuple[Any, ...]:  # crosses process boundaries (diff reads A in a worker)
        return (VerificationError, (self.path, self.problems))


class _Stop(Exception):
    """Ends the pass after problems were recorded (adds none of its own)."""


# --- the manifest --------------------------------------------------------------------------------

_epoch_days: dict[str, int] = {}


def time_ns(text: str) -> int:
    """ns since the epoch of a canonical bundle time (format.format_time); ValueError if it is not one."""
    if not isinstance(text, str) or not TIME(text):
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


# --- the pass ----------------------------------------------------------------------------------


class Verifier:
    """One pass over a bundle. `run()` yields each event once it has been checked."""

    def __init__(
        self,
        path: str,
        limits: Limits,
        *,
        parallel: bool = False,
        start: Start | None = None,
        ahead: bool = True,
    ) -> None:
        self.path = path
        self.limits = limits
        self.problems: list[str] = []
        # set once the manifest passed its checks (format.Manifest), before anything reads it
        self.manifest: ManifestJSON = cast("ManifestJSON", {})
        self.parallel = parallel
        self.ahead = ahead  # inflating in a thread of its own, ahead of the checks
        self.helper: Helper | None = None
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
        self.manifest_sha256 = ""
        self.attestation: attestation.Attestation | None = None  # a signed bundle's, once checked
        self.complete = False  # the whole bundle was read and found valid

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
            and os.fstat(f.fileno()).st_size >= PARALLEL_MIN
            and Helper.usable()
        ):
            self.helper = Helper()  # forked before the inflating thread starts
        if manifest_only:  # inflated a little at a time, not a CHUNK of the events it never reads
            chunks: Generator[bytes, None, None] | Ahead = inflate(f, self.limits, 1 << 16)
        else:
            most = None if self.helper is not None else _PIECE  # (the helper's pieces: a CHUNK each)
            chunks = Ahead(inflate(f, self.limits, most)) if self.ahead else inflate(f, self.limits, most)
        try:
            yield from self._walk(Stream(chunks), manifest_only)
        except _Stop:
            pass
        except Fatal as e:
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

    def _walk(self, s: Stream, manifest_only: bool) -> Iterator[EventJSON]:
        first = header(s.read(BLOCK))
        if first is None:
            raise Fatal("empty archive: no manifest.json")
        if first.name != fmt.MANIFEST_NAME:
            if first.name == fmt.EVENTS_NAME:
                raise Fatal(f"{fmt.MANIFEST_NAME} must be the first member, found {fmt.EVENTS_NAME}")
            raise unexpected(first)
        if first.size > self.limits.manifest:
            raise Fatal(f"{fmt.MANIFEST_NAME} is larger than the limit of {self.limits.manifest} bytes")
        raw = s.read(first.size)
        if len(raw) < first.size:
            raise Fatal(f"truncated tar archive (inside {fmt.MANIFEST_NAME})")
        s.read((-first.size) % BLOCK)
        self.manifest_sha256 = hashlib.sha256(raw).hexdigest()
        manifest = parse(raw, fmt.MANIFEST_NAME, self.limits)
        bad = _check_manifest(manifest)
        if bad:
            self.problems.extend(bad)
            raise _Stop()
        self.manifest = cast("ManifestJSON", manifest)  # checked against format.Manifest: its shape
        if manifest_only:
            return
        second = header(s.read(BLOCK))
        if second is None:
            raise Fatal(f"archive has no {fmt.EVENTS_NAME}")
        if second.name != fmt.EVENTS_NAME:
            if second.name == fmt.MANIFEST_NAME:
                raise Fatal(f"duplicate member {fmt.MANIFEST_NAME}")
            raise unexpected(second)
        declared = manifest["files"][fmt.EVENTS_NAME]["size"]
        if second.size > self.limits.decompressed:
            raise Fatal(f"{fmt.EVENTS_NAME} is larger than the limit of {self.limits.decompressed} bytes")
        if second.size != declared:
            raise Fatal(f"{fmt.EVENTS_NAME} is {second.size} bytes, the manifest says {declared}")
        yield from self._events(s, second.size)
        s.read((-second.size) % BLOCK)
        block = s.read(BLOCK)
        third = header(block) if len(block) == BLOCK and block != bytes(BLOCK) else None
        if third is None:
            check_trailer(s, block)
        elif third.name != fmt.ATTESTATION_NAME:
            raise unexpected(third)
        else:
            self._attestation(s, third.size)
            check_trailer(s, attested=True)
        self.complete = not self.problems

    def _attestation(self, s: Stream, size: int) -> None:
        """attestation.intoto.json: within its limit, canonical JSON, a DSSE envelope whose statement
        names the members with their digests and agrees with the manifest (bundle/attestation.py).
        The signature is checked against a key by the caller (signing.check)."""
        name = fmt.ATTESTATION_NAME
        if size > self.limits.attestation:
            raise Fatal(f"{name} is larger than the limit of {self.limits.attestation} bytes")
        raw = s.read(size)
        if len(raw) < size:
            raise Fatal(f"truncated tar archive (inside {name})")
        s.read((-size) % BLOCK)
        doc = parse(raw, name, self.limits)
        try:
            att = attestation.parse_envelope(raw, doc, lambda b: parse(b, f"{name} payload", self.limits))
            attestation.check_statement(att, self.manifest, self.manifest_sha256, self.file_hash.hexdigest())
        except attestation.AttestationError as e:
            self.fail(f"{name}: {e}")
            return
        self.attestation = att

    def _events(self, s: Stream, size: int) -> Iterator[Any]:
        """Stream, check and yield the events (or the folds), a piece (about container.CHUNK bytes
        of whole lines) at a time.

        Each event goes through the fast path (fastpath.fast), which passes it or gives up at it,
        and from there the careful path (_careful) takes over, which explains. Once a problem was
        found or run.finished seen, only the careful path is taken. With a helper process, the fast path
        runs on two CPUs: pieces read ahead go to the helper while it has room, the others are
        checked here, in order. When folding, this process does not wait idle for the helper's
        answer about the next piece in line: it checks (and folds) a later piece meanwhile, the
        results then taken in order. A problem found while reading waits in line, so that the
        events before it are checked first, as in one pass."""
        m = self.manifest
        ctx = Context(m["run_id"], m["source"], self.limits.line, fmt.labels_attribute(m.get("labels")))
        start = self.start
        helper = self.helper
        if helper is not None:
            helper.start(ctx, self._start_pickled)
        pieces = whole_lines(s, size, self.limits, self.file_hash.update)
        pending: collections.deque[Piece] = collections.deque()
        lines_read = 0

        def take() -> Piece | None:
            nonlocal pieces, lines_read
            try:
                data = next(pieces)
            except StopIteration:
                return None
            except Fatal as e:
                piece = Piece(b"", lines_read, fatal=e)
                pieces = iter(())
            else:
                piece = Piece(data, lines_read)
                lines_read += piece.shape[0]
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
                    ahead.answer = check_piece(ahead.lines, ahead.seq, ctx, start)
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
                    raise Fatal(f"{fmt.EVENTS_NAME}: more than {self.limits.events} events")
                self.root.update(root)
                self._count(counts)
                self.seq += n
                if start is None:
                    yield from map(orjson.loads, piece.lines)
                else:
                    yield folded
                continue
            n, most = piece.shape
            if most > self.limits.line:
                raise Fatal(f"{fmt.EVENTS_NAME}: a line is longer than {self.limits.line} bytes")
            if self.seq + n > self.limits.events:
                raise Fatal(f"{fmt.EVENTS_NAME}: more than {self.limits.events} events")
            events = self._checked(piece, ctx)
            if start is None:
                yield from events
            else:
                folded = start(piece.seq)
                collections.deque(map(folded.feed, events), maxlen=0)
                yield folded
        self._finish()

    def _checked(self, piece: Piece, ctx: Context) -> Iterator[EventJSON]:
        """The events of the piece's lines that pass, in order: the fast path while it can (over the
        piece's bytes: no list of its lines), then the careful. The run's first event is the careful
        path's (it checks run.started against the manifest); the fast path takes the events after
        it, not the careful path the whole first piece."""
        done = 0
        n = piece.shape[0]
        if self.seq == 0 and n and self._fast():
            yield from self._careful(piece.lines[:1])
            done = 1
        if done < n and self._fast():
            passed = Passed()
            yield from fast(piece.lines[done:] if done else piece.data, self.seq, ctx, passed)
            self.root.update(passed.root_bytes())
            self._count(passed.counts)
            self.seq += passed.n
            done += passed.n
        if done < n:
            yield from self._careful(piece.lines[done:] if done else piece.lines)

    def _fast(self) -> bool:
        """Whether the fast path may be taken: no problem so far and no run.finished yet."""
        return self.ok and self.finished_at < 0

    def _count(self, counts: dict[str, int]) -> None:
        for etype, n in counts.items():
            self.counts[etype] = self.counts.get(etype, 0) + n

    def _careful(self, lines: list[bytes]) -> Iterator[EventJSON]:
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
                    and TIME(ev["time"]) is not None
                    and schemas.DATA_CHECKERS[ev["type"]](ev["data"]) is None
                )
            except (orjson.JSONDecodeError, orjson.JSONEncodeError, AttributeError, KeyError, TypeError):
                good = False
            if good:
                etype = ev["type"]
                if seq == 0 or etype in (fmt.RUN_STARTED, fmt.RUN_FINISHED) or self.finished_at >= 0:
                    why = self._position(ev, seq)
            else:
                why = self._reason(line, seq)  # raises Fatal if the line cannot be parsed
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
        """Why line `seq` is not a valid event (the slow path). Raises Fatal for lines that are not
        canonical JSON at all: after such a line nothing can be trusted."""
        where = f"{fmt.EVENTS_NAME} line {seq + 1}"
        ev = parse(line, where, self.limits)
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
        if type(ev["time"]) is not str or not TIME(ev["time"]):
            return f"time {_show(ev['time'])} is not an RFC 3339 UTC time with nine fraction digits"
        etype = ev["type"]
        check = schemas.DATA_CHECKERS.get(etype) if type(etype) is str else None
        if check is None:
            return f"unknown event type {_show(etype)}"
        bad = check(ev["data"])
        if bad is not None:
            return f"{etype} data {bad}"
        return (
            self._position(cast("EventJSON", ev), seq) or "is not a valid event"
        )  # its envelope checked above

    def _position(self, ev: EventJSON, seq: int) -> str | None:
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
