"""A run as the recorder holds it while it records: `Session`, and `Spool`, where its records go.

The recorder (agent/recorder/recording.py) makes a session when a run starts and ends it when the
run finishes; the ring buffer's consumer (agent/recorder/pipeline.py) appends to it. Everything
else changes a session through its methods (a degradation, a policy, the command's pid, labels,
records of its own), and `describe()` is what its run record on disk holds, whole.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import orjson

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
from evidence.bundle.premade import Premade
from evidence.bundle.record_types import DenialRecord, SpoolRecord
from evidence.bundle.writer import Behaviour

if TYPE_CHECKING:
    from evidence.agent.recorder.cgroups import CgroupNames

logger = logging.getLogger(__name__)


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
    journal: Path | None = None  # where add_records journals them (JOURNAL_SUFFIX beside the spool)
    journal_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)
    roots: dict[str, str] = dataclasses.field(default_factory=dict)
    # what the run id is made of, fed by the spool as records are written (the writer's Behaviour)
    behaviour: Behaviour | None = None
    # full detail: its events' lines made as its records are spooled (bundle/premade.py)
    premade: Premade | None = None
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
        if self.hashes is not None:  # its names are the run's (a /dev/shm of its own)
            self.hashes.in_root_of(pid)

    def adopts(self, pid: int) -> None:
        """Process `pid`, already running, is the run's (the pid the client named): not a claim."""
        self.pid = pid

    def degrade(self, *said: Degradation) -> None:
        """What the run could not record or enforce, in the order it was found."""
        self.degradations += said
        if self.premade is not None:  # an event each before the records': their numbers move
            self.premade.restart(self.labels, 1 + len(self.degradations))

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
        """Records of the run made outside the ring buffer (the connect guard's denials, the command
        rules' refusals and approvals, limit events): spooled when the run finishes, and journaled
        as they are made (`journal`, one JSON line each, written through) so that a recorder killed
        before the end loses none of them: `evidence recover` reads the journal beside the spool."""
        with self.journal_lock:
            self.extra_records += recs
            self._journal(recs)

    def journal_early(self, recs: Sequence[SpoolRecord]) -> None:
        """Journal records that are not the run's yet (limit events before the run's exits name
        their victims): what a recovery has if the recorder dies first; `rejournal` drops them."""
        with self.journal_lock:
            self._journal(recs)

    def rejournal(self) -> None:
        """The journal holds the run's records made outside the ring buffer and nothing else (the
        early ones dropped), replaced whole."""
        with self.journal_lock:
            if self.journal is None:
                return
            tmp = self.journal.with_name(self.journal.name + ".tmp")
            try:
                tmp.unlink(missing_ok=True)
                self._journal(self.extra_records, tmp)
                if tmp.exists():
                    tmp.replace(self.journal)
                else:
                    self.journal.unlink(missing_ok=True)
            except OSError as e:
                logger.warning("run %s: cannot rewrite its journal: %s", self.session_id, e)

    def _journal(self, recs: Sequence[SpoolRecord], to: Path | None = None) -> None:
        path = to or self.journal
        if path is None or not recs:
            return
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, b"".join(orjson.dumps(r) + b"\n" for r in recs))
            finally:
                os.close(fd)
        except OSError as e:  # the bundle still has them; only a recovery would miss them
            logger.warning("run %s: cannot journal %d records: %s", self.session_id, len(recs), e)

    def drop_journal(self) -> None:
        """The run's records are all in its spool (it is closed): the journal is not needed."""
        with self.journal_lock:
            if self.journal is not None:
                self.journal.unlink(missing_ok=True)
                self.journal = None

    def update_labels(self, labels: Mapping[str, str]) -> None:
        self.labels.update(labels)
        if self.premade is not None:  # every event carries them
            self.premade.restart(self.labels, 1 + len(self.degradations))
