"""One owner for a run's life: prepare -> start -> the command's process -> record -> finish -> bundle.

- prepare: a `RunPlan`, what the run is before anything is made (command, cwd, labels, detail,
  network, roots, the capabilities and degradations of what its command runs under) and its
  policy's `Enforcement`, loaded and checked first (a bad policy starts nothing).
- start: `Run.start` makes the recorder's session for a cgroup (a new run slot, tracked from then
  on), with everything the plan says, and attaches the policy to it before the command is in it.
- the command's process: `launched` (a process of the run, from before it execs, runs the
  command: the manifest's command is what the kernel executed, the plan's a claim) or `adopt` (a
  process already running: `start --pid`).
- record: the recorder's threads (agent/recorder/pipeline.py); `degrade`, `update_labels` and
  `poll_denials` add to the run meanwhile.
- finish: the policy's last denials, then the bundle (agent/recorder/recording.py: finish).

A policy's `limits` (agent/recorder/limits.py) are the run's too: set on its cgroup in `start`,
before the command is in it (what cannot be set is a degradation, or PolicyError under
--fail-closed), the command's process put into the v1 cgroups that hold them (`launched`,
`enter_limits`), read by `poll_limits` while the run lives (the driver kills the run's cgroup when
it says the wall limit is reached) and once more in `finish`: each limit reached is a
`policy.limit` record, an OOM kill naming the processes it took from the run's exits.

The run record beside the spool (`<session>.run.json`) is the session's description, whole
(agent/recorder/description.py): `Run` writes it when the run starts and again whenever something
in it changes, and removes it once the bundle is written. `evidence run`
(agent/commands/run_standalone.py) and the agent (agent/daemon/backend.py) both drive a `Run`;
what is theirs alone (a launcher, a cgroup of the agent's, a client's pidfd) stays with them.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from evidence.agent.recorder.description import Detail, Network
from evidence.agent.recorder.kernel import capabilities_in_force
from evidence.agent.recorder.recovery import RUN_META_SUFFIX, hold, spool_dir_lock, write_run_record
from evidence.bundle.format import Artifacts, Degradation
from evidence.bundle.record_types import DenialRecord, ExitRecord, LimitRecord, SpoolRecord
from evidence.errors import PolicyError

if TYPE_CHECKING:
    from evidence.agent.recorder.command_rules import CommandRules
    from evidence.agent.recorder.enforce import Enforcement
    from evidence.agent.recorder.limits import AppliedLimits, LimitEvent, LimitWatcher
    from evidence.agent.recorder.notices import NoticeWriter
    from evidence.agent.recorder.recording import Recorder
    from evidence.agent.recorder.session import Session, Spool
    from evidence.bundle.attestation import Signer
    from evidence.bundle.spool import SpoolWriter
    from evidence.probes.headers import Headers
    from evidence.probes.loader import RecorderProbes

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What a run is, decided before it starts."""

    command: Sequence[str]  # as the caller gave it (with `launched`, a claim)
    cwd: str
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    detail: Detail = "summary"
    network: Network = None  # the command's private network namespace (--net)
    roots: Mapping[str, str] = dataclasses.field(default_factory=dict)  # placeholder -> path
    # over the recorder's: what this run's command runs under (isolation, 32-bit system calls)
    capabilities: Mapping[str, str] = dataclasses.field(default_factory=dict)
    degradations: Sequence[Degradation] = ()
    session_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    attached_late: bool = False  # the cgroup held processes before the run started
    subjects: Sequence[str] = ()  # `--subject`: globs, in the workspace, of files the run produces
    subjects_as: tuple[int, int] | None = None  # (uid, gid) they are read as (an agent's client); None: root

    @staticmethod
    def roots_of(enforcement: Enforcement | None) -> dict[str, str]:
        """A policy's private tmp and workspace, which the run id names by their placeholders."""
        if enforcement is None:
            return {}
        return {"${TMPDIR}": enforcement.tmpdir, "${WORKSPACE}": enforcement.workspace}


