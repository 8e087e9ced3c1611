"""The agent's `Backend` over one `Recorder`: runs on existing cgroups, isolated runs, windows, metrics.

(About 700 lines on purpose: `RecorderBackend` is one state machine over the table of runs and the
lock that guards it; its helpers already live in wrappers.py, pods.py, exits.py, policy.py and
agent/recorder/recovery.py. Splitting its methods further would spread that lock across modules.)

`RecorderBackend` is what agent/daemon/api.py talks to. It adds to the recorder, from outside it:

- Attaching late. A run starts on a cgroup that may already hold processes: tracking starts first,
  then an inventory of every process there (argv, cwd, exe, sockets) is written at the head of the
  spool, and those processes become roots of the run's process tree (depth 0, or their depth below
  another inventoried process), so what they do next has a parent.
- Observing the spool. Each session's spool writer is wrapped (agent/daemon/wrappers.py:
  `ObservedSpool`): records are counted by kind for /metrics, copied to the live event stream, and
  flushed now and then, so that the spool of an agent that dies is readable up to the last flush.
- Recovery. Beside each spool, `<session>.run.json` holds what the bundle's manifest needs; the
  backend writes it when a run starts and when its labels change, and removes it once the bundle is
  written. A later agent turns what a dead one left into bundles (agent/recorder/recovery.py).
- Windows. `rotate` cuts a long-lived run in two with no gap: the new run is tracked before the old
  one is finished, and the old one's untrack is skipped (`HandoverProbes`).
- Isolated runs (`isolate`, for `evidence run --agent`): the agent makes a cgroup of its own for
  the run, starts tracking it, then moves the client's waiting child in; finishing such a run kills
  what the command left in it and removes the cgroup (a run cut short at shutdown is not killed: its
  cgroup is removed only once empty). The command's exit status is the one read through the pidfd
  the agent holds (agent/daemon/exits.py), not the client's, and its command the argv the kernel
  executed, the client's `command` kept as its claim (`Session.starts_command`, bundle/command.py);
  the watchdog is told each such cgroup, and kills those still there if the agent dies.
- Kubernetes (agent/daemon/pods.py: `PodRuns`): one run per pod cgroup; containers are child cgroups,
  covered by the pod's run. Their records carry `cgroup` (the path below the pod's) and, when the
  scope name says so, `container` (the id); the run's labels also list every container seen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from evidence.agent.daemon import exits
from evidence.agent.daemon import metrics as m
from evidence.agent.daemon.api import NotReady, RunConflict, RunInfo, UnknownRun
from evidence.agent.daemon.wrappers import HandoverProbes, ObservedSpool
from evidence.agent.recorder.inventory import cgroup_pids, read_process, take_inventory
from evidence.agent.recorder.launch import COMPAT_NOT_REFUSED, COMPAT_REFUSED
from evidence.agent.recorder.recovery import RUN_META_SUFFIX, unique_path, write_run_record
from evidence.errors import Error, SetupError, UsageError
from evidence.files import file_sha256

if TYPE_CHECKING:
    from evidence.agent.daemon.delivery import BundleUploader, EventStreamer
    from evidence.agent.daemon.fleet import FleetPublisher
    from evidence.agent.daemon.models import PolicySpec
    from evidence.agent.recorder.cgroups import RunCgroup
    from evidence.agent.recorder.enforce import Enforcement
    from evidence.agent.recorder.recording import Recorder, Session
    from evidence.bundle.record_types import SpoolRecord
    from evidence.bundle.spool import SpoolWriter

logger = logging.getLogger(__name__)

FLUSH_SECONDS = 2.0


# --- runs --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """A run the backend records: its session, its observed spool, and what the agent adds."""

    session: Session
    spool: ObservedSpool
    pid: int | None
    bundle_name: str | None = None  # where finish_all / pod runs write it, in the bundle dir
    extensions: dict[str, str] = dataclasses.field(default_factory=dict)
    finishing: bool = False
    lost: dict[str, int] = dataclasses.field(default_factory=dict)  # last read, while active
    seq: int = 0
    cgroup: RunCgroup | None = None  # made by the agent for this run (isolated): removed at finish
    pidfd: int | None = None  # of the isolated process, held from before it was moved in
    enforcement: Enforcement | None = None  # its policy's connect guard and denial matching

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


class RunWatchdog(Protocol):
    """agent/recorder/launch.py `Watchdog`: kills the cgroups it watches if the agent dies."""

    def watch(self, cgroup: Path, session_id: str) -> None: ...

    def unwatch(self, cgroup: Path) -> None: ...


def process_depths(inventory: Sequence[Mapping[str, Any]]) -> dict[int, int]:
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
    """The `Backend` of agent/daemon/api.py over one Recorder (attached once its probes are loaded)."""

    def __init__(
        self,
        bundle_dir: Path,
        spool_dir: Path,
        *,
        uploader: BundleUploader | None = None,
        streamer: EventStreamer | None = None,
        registry: m.Registry | None = None,
        watchdog: RunWatchdog | None = None,
        signer: Any = None,
        fleet: FleetPublisher | None = None,
    ) -> None:
        self.fleet = fleet  # a fleet's NATS JetStream (agent/daemon/fleet.py): events and bundles
        self.bundle_dir = Path(bundle_dir)
        self.signer = signer  # every bundle this agent writes is signed with its key, if it has one
        self.watchdog = watchdog
        self.spool_dir = Path(spool_dir)
        self.uploader = uploader
        self.streamer = streamer
        self.registry = registry or m.Registry()
        self.recorder: Recorder | None = None
        self._probes: HandoverProbes | None = None
        self._not_ready: str | None = "the probes are loading"
        self._lock = threading.Lock()
        self._runs: dict[str, Run] = {}
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
        roots: dict[str, str] | None = None,
        launched: bool = False,
    ) -> Run:
        """A run of `cgroup`. `launched`: its command was started by an `evidence run --agent`
        client, which gave it the filter that refuses 32-bit system calls; otherwise (a pid or
        cgroup adopted, a pod) the run says they are neither refused nor recorded."""
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
            run = self._start_locked_out(
                rec, cgroup, labels, pid, bundle_name, extensions, session_id, detail, command, roots
            )
        finally:
            with self._lock:
                self._starting.discard(cgroup)
        if not launched:
            run.session.degradations.append(dict(COMPAT_NOT_REFUSED))
            self._write_meta(run)  # recovery says it too
        return run

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
        roots: dict[str, str] | None = None,
    ) -> Run:
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
        runs: list[Run] = []  # the run, once made (the spool holds every record back until then)

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
                roots=roots,
            )
        except FileNotFoundError:
            raise UsageError(f"{cgroup} is gone") from None
        spool = cast(ObservedSpool, session.spool)
        run = Run(session=session, spool=spool, pid=pid, bundle_name=bundle_name)
        runs.append(run)
        run.extensions = dict(extensions or {})
        if pid is not None and command is not None:  # isolated: the client's claim, before its exec
            session.starts_command(pid)
        elif pid is not None:
            session.pid = pid
            rec.configure_resolvers(session, pid)  # ---- dns: its /etc/resolv.conf
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
        depth = process_depths(inventory)
        if pid is None and inventory:  # ---- dns: the resolv.conf of the process at the top of the tree
            first = min(inventory, key=lambda r: (depth[int(r["pid"])], int(r["pid"])))
            rec.configure_resolvers(session, int(first["pid"]))
            self._write_meta(run)
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
        policy: PolicySpec | None = None,
        net: str | None = None,
    ) -> RunInfo:
        """A run in a cgroup made for it, holding only `pid` (and what it starts): the cgroup is
        tracked first, then the process is moved in, so nothing it does from then on is missed.
        The caller (agent/daemon/api.py claim_pid) has checked that the peer owns the process.

        The cgroup is made below the one the process is in (evidence-<session>), so that the
        limits of the client's cgroup (a CI job's, a pod's) keep applying to the command, when the
        command could not move itself out of it from there (agent/recorder/cgroups.py isolation_home);
        otherwise under <mount>/evidence/, and the run says why with a degradation event. A
        process that a run already records is refused: a run of its own would take it out of
        that recording."""

        self._require_recorder()
        enforcement = None
        if policy is not None:  # loaded and compiled before anything is made: a bad one starts nothing
            from evidence.agent.daemon.policy import agent_enforcement

            try:
                enforcement = agent_enforcement(policy, net)
                enforcement.load_programs()
            except Error as e:
                if enforcement is not None:
                    enforcement.close()
                raise UsageError(e.message, e.hint) from None
        try:
            return self._isolate(pid, labels, Path(mount), list(command), detail, pidfd, enforcement, net)
        except BaseException:
            if enforcement is not None:
                enforcement.close()
            raise

    def _isolate(
        self,
        pid: int,
        labels: Mapping[str, str],
        mount: Path,
        command: list[str],
        detail: str,
        pidfd: int | None,
        enforcement: Enforcement | None,
        net: str | None = None,
    ) -> RunInfo:
        from evidence.agent.recorder.cgroups import RunCgroup, isolation_home

        sid = uuid.uuid4().hex
        cgroup, home, why_not = isolation_home(pid, Path(mount))
        recorded = self._recording(cgroup) if cgroup is not None else None
        if recorded is not None:
            raise RunConflict(
                f"process {pid} is already recorded, by run {recorded[1]} of {recorded[0]}",
                hint="a run of its own would take it out of that recording; use that run's bundle",
            )
        # the client is not trusted to have given its command evidence's filters: read them back
        unfiltered, compat = filter_degradations(pid)
        if home is not None:
            try:
                cg = RunCgroup.create_in(home, f"evidence-{sid}")
            except SetupError as e:
                home, why_not = None, e.message
        if home is None:
            cg = RunCgroup.create(sid, Path(mount))
        try:
            run = self.start_run(
                cg.path,
                labels,
                pid=pid,
                session_id=sid,
                detail=detail,
                command=list(command),
                roots=None
                if enforcement is None
                else {"${TMPDIR}": enforcement.tmpdir, "${WORKSPACE}": enforcement.workspace},
                launched=True,
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
        run.session.degradations += unfiltered
        run.session.capabilities["32bit_syscalls"] = compat
        if net is not None:
            run.session.network = net
        if enforcement is not None:  # the guard holds the cgroup before the command is in it
            run.enforcement = enforcement
            enforcement.enforce_on(run.session)
        self._write_meta(run)  # before the process is moved in: recovery keeps all of it
        if pidfd is not None:
            run.pidfd = os.dup(pidfd)
        if self.watchdog is not None:
            self.watchdog.watch(cg.path, sid)
        proc = read_process(pid)
        if proc is not None:
            run.session.correlator.add_root(pid, proc["ppid"], proc["cwd"] or "")
        try:
            if proc is None or (pidfd is not None and exits.observe(pidfd, 0).state != "running"):
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

    def _abandon(self, run: Run) -> None:
        """Finish a run that never got its process, and throw the bundle away."""
        tmp = self.spool_dir / f".abandoned-{run.session.session_id}.tar.gz"
        try:
            self.finish(run.session.session_id, tmp)
        except Exception as e:
            logger.warning("run %s: could not be abandoned cleanly: %s", run.session.session_id, e)
        tmp.unlink(missing_ok=True)

    def _observe(self, run: Run, recs: Sequence[SpoolRecord]) -> None:
        counts: dict[str, int] = {}
        for r in recs:
            k = str(r.get("k"))
            counts[k] = counts.get(k, 0) + 1
        with self._lock:
            for k, n in counts.items():
                self._events[k] = self._events.get(k, 0) + n
        if self.streamer is not None or self.fleet is not None:
            from evidence.agent.daemon.delivery import live_event

            sid = run.session.session_id
            for r in recs:
                try:
                    event = live_event(sid, run.seq, r, run.extensions)
                    for sink in (self.streamer, self.fleet):
                        if sink is not None:
                            sink.submit(event)
                except (KeyError, ValueError) as e:
                    logger.debug("no live event for a %s record: %s", r.get("k"), e)
                run.seq += 1

    def _write_meta(self, run: Run) -> None:
        s = run.session
        try:
            write_run_record(self.spool_dir, s.describe(bundle_name=run.bundle_name))
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
            observed = exits.observe(run.pidfd) if run.pidfd is not None else None
            left = run.cgroup.kill()
            if left:
                logger.info("run %s: killed %d process(es) the command left behind", sid, left)
            if not run.cgroup.wait_empty():
                logger.warning("run %s: %s is still populated after SIGKILL", sid, run.cgroup.path)
            exit_code, signal, cut_short = self._exit_status(run, observed, exit_code, signal)
        if run.pidfd is not None:
            os.close(run.pidfd)
            run.pidfd = None
        self._poll_denials(run)
        if run.enforcement is not None:
            run.enforcement.close()
        try:
            manifest = rec.finish(
                run.session,
                bundle_path,
                exit_code=exit_code,
                signal=signal,
                cut_short=cut_short,
                signer=self.signer,
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
        _sha, size = file_sha256(Path(bundle_path))
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
        if self.fleet is not None and Path(bundle_path).parent == self.bundle_dir:  # not an abandoned run's
            self.fleet.bundle_written(Path(bundle_path), manifest)
        return manifest

    def _exit_status(
        self, run: Run, observed: exits.Exit | None, exit_code: int | None, signal: str | None
    ) -> tuple[int | None, str | None, bool]:
        """(exit_code, signal, cut_short) for an isolated run's manifest: what the agent observed,
        never only what the client says; a run whose end the agent could not see is cut short."""
        sid = run.session.session_id
        reported = exits.describe(exit_code, signal)
        if observed is not None and observed.state == "exited":
            if not observed.same_as(exit_code, signal):
                logger.warning(
                    "run %s: the client reported %s, the agent observed %s",
                    sid,
                    reported,
                    observed.describe(),
                )
                run.session.degradations.append(
                    {
                        "component": "exit-status",
                        "reason": f"the client reported {reported}; the agent observed {observed.describe()}",
                        "impact": "the manifest carries the status the agent observed",
                    }
                )
            return observed.exit_code, observed.signal, False
        why = observed.why if observed is not None else "the agent holds no pidfd of the command"
        logger.warning("run %s: exit status not observed (%s); the client reported %s", sid, why, reported)
        run.session.degradations.append(
            {
                "component": "exit-status",
                "reason": f"the agent could not observe how the command ended: {why}",
                "impact": f"the run is marked cut short; the client reported {reported}, which is not recorded",
            }
        )
        return None, None, True

    def _remove_cgroup(self, run: Run) -> None:
        cg = run.cgroup
        if cg is None:
            return
        if cg.populated():
            logger.warning(
                "run %s: %s still holds processes; it is left in place", run.session.session_id, cg.path
            )
            return
        cg.remove()
        if self.watchdog is not None:
            self.watchdog.unwatch(cg.path)

    def default_bundle_path(self, run: Run) -> Path:
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

    def rotate(self, session_id: str, bundle_path: Path, labels: Mapping[str, str]) -> tuple[Run, str]:
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
        sha, _ = file_sha256(bundle_path)
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

    def open_runs(self) -> list[Run]:
        with self._lock:
            return [r for r in self._runs.values() if not r.finishing]

    def run(self, session_id: str) -> Run | None:
        with self._lock:
            return self._runs.get(session_id)

    def runs(self) -> Sequence[RunInfo]:
        return [r.info for r in self.open_runs()]

    def _poll_denials(self, run: Run) -> None:
        """Move the connect guard's denials into the run's records."""
        enf = run.enforcement
        if enf is None or enf.guard is None:
            return
        try:
            run.session.extra_records += enf.poll_denials(run.session.correlator.exe_of)
        except Exception as e:  # noqa: BLE001 - housekeeping goes on; the guard's losses are counted
            logger.warning("run %s: reading connect denials failed: %s", run.session.session_id, e)

    def poll_denials(self) -> None:
        for run in self.open_runs():
            self._poll_denials(run)

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


def filter_degradations(pid: int) -> tuple[list[dict[str, str]], str]:
    """What the run of an isolated process must say of evidence's seccomp filters, which its client
    installs (agent/recorder/seccomp_check.py): a degradation per filter it does not run under, or
    one when they cannot be read; and the manifest's capabilities.32bit_syscalls."""
    from evidence.agent.recorder import seccomp_check

    try:
        absent = seccomp_check.missing(seccomp_check.installed_filters(pid))
    except OSError as e:
        if e.errno in (errno.ESRCH, errno.ETIMEDOUT):
            raise UsageError(f"cannot isolate process {pid}: {e.strerror}") from None
        logger.warning("cannot read the seccomp filters of process %d: %s", pid, e.strerror)
        return [
            {
                "component": "isolation",
                "reason": f"the agent could not read the seccomp filters of the command's process ({e.strerror}; "
                "it needs CAP_SYS_ADMIN and CAP_SYS_PTRACE, outside a seccomp profile of its own)",
                "impact": "its client's word is taken that 32-bit system calls, io_uring and terminal injection are "
                "refused: a client of the job's own may not have refused them, and what the job did through "
                "32-bit calls or io_uring would not be recorded",
            }
        ], "unverified: refused by the client's filter, which the agent could not read"
    out = [
        {
            "component": "isolation",
            "reason": f"the command's process does not run under evidence's seccomp filter for {name}: its "
            "client did not install it (not `evidence run --agent`, or an older one)",
            "impact": seccomp_check.EXPECTED[name][1],
        }
        for name in absent
    ]
    refused = "32-bit system calls" not in absent
    return out, COMPAT_REFUSED if refused else "not refused, not recorded (no filter: see the degradation)"
