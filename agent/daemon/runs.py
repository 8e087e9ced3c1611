"""The agent's runs: `AgentRun` (a run, agent/recorder/run.py, with what the agent adds: its observed
spool, the client's pid and pidfd, the cgroup it made), what a run's command runs under (`Launched`
for an `evidence run --agent` client's, `ADOPTED` for processes the agent did not start), and what
the agent reads of them: the depth of processes already there (`process_depths`), evidence's seccomp
filters read back from an isolated process (`filter_degradations`). agent/daemon/backend.py keeps
the table of runs."""

from __future__ import annotations

import dataclasses
import errno
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, Protocol, TypedDict

from evidence.agent.daemon.api import RunStatus
from evidence.agent.daemon.wrappers import ObservedSpool
from evidence.agent.recorder.description import Network
from evidence.agent.recorder.launch import (
    COMPAT_ADOPTED,
    COMPAT_NOT_REFUSED,
    COMPAT_REFUSED,
    IPC_ADOPTED,
    IPC_NOT_PRIVATE,
    IPC_SHARED,
)
from evidence.agent.recorder.run import Run, RunPlan
from evidence.bundle.format import Degradation
from evidence.errors import SetupError, UsageError

if TYPE_CHECKING:
    from evidence.agent.recorder.cgroups import RunCgroup
    from evidence.agent.recorder.enforce import Enforcement
    from evidence.agent.recorder.session import Session

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class AgentRun:
    """A run the backend records: the run (agent/recorder/run.py), its observed spool, and what the
    agent adds."""

    run: Run
    spool: ObservedSpool
    pid: int | None
    bundle_name: str | None = None  # where finish_all / pod runs write it, in the bundle dir
    extensions: dict[str, str] = dataclasses.field(default_factory=dict)
    finishing: bool = False
    lost: dict[str, int] = dataclasses.field(default_factory=dict)  # last read, while active
    seq: int = 0
    cgroup: RunCgroup | None = None  # made by the agent for this run (isolated): removed at finish
    pidfd: int | None = None  # of the isolated process, held from before it was moved in

    @property
    def session(self) -> Session:
        return self.run.session

    @property
    def info(self) -> RunStatus:
        s = self.session
        return RunStatus(
            session_id=s.session_id,
            cgroup=str(s.cgroup_path),
            labels=dict(s.labels),
            started_ns=s.started_ns,
            attached_late=s.attached_late,
            pid=self.pid,
            isolated=self.cgroup is not None,
        )


class PlanFields(TypedDict):
    """What a run's plan says of what its command runs under (agent/recorder/run.py RunPlan)."""

    network: Network
    roots: dict[str, str]
    capabilities: dict[str, str]
    degradations: tuple[Degradation, ...]
    subjects: NotRequired[tuple[str, ...]]
    subjects_as: NotRequired[tuple[int, int] | None]


# a run of processes the agent adopted (start --pid/--cgroup, a pod): not started by evidence, so
# without the filter that refuses 32-bit system calls, and its manifest says so
ADOPTED = PlanFields(
    network=None,
    roots={},
    capabilities={"32bit_syscalls": COMPAT_ADOPTED, "ipc": IPC_ADOPTED},
    degradations=(COMPAT_NOT_REFUSED, IPC_NOT_PRIVATE),
)


@dataclasses.dataclass(frozen=True)
class Launched:
    """What the command of an `evidence run --agent` client runs under: its policy, its private
    network, evidence's seccomp filters as read back (capabilities.32bit_syscalls), and what the
    agent found wanting (its cgroup's place, filters missing)."""

    enforcement: Enforcement | None
    network: Network
    compat: str
    degradations: tuple[Degradation, ...]
    subjects: tuple[str, ...] = ()  # `--subject`, collected as the client (uid, gid)
    subjects_as: tuple[int, int] | None = None
    ipc: str = IPC_SHARED  # capabilities.ipc, read back (launch.py ipc_isolation)

    def plan(self) -> PlanFields:
        return PlanFields(
            network=self.network,
            roots=RunPlan.roots_of(self.enforcement),
            capabilities={"32bit_syscalls": self.compat, "ipc": self.ipc},
            degradations=self.degradations,
            subjects=self.subjects,
            subjects_as=self.subjects_as,
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


def isolated_cgroup(
    sid: str, home: Path | None, why_not: str | None, mount: Path
) -> tuple[RunCgroup, Degradation | None]:
    """An isolated run's cgroup: evidence-<sid> below `home` (the client's cgroup's place, where its
    limits keep applying), else under <mount>/evidence/; and what the run must say when it could
    not be below the client's (`why_not`: why not, from agent/recorder/cgroups.py isolation_home)."""
    from evidence.agent.recorder.cgroups import RunCgroup

    if home is not None:
        try:
            return RunCgroup.create_in(home, f"evidence-{sid}"), None
        except SetupError as e:
            why_not = e.message
    cgroup = RunCgroup.create(sid, mount)
    if why_not is None:  # the client's cgroup is the root: no limits to keep
        return cgroup, None
    return cgroup, Degradation(
        component="cgroup",
        reason=f"the run's cgroup is not below the client's: {why_not}",
        impact="the limits of the client's cgroup (memory, pids, cpu) did not apply to the command",
    )


def filter_degradations(pid: int) -> tuple[list[Degradation], str]:
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
            Degradation(
                component="isolation",
                reason=f"the agent could not read the seccomp filters of the command's process ({e.strerror}; "
                "it needs CAP_SYS_ADMIN and CAP_SYS_PTRACE, outside a seccomp profile of its own)",
                impact="its client's word is taken that 32-bit system calls, io_uring and terminal injection are "
                "refused: a client of the job's own may not have refused them, and what the job did through "
                "32-bit calls or io_uring would not be recorded",
            )
        ], "unverified: refused by the client's filter, which the agent could not read"
    out = [
        Degradation(
            component="isolation",
            reason=f"the command's process does not run under evidence's seccomp filter for {name}: its "
            "client did not install it (not `evidence run --agent`, or an older one)",
            impact=seccomp_check.EXPECTED[name][1],
        )
        for name in absent
    ]
    refused = "32-bit system calls" not in absent
    return out, COMPAT_REFUSED if refused else "not refused, not recorded (no filter: see the degradation)"