class Run:
    """A run's life (this module's docstring). `record_dir`: where its run record goes (beside its
    spool); `where`: the bundle's name, path and signing key, for recovery; `held`: the record is
    locked while the run lives (`evidence run`: `evidence recover` never takes a live run)."""

    def __init__(
        self,
        recorder: Recorder,
        plan: RunPlan,
        *,
        record_dir: Path,
        enforcement: Enforcement | None = None,
        where: Mapping[str, str | None] | None = None,
        held: bool = False,
    ) -> None:
        self.recorder = recorder
        self.plan = plan
        self.enforcement = enforcement
        self.record_dir = record_dir
        self.where = dict(where or {})
        self._held = held
        self._lock_fd = -1
        self._session: Session | None = None
        self.limits: AppliedLimits | None = None
        self._watcher: LimitWatcher | None = None
        self._limit_events: list[tuple[LimitEvent, int]] = []  # (event, the previous poll's time)
        self._polled_ns = 0
        self._killed: collections.deque[ExitRecord] = collections.deque(maxlen=4096)  # SIGKILLed
        self.wall_reached = False
        self.commands: CommandRules | None = None  # the policy's command rules, when in force
        # the job's stderr: a line for each refusal of the policy's (exec, file, connect), rate-limited
        self.notices: NoticeWriter | None = None

    @property
    def session_id(self) -> str:
        return self.plan.session_id

    @property
    def session(self) -> Session:
        if self._session is None:
            raise RuntimeError(f"run {self.plan.session_id} has not started")
        return self._session

    # ---- start --------------------------------------------------------------------------------
    def start(
        self,
        cgroup: Path,
        *,
        wrap_spool: Callable[[SpoolWriter], Spool] | None = None,
        signed: bool = False,
    ) -> Session:
        """Record `cgroup` from now on, as the plan says; the policy, if any, attached to it (its
        connect guard holds the cgroup before the command is in it). Writes the run record.
        `signed`: its bundle will be signed (Recorder.start)."""
        plan = self.plan
        said = self._apply_limits(cgroup)  # before the command is in the cgroup
        capabilities = dict(plan.capabilities)
        if self.limits is not None:
            capabilities["limits"] = _limits_text(self.limits)
        # until its record is written and held (save), the run's spool is locked by the directory's
        # lock: an `evidence recover` meanwhile would take it for a dead run's
        with spool_dir_lock(self.record_dir, exclusive=False):
            try:
                self._session = self.recorder.start(
                    cgroup,
                    list(plan.command),
                    plan.cwd,
                    detail=plan.detail,
                    labels=plan.labels,
                    attached_late=plan.attached_late,
                    session_id=plan.session_id,
                    wrap_spool=wrap_spool,
                    roots=plan.roots,
                    network=plan.network,
                    capabilities=capabilities,
                    degradations=plan.degradations,
                    signed=signed,
                )
            except BaseException:
                self.close_limits()
                raise
            if self.enforcement is not None:
                self.enforcement.enforce_on(
                    self._session,
                    watch=self._watch_exits if self.limits is not None else None,
                    tell=self.tell,
                )
            self._session.degrade(*said)
            self.save()
        return self._session

    def _apply_limits(self, cgroup: Path) -> list[Degradation]:
        """Set the policy's limits on `cgroup` (`self.limits`); what could not be set, as
        degradations. Under --fail-closed, anything not set refuses the run (PolicyError)."""
        enf = self.enforcement
        if enf is None or enf.policy.limits is None:
            return []
        from evidence.agent.recorder import limits

        if enf.mode == "dry-run":
            return [
                Degradation(
                    component="limits",
                    reason="--dry-run: the policy's limits are not applied",
                    impact="the run may use more than the policy allows, and nothing says where it would have",
                )
            ]
        applied = limits.apply(enf.policy.limits, cgroup)
        said = [
            Degradation(component="limits", reason=d.reason, impact=d.impact) for d in applied.degradations
        ]
        if said and enf.fail_closed:
            applied.remove()
            raise PolicyError(
                f"the policy cannot be fully enforced here: limits: {said[0].reason}",
                "drop --fail-closed to run with it recorded",
            )
        self.limits = applied
        wall_offset = self.recorder.wall_offset_ns
        self._watcher = limits.LimitWatcher(applied, clock_ns=lambda: time.monotonic_ns() + wall_offset)
        self._polled_ns = self._watcher.clock_ns()
        return said

    def _watch_exits(self, records: Sequence[SpoolRecord]) -> None:
        self._killed.extend(_sigkilled(records))

    def enter_limits(self, pid: int) -> None:
        """Put process `pid` (the command's, before it execs) into the run's v1 cgroups."""
        if self.limits is not None:
            self.limits.enter(pid)

    def poll_limits(self) -> bool:
        """Read what the run's limits counted since the last look; True once the wall limit is
        reached (the caller kills the run's cgroup, once)."""
        watcher = self._watcher
        if watcher is None:
            return False
        since, self._polled_ns = self._polled_ns, watcher.clock_ns()
        events = watcher.poll()
        self._limit_events += [(e, since) for e in events]
        if events:  # what a recovery has if the recorder dies before the run's end names the victims
            self.session.journal_early(self._limit_records_of([(e, since) for e in events]))
        wall = any(e.kind == "wall" for e in events)
        self.wall_reached = self.wall_reached or wall
        return wall

    def _limit_records(self) -> list[LimitRecord]:
        out = self._limit_records_of(self._limit_events)
        self._limit_events = []
        return out

    def _limit_records_of(self, events: Sequence[tuple[LimitEvent, int]]) -> list[LimitRecord]:
        from evidence.agent.recorder.limits import name_victims

        out: list[LimitRecord] = []
        ooms = [since for event, since in events if event.kind == "oom_kill"]
        # exits held back behind an exec's hash are not observed yet (the recorder's finish does
        # that): a victim's exit may be one of them, so they are looked at here too
        killed = [*self._killed, *_sigkilled(self.session.held if ooms else ())]
        for event, since in events:
            # a victim may exit after the poll that counted its kill: named up to the next such poll
            later = [s for s in ooms if s > since]
            e = name_victims(event, killed, since, until=min(later) if later else 2**63 - 1)
            detail = e.describe()
            if e.kind == "wall" and self.limits is not None:
                detail = f"the run reached limits.wall ({self.limits.limits.wall_ms} ms) and was killed"
            out.append(
                {
                    "k": "limit",
                    "t": e.t,
                    "limit": e.limit,
                    "kind": e.kind,
                    "count": e.count,
                    "pids": list(e.pids),
                    "certain": e.certain,
                    "detail": detail,
                }
            )
        return out

    def launched(self, pid: int) -> None:
        """Process `pid`, of the run from before it execs, runs the plan's command (which becomes
        its claim); the run's resolvers are those it sees. Before the command can run: saved."""
        self.session.starts_command(pid)
        self.enter_limits(pid)
        self.recorder.configure_resolvers(self.session, pid)
        self.save()

    def adopt(self, pid: int) -> None:
        """Process `pid`, already running, is the run's (the one a client named)."""
        self.session.adopts(pid)
        self.recorder.configure_resolvers(self.session, pid)
        self.save()

    # ---- record -------------------------------------------------------------------------------
    def degrade(self, *said: Degradation) -> None:
        self.session.degrade(*said)
        self.save()

    def update_labels(self, labels: Mapping[str, str], **where: str | None) -> None:
        self.session.update_labels(labels)
        self.where.update(where)
        self.save()

    def poll_denials(self, timeout_ms: int = 0) -> None:
        """Move the connect guard's denials into the run's records (and tell the job)."""
        enf = self.enforcement
        if enf is not None and enf.guard is not None:
            denials = enf.poll_denials(self.session.correlator.exe_of, timeout_ms=timeout_ms)
            self.session.add_records(denials)
            for rec in denials:
                self.tell(rec)

    def tell(self, rec: DenialRecord) -> None:
        """One line on the job's stderr for a refusal (notices.py: not for what went on)."""
        notices = self.notices
        if notices is not None:
            notices.denial(rec)

    def save(self, **ended: str | int | None) -> Path | None:
        """Write the run record: the session's description, whole, and where its bundle goes
        (`ended`: how the command ended, when only the bundle could not be written)."""
        if self._session is None:
            return None
        try:
            # a new file replaces the record, unlocked until held below: the directory's lock
            # meanwhile (spool_dir_lock)
            with spool_dir_lock(self.record_dir, exclusive=False):
                path = write_run_record(self.record_dir, self._session.describe(**self.where, **ended))
                if self._held:
                    if self._lock_fd >= 0:
                        os.close(self._lock_fd)  # the record was replaced: hold the new one
                    self._lock_fd = hold(path)
        except OSError as e:
            if self._held:  # `evidence run`: no record, no run (recover could take a live spool)
                raise
            logger.warning("run %s: cannot write its recovery record: %s", self.session_id, e)
            return None
        return path

    # ---- finish -------------------------------------------------------------------------------
    def finish(
        self,
        bundle_path: Path,
        *,
        exit_code: int | None,
        signal: str | None = None,
        cut_short: bool = False,
        signer: Signer | None = None,
    ) -> dict[str, Any]:  # the manifest, as the writer returns it
        """The policy's last denials, then the bundle; its manifest. The run record is removed once
        the bundle is written; on an error it stays (the spool too) and the error is raised."""
        try:
            self.poll_denials()
        except Exception as e:  # noqa: BLE001 - the bundle is written all the same; the guard counts its losses
            logger.warning("run %s: reading connect denials failed: %s", self.session_id, e)
        if self.commands is not None:  # the run's processes are gone: nothing waits any more
            self.close_commands()
        if self._watcher is not None:  # the last counts, the run's exits all read: the victims named
            self.recorder.drain()
            self.poll_limits()
            self.session.add_records(self._limit_records())
            self.session.rejournal()  # the early limit records out, the named ones in
        try:  # (the policy's matching of records held back behind a hash runs in the recorder's finish)
            manifest = self.recorder.finish(
                self.session,
                bundle_path,
                exit_code=exit_code,
                signal=signal,
                cut_short=cut_short,
                signer=signer,
                artifacts=self._artifacts(),
            )
        finally:
            self.close_enforcement()
        self.forget_record()
        return manifest

    def _artifacts(self) -> Artifacts | None:
        """The files the plan's subjects match in the workspace, hashed now that the command exited."""
        if not self.plan.subjects:
            return None
        from evidence.bundle import subjects

        workspace = self.enforcement.workspace if self.enforcement is not None else self.plan.cwd
        if self.plan.subjects_as is not None:
            return subjects.collect_as(*self.plan.subjects_as, workspace, self.plan.subjects)
        return subjects.collect(workspace, self.plan.subjects)

    def close_enforcement(self) -> None:
        """Detach the policy's connect guard, remove its network namespace and the private tmp it
        owns; once (a second removal of a tmp path could remove what someone made there since)."""
        enforcement, self.enforcement = self.enforcement, None
        if enforcement is not None:
            enforcement.close()
        self.close_commands()
        self.close_limits()
        notices, self.notices = self.notices, None
        if notices is not None:
            notices.close()

    def close_commands(self) -> None:
        """Stop deciding the run's execs (a waiting one fails) and withdraw its approval requests."""
        rules, self.commands = self.commands, None
        if rules is not None:
            rules.close()

    def close_limits(self) -> None:
        """Remove the v1 cgroups made for the run's limits (killing what is left in them); once."""
        applied, self.limits = self.limits, None
        if applied is not None:
            applied.remove()

    def forget_record(self) -> None:
        """Remove the run record (its bundle is written, or the agent gave the run up)."""
        (self.record_dir / f"{self.session_id}{RUN_META_SUFFIX}").unlink(missing_ok=True)
        self.release()

    def release(self) -> None:
        """Let go of the run record's lock (the process exits, or the record is gone)."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def _sigkilled(records: Iterable[SpoolRecord]) -> list[ExitRecord]:
    """The exits of `records` by SIGKILL (an OOM kill's victims are among them)."""
    return [r for r in list(records) if r["k"] == "exit" and r["signal"] == "SIGKILL"]


def _limits_text(applied: AppliedLimits) -> str:
    """The manifest's capabilities.limits: each limit in force and what holds it."""
    parts = [f"{name} {v['value']} ({v['by']})" for name, v in applied.in_force().items()]
    return ", ".join(parts) if parts else "none in force"


# ---- setting up a recorder: `evidence run` and the agent alike ---------------------------------


def open_recorder(
    spool_dir: Path,
    headers: Headers,
    *,
    enforcement: str = "none (observe only)",
    probes: RecorderProbes | None = None,
) -> Recorder:
    """The recorder of `evidence run` and of the agent: the probes (`probes`, or loaded now), the
    manifest's capabilities of this kernel. What a run's command runs under (its isolation, 32-bit
    system calls) is the run's own (RunPlan.capabilities)."""
    from evidence.agent.recorder.recording import Recorder

    caps = {**capabilities_in_force(), "recorder": "tracepoints+ringbuf", "enforcement": enforcement}
    return Recorder(spool_dir=spool_dir, headers=headers, capabilities=caps, probes=probes)
