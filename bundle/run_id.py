"""What a run's content-addressed run id is made of (`Behaviour`), and the run id itself.

`Behaviour` holds what the run did, normalised by the run's roots (its workspace and tmp become
placeholders), as sets: how often and when do not change the run id. The recorder feeds it record
by record as it spools them (so the writer, bundle/writer.py, need not read the spool for it); for a
spool recovered after a crash the writer's own pass feeds it. Its sets are bounded: past the memory
budget (MEMORY_ITEMS, shared with the writer) they go to disk as sorted runs, merged back when the
run id is made, so a job that floods execs or distinct paths cannot grow the recorder's memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import io
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import zstandard

from evidence.bundle import canonical
from evidence.bundle.normalize import Normalizer
from evidence.bundle.record_types import SpoolRecord
from evidence.bundle.sink import compiled

_fast = compiled()  # the C hot path: plain opens' file items, a spill's sorted lines, the merge

logger = logging.getLogger(__name__)

# Records and behaviour items the writer holds in memory at most (EVIDENCE_WRITER_MEMORY sets it;
# tests use a small value). Past it, a summary bundle's events are streamed by a second pass over
# the spool instead of kept, and the run id's sorted sets go to sorted runs on disk, merged when the
# run id is made: a job that floods execs or, under full detail, distinct paths cannot grow the
# writer's memory (the recorder's or the agent's) with the number of its records.
MEMORY_ITEMS = int(os.environ.get("EVIDENCE_WRITER_MEMORY", "150000"))
# A run's Behaviour while it is recorded holds a quarter of that: an agent records many runs at once.
RECORDING_ITEMS = max(1, MEMORY_ITEMS // 4)


class _SpillSet:
    """A set of behaviour items that yields the canonical JSON of each, sorted by repr; past the
    budget of its Behaviour, its items go to disk as a sorted run and are merged back."""

    def __init__(self, owner: Behaviour) -> None:
        self.owner = owner
        self.items: set[tuple[Any, ...]] = set()
        self.runs: list[IO[bytes]] = []
        self.added: list[tuple[Any, ...]] = []  # the items' order, for their lines when sorted
        # the C path's items (plain opens' file items, Behaviour.add_many): kept as their lines in
        # a sorted run (repr, a tab, canonical JSON, a newline) alone, no Python object each
        self.fast: Any = _fast.LineSet() if _fast is not None else None
        # its spill on a thread of its own (sorted and written without the GIL, beside the
        # correlator): one at a time, waited for before the runs are read (_settle)
        self._spilling: threading.Thread | None = None
        self._spill_error: BaseException | None = None

    def add(self, item: tuple[Any, ...]) -> None:
        if item not in self.items:
            self.items.add(item)
            self.added.append(item)
            self.owner.held += 1
            if self.owner.held > self.owner.budget:
                self.owner.spill()

    def __len__(self) -> int:
        """The items held in memory (Python's and the C path's: one item may be in both)."""
        return len(self.items) + (len(self.fast) if self.fast is not None else 0)

    def __bool__(self) -> bool:
        return bool(len(self) or self.runs)

    def spill(self) -> None:
        """The items held go to disk as sorted runs: Python's one, the C path's another (sorted and
        written without the GIL); the merge takes them all (canonical_items, hash_items)."""
        held = len(self)
        if self.items:
            run = self._run()
            lines = self._sorted(fast=False)
            run.write(b"".join(lines))  # (one write: writelines' calls were 2/3 of a spill)
            run.seek(0)
        if self.fast is not None and len(self.fast):
            self._settle()  # (two sets' lines held at most: the one spilling and the one filling)
            taken, run = self.fast.take(), self._run()

            def spill() -> None:
                try:
                    taken.spill(run.fileno())  # (on the descriptor: the file object's buffer is empty)
                    run.seek(0)
                except BaseException as e:  # noqa: BLE001 - raised by _settle, on the set's own thread
                    self._spill_error = e

            self._spilling = threading.Thread(target=spill, name="evidence-run-id-spill", daemon=True)
            self._spilling.start()
        self.owner.held -= held
        self.items = set()
        self.added = []

    def _settle(self) -> None:
        """Wait for the C path's spill under way, and raise its error."""
        if self._spilling is not None:
            self._spilling.join()
            self._spilling = None
        error, self._spill_error = self._spill_error, None
        if error is not None:
            raise error

    def _run(self) -> IO[bytes]:
        run = tempfile.TemporaryFile(dir=self.owner.tmp_dir)  # noqa: SIM115 - read back by canonical_items, closed by close()
        self.runs.append(run)
        return run

    def _sorted(self, fast: bool = True) -> list[bytes]:
        """The lines of the items held in memory (`fast`: the C path's too), sorted: by their
        repr's UTF-8 bytes, as code points sort, the order of sorted(items, key=repr) (no repr holds
        a tab or a newline, and one item has one repr); an item both in Python's set and the C
        path's, twice (taken once by the merge)."""
        dumps = canonical.dumps_unchecked
        lines = self.fast.lines() if fast and self.fast is not None else []
        lines += [repr(i).encode("utf-8", "surrogatepass") + b"\t" + dumps(i) + b"\n" for i in self.added]
        lines.sort()
        return lines

    def canonical_items(self) -> Iterator[bytes]:
        """The canonical JSON of every item once, in the order of sorted(items, key=repr): the runs'
        lines merged as bytes (in key order: a key's tab sorts before any character of a longer
        key, whose repr holds none below a space), an item spilled in one run and added again after
        it (the same line) taken once."""
        self._settle()
        lines: Iterator[bytes] = iter(self._sorted())
        if self.runs:
            lines = heapq.merge(lines, *map(_run_lines, self.runs))
        last = None
        for line in lines:
            if line != last:
                last = line
                yield line[line.index(b"\t") + 1 : -1]

    def hash_items(self, update: Callable[[bytes], object]) -> None:
        """canonical_items joined by commas, into `update` (a hash's) in pieces: merged in C
        without the GIL when built (src/fast/_fast.c: merge_items; 2M items 0.1 s, not 1), else
        a few thousand at a time."""
        self._settle()
        if _fast is not None:
            for run in self.runs:
                run.flush()  # (read by its descriptor, from its start)
            _fast.merge_items([run.fileno() for run in self.runs], tuple(self._sorted()), update)
            return
        batch: list[bytes] = []
        sep = b""  # (before each batch but the first)
        for item in self.canonical_items():
            batch.append(item)
            if len(batch) >= 4096:
                update(sep + b",".join(batch))
                sep = b","
                batch.clear()
        if batch:
            update(sep + b",".join(batch))

    def close(self) -> None:
        if self._spilling is not None:
            self._spilling.join()  # (its error, if any, goes with the runs: nothing reads them now)
            self._spilling = None
        for run in self.runs:
            run.close()


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _run_lines(run: IO[bytes]) -> Iterator[bytes]:
    """A sorted run's lines from its start: as written (Python's spill), or decompressed (the C
    path's, one zstandard frame: src/fast/_fast.c lineset_spill)."""
    run.seek(0)
    if run.read(4) != _ZSTD_MAGIC:
        run.seek(0)
        yield from run
        return
    run.seek(0)
    reader = zstandard.ZstdDecompressor().stream_reader(run, closefd=False)
    yield from io.BufferedReader(reader)


