"""Each subject tied to the run that made it, from the recorded events (pure).

`Tracker.feed(type, time, data)` takes the events in order (the writer's as it writes them, or a
verified bundle's); `Tracker.ties(artifacts, started_at, finished_at)` then says, for each subject
(format.ArtifactFile), whether the run wrote it:

- written: the latest thing the run did to its path (resolved as the events name it) was a write
  (a successful open for writing or creating, a truncate) by a process of the run, named by its pid,
  its program and that program's sha256 (the latest exec of the pid, or of its parent for a forked
  child that did not exec, before the write); or a rename (or link) into place whose source the run
  wrote (followed back through at most MAX_HOPS renames);
- not written, with the reason: the run never wrote, created or renamed anything into the path (it
  existed before and was left alone, or something outside the run made it); the run removed or
  moved it away after its last write; it was renamed into place from a file the run did not write;
  or what is there now is not what the run left: its ctime (which no process can set) is after the
  run ended, or before the run started, or more than CTIME_SLACK_NS before the run's last write, or
  more than CTIME_SLACK_NS after every process that could have written it had exited (the writer
  and the processes forked from it, by their recorded exits: a descriptor passed over a socket
  to another process is not followed, so such a file is called not written, the safe side).

What the events cannot say (docs/bundle-format.md "Artifacts"): they record opens and renames, not
each write, and neither sizes nor inode numbers, so a process outside the run that writes to the
file while a process of the run that could write it is still alive is not told apart from the run; a write in another mount namespace (`mntns: "other"`) or through a name
with a `..` may have named another file, so it does not count as the run's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from typing import Any, Literal, TypedDict

from evidence.bundle import format as fmt

logger = logging.getLogger(__name__)

MAX_HOPS = 8  # renames followed back from a subject
MAX_OPS = 16  # latest operations kept per path
CTIME_SLACK_NS = 1_000_000_000  # file times are taken from a coarse clock; event times from another
_WRITE = frozenset(("write", "create"))


@dataclasses.dataclass(frozen=True)
class _Op:
    t: str  # the event's last time (canonical times compare as text)
    kind: Literal["write", "rename", "remove"]
    pid: int
    ppid: int
    exe: str | None
    source: str | None = None  # rename: the old name


class WriterJSON(TypedDict):
    pid: int
    program: str | None
    sha256: str | None


class TieJSON(TypedDict):
    """How a subject is tied to the run: the `annotations` of its fileAccess entry."""

    subject: str
    writtenByRun: bool
    how: str | None  # "written" | "renamed"
    at: str | None
    writer: WriterJSON | None
    renamedFrom: str | None
    renamedBy: int | None
    reason: str | None


@dataclasses.dataclass(frozen=True)
class Tie:
    name: str
    path: str
    sha256: str
    size: int
    written: bool
    how: Literal["written", "renamed"] | None = None
    at: str | None = None
    writer: WriterJSON | None = None
    renamed_from: str | None = None
    renamed_by: int | None = None
    reason: str | None = None

    def to_json(self) -> TieJSON:
        return {
            "subject": self.name,
            "writtenByRun": self.written,
            "how": self.how,
            "at": self.at,
            "writer": self.writer,
            "renamedFrom": self.renamed_from,
            "renamedBy": self.renamed_by,
            "reason": self.reason,
        }


def _time(data: Mapping[str, Any], fallback: str) -> str:
    t = data.get("last_time")
    return t if isinstance(t, str) else fallback


class Tracker:
    """The events a tie needs: every exec, and the latest operations on every path the run wrote,
    renamed or removed (reads are not kept: a run that reads 100k files costs nothing here)."""

    def __init__(self) -> None:
        self.execs: dict[int, list[tuple[str, str, str | None]]] = {}  # pid -> (time, filename, sha256)
        self.ops: dict[str, list[_Op]] = {}
        self.parent: dict[int, int] = {}  # pid -> ppid (the correlator's: the parent it forked from)
        self.exits: dict[int, list[str]] = {}  # pid -> the times it exited

    def _op(self, path: str, op: _Op) -> None:
        ops = self.ops.setdefault(path, [])
        ops.append(op)
        if len(ops) > MAX_OPS:
            del ops[0]

    def feed(self, etype: str, time: str, data: Mapping[str, Any]) -> None:
        if etype in (fmt.PROCESS_EXEC, fmt.PROCESS_EXIT) and isinstance(data.get("pid"), int):
            if isinstance(data.get("ppid"), int):
                self.parent[data["pid"]] = data["ppid"]
            if etype == fmt.PROCESS_EXIT:
                self.exits.setdefault(data["pid"], []).append(time)
                return
            if data.get("result") == 0 and isinstance(data.get("pid"), int):
                self.execs.setdefault(data["pid"], []).append(
                    (time, data.get("filename") or "", data.get("sha256"))
                )
            return
        if etype not in (fmt.FILE_OPEN, fmt.FILE_CHANGE):
            return
        if data.get("result") != 0 or data.get("mntns") is not None:
            return  # failed; or in another mount namespace: its path may name another file
        path = data.get("path")
        if not isinstance(path, str) or fmt.has_dotdot(path):
            return
        pid, ppid, exe = data.get("pid", 0), data.get("ppid", 0), data.get("exe")
        t = _time(data, time)
        if etype == fmt.FILE_OPEN:
            if _WRITE.intersection(data.get("access") or ()):
                self._op(path, _Op(t, "write", pid, ppid, exe))
            return
        operation = data.get("operation")
        target = data.get("target")
        if operation == "truncate":
            self._op(path, _Op(t, "write", pid, ppid, exe))
        elif operation == "unlink":
            self._op(path, _Op(t, "remove", pid, ppid, exe))
        elif operation in ("rename", "link") and isinstance(target, str) and not fmt.has_dotdot(target):
            self._op(target, _Op(t, "rename", pid, ppid, exe, source=path))
            if operation == "rename":
                self._op(path, _Op(t, "remove", pid, ppid, exe))

    def feed_events(self, events: Iterable[Mapping[str, Any]]) -> None:
        for ev in events:
            self.feed(ev["type"], ev["time"], ev["data"])

    def _program(self, pid: int, ppid: int, t: str) -> tuple[str | None, str | None]:
        for who in (pid, ppid):
            before = [e for e in self.execs.get(who, ()) if e[0] <= t]
            if before:
                _, filename, sha = before[-1]
                return filename, sha
        return None, None

    def _writer(self, op: _Op) -> WriterJSON:
        program, sha = self._program(op.pid, op.ppid, op.t)
        return {"pid": op.pid, "program": program or op.exe, "sha256": sha}

    def _gone(self, pid: int, after: str) -> str | None:
        """When the last process that could hold what `pid` opened at `after` exited: `pid` and
        the processes forked from it (transitively), each by its latest recorded exit after that
        time; None when one of them has no such exit (not known to be gone)."""
        children: dict[int, list[int]] = {}
        for child, parent in self.parent.items():
            children.setdefault(parent, []).append(child)
        last = ""
        todo, seen = [pid], {pid}
        while todo:
            p = todo.pop()
            ended = self.exits.get(p, [])
            ends = [t for t in ended if t >= after]
            if not ends:
                if ended and p != pid:
                    continue  # exited before the write: it held nothing of it
                return None  # not known to have exited since
            last = max(last, *ends)
            for c in children.get(p, ()):
                if c not in seen:
                    seen.add(c)
                    todo.append(c)
        return last or None

    def _last(self, path: str, before: str | None) -> _Op | None:
        """The latest operation on `path` (`before`: up to a rename from it at that time, which
        itself removed it then: a removal at that very time is not counted)."""
        ops = [
            o
            for o in self.ops.get(path, ())
            if before is None or o.t < before or (o.t == before and o.kind != "remove")
        ]
        if not ops:
            return None
        # the latest; at the same time, a placement wins over a removal (rename's source and target)
        return max(ops, key=lambda o: (o.t, o.kind != "remove"))

    def tie(self, f: Mapping[str, Any], started_at: str, finished_at: str) -> Tie:
        """The tie of one subject (a format.ArtifactFile as JSON)."""
        name, path = f["name"], f["path"]
        base = {"name": name, "path": path, "sha256": f["sha256"], "size": f["size"]}
        op = self._last(path, None)
        if op is None:
            why = f"the run did not write, create or rename anything into {path}: it was there before, or made outside the run"
            return Tie(**base, written=False, reason=why)
        if op.kind == "remove":
            why = f"the run removed or moved {path} away at {op.t}, after it last wrote it: what is there now came from elsewhere"
            return Tie(**base, written=False, reason=why)
        placed = op
        src_op: _Op | None = op
        hops = 0
        while src_op is not None and src_op.kind == "rename" and hops < MAX_HOPS:
            assert src_op.source is not None
            source = src_op.source
            src_op = self._last(source, src_op.t)
            hops += 1
            if src_op is None or src_op.kind == "remove":
                why = f"renamed into place from {source}, which the run did not write"
                return Tie(
                    **base, written=False, renamed_from=placed.source, renamed_by=placed.pid, reason=why
                )
        if src_op is None or src_op.kind != "write":
            why = f"renamed into place through more than {MAX_HOPS} names: its writer was not followed"
            return Tie(**base, written=False, renamed_from=placed.source, renamed_by=placed.pid, reason=why)
        how: Literal["written", "renamed"] = "renamed" if placed.kind == "rename" else "written"
        found = {
            "how": how,
            "at": placed.t,
            "writer": self._writer(src_op),
            "renamed_from": placed.source,
            "renamed_by": placed.pid if placed.kind == "rename" else None,
        }
        ctime = f["ctime"]
        if ctime > finished_at:
            why = f"changed after the run ended: its ctime {ctime} is after {finished_at}"
            return Tie(**base, written=False, **found, reason=why)  # type: ignore[arg-type]
        if ctime < started_at:
            why = f"unchanged during the run: its ctime {ctime} is before the run started"
            return Tie(**base, written=False, **found, reason=why)  # type: ignore[arg-type]
        try:
            early = fmt.parse_time(placed.t) - fmt.parse_time(ctime) > CTIME_SLACK_NS
        except ValueError:
            early = False
        if early:
            why = (
                f"its ctime {ctime} is before the run's last write of it at {placed.t}: not the file it wrote"
            )
            return Tie(**base, written=False, **found, reason=why)  # type: ignore[arg-type]
        gone = self._gone(src_op.pid, src_op.t)
        if gone is not None and _later(ctime, max(gone, placed.t)):
            why = (
                f"changed at {ctime}, after every process of the run that could have written it had "
                f"exited (the last at {gone}): replaced by a process outside the run"
            )
            return Tie(**base, written=False, **found, reason=why)  # type: ignore[arg-type]
        return Tie(**base, written=True, **found)  # type: ignore[arg-type]

    def ties(self, files: Iterable[Mapping[str, Any]], started_at: str, finished_at: str) -> list[Tie]:
        return [self.tie(f, started_at, finished_at) for f in files]


def _later(a: str, b: str) -> bool:
    """Whether time `a` is more than CTIME_SLACK_NS after time `b`."""
    try:
        return fmt.parse_time(a) - fmt.parse_time(b) > CTIME_SLACK_NS
    except ValueError:
        return False


def ties_of(manifest: Mapping[str, Any], events: Iterable[Mapping[str, Any]]) -> list[Tie]:
    """The ties of a (verified) bundle's subjects: [] when it has none."""
    artifacts = manifest.get("artifacts")
    if not artifacts:
        return []
    tracker = Tracker()
    tracker.feed_events(events)
    return tracker.ties(artifacts["files"], manifest["started_at"], manifest["finished_at"])
