"""The agent's `Backend` over one `Recorder`: runs on existing cgroups, isolated runs, windows, metrics.

`RecorderBackend` is what agent/daemon/api.py talks to: one state machine over the table of runs
and the lock that guards it (its runs and what they run under are agent/daemon/runs.py's; each
drives a `Run`, agent/recorder/run.py). It adds to the recorder, from outside it:

- Attaching late. A run starts on a cgroup that may already hold processes: tracking starts first,
  then an inventory of every process there (argv, cwd, exe, sockets) is written at the head of the
  spool, and those processes become roots of the run's process tree (depth 0, or their depth below
  another inventoried process), so what they do next has a parent.
- Observing the spool. Each session's spool writer is wrapped (agent/daemon/wrappers.py:
  `ObservedSpool`): records are counted by kind for /metrics, copied to the live event stream, and
  flushed now and then, so that the spool of an agent that dies is readable up to the last flush.
- Recovery. Beside each spool, `<session>.run.json` is the run's description, whole, written by its
  `Run` when it starts and whenever it changes (labels, a degradation), removed once the bundle is
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

Why this module is over 600 lines (issue 23): it is one state machine, the table of runs and the
lock that guards it, and every method left here reads or changes that table under the lock (start,
isolate, finish, rotate, the housekeeping that walks the open runs). What does not touch the table
is already elsewhere: the runs and what they run under (runs.py), a policy's pieces on an isolated
run (policy.py), exit statuses (exits.py), spool wrappers (wrappers.py), pods (pods.py), a run's
own life (agent/recorder/run.py). Cutting the rest in two would put the lock's invariants (a run
is in the table until its bundle is written; `finishing` is set once, under the lock) in two files.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from evidence.agent.daemon import exits
from evidence.agent.daemon import metrics as m
from evidence.agent.daemon.api import NotReady, RunConflict, RunStatus, UnknownRun
from evidence.agent.daemon.policy import command_rules, exec_listener, job_notices
from evidence.agent.daemon.runs import (
    ADOPTED,
    AgentRun,
    Launched,
    RunWatchdog,
    filter_degradations,
    isolated_cgroup,
    process_depths,
)
from evidence.agent.daemon.wrappers import HandoverProbes, ObservedSpool
from evidence.agent.recorder.approvals import ApprovalBroker
from evidence.agent.recorder.description import Detail, Network
from evidence.agent.recorder.inventory import cgroup_pids, read_process, take_inventory
from evidence.agent.recorder.launch import ipc_isolation
from evidence.agent.recorder.recovery import unique_path
from evidence.agent.recorder.run import Run, RunPlan
from evidence.bundle.format import Degradation
from evidence.errors import UsageError
from evidence.files import file_sha256

if TYPE_CHECKING:
    from evidence.agent.daemon.delivery import BundleUploader, EventStreamer
    from evidence.agent.daemon.fleet import FleetPublisher
    from evidence.agent.daemon.models import PolicySpec
    from evidence.agent.recorder.enforce import Enforcement
    from evidence.agent.recorder.recording import Recorder
    from evidence.bundle.attestation import Signer
    from evidence.bundle.record_types import ApprovalRecord, SpoolRecord
    from evidence.bundle.spool import SpoolWriter

logger = logging.getLogger(__name__)

FLUSH_SECONDS = 2.0


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
        signer: Signer | None = None,
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
        self._runs: dict[str, AgentRun] = {}
        self._moved: dict[str, str] = {}  # a rotated run whose command rules went on -> the next run
        self._starting: set[Path] = set()
        self._events: dict[str, int] = {}
        self._lost_done: dict[str, int] = {}
        self._started = 0
        self._finished = 0
        self._bundles = 0
        self._bundle_bytes = 0
        self._lag = 0.0
        self._lag_probe_since: float | None = None
        # ONE broker for every run's approvals (command rules' `approve`): the API's /approvals
        # and `evidence approvals` answer through it; each record goes to its run
        self.approvals = ApprovalBroker(record=lambda _rec: None, route=self._approval_record)

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

    def start(self, cgroup: Path, labels: Mapping[str, str], pid: int | None = None) -> RunStatus:
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
        detail: Detail = "summary",
        command: list[str] | None = None,
        launched: Launched | None = None,
    ) -> AgentRun:
        """A run of `cgroup`. `launched`: its command was started by an `evidence run --agent`
        client (what it runs under: its policy, network, filters); otherwise (a pid or cgroup
        adopted, a pod) the run says 32-bit system calls are neither refused nor recorded."""
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
                rec, cgroup, labels, pid, bundle_name, extensions, session_id, detail, command, launched
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
        session_id: str | None,
        detail: Detail,
        command: list[str] | None,
        launched: Launched | None,
    ) -> AgentRun:
        before = cgroup_pids(cgroup)
        argv: list[str] = []
        cwd = ""
        if pid is not None:
            proc = read_process(pid)
            if proc is not None:
                argv, cwd = list(proc["argv"]), proc["cwd"] or ""
        if command is not None:
            argv = list(command)
        plan = RunPlan(
            command=argv,
            cwd=cwd,
            labels=dict(labels),
            detail=detail,
            attached_late=bool(before),
            session_id=session_id or uuid.uuid4().hex,
            **(launched.plan() if launched is not None else ADOPTED),
        )
        sid = plan.session_id
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        run = Run(
            rec,
            plan,
            record_dir=self.spool_dir,
            enforcement=launched.enforcement if launched is not None else None,
            where={"bundle_name": bundle_name},
        )
        made: list[AgentRun] = []  # the run, once made (the spool holds every record back until then)

        def observed(inner: SpoolWriter) -> ObservedSpool:
            return ObservedSpool(inner, lambda recs: self._observe(made[0], recs))

        try:
            session = run.start(cgroup, wrap_spool=observed, signed=self.signer is not None)
        except FileNotFoundError:
            raise UsageError(f"{cgroup} is gone") from None
        spool = cast(ObservedSpool, session.spool)
        agent_run = AgentRun(run=run, spool=spool, pid=pid, bundle_name=bundle_name)
        made.append(agent_run)
        agent_run.extensions = dict(extensions or {})
        if pid is not None and command is not None:  # isolated: the client's claim, before its exec
            session.starts_command(pid)
            run.save()
        elif pid is not None:
            run.adopt(pid)  # ---- dns: its /etc/resolv.conf
        with self._lock:
            self._runs[sid] = agent_run
            self._started += 1
        # Inventory after tracking began: anything forked meanwhile is both listed and recorded.
        try:
            inventory = take_inventory(cgroup)
        except Exception as e:  # the run goes on without it, and says so
            logger.warning("run %s: inventory of %s failed: %s", sid, cgroup, e)
            run.degrade(
                Degradation(
                    component="inventory",
                    reason=str(e),
                    impact="processes present at attach are not listed",
                )
            )
            inventory = []
        depth = process_depths(inventory)
        if pid is None and inventory:  # ---- dns: the resolv.conf of the process at the top of the tree
            first = min(inventory, key=lambda r: (depth[int(r["pid"])], int(r["pid"])))
            rec.configure_resolvers(session, int(first["pid"]))
            run.save()
        for r in inventory:
            p = int(r["pid"])
            known = session.correlator.procs.get(p)
            if known is None:
                session.correlator.add_root(p, int(r["ppid"]), cast(str, r["cwd"]), r["exe"], depth[p])
            elif known.depth < 0:
                known.depth = depth[p]
        agent_run.spool.set_prelude(inventory)
        logger.info(
            "run %s: attached to %s (%d process(es) already there)%s",
            sid,
            cgroup,
            len(inventory),
            f", labels {dict(labels)}" if labels else "",
        )
        return agent_run

    def isolate(
        self,
        pid: int,
        labels: Mapping[str, str],
        mount: Path,
        *,
        command: Sequence[str] = (),
        detail: Detail = "summary",
        pidfd: int | None = None,
        policy: PolicySpec | None = None,
        net: Network = None,
        subjects: Sequence[str] = (),
        subjects_as: tuple[int, int] | None = None,
    ) -> RunStatus:
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
        from evidence.agent.daemon.policy import loaded_enforcement

        # loaded and compiled before anything is made: a bad one starts nothing
        enforcement = loaded_enforcement(policy, net) if policy is not None else None
        try:
            subjects_of = (tuple(subjects), subjects_as)
            return self._isolate(
                pid, labels, Path(mount), list(command), detail, pidfd, enforcement, net, subjects_of, policy
            )
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
        detail: Detail,
        pidfd: int | None,
        enforcement: Enforcement | None,
        net: Network = None,
        subjects_of: tuple[tuple[str, ...], tuple[int, int] | None] = ((), None),
        spec: PolicySpec | None = None,
    ) -> RunStatus:
        from evidence.agent.recorder.cgroups import isolation_home

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
        ipc, shared = ipc_isolation(pid)  # its own IPC and /dev/shm, read back too
        if shared and enforcement is not None and enforcement.fail_closed:
            raise UsageError(f"the command cannot be isolated: {shared[0].reason}", "drop --fail-closed")
        unfiltered += shared
        listener = exec_listener(pid, pidfd, enforcement, spec)
        try:
            cg, misplaced = isolated_cgroup(sid, home, why_not, Path(mount))
        except BaseException:
            if listener is not None:
                os.close(listener)
            raise
        said = ([misplaced] if misplaced is not None else []) + unfiltered
        try:  # the policy's guard holds the cgroup before the command is in it, the record says all
            run = self.start_run(
                cg.path,
                labels,
                pid=pid,
                session_id=sid,
                detail=detail,
                command=list(command),
                launched=Launched(enforcement, net, compat, tuple(said), *subjects_of, ipc=ipc),
            )
        except BaseException:
            cg.remove()
            if listener is not None:
                os.close(listener)
            raise
        run.cgroup = cg
        if spec is not None and pidfd is not None:
            job_notices(run.run, pidfd, spec)
        if listener is not None:
            assert enforcement is not None and spec is not None and pidfd is not None
            run.run.commands = command_rules(
                run.run, pid, pidfd, listener, enforcement, spec, self.approvals, self._require_recorder()
            )
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
            run.run.enter_limits(pid)  # the policy's limits held on v1 hierarchies, if any
            (cg.path / "cgroup.procs").write_text(str(pid))
        except OSError as e:
            self._abandon(run)
            why = "it has exited" if isinstance(e, ProcessLookupError) else e.strerror
            raise UsageError(f"cannot move process {pid} into {cg.path}: {why}") from None
        logger.info("run %s: process %d moved into its own cgroup %s", sid, pid, cg.path)
        return run.info

    def _approval_record(self, session_id: str, rec: ApprovalRecord) -> None:
        with self._lock:  # a run whose command rules went on in a later window (rotate)
            while session_id in self._moved:
                session_id = self._moved[session_id]
        run = self.run(session_id)
        if run is not None:
            run.session.add_records([rec])

    def _recording(self, cgroup: Path) -> tuple[Path, str] | None:
        """(cgroup, session) of the run that records `cgroup` (it or an ancestor), if any."""
        with self._lock:
            for r in self._runs.values():
                path = r.session.cgroup_path
                if path == cgroup or path in cgroup.parents:
                    return path, r.session.session_id
        return None

    def _abandon(self, run: AgentRun) -> None:
        """Finish a run that never got its process, and throw the bundle away."""
        tmp = self.spool_dir / f".abandoned-{run.session.session_id}.tar.gz"
        try:
            self.finish(run.session.session_id, tmp)
        except Exception as e:
            logger.warning("run %s: could not be abandoned cleanly: %s", run.session.session_id, e)
        tmp.unlink(missing_ok=True)

    def _observe(self, run: AgentRun, recs: Sequence[SpoolRecord]) -> None:
        """Count a run's records by kind (for /metrics), and copy them to the live event stream."""
        counts = Counter(str(r.get("k")) for r in recs)
        with self._lock:
            for k, n in counts.items():
                self._events[k] = self._events.get(k, 0) + n
        if self.streamer is not None or self.fleet is not None:
            from evidence.agent.daemon.delivery import live_events  # the agent extra's cloudevents

            events, run.seq = live_events(run.session.session_id, run.seq, recs, run.extensions)
            if self.streamer is not None:
                for event in events:
                    self.streamer.submit(event)
            if self.fleet is not None:
                self.fleet.submit_many(events)

    def update_labels(
        self, session_id: str, labels: Mapping[str, str], bundle_name: str | None = None
    ) -> None:
        with self._lock:
            run = self._runs.get(session_id)
            if run is None:
                return
            if bundle_name is not None:
                run.bundle_name = bundle_name
        run.run.update_labels(labels, **({"bundle_name": bundle_name} if bundle_name is not None else {}))

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
            exit_code, signal, cut_short, said = exits.verdict(sid, observed, exit_code, signal)
            if said is not None:
                run.session.degrade(said)
        if run.pidfd is not None:
            os.close(run.pidfd)
            run.pidfd = None
        try:
            manifest = run.run.finish(
                Path(bundle_path), exit_code=exit_code, signal=signal, cut_short=cut_short, signer=self.signer
            )
        except BaseException:
            logger.exception("run %s: writing its bundle %s failed", sid, bundle_path)
            with self._lock:
                self._runs.pop(sid, None)
                self._finished += 1
            run.run.forget_record()
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
        self._bundle_written(run, Path(bundle_path), manifest)
        return manifest

    def _bundle_written(self, run: AgentRun, bundle_path: Path, manifest: Mapping[str, Any]) -> None:
        """The seam where a run ends: its bundle is written (`manifest`). One in the bundle
        directory (not an abandoned run's, beside the spools) is queued for upload and for the
        fleet."""
        if bundle_path.parent != self.bundle_dir:
            return
        if self.uploader is not None:
            self.uploader.enqueue(bundle_path)
        if self.fleet is not None:
            self.fleet.bundle_written(bundle_path, manifest)

    def _remove_cgroup(self, run: AgentRun) -> None:
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

    def default_bundle_path(self, run: AgentRun) -> Path:
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

    def rotate(self, session_id: str, bundle_path: Path, labels: Mapping[str, str]) -> tuple[AgentRun, str]:
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
        rules, old.run.commands = old.run.commands, None
        if rules is not None:  # the command rules go on deciding, the exec check on the new slot
            rules.moved(new.session.slot)
            rules.add_records = new.session.add_records
            new.run.commands = rules
            if new.run.notices is None:  # the job is still told, through the new run
                new.run.notices, old.run.notices = old.run.notices, None
            with self._lock:  # its approvals' records (asked under the first run's id) go on too
                self._moved[session_id] = new.session.session_id
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

    def open_runs(self) -> list[AgentRun]:
        with self._lock:
            return [r for r in self._runs.values() if not r.finishing]

    def run(self, session_id: str) -> AgentRun | None:
        with self._lock:
            return self._runs.get(session_id)

    def runs(self) -> Sequence[RunStatus]:
        return [r.info for r in self.open_runs()]

    def _poll_denials(self, run: AgentRun) -> None:
        """Move the connect guard's denials into the run's records; read its limits (the wall limit
        reached: its cgroup is killed, and the client sees its command killed)."""
        try:
            run.run.poll_denials()
        except Exception as e:  # noqa: BLE001 - housekeeping goes on; the guard's losses are counted
            logger.warning("run %s: reading connect denials failed: %s", run.session.session_id, e)
        try:
            if run.run.poll_limits() and run.cgroup is not None:
                logger.info(
                    "run %s: limits.wall reached: killing %s", run.session.session_id, run.cgroup.path
                )
                run.cgroup.kill()
        except Exception as e:  # noqa: BLE001 - housekeeping goes on
            logger.warning("run %s: reading its limits failed: %s", run.session.session_id, e)

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
