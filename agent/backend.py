"""The agent's `Backend` over one `Recorder`: runs on existing cgroups, pods, windows, metrics, recovery.

`RecorderBackend` is what agent/api.py talks to. It adds to the recorder, from outside it:

- Attaching late. A run starts on a cgroup that may already hold processes: tracking starts first,
  then an inventory of every process there (argv, cwd, exe, sockets) is written at the head of the
  spool, and those processes become roots of the run's process tree (depth 0, or their depth below
  another inventoried process), so what they do next has a parent.
- Observing the spool. Each session's spool writer is wrapped (`ObservedSpool`): records are counted
  by kind for /metrics, copied to the live event stream, and flushed now and then, so that the spool
  of an agent that dies is readable up to the last flush.
- Recovery. Beside each spool, `<session>.run.json` holds what the bundle's manifest needs. On start,
  `recover_spools` turns every spool a dead agent left into a bundle marked cut short, with a
  degradation event saying so; a spool that cannot be read is moved to `<spool_dir>/failed/`.
- Windows. `rotate` cuts a long-lived run in two with no gap: the new run is tracked before the old
  one is finished, and the old one's untrack is skipped (`HandoverProbes`).
- Isolated runs (`isolate`, for `evidence run --agent`): the agent makes a cgroup of its own for
  the run, starts tracking it, then moves the client's waiting child in; finishing such a run kills
  what the command left in it and removes the cgroup (a run cut short at shutdown is not killed: its
  cgroup is removed only once empty).
- Kubernetes (`PodRuns`): one run per pod cgroup; containers are child cgroups, covered by the
  pod's run; their ids are recorded as labels (events carry no container id: see docs/deploy.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import select
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from agent import k8s
from agent import metrics as m
from agent.api import NotReady, RunConflict, RunInfo, UnknownRun
from agent.inventory import cgroup_pids, read_process, take_inventory
from evidence.errors import SetupError, UsageError

if TYPE_CHECKING:
    from agent.cgroups import RunCgroup
    from agent.delivery import BundleUploader, EventStreamer
    from agent.recorder import Recorder, Session
    from bundle.spool import SpoolWriter

logger = logging.getLogger(__name__)

RUN_META_SUFFIX = ".run.json"
SPOOL_SUFFIX = ".spool.zst"
FLUSH_SECONDS = 2.0
POD_LABEL = "k8s/"


# --- the spool, observed -----------------------------------------------------------------------------


class ObservedSpool:
    """Wraps a session's SpoolWriter: holds records back until the inventory is written first, then
    passes every batch to `observe` as it is written. Thread-safe (the recorder's worker writes,
    the housekeeping thread flushes, the finishing thread closes)."""

    def __init__(self, inner: SpoolWriter, observe: Callable[[list[dict[str, Any]]], None]) -> None:
        self._inner = inner
        self._observe = observe
        self._lock = threading.Lock()
        self._held: list[dict[str, Any]] | None = []  # None once the prelude is written
        self._closed = False
        self._dirty = False

    @property
    def path(self) -> Path:
        return self._inner.path

    @property
    def records(self) -> int:
        return self._inner.records

    def size(self) -> int:
        try:
            return os.stat(self._inner.path).st_size
        except FileNotFoundError:
            return 0

    def _write(self, recs: list[dict[str, Any]]) -> None:
        if recs:
            self._inner.write_many(recs)
            self._dirty = True
            self._observe(recs)

    def set_prelude(self, recs: list[dict[str, Any]]) -> None:
        """Write `recs` (the inventory), then whatever arrived meanwhile."""
        with self._lock:
            if self._held is None or self._closed:
                return
            held, self._held = self._held, None
            self._write(list(recs))
            self._write(held)

    def write_many(self, recs: list[dict[str, Any]]) -> None:
        with self._lock:
            if self._held is not None:
                self._held.extend(recs)
            else:
                self._write(recs)

    def write(self, rec: dict[str, Any]) -> None:
        self.write_many([rec])

    def flush(self) -> None:
        with self._lock:
            if not self._closed and self._dirty:
                self._inner.flush()
                self._dirty = False

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            if self._held is not None:
                held, self._held = self._held, None
                self._write(held)
            self._closed = True
            self._inner.close()


class HandoverProbes:
    """Wraps the recorder's probes so that one untrack can be skipped: when a window is cut, the new
    run already owns the cgroup (track overwrote the map entry), and the old run's finish must not
    take it away. Everything else is passed through."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._keep: dict[int, int] = {}
        self._lock = threading.Lock()

    def keep(self, cgroup_id: int) -> None:
        with self._lock:
            self._keep[cgroup_id] = self._keep.get(cgroup_id, 0) + 1

    def untrack(self, cgroup_id: int) -> None:
        with self._lock:
            n = self._keep.get(cgroup_id, 0)
            if n:
                if n == 1:
                    del self._keep[cgroup_id]
                else:
                    self._keep[cgroup_id] = n - 1
                self._inner.clear_cache()
                return
        self._inner.untrack(cgroup_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


# --- runs --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Run:
    session: Session
    spool: ObservedSpool
    pid: int | None
    bundle_name: str | None = None  # where finish_all / pod runs write it, in the bundle dir
    extensions: dict[str, str] = dataclasses.field(default_factory=dict)
    finishing: bool = False
    lost: dict[str, int] = dataclasses.field(default_factory=dict)  # last read, while active
    seq: int = 0
    cgroup: RunCgroup | None = None  # made by the agent for this run (isolated): removed at finish

    @property
    def info(self) -> RunInfo:
        s = self.session
        return RunInfo(
            session_id=s.session_id,
            cgroup=str(s.cgroup_path),
            labels=dict(s.labels),
            started_ns=s.started_ns,
            attached_late=s.attached_late,
            pid=self.pid,
            isolated=self.cgroup is not None,
        )


def _exited(pidfd: int) -> bool:
    """True once the process behind pidfd has exited (its pidfd polls readable)."""
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(0))


