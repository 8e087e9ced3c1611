"""A run as the recorder holds it while it records: `Session`, and `Spool`, where its records go.

The recorder (agent/recorder/recording.py) makes a session when a run starts and ends it when the
run finishes; the ring buffer's consumer (agent/recorder/pipeline.py) appends to it. Everything
else changes a session through its methods (a degradation, a policy, the command's pid, labels,
records of its own), and `describe()` is what its run record on disk holds, whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from evidence.agent.recorder import exe_hash
from evidence.agent.recorder.correlate import Correlator
from evidence.agent.recorder.description import (
    Capabilities,
    Detail,
    HeaderFacts,
    ManifestPolicy,
    Network,
    RunDescription,
)
from evidence.bundle.format import Degradation
from evidence.bundle.record_types import DenialRecord, SpoolRecord
from evidence.bundle.writer import Behaviour

if TYPE_CHECKING:
    from evidence.agent.recorder.cgroups import CgroupNames


class Spool(Protocol):
    """Where a run's records go: a SpoolWriter, or something wrapping one (Recorder.start)."""

    @property
    def path(self) -> Path: ...

    def write_many(self, recs: Sequence[SpoolRecord]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


@dataclasses.dataclass
class Session:
    slot: int
    session_id: str
    cgroup_path: Path
    cgroup_id: int
    command: list[str]  # as the caller gave it: with `claimed`, only its claim (bundle/command.py)
    cwd: str
    detail: Detail
    labels: dict[str, str]
    spool: Spool
    correlator: Correlator
    started_ns: int
    attached_late: bool = False
    pid: int = 0
    records: int = 0
    dirty: bool = False  # records written since the last flush
    # --detail summary: distinct keys kept (0: every operation is a record, --detail full)
    max_distinct: int = 0
    # the kernel's aggregation key -> what its first record said (counts come from the kernel)
    firsts: dict[tuple[int, ...], dict[str, object]] = dataclasses.field(default_factory=dict)
    plain_keys: set[tuple[object, ...]] = dataclasses.field(default_factory=set)  # keys of plain records
    past_cap: dict[str, int] = dataclasses.field(default_factory=dict)  # kind -> not kept, counted
    policy: ManifestPolicy | None = None
    network: Network = None  # the command's private network (--net), for the manifest
    degradations: list[Degradation] = dataclasses.field(default_factory=list)
    failed: int = 0  # records of batches the correlator failed on (a bug: logged), not recorded
    extra_records: list[SpoolRecord] = dataclasses.field(default_factory=list)
    roots: dict[str, str] = dataclasses.field(default_factory=dict)
    # what the run id is made of, fed by the spool as records are written (the writer's Behaviour)
    behaviour: Behaviour | None = None
    finished: bool = False
    cgroup_names: CgroupNames | None = None  # names of the cgroups below the run's
    # Called with each batch of correlated records; returns records to add (policy denials).
    observer: Callable[[Sequence[SpoolRecord]], list[DenialRecord]] | None = None
    held: list[SpoolRecord] = dataclasses.field(default_factory=list)  # from an exec still hashed
    hashes: exe_hash.RunHashes | None = None  # the run's queue and budget of program hashes
    # ---- dns: the run's configured resolvers (Recorder.configure_resolvers), None: not known
    resolvers: list[str] | None = None
    # the command starts in the run, by process `pid` (`run`, `run --agent`): the manifest's command
    # is the argv of that process's first exec as the kernel copied it; `command` is the claim
    claimed: bool = False
    # what the recorder could use, and what this run's command ran under (isolation, 32-bit calls)
    capabilities: Capabilities = dataclasses.field(default_factory=dict)
    headers: HeaderFacts = dataclasses.field(default_factory=dict)

    def describe(self, **where: str | int | None) -> RunDescription:
        """The run as known so far, whole (agent/recorder/description.py): what its run record on
        disk holds. `where`: the bundle's name or path and key, and how the command ended."""
        return RunDescription.model_validate(
            {
                "session_id": self.session_id,
                "cgroup": str(self.cgroup_path),
                "command": list(self.command),
                "claimed": self.claimed,
                "cwd": self.cwd,
                "pid": self.pid,
                "started_ns": self.started_ns,
                "attached_late": self.attached_late,
                "detail": self.detail,
                "labels": dict(self.labels),
                "policy": self.policy,
                "network": self.network,
                "roots": dict(self.roots),
                "capabilities": dict(self.capabilities),
                "headers": dict(self.headers),
                "degradations": list(self.degradations),
                "resolvers": None if self.resolvers is None else list(self.resolvers),
                **where,
            }
        )

    # ---- what the rest of evidence changes of a run, said once each ----

    def starts_command(self, pid: int) -> None:
        """Process `pid`, of the run from before it execs, is the one that runs `command`: the
        manifest's command will be what the kernel executed, `command` kept as the claim."""
        self.pid = pid
        self.claimed = True
        self.correlator.root_pid = pid

    def adopts(self, pid: int) -> None:
        """Process `pid`, already running, is the run's (the pid the client named): not a claim."""
        self.pid = pid

    def degrade(self, *said: Degradation) -> None:
        """What the run could not record or enforce, in the order it was found."""
        self.degradations += said

    def enforce(
        self,
        policy: ManifestPolicy,
        degradations: Sequence[Degradation],
        observer: Callable[[Sequence[SpoolRecord]], list[DenialRecord]],
    ) -> None:
        """The run's policy (the manifest's summary of it), what it could not enforce, and what
        turns the run's records into its denials (agent/recorder/enforce.py: enforce_on)."""
        self.policy = policy
        self.degrade(*degradations)
        self.observer = observer

    def add_records(self, recs: Sequence[SpoolRecord]) -> None:
        """Records of the run made outside the ring buffer (the connect guard's denials): spooled
        when the run finishes."""
        self.extra_records += recs

    def update_labels(self, labels: Mapping[str, str]) -> None:
        self.labels.update(labels)