class Behaviour:
    """What the run id is made of: what the run did, with the run's roots (workspace, tmp) replaced
    by their placeholders, as sets (how often and when do not change it). Fed record by record: by
    the recorder as it spools them (SpoolWriter's `feed`), so that the writer need not read the spool
    for it, or by the writer's own pass over the records. Its run id is made once."""

    def __init__(
        self, roots: Mapping[str, str] | None = None, budget: int | None = None, tmp_dir: Path | None = None
    ) -> None:
        self.roots = dict(roots or {})  # the writer uses it only for a run with these same roots
        self.norm = Normalizer(self.roots)
        self.tmp_dir = tmp_dir  # where sets past the budget go (beside the bundle: not a tmpfs in RAM)
        self.budget = MEMORY_ITEMS if budget is None else budget
        self.closed = False
        self.held = 0
        self.execs = _SpillSet(self)
        self.files = _SpillSet(self)
        self.nets = _SpillSet(self)
        self.denials = _SpillSet(self)
        self.changes = _SpillSet(self)
        self.namespaces = _SpillSet(self)
        self.sets = (self.execs, self.files, self.nets, self.denials, self.changes, self.namespaces)
        # the roots as UTF-8, for the C path's file items (None: not taken there)
        self.fast_roots: tuple[bytes, ...] | None = None
        plain = self.norm.roots()
        if _fast is not None and plain is not None:
            with contextlib.suppress(UnicodeEncodeError):
                self.fast_roots = tuple(root.encode() for root in plain)

    def spill(self) -> None:
        """Past the budget: the set holding the most items goes to disk."""
        max(self.sets, key=len).spill()

    def add_many(self, recs: Iterable[SpoolRecord | bytes]) -> None:
        """Add records as they are spooled; an item that is bytes is an open's spool line, which adds
        nothing: a repeated open's (the record before it but for its time), or a plain open's whose
        item the C path added as it made the line (agent/recorder/pipeline.py: process_opens, into
        `fast_files`, counted by `took`)."""
        add = self.add
        if self.fast_roots is not None and recs.__class__ is list:
            # plain opens' file items in C (their paths their own normal form), the rest below
            added, recs = self.files.fast.add_files(recs, self.fast_roots)
            self.held += added
            if self.held > self.budget:
                self.spill()
        for rec in recs:
            if rec.__class__ is not bytes:  # (not isinstance: this runs for every record spooled)
                add(rec)  # type: ignore[arg-type] # a record: mypy does not narrow by __class__

    def fast_files(self) -> tuple[Any, tuple[bytes, ...]] | None:
        """Where the C path adds plain opens' file items as it makes their spool lines (the files'
        LineSet, its roots as add_files takes them), or None: not taken there."""
        if self.fast_roots is None or self.files.fast is None or self.closed:
            return None
        return self.files.fast, self.fast_roots

    def took(self, added: int) -> None:
        """`added` items new to `fast_files`'s set (spilled past the budget, as add_many does)."""
        self.held += added
        if self.held > self.budget:
            self.spill()

    def add(self, rec: SpoolRecord) -> None:
        norm = self.norm
        # each test of `k` narrows the record's type (not through a local copy): opens first
        if rec["k"] == "open":
            self.files.add((norm.text(rec["path"]), tuple(rec["access"]), rec["result"]))
        elif rec["k"] == "exec":
            self.execs.add((norm.text(rec["filename"]), tuple(norm.argv(rec["argv"])), rec["result"]))
        elif rec["k"] == "connect":
            self.nets.add((rec["family"], norm.text(rec["address"]), rec.get("port"), rec["result"]))
        elif rec["k"] == "change":
            target = rec.get("target")
            self.changes.add(
                (
                    rec["operation"],
                    norm.text(rec["path"]),
                    norm.text(target) if target else None,
                    rec["result"],
                )
            )
        elif rec["k"] == "denial":
            self.denials.add((rec["operation"], norm.text(rec["target"]), rec["rule"], rec["enforced"]))
        elif rec["k"] == "namespace":
            paths = tuple(norm.text(p) for p in rec["paths"])
            self.namespaces.add((rec["operation"], tuple(rec["flags"]), paths, rec["result"]))

    def run_id(self, command: list[str]) -> str:
        """`run-` and the first half of the sha256 of the canonical JSON of {command, execs, files,
        connects, denials, and changes and namespaces when there are some}, each set sorted by repr:
        streamed into the hash, as canonical.dumps would write the whole document."""
        parts: dict[str, _SpillSet | None] = {
            "command": None,
            "execs": self.execs,
            "files": self.files,
            "connects": self.nets,
            "denials": self.denials,
        }
        if self.changes:  # only when there are some: a run id made before file changes were recorded holds
            parts["changes"] = self.changes
        if self.namespaces:  # the same: only when there are some
            parts["namespaces"] = self.namespaces
        h = hashlib.sha256(b"{")
        for i, name in enumerate(sorted(parts)):
            h.update(b"," * (i > 0) + canonical.dumps(name) + b":")
            part = parts[name]
            if part is None:
                h.update(canonical.dumps(self.norm.argv(command), check=False))
                continue
            h.update(b"[")
            part.hash_items(h.update)
            h.update(b"]")
        h.update(b"}")
        self.close()
        return "run-" + h.hexdigest()[:32]

    def close(self) -> None:
        """Let go of the sets' runs on disk; a closed Behaviour makes no run id."""
        self.closed = True
        for part in self.sets:
            part.close()