def _file_sha256(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def _write_json_atomic(path: Path, obj: Any) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".evidence-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _depths(inventory: Sequence[Mapping[str, Any]]) -> dict[int, int]:
    """Depth of each inventoried process: 0 when its parent is not in the inventory."""
    parent = {int(r["pid"]): int(r["ppid"]) for r in inventory}
    depth: dict[int, int] = {}

    def of(pid: int, seen: int = 0) -> int:
        if pid in depth:
            return depth[pid]
        pp = parent.get(pid)
        d = 0 if pp is None or pp not in parent or seen > len(parent) else of(pp, seen + 1) + 1
        depth[pid] = d
        return d

    for pid in parent:
        of(pid)
    return depth


class RecorderBackend:
    """The `Backend` of agent/api.py over one Recorder (attached once its probes are loaded)."""

    def __init__(
        self,
        bundle_dir: Path,
        spool_dir: Path,
        *,
        uploader: BundleUploader | None = None,
        streamer: EventStreamer | None = None,
        registry: m.Registry | None = None,
    ) -> None:
        self.bundle_dir = Path(bundle_dir)
        self.spool_dir = Path(spool_dir)
        self.uploader = uploader
        self.streamer = streamer
        self.registry = registry or m.Registry()
        self.recorder: Recorder | None = None
        self._probes: HandoverProbes | None = None
        self._not_ready: str | None = "the probes are loading"
        self._lock = threading.Lock()
        self._runs: dict[str, _Run] = {}
        self._starting: set[Path] = set()
        self._events: dict[str, int] = {}
        self._lost_done: dict[str, int] = {}
        self._started = 0
        self._finished = 0
        self._bundles = 0
        self._bundle_bytes = 0
        self._lag = 0.0
        self._lag_probe_since: float | None = None

    # lifecycle

    def attach(self, recorder: Recorder) -> None:
        self._probes = HandoverProbes(recorder.probes)
        recorder.probes = self._probes  # type: ignore[assignment]
        self.recorder = recorder
        self._not_ready = None

    def set_not_ready(self, reason: str) -> None:
        self._not_ready = reason

    def ready(self) -> str | None:
        return self._not_ready

    def _require_recorder(self) -> Recorder:
        if self.recorder is None or self._not_ready is not None:
            raise NotReady(f"the recorder is not ready: {self._not_ready}")
        return self.recorder

    # starting

    def start(self, cgroup: Path, labels: Mapping[str, str], pid: int | None = None) -> RunInfo:
        return self.start_run(Path(cgroup), labels, pid=pid).info

    def start_run(
        self,
        cgroup: Path,
        labels: Mapping[str, str],
        *,
        pid: int | None = None,
        bundle_name: str | None = None,
        extensions: Mapping[str, str] | None = None,
        replacing: str | None = None,
        session_id: str | None = None,
        detail: str = "summary",
        command: list[str] | None = None,
    ) -> _Run:
        rec = self._require_recorder()
        cgroup = Path(cgroup)
        with self._lock:
            taken = [(r.session.cgroup_path, r.session.session_id) for r in self._runs.values()]
            taken += [(p, "") for p in self._starting]
            for path, sid in taken:
                if replacing is not None and sid == replacing:
                    continue
                if path == cgroup or path in cgroup.parents or cgroup in path.parents:
                    raise RunConflict(
                        f"{cgroup} is already recorded" + (f" (as part of {path})" if path != cgroup else ""),
                        hint="finish that run first",
                    )
            self._starting.add(cgroup)
        try:
            return self._start_locked_out(
                rec, cgroup, labels, pid, bundle_name, extensions, session_id, detail, command
            )
        finally:
            with self._lock:
                self._starting.discard(cgroup)

    def _start_locked_out(
        self,
        rec: Recorder,
        cgroup: Path,
        labels: Mapping[str, str],
        pid: int | None,
        bundle_name: str | None,
        extensions: Mapping[str, str] | None,
        session_id: str | None = None,
        detail: str = "summary",
        command: list[str] | None = None,
    ) -> _Run:
        before = cgroup_pids(cgroup)
        argv: list[str] = []
        cwd = ""
        if pid is not None:
            proc = read_process(pid)
            if proc is not None:
                argv, cwd = list(proc["argv"]), proc["cwd"] or ""
        if command is not None:
            argv = list(command)
        sid = session_id or uuid.uuid4().hex
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        runs: list[_Run] = []  # the run, once made (the spool holds every record back until then)

        def observed(inner: SpoolWriter) -> ObservedSpool:
            return ObservedSpool(inner, lambda recs: self._observe(runs[0], recs))

        try:
            session = rec.start(
                cgroup,
                argv,
                cwd,
                detail=detail,
                labels=dict(labels),
                attached_late=bool(before),
                session_id=sid,
                wrap_spool=observed,
            )
        except FileNotFoundError:
            raise UsageError(f"{cgroup} is gone") from None
        spool = cast(ObservedSpool, session.spool)
        run = _Run(session=session, spool=spool, pid=pid, bundle_name=bundle_name)
        runs.append(run)
        run.extensions = dict(extensions or {})
        if pid is not None:
            session.pid = pid
        with self._lock:
            self._runs[sid] = run
            self._started += 1
        self._write_meta(run)
        # Inventory after tracking began: anything forked meanwhile is both listed and recorded.
        try:
            inventory = take_inventory(cgroup)
        except Exception as e:  # the run goes on without it, and says so
            logger.warning("run %s: inventory of %s failed: %s", sid, cgroup, e)
            session.degradations.append(
                {
                    "component": "inventory",
                    "reason": str(e),
                    "impact": "processes present at attach are not listed",
                }
            )
            inventory = []
        depth = _depths(inventory)
        for r in inventory:
            p = int(r["pid"])
            known = session.correlator.procs.get(p)
            if known is None:
                session.correlator.add_root(p, int(r["ppid"]), cast(str, r["cwd"]), r["exe"], depth[p])
            elif known.depth < 0:
                known.depth = depth[p]
        run.spool.set_prelude(inventory)
        logger.info(
            "run %s: attached to %s (%d process(es) already there)%s",
            sid,
            cgroup,
            len(inventory),
            f", labels {dict(labels)}" if labels else "",
        )
        return run

    def isolate(
        self,
        pid: int,
        labels: Mapping[str, str],
        mount: Path,
        *,
        command: Sequence[str] = (),
        detail: str = "summary",
        pidfd: int | None = None,
    ) -> RunInfo:
        """A run in a cgroup made for it, holding only `pid` (and what it starts): the cgroup is
        tracked first, then the process is moved in, so nothing it does from then on is missed.
        The caller (agent/api.py claim_pid) has checked that the peer owns the process.

        The cgroup is made below the one the process is in (evidence-<session>), so that the
        limits of the client's cgroup (a CI job's, a pod's) keep applying to the command, when the
        command could not move itself out of it from there (agent/cgroups.py isolation_home);
        otherwise under <mount>/evidence/, and the run says why with a degradation event. A
        process that a run already records is refused: a run of its own would take it out of
        that recording."""
        from agent.cgroups import RunCgroup, isolation_home

        self._require_recorder()
        sid = uuid.uuid4().hex
        cgroup, home, why_not = isolation_home(pid, Path(mount))
        recorded = self._recording(cgroup) if cgroup is not None else None
        if recorded is not None:
            raise RunConflict(
                f"process {pid} is already recorded, by run {recorded[1]} of {recorded[0]}",
                hint="a run of its own would take it out of that recording; use that run's bundle",
            )
        if home is not None:
            try:
                cg = RunCgroup.create_in(home, f"evidence-{sid}")
            except SetupError as e:
                home, why_not = None, e.message
        if home is None:
            cg = RunCgroup.create(sid, Path(mount))
        try:
            run = self.start_run(
                cg.path, labels, pid=pid, session_id=sid, detail=detail, command=list(command)
            )
        except BaseException:
            cg.remove()
            raise
        if why_not is not None:
            run.session.degradations.append(
                {
                    "component": "cgroup",
                    "reason": f"the run's cgroup is not below the client's: {why_not}",
                    "impact": "the limits of the client's cgroup (memory, pids, cpu) did not apply to the command",
                }
            )
        run.cgroup = cg
        proc = read_process(pid)
        if proc is not None:
            run.session.correlator.add_root(pid, int(proc["ppid"]), cast(str, proc["cwd"] or ""))
        try:
            if proc is None or (pidfd is not None and _exited(pidfd)):
                raise ProcessLookupError
            (cg.path / "cgroup.procs").write_text(str(pid))
        except OSError as e:
            self._abandon(run)
            why = "it has exited" if isinstance(e, ProcessLookupError) else e.strerror
            raise UsageError(f"cannot move process {pid} into {cg.path}: {why}") from None
        logger.info("run %s: process %d moved into its own cgroup %s", sid, pid, cg.path)
        return run.info

    def _recording(self, cgroup: Path) -> tuple[Path, str] | None:
        """(cgroup, session) of the run that records `cgroup` (it or an ancestor), if any."""
        with self._lock:
            for r in self._runs.values():
                path = r.session.cgroup_path
                if path == cgroup or path in cgroup.parents:
                    return path, r.session.session_id
        return None

    def _abandon(self, run: _Run) -> None:
        """Finish a run that never got its process, and throw the bundle away."""
        tmp = self.spool_dir / f".abandoned-{run.session.session_id}.tar.gz"
        try:
            self.finish(run.session.session_id, tmp)
        except Exception as e:
            logger.warning("run %s: could not be abandoned cleanly: %s", run.session.session_id, e)
        tmp.unlink(missing_ok=True)

    def _observe(self, run: _Run, recs: list[dict[str, Any]]) -> None:
        counts: dict[str, int] = {}
        for r in recs:
            k = str(r.get("k"))
            counts[k] = counts.get(k, 0) + 1
        with self._lock:
            for k, n in counts.items():
                self._events[k] = self._events.get(k, 0) + n
        if self.streamer is not None:
            from agent.delivery import live_event

            sid = run.session.session_id
            for r in recs:
                try:
                    self.streamer.submit(live_event(sid, run.seq, r, run.extensions))
                except (KeyError, ValueError) as e:
                    logger.debug("no live event for a %s record: %s", r.get("k"), e)
                run.seq += 1

    def _write_meta(self, run: _Run) -> None:
        s = run.session
        meta = {
            "session_id": s.session_id,
            "cgroup": str(s.cgroup_path),
            "command": s.command,
            "cwd": s.cwd,
            "pid": s.pid,
            "started_ns": s.started_ns,
            "attached_late": s.attached_late,
            "detail": s.detail,
            "labels": dict(s.labels),
            "bundle_name": run.bundle_name,
        }
        try:
            _write_json_atomic(self.spool_dir / f"{s.session_id}{RUN_META_SUFFIX}", meta)
        except OSError as e:
            logger.warning("run %s: cannot write its recovery record: %s", s.session_id, e)

    def update_labels(
        self, session_id: str, labels: Mapping[str, str], bundle_name: str | None = None
    ) -> None:
        with self._lock:
            run = self._runs.get(session_id)
            if run is None:
                return
            run.session.labels.update(labels)
            if bundle_name is not None:
                run.bundle_name = bundle_name
        self._write_meta(run)

    # finishing

    def finish(
        self,
        session_id: str,
        bundle_path: Path,
        *,
        cut_short: bool = False,
        exit_code: int | None = None,
        signal: str | None = None,
    ) -> Mapping[str, Any]:
        rec = self._require_recorder() if not cut_short else self.recorder
        if rec is None:
            raise NotReady("the recorder is not ready")
        with self._lock:
            run = self._runs.get(session_id)
            if run is None or run.finishing:
                raise UnknownRun(f"no run {session_id}")
            run.finishing = True
        sid = session_id
        if run.cgroup is not None and not cut_short:
            left = run.cgroup.kill()
            if left:
                logger.info("run %s: killed %d process(es) the command left behind", sid, left)
            if not run.cgroup.wait_empty():
                logger.warning("run %s: %s is still populated after SIGKILL", sid, run.cgroup.path)
        try:
            manifest = rec.finish(
                run.session, bundle_path, exit_code=exit_code, signal=signal, cut_short=cut_short
            )
        except BaseException:
            logger.exception("run %s: writing its bundle %s failed", sid, bundle_path)
            with self._lock:
                self._runs.pop(sid, None)
                self._finished += 1
            with contextlib.suppress(FileNotFoundError):
                (self.spool_dir / f"{sid}{RUN_META_SUFFIX}").unlink()
            self._remove_cgroup(run)
            raise
        self._remove_cgroup(run)
        _sha, size = _file_sha256(Path(bundle_path))
        by_kind = manifest.get("lost", {}).get("by_kind", {})
        with self._lock:
            self._runs.pop(sid, None)
            self._finished += 1
            self._bundles += 1
            self._bundle_bytes += size
            for k, v in by_kind.items():
                self._lost_done[k] = self._lost_done.get(k, 0) + int(v)
        with contextlib.suppress(FileNotFoundError):
            (self.spool_dir / f"{sid}{RUN_META_SUFFIX}").unlink()
        if self.uploader is not None and Path(bundle_path).parent == self.bundle_dir:
            self.uploader.enqueue(bundle_path)
        return manifest

    def _remove_cgroup(self, run: _Run) -> None:
        cg = run.cgroup
        if cg is None:
            return
        if cg.populated():
            logger.warning(
                "run %s: %s still holds processes; it is left in place", run.session.session_id, cg.path
            )
            return
        cg.remove()

    def default_bundle_path(self, run: _Run) -> Path:
        return unique_path(self.bundle_dir / (run.bundle_name or f"{run.session.session_id}.tar.gz"))

    def finish_all(self, cut_short: bool = True) -> list[Path]:
        """Finish every open run (on shutdown): each bundle into the bundle directory."""
        written = []
        for run in self.open_runs():
            path = self.default_bundle_path(run)
            try:
                self.finish(run.session.session_id, path, cut_short=cut_short)
                written.append(path)
                logger.info("run %s: cut short, bundle %s", run.session.session_id, path)
            except Exception as e:  # one failure must not stop the others
                logger.error("run %s: could not be finished: %s", run.session.session_id, e)
        return written

    def rotate(self, session_id: str, bundle_path: Path, labels: Mapping[str, str]) -> tuple[_Run, str]:
        """End a run's window: a new run on the same cgroup takes over with no gap, then the old one
        is finished into bundle_path. Returns the new run and the old bundle's sha256."""
        with self._lock:
            old = self._runs.get(session_id)
            if old is None or old.finishing:
                raise UnknownRun(f"no run {session_id}")
        assert self._probes is not None
        new = self.start_run(
            old.session.cgroup_path,
            labels,
            bundle_name=None,
            extensions=old.extensions,
            replacing=session_id,
        )
        self._probes.keep(old.session.cgroup_id)  # the new run's track must outlive the old untrack
        self.finish(session_id, bundle_path)
        sha, _ = _file_sha256(bundle_path)
        self.update_labels(new.session.session_id, {"previous_bundle_sha256": sha})
        return new, sha

    def wait_idle(self, timeout: float) -> bool:
        """Wait for finishes in progress (API requests) to end; True when no run is left."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._runs:
                    return True
            time.sleep(0.05)
        return False

    # state

    def open_runs(self) -> list[_Run]:
        with self._lock:
            return [r for r in self._runs.values() if not r.finishing]

    def run(self, session_id: str) -> _Run | None:
        with self._lock:
            return self._runs.get(session_id)

    def runs(self) -> Sequence[RunInfo]:
        return [r.info for r in self.open_runs()]

    def flush_spools(self) -> None:
        for run in self.open_runs():
            try:
                run.spool.flush()
            except (OSError, ValueError) as e:
                logger.debug("flush of %s failed: %s", run.spool.path, e)

    def probe_lag(self) -> None:
        """Measure how far behind the consumer is: the time a barrier takes through the ring buffer
        poller, the batch queue and the correlator."""
        rec = self.recorder
        if rec is None:
            return
        t0 = time.monotonic()
        self._lag_probe_since = t0
        rec.drain()
        self._lag = time.monotonic() - t0
        self._lag_probe_since = None

    def metrics(self) -> m.MetricsSnapshot:
        lost = dict(self._lost_done)
        active = self.open_runs()
        if self.recorder is not None:
            for run in active:
                with contextlib.suppress(Exception):  # slot gone meanwhile: keep the last reading
                    run.lost = self.recorder.probes.read_lost(run.session.slot)
        with self._lock:
            for run in self._runs.values():
                for k, v in run.lost.items():
                    lost[k] = lost.get(k, 0) + v
            events = dict(self._events)
            lag = self._lag
            if self._lag_probe_since is not None:
                lag = max(lag, time.monotonic() - self._lag_probe_since)
            return m.MetricsSnapshot(
                events_by_kind=events,
                lost_by_kind=lost,
                runs_active=len(self._runs),
                runs_started=self._started,
                runs_finished=self._finished,
                consumer_lag_seconds=lag,
                bundle_bytes=self._bundle_bytes,
                bundles_written=self._bundles,
            )


def unique_path(path: Path) -> Path:
    """path, or path with -2, -3 ... before .tar.gz when it is taken."""
    if not os.path.lexists(path):
        return path
    stem = path.name.removesuffix(".tar.gz")
    n = 2
    while os.path.lexists(path.with_name(f"{stem}-{n}.tar.gz")):
        n += 1
    return path.with_name(f"{stem}-{n}.tar.gz")


# --- recovery after a crash --------------------------------------------------------------------------


def _tolerant_records(path: Path, state: dict[str, Any]) -> Callable[[], Iterator[dict[str, Any]]]:
    """The records of a spool whose writer died: everything up to the first unreadable byte
    (state["error"] says what stopped the reading, if anything did)."""
    from bundle.spool import read_spool

    def gen() -> Iterator[dict[str, Any]]:
        it = read_spool(path)
        while True:
            try:
                rec = next(it)
            except StopIteration:
                return
            except Exception as e:  # truncated frame or a half-written line: the end of what survived
                state["error"] = str(e) or type(e).__name__
                return
            if isinstance(rec, dict) and isinstance(rec.get("k"), str) and isinstance(rec.get("t"), int):
                yield rec

    return gen


def recover_spools(spool_dir: Path, bundle_dir: Path) -> list[Path]:
    """Turn every spool left by an agent that died into a bundle marked cut short; returns them.

    What a spool holds is what was flushed before the agent died (flushes happen every couple of
    seconds); the bundle says so with a degradation event. A spool that cannot be turned into a
    bundle is moved to <spool_dir>/failed/ and logged, never deleted."""
    from agent.kernel import host_info
    from bundle.writer import RunMeta, write_bundle

    if not spool_dir.is_dir():
        return []
    bundle_dir.mkdir(parents=True, exist_ok=True)
    for tmp in bundle_dir.glob(".evidence-*.tmp"):  # a bundle or marker cut off mid-write
        logger.warning("removing %s, a partial write of an agent that stopped", tmp)
        tmp.unlink(missing_ok=True)
    out = []
    for spool in sorted(spool_dir.glob(f"*{SPOOL_SUFFIX}")):
        sid = spool.name.removesuffix(SPOOL_SUFFIX)
        meta_path = spool_dir / f"{sid}{RUN_META_SUFFIX}"
        try:
            info: dict[str, Any] = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        except (OSError, ValueError) as e:
            logger.warning("recovery record %s is unreadable (%s): recovering with less", meta_path, e)
            info = {}
        state: dict[str, Any] = {}
        records = _tolerant_records(spool, state)
        last_t = first_t = count = 0
        for r in records():
            count += 1
            last_t = max(last_t, r["t"])
            first_t = r["t"] if not first_t else min(first_t, r["t"])
        mtime = spool.stat().st_mtime_ns
        if count == 0 and state.get("error"):
            _move_aside(spool, meta_path, spool_dir, state["error"])
            continue
        started = int(info.get("started_ns") or first_t or mtime)
        name = info.get("bundle_name") or f"{sid}.tar.gz"
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,200}\.tar\.gz", str(name)):
            name = f"{sid}.tar.gz"
        target = unique_path(bundle_dir / str(name))
        meta = RunMeta(
            session_id=str(info.get("session_id") or sid),
            command=[str(a) for a in info.get("command") or []],
            cwd=str(info.get("cwd") or ""),
            pid=int(info.get("pid") or 0),
            cgroup=str(info.get("cgroup") or ""),
            started_ns=started,
            finished_ns=max(started, last_t, mtime if not last_t else 0),
            exit_code=None,
            cut_short=True,
            attached_late=bool(info.get("attached_late", True)),
            detail=str(info.get("detail") or "summary"),
            host=host_info(),
            labels={str(k): str(v) for k, v in (info.get("labels") or {}).items()},
            degradations=[
                {
                    "component": "agent",
                    "reason": "recovered from the spool of an agent that stopped without finishing "
                    "this run (crash, kill -9, node reboot)",
                    "impact": "events after the spool's last flush, and the kernel's loss counts, "
                    "are missing",
                }
            ],
        )
        try:
            write_bundle(target, meta, records)
        except Exception as e:
            _move_aside(spool, meta_path, spool_dir, str(e))
            continue
        spool.unlink(missing_ok=True)
        meta_path.unlink(missing_ok=True)
        logger.warning("recovered run %s of a previous agent into %s (cut short)", sid, target)
        out.append(target)
    for orphan in spool_dir.glob(f"*{RUN_META_SUFFIX}"):  # a run whose spool was never created
        if not (spool_dir / orphan.name.replace(RUN_META_SUFFIX, SPOOL_SUFFIX)).exists():
            orphan.unlink(missing_ok=True)
    return out


def _move_aside(spool: Path, meta_path: Path, spool_dir: Path, why: str) -> None:
    failed = spool_dir / "failed"
    failed.mkdir(exist_ok=True)
    shutil.move(str(spool), failed / spool.name)
    if meta_path.exists():
        shutil.move(str(meta_path), failed / meta_path.name)
    logger.error("cannot recover %s (%s): moved to %s", spool, why, failed)


# --- Kubernetes: one run per pod ---------------------------------------------------------------------


@dataclasses.dataclass
class _PodRun:
    ref: k8s.PodRef
    session_id: str
    window: int
    started: float  # monotonic
    containers: dict[str, k8s.PodRef] = dataclasses.field(default_factory=dict)
    meta: k8s.PodMeta | None = None


class PodRuns:
    """Follows KubeWatcher's events: a run per pod, cut into windows, finished when the pod goes."""

    def __init__(
        self,
        backend: RecorderBackend,
        cgroup_root: Path,
        pod_logs: Path,
        *,
        window_seconds: float,
        window_bytes: int,
        poll_interval: float = 2.0,
    ) -> None:
        self.backend = backend
        self.cgroup_root = Path(cgroup_root)
        self.pod_logs = Path(pod_logs)
        self.container_logs = self.pod_logs.parent / "containers"
        self.window_seconds = window_seconds
        self.window_bytes = window_bytes
        self.watcher = k8s.KubeWatcher(self.cgroup_root, poll_interval)
        self.pods: dict[str, _PodRun] = {}  # pod cgroup path (relative) -> run
        self._container_info: dict[str, dict[str, Any]] = {}  # container id -> label data

    # names and labels

    def _meta(self, pod: _PodRun) -> k8s.PodMeta | None:
        if pod.meta is None:
            pod.meta = k8s.pod_metadata(pod.ref.pod_uid, self.pod_logs)
        return pod.meta

    def _bundle_name(self, pod: _PodRun) -> str:
        meta = self._meta(pod)
        ns, name = (meta.namespace, meta.name) if meta else ("unknown", "unknown")
        return f"{ns}_{name}_{pod.ref.pod_uid}-{pod.window}.tar.gz"

    def _labels(self, pod: _PodRun) -> dict[str, str]:
        labels = {
            f"{POD_LABEL}pod-uid": pod.ref.pod_uid,
            f"{POD_LABEL}qos": pod.ref.qos,
            f"{POD_LABEL}pod-cgroup": pod.ref.pod_path,
            f"{POD_LABEL}window": str(pod.window),
        }
        meta = self._meta(pod)
        if meta is not None:
            labels[f"{POD_LABEL}namespace"] = meta.namespace
            labels[f"{POD_LABEL}pod"] = meta.name
        for cid, ref in pod.containers.items():
            labels[f"{POD_LABEL}container/{cid}"] = self._container_label(ref)
        return labels

    def _container_label(self, ref: k8s.PodRef) -> str:
        """The container's cgroup (path, id), runtime and name, as canonical JSON. The cgroup id is
        read when the container is first seen (it is gone by the time its pod's bundle is written)."""
        cid = ref.container_id or ""
        info = self._container_info.setdefault(cid, {"runtime": ref.runtime, "cgroup": ref.container_path})
        if "cgroup_id" not in info:
            try:
                info["cgroup_id"] = os.stat(self.cgroup_root / (ref.container_path or "")).st_ino
            except OSError:
                info["cgroup_id"] = None
        if info.get("name") is None:
            info["name"] = k8s.container_name(cid, self.container_logs)
        return json.dumps(info, sort_keys=True, separators=(",", ":"))

    def _next_window(self, uid: str) -> int:
        """1 + the highest window number of this pod's bundles already on disk (agent restarts)."""
        best = 0
        for p in self.backend.bundle_dir.glob(f"*_{uid}-*.tar.gz"):
            tail = p.name.removesuffix(".tar.gz").rsplit("-", 1)[-1]
            if tail.isdigit():
                best = max(best, int(tail))
        return best + 1

    # events

    def poll(self) -> None:
        for ev in self.watcher.poll():
            try:
                self.handle(ev)
            except Exception as e:
                logger.error("%s %s: %s", ev.kind, ev.ref.path, e)
        self.cut_windows()

    def handle(self, ev: k8s.KubeEvent) -> None:
        ref = ev.ref
        if ev.kind == "pod-appeared":
            pod = _PodRun(ref, "", self._next_window(ref.pod_uid), time.monotonic())
            run = self.backend.start_run(
                self.cgroup_root / ref.pod_path,
                self._labels(pod),
                extensions={"poduid": ref.pod_uid},
            )
            pod.session_id = run.session.session_id
            run.bundle_name = self._bundle_name(pod)
            self.pods[ref.pod_path] = pod
            logger.info("pod %s: recording as run %s", ref.pod_uid, pod.session_id)
        elif ev.kind == "container-appeared":
            owner = self.pods.get(ref.pod_path)
            if owner is not None and ref.container_id:
                owner.containers[ref.container_id] = ref
                self.backend.update_labels(owner.session_id, self._labels(owner), self._bundle_name(owner))
        elif ev.kind == "pod-gone":
            gone = self.pods.pop(ref.pod_path, None)
            if gone is not None:
                self._finish(gone)
                for cid in gone.containers:
                    self._container_info.pop(cid, None)

    def _finish(self, pod: _PodRun) -> Path:
        name = self._bundle_name(pod)
        self.backend.update_labels(pod.session_id, self._labels(pod), name)
        path = unique_path(self.backend.bundle_dir / name)
        self.backend.finish(pod.session_id, path)
        logger.info("pod %s: bundle %s", pod.ref.pod_uid, path)
        return path

    def cut_windows(self) -> None:
        now = time.monotonic()
        for pod in list(self.pods.values()):
            run = self.backend.run(pod.session_id)
            if run is None:
                continue
            if now - pod.started < self.window_seconds and run.spool.size() < self.window_bytes:
                continue
            name = self._bundle_name(pod)
            self.backend.update_labels(pod.session_id, self._labels(pod), name)
            path = unique_path(self.backend.bundle_dir / name)
            # containers still there carry over into the next window
            live = {
                cid: r
                for cid, r in pod.containers.items()
                if (self.cgroup_root / (r.container_path or "")).is_dir()
            }
            nxt = _PodRun(pod.ref, "", pod.window + 1, now, live, pod.meta)
            try:
                new, sha = self.backend.rotate(pod.session_id, path, self._labels(nxt))
            except Exception as e:
                logger.error("pod %s: cutting window %d failed: %s", pod.ref.pod_uid, pod.window, e)
                continue
            nxt.session_id = new.session.session_id
            new.bundle_name = self._bundle_name(nxt)
            self.pods[pod.ref.pod_path] = nxt
            logger.info("pod %s: window %d in %s (sha256 %s)", pod.ref.pod_uid, pod.window, path, sha)

    def loop(self, stop: threading.Event) -> None:
        """Scan, then wait for the next scan: poll_interval, or less when the tree changes."""
        try:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    self.poll()
                    self.watcher.wait(
                        max(0.0, self.watcher.poll_interval - (time.monotonic() - started)), stop
                    )
                except Exception:
                    logger.exception("kubernetes scan failed")
                    stop.wait(max(0.0, self.watcher.poll_interval - (time.monotonic() - started)))
        finally:
            self.watcher.close()
