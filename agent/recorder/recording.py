"""The long-lived recorder: probes loaded once, a ring-buffer poller, correlation, one spool per run.

Threads:
- poller: waits on the ring buffer (wakeups are batched by the probes, and it polls on a short timer),
  lets records gather a few milliseconds after a wakeup (GATHER_SECONDS), collects the raw records
  into a batch and hands whole batches to a bounded queue. When the queue is
  full it stops reading, so back-pressure lands in the kernel's ring buffer, where every record that
  does not fit is counted as lost, per run and kind. Nothing is dropped in user space.
- correlator: takes the batches waiting in the queue together (COALESCE), decodes them (opens, the
  bulk of any run, in one unpack each), routes records to their run by slot, correlates them and appends
  the results to the run's zstandard spool on disk, so memory stays flat however long the run is.
  It flushes every spool with new records at least once a second (FLUSH_SECONDS), so a recorder
  killed outright loses at most about a second of records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import struct
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import orjson

from evidence.agent.recorder import decode as dec
from evidence.agent.recorder import exe_hash
from evidence.agent.recorder.correlate import Correlated, Correlator
from evidence.agent.recorder.description import RunDescription
from evidence.bundle.command import judge
from evidence.bundle.record_types import DenialRecord, SpoolRecord
from evidence.bundle.records import SUMMARY_KEYS, summary_key
from evidence.bundle.spool import SpoolWriter, read_spool, read_spool_lines
from evidence.bundle.writer import RECORDING_ITEMS, Behaviour, RunMeta, no_cycle_collection, write_bundle
from evidence.errors import SetupError
from evidence.probes.headers import Headers

if TYPE_CHECKING:
    from evidence.bundle.attestation import Signer
    from evidence.probes.loader import RecorderProbes

logger = logging.getLogger(__name__)

POLL_MS = 50
QUEUE_BATCHES = 256
GATHER_SECONDS = 0.005  # after a wakeup, the poller waits this long before it reads (see _poll_loop)
COALESCE = 65536  # records: the correlator processes the batches waiting in the queue together, up to this
# Each run's spool is flushed to disk at least this often while records arrive (and within this
# long after the last ones): a recorder killed with SIGKILL leaves at most about this much unwritten.
FLUSH_SECONDS = 1.0
# Per run (--detail summary): distinct (program, path or address, access, result, cgroup) keys kept.
# Past it, opens, connects and file changes are counted by kind (lost.by_kind "open_past_cap", ...), not
# kept, so a flood of distinct names cannot grow the recorder's memory or the bundle past what the
# reader accepts. EVIDENCE_MAX_DISTINCT sets it (tests use a small value).
MAX_DISTINCT = int(os.environ.get("EVIDENCE_MAX_DISTINCT", "100000"))
# kinds under the cap on distinct summary keys (bundle/records.py: summary_key). File changes are not
# aggregated in the kernel (far rarer than opens): every one is a plain record, summarised by the
# writer, under the same cap on distinct keys (change_past_cap)
_CAPPED = ("open", "connect", "change", "dns")  # dns: plain records too (dns_past_cap)
# what is kept of a key's first record, to write its count when the run ends
_FIRST_FIELDS = {k: (*SUMMARY_KEYS[k], "k", "pid") for k in _CAPPED}
_FIRST_FIELDS["connect"] += ("names", "other_names")  # ---- dns: what the run's DNS answers named the address


def proc_lookup(pid: int) -> tuple[int, str | None, str | None] | None:
    """(ppid, cwd, exe) of a live process, for processes first seen mid-life."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
    cwd = exe = None
    try:
        cwd = dec.path_text(os.readlink(f"/proc/{pid}/cwd"))
        exe = dec.path_text(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        pass
    return ppid, cwd, exe


def tgid_of(tid: int) -> int | None:
    """The process id of thread `tid` (from /proc), None when it is gone."""
    try:
        with open(f"/proc/{tid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def cgroup_of(pid: int) -> str | None:
    """The cgroup2 path of process `pid` (from /proc), None when it is gone."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                if line.startswith("0::"):
                    return line[3:].rstrip("\n")
    except OSError:
        return None
    return None


def _container_namer(cgroup_path: Path) -> Any:
    """A nested cgroup's name (relative to the run's) -> the container id its scope name carries."""
    from evidence.agent.recorder.cgroups import find_cgroup2_mount
    from evidence.agent.recorder.pod_cgroups import parse_cgroup_path

    try:
        base = str(cgroup_path.relative_to(find_cgroup2_mount()))
    except (ValueError, OSError, SetupError):
        return None
    cache: dict[str, str | None] = {}

    def container_of(rel: str) -> str | None:
        if rel not in cache:
            ref = None if rel.startswith("cgroup-id:") else parse_cgroup_path(f"{base}/{rel}")
            cache[rel] = ref.container_id if ref else None
        return cache[rel]

    return container_of


def elf_abi(pid: int, filename: str) -> str | None:
    """ "ia32" when the program a process runs is a 32-bit x86 ELF (read from /proc/<pid>/exe, the
    very file it runs, or from its path if it is gone already), else None."""
    head = b""
    for path in (f"/proc/{pid}/exe", filename):
        got = exe_hash.read_head(path, 20)  # never blocks (a FIFO the job put at the path)
        if got is not None:
            head = got[0]
            break
    if len(head) >= 20 and head[:4] == b"\x7fELF" and head[4] == 1 and head[18:20] == b"\x03\x00":
        return "ia32"
    return None


DRAIN_SECONDS = 30  # how long finish waits for the consumer to spool what the kernel wrote


class Spool(Protocol):
    """Where a run's records go: a SpoolWriter, or something wrapping one (Recorder.start)."""

    @property
    def path(self) -> Path: ...

    def write_many(self, recs: Sequence[SpoolRecord]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def _cgroup_mount_of(path: Path) -> str | None:
    """The cgroup2 mount `path` is under (the nearest ancestor whose parent is another filesystem)."""
    try:
        dev = os.stat(path).st_dev
        mount = path
        while mount.parent != mount and os.stat(mount.parent).st_dev == dev:
            mount = mount.parent
    except OSError:
        return None
    return str(mount)


@dataclasses.dataclass
class Session:
    slot: int
    session_id: str
    cgroup_path: Path
    cgroup_id: int
    command: list[str]  # as the caller gave it: with `claimed`, only its claim (bundle/command.py)
    cwd: str
    detail: str
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
    plain_keys: set[tuple[Any, ...]] = dataclasses.field(default_factory=set)  # keys of plain records
    past_cap: dict[str, int] = dataclasses.field(default_factory=dict)  # kind -> not kept, counted
    policy: dict[str, Any] | None = None
    network: str | None = None  # the command's private network (--net), for the manifest
    degradations: list[dict[str, str]] = dataclasses.field(default_factory=list)
    failed: int = 0  # records of batches the correlator failed on (a bug: logged), not recorded
    extra_records: list[SpoolRecord] = dataclasses.field(default_factory=list)
    roots: dict[str, str] = dataclasses.field(default_factory=dict)
    # what the run id is made of, fed by the spool as records are written (the writer's Behaviour)
    behaviour: Behaviour | None = None
    finished: bool = False
    cgroup_names: Any = None  # evidence.agent.recorder.cgroups.CgroupNames for this run's subtree
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
    capabilities: dict[str, Any] = dataclasses.field(default_factory=dict)
    headers: dict[str, Any] = dataclasses.field(default_factory=dict)

    def describe(self, **where: Any) -> RunDescription:
        """The run as known so far, whole (agent/recorder/description.py): what its run record on
        disk holds. `where`: the bundle's name or path and key, and how the command ended."""
        return RunDescription(
            session_id=self.session_id,
            cgroup=str(self.cgroup_path),
            command=list(self.command),
            claimed=self.claimed,
            cwd=self.cwd,
            pid=self.pid,
            started_ns=self.started_ns,
            attached_late=self.attached_late,
            detail="full" if self.detail == "full" else "summary",
            labels=dict(self.labels),
            policy=self.policy,
            network="none" if self.network == "none" else "loopback" if self.network == "loopback" else None,
            roots=dict(self.roots),
            capabilities=dict(self.capabilities),
            headers=dict(self.headers),
            degradations=[dict(d) for d in self.degradations],
            resolvers=None if self.resolvers is None else list(self.resolvers),
            **where,
        )

    def starts_command(self, pid: int) -> None:
        """Process `pid`, of the run from before it execs, is the one that runs `command`: the
        manifest's command will be what the kernel executed, `command` kept as the claim."""
        self.pid = pid
        self.claimed = True
        self.correlator.root_pid = pid


class Recorder:
    def __init__(
        self,
        spool_dir: str | Path,
        headers: Headers | None = None,
        capabilities: dict[str, Any] | None = None,
        probes: RecorderProbes | None = None,
        max_distinct: int | None = None,
    ) -> None:
        self.max_distinct = MAX_DISTINCT if max_distinct is None else max_distinct
        if probes is None:
            from evidence.probes.loader import load_probes

            probes = load_probes()
        self.probes: RecorderProbes = probes
        self.spool_dir = Path(spool_dir)
        self.headers = headers
        self.capabilities: dict[str, Any] = capabilities or {}
        self.wall_offset_ns = time.time_ns() - time.monotonic_ns()
        self._sessions: dict[int, Session] = {}
        # finished runs' slots whose aggregation entries are being removed (_release): not reused yet
        self._releasing: dict[int, threading.Thread] = {}
        self.hasher = exe_hash.Hasher(exe_hash.ExeHasher(max_size=exe_hash.max_size_setting()))
        self._lock = threading.Lock()
        self._queue: queue.Queue[list[bytes] | threading.Event | None] = queue.Queue(QUEUE_BATCHES)
        self._barriers: queue.SimpleQueue[threading.Event] = queue.SimpleQueue()
        self._stop = threading.Event()
        self.stats = {"records": 0, "batches": 0, "stray": 0, "decode_errors": 0, "failed_batches": 0}
        self._ring = self.probes.ring()
        self._poller = threading.Thread(target=self._poll_loop, name="evidence-poller", daemon=True)
        self._worker = threading.Thread(target=self._work_loop, name="evidence-correlator", daemon=True)
        self._poller.start()
        self._worker.start()

    # ---- runs -------------------------------------------------------------------------------
    def start(
        self,
        cgroup_path: Path,
        command: list[str],
        cwd: str,
        *,
        detail: str = "summary",
        labels: dict[str, str] | None = None,
        attached_late: bool = False,
        session_id: str | None = None,
        wrap_spool: Callable[[SpoolWriter], Spool] | None = None,
        max_distinct: int | None = None,
        roots: dict[str, str] | None = None,
    ) -> Session:
        """Start recording `cgroup_path` (a new run slot). `wrap_spool` wraps the run's spool before
        the cgroup is tracked, so that the wrapper sees every record the run gets. `max_distinct`:
        the run's cap on distinct summary keys (default: the recorder's). `roots`: the run's private
        tmp and workspace ({placeholder: path}), which its run id names by their placeholders."""
        from evidence.agent.recorder.cgroups import CgroupNames, cgroup_id

        with self._lock:
            slot = next(
                (
                    s
                    for s in range(1, self.probes.config.max_runs)
                    if s not in self._sessions and s not in self._releasing
                ),
                None,
            )
            if slot is None:
                raise SetupError("too many concurrent runs", f"at most {self.probes.config.max_runs - 1}")
            sid = session_id or uuid.uuid4().hex
            cgid = cgroup_id(cgroup_path)  # first: a cgroup already gone leaves no spool behind
            names = CgroupNames(cgroup_path, cgid)
            self.spool_dir.mkdir(parents=True, exist_ok=True)
            behaviour = Behaviour(roots, RECORDING_ITEMS, self.spool_dir)
            raw = SpoolWriter(self.spool_dir / f"{sid}.spool.zst", feed=behaviour.add_many)
            spool: Spool = raw if wrap_spool is None else wrap_spool(raw)
            hashes = self.hasher.run(sid)
            session = Session(
                slot=slot,
                session_id=sid,
                cgroup_path=cgroup_path,
                cgroup_id=cgid,
                command=list(command),
                cwd=cwd,
                detail=detail,
                labels=dict(labels or {}),
                spool=spool,
                roots=dict(roots or {}),
                behaviour=behaviour,
                correlator=Correlator(self.wall_offset_ns, proc_lookup, abi_of=elf_abi, hash_of=hashes),
                hashes=hashes,
                cgroup_names=names,
                started_ns=time.time_ns(),
                attached_late=attached_late,
                capabilities=dict(self.capabilities),
                headers=self.headers.as_dict() if self.headers else {},
                max_distinct=0
                if detail == "full"
                else max(1, self.max_distinct if max_distinct is None else max_distinct),
            )
            session.correlator.cgroup_name = session.cgroup_names
            session.correlator.run_cgroup = str(cgroup_path)
            session.correlator.cgroup_mount = _cgroup_mount_of(cgroup_path)
            session.correlator.container_of = _container_namer(cgroup_path)
            session.correlator.tgid_of = tgid_of
            session.correlator.cgroup_of = cgroup_of
            self._sessions[slot] = session
            self.probes.reset_lost(slot)
            self.probes.set_aggregation(slot, session.max_distinct)
            try:  # ---- dns: before the cgroup is tracked, so that no delivery of the run is missed
                self.probes.attach_ingress(session.cgroup_id, cgroup_path)
            except OSError as e:
                logger.warning("run %s: DNS deliveries are not recorded: %s", sid, e)
                session.degradations.append(
                    {
                        "component": "dns",
                        "reason": f"what the kernel delivers to the run's sockets could not be recorded: {e}",
                        "impact": "no DNS answer of the run is credited to its query: connects carry no names, "
                        "and diff, baseline and profile compare them by address",
                    }
                )
            self.probes.track(session.cgroup_id, slot)
        logger.info("run %s: recording cgroup %s (slot %d)", sid, cgroup_path, slot)
        return session

    @staticmethod
    def configure_resolvers(session: Session, pid: int) -> None:
        """---- dns: the run's configured resolvers, the nameservers of /etc/resolv.conf as process
        `pid` (the run's first) sees it; called before the command starts (an answer correlated
        before then counts as another server's)."""
        from evidence.agent.recorder.resolvconf import read_resolvers

        session.resolvers = read_resolvers(pid)
        session.correlator.dns.configure(session.resolvers or ())

    def drain(self, timeout: float = DRAIN_SECONDS) -> bool:
        """Return once every record the kernel had written before this call is in its spool: True,
        or False when the consumer did not get there within `timeout` (stuck, or dead)."""
        ev = threading.Event()
        self._barriers.put(ev)
        self._ring.wake()
        if not ev.wait(timeout=timeout):
            logger.warning("drain timed out: the consumer is stuck")
            return False
        return True

    def finish(
        self,
        session: Session,
        bundle_path: str | Path,
        *,
        exit_code: int | None,
        signal: str | None = None,
        cut_short: bool = False,
        signer: Signer | None = None,
    ) -> dict[str, Any]:
        """End the run and write its bundle; its manifest. The cyclic garbage collector is off
        meanwhile (writer.no_cycle_collection): the run's aggregates and first records, 100,000 of
        each past a flood, would make it walk every object alive again and again."""
        with no_cycle_collection():
            return self._finish(session, bundle_path, exit_code, signal, cut_short, signer)

    def _finish(
        self,
        session: Session,
        bundle_path: str | Path,
        exit_code: int | None,
        signal: str | None,
        cut_short: bool,
        signer: Signer | None,
    ) -> dict[str, Any]:
        with self._lock:
            self.probes.untrack(session.cgroup_id)
        # everything the kernel wrote for this run before untrack is now spooled, unless the consumer
        # is stuck: those records were written to the ring (no reservation failed, no loss counted)
        # and are not in the spool, so the bundle must say so
        drained = self.drain()
        finished_ns = time.time_ns()
        if not drained:
            session.degradations.append(
                {
                    "component": "recorder",
                    "reason": f"the ring buffer's consumer did not drain the run's records within {DRAIN_SECONDS} s of its end",
                    "impact": "records the kernel wrote for this run may be missing, and are not counted as lost",
                }
            )
        with self._lock:
            lost = self.probes.read_lost(session.slot)
            session.finished = True
            del self._sessions[session.slot]
            in_flight = self.probes.in_flight(session.slot)
            aggregates, agg_keys = self.probes.read_aggregates(session.slot)
            fallbacks = self.probes.read_fallbacks(session.slot)
            self._release(session.slot, agg_keys)
        if session.correlator.unpaired:
            lost["unpaired_results"] = session.correlator.unpaired
        if session.failed:
            lost["not_correlated"] = session.failed
            session.degradations.append(
                {
                    "component": "recorder",
                    "reason": f"correlating {session.failed} records failed (a bug: the recorder's log says where)",
                    "impact": "those records are not in the bundle (counted as lost, not_correlated); the rest is",
                }
            )
        counted = self._counted(session, aggregates, lost)
        for kind, n in session.past_cap.items():
            lost[kind] = lost.get(kind, 0) + n
        past = {k: v for k, v in lost.items() if k.endswith("_past_cap")}
        if past:
            logger.warning(
                "run %s: past its cap of %d distinct summary keys, %s were counted, not kept",
                session.session_id,
                session.max_distinct,
                ", ".join(f"{n} {k.removesuffix('_past_cap')}s" for k, n in sorted(past.items())),
            )
        if fallbacks:
            session.degradations.append(
                {
                    "component": "recorder",
                    "reason": f"the kernel's aggregation map was full: {fallbacks} operations were recorded one by one",
                    "impact": "none on what is recorded; recording them cost more",
                }
            )
        # calls whose result never came (in progress when the run ended): recorded with NO_RESULT
        pending: list[SpoolRecord] = []
        for raw in in_flight:
            with contextlib.suppress(dec.DecodeError, ValueError):
                pending += session.correlator.feed(dec.decode(raw))
        exe_hash.settle(session.held, wait=True)
        held, session.held = session.held, []
        if session.hashes is not None:
            session.hashes.close()
            said = session.hashes.degradation()
            if said is not None:
                session.degradations.append(said)
        if session.observer is not None:  # held back behind an exec's hash: not observed yet
            held += session.observer(held)
        session.spool.write_many(held + pending + session.correlator.flush() + counted)
        session.spool.write_many(session.extra_records)
        session.spool.close()
        command, claimed = session.command, None
        if session.claimed:  # what the kernel executed, and the caller's claim beside it
            verdict = judge(session.command, session.correlator.root_exec)
            command, claimed = verdict.command, session.command
            if verdict.degradation is not None:
                logger.warning("run %s: %s", session.session_id, verdict.degradation["reason"])
                session.degradations.append(verdict.degradation)
        meta = RunMeta(
            session_id=session.session_id,
            command=command,
            claimed_command=claimed,
            cwd=session.cwd,
            pid=session.pid,
            cgroup=str(session.cgroup_path),
            started_ns=session.started_ns,
            finished_ns=finished_ns,
            exit_code=exit_code,
            signal=signal,
            cut_short=cut_short,
            attached_late=session.attached_late,
            detail=session.detail,
            host=_host(),
            capabilities=session.capabilities,
            headers=session.headers,
            lost=lost,
            labels=session.labels,
            policy=session.policy,
            network=session.network,
            resolvers=session.resolvers,
            degradations=session.degradations,
            roots=session.roots,
        )
        spool_path = session.spool.path
        behaviour, session.behaviour = session.behaviour, None  # made into a run id once: a retry reads
        try:
            manifest = write_bundle(
                bundle_path,
                meta,
                lambda: read_spool(spool_path),
                signer=signer,
                behaviour=behaviour,
                lines=lambda: read_spool_lines(spool_path),
            )
        except BaseException:
            # never lose what was recorded: the spool stays for a retry or for recovery
            logger.info("run %s: bundle not written; its records stay in %s", session.session_id, spool_path)
            raise
        spool_path.unlink(missing_ok=True)
        return manifest

    def _counted(
        self,
        session: Session,
        aggregates: list[tuple[tuple[int, int, int, int, int, int, int], int, int, int]],
        lost: dict[str, int],
    ) -> list[SpoolRecord]:
        """Records with the counts the kernel kept: for each aggregated key seen more than once, its
        first record's key fields with `n` (the occurrences after the first) and `tl` (the last
        time), which the bundle writer adds to that key's summary. A key whose first record never
        reached the correlator is counted as lost."""
        off = self.wall_offset_ns
        out: list[SpoolRecord] = []
        for key, count, first, last in aggregates:
            fields = session.firsts.get(key)
            if fields is None:
                kind = "open" if key[3] == dec.EV_OPEN else "connect"
                lost[kind] = lost.get(kind, 0) + count
                continue
            if count > 1:
                # a partial record: the first's key fields, enough for the writer's summary key and
                # totals (never an event of its own: its key's first record came before it)
                fields = dict(fields)
                fields.update(t=first + off, tl=last + off, n=count - 1)
                upd = cast(SpoolRecord, fields)
                out.append(upd)
                if session.observer is not None:  # the denials of the repeats, with their count
                    for den in session.observer([upd]):
                        den["n"] = count - 1
                        den["tl"] = last + off
                        out.append(den)
        session.firsts.clear()
        session.plain_keys.clear()
        return out

    def _release(self, slot: int, agg_keys: bytes) -> None:
        """Remove run `slot`'s entries from the kernel's aggregation map on a thread of its own,
        while its bundle is written (a flood's hundred thousand keys take the kernel a few tenths
        of a second; the system call lets go of the GIL); the slot goes to no other run until then.
        Called with the lock held."""

        def release() -> None:
            try:
                self.probes.drop_aggregates(slot, agg_keys)
            except Exception:  # pragma: no cover - the map is the kernel's: keep the slot out of use
                logger.exception("cannot remove the aggregates of slot %d: it is not used again", slot)
                return
            with self._lock:
                self._releasing.pop(slot, None)

        thread = threading.Thread(target=release, name="evidence-release", daemon=True)
        self._releasing[slot] = thread
        thread.start()

    def close(self, background: bool = False) -> None:
        """Stop the threads and unload the probes; `background`: see RecorderProbes.close (a slot
        still being released is then left to the kernel, which frees the map with the probes)."""
        if not background:
            with self._lock:
                releasing = list(self._releasing.values())
            for thread in releasing:
                thread.join(timeout=30)
        self._stop.set()
        self._ring.wake()
        self._poller.join(timeout=2)
        try:  # (a full queue and a correlator that is gone must not hang the end of a run)
            self._queue.put(None, timeout=5)
        except queue.Full:
            logger.warning("the correlator does not take its queue: not waiting for it")
        self._worker.join(timeout=5)
        self.hasher.close()
        self.probes.close(background=background)

    # ---- threads ------------------------------------------------------------------------------
    def queue_depth(self) -> int:
        """Batches read from the ring buffer and not yet correlated (consumer lag)."""
        return self._queue.qsize()

    def _drain_ring(self) -> None:
        while True:
            batch = self._ring.read()
            if not batch:
                return
            self._queue.put(batch)  # blocks when full: back-pressure goes to the ring buffer

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            try:
                if self._barriers.empty():
                    self._ring.wait(POLL_MS)
                    # let records gather: one read of many, not many reads of a few (a kernel wakeup
                    # comes every WAKEUP_EVERY records, and each read and batch has a cost of its own)
                    self._stop.wait(GATHER_SECONDS)
                self._drain_ring()
                if not self._barriers.empty():
                    barriers = []
                    while not self._barriers.empty():
                        barriers.append(self._barriers.get())
                    self._drain_ring()  # everything written before the barrier was asked for
                    for b in barriers:
                        self._queue.put(b)
            except Exception:  # pragma: no cover - keep recording whatever happens
                logger.exception("ring buffer poll failed")
                time.sleep(0.1)

    def _work_loop(self) -> None:
        next_flush = time.monotonic() + FLUSH_SECONDS
        while True:
            try:
                item = self._queue.get(timeout=FLUSH_SECONDS / 2)
            except queue.Empty:
                pass
            else:
                for after in self._process_waiting(item) if isinstance(item, list) else [item]:
                    if after is None:
                        return
                    after.set()
            now = time.monotonic()
            if now >= next_flush:
                self._flush_spools()
                next_flush = now + FLUSH_SECONDS

    def _process_waiting(self, batch: list[bytes]) -> list[threading.Event | None]:
        """Process `batch` together with the batches queued behind it (up to COALESCE records): a
        consumer that keeps up reads the ring buffer often, a few records at a time, and each batch
        has a cost of its own. Returns the barrier or stop that ended the run of batches, if one
        did, for the caller to handle after them (a barrier still follows every record read
        before it)."""
        after: list[threading.Event | None] = []
        while len(batch) < COALESCE:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if not isinstance(item, list):
                after.append(item)
                break
            batch += item
        try:
            self._process(batch)
        except Exception:  # a bug must not stop the recording, nor hang the run at its end
            logger.exception("correlating a batch of %d records failed: they are not recorded", len(batch))
            self.stats["failed_batches"] += 1
            with self._lock:
                for session in self._sessions.values():  # whose they were is not known: every live run's
                    if not session.finished:
                        session.failed += len(batch)
        return after

    def _flush_spools(self) -> None:
        """Flush the spools written to since the last flush (on the correlator thread, the only one
        that writes to a live run's spool; a finished run's spool is closed by finish())."""
        with self._lock:  # finish() marks a run finished under it before it touches the spool
            for session in self._sessions.values():
                if session.held and not session.finished:
                    self._write(session, [])
                if session.dirty and not session.finished:
                    session.dirty = False
                    try:
                        session.spool.flush()
                    except (OSError, ValueError) as e:
                        logger.warning("flush of %s failed: %s", session.spool.path, e)

    def _process(self, batch: list[bytes]) -> None:
        """Decode, correlate and spool a batch. Opens, by far the most frequent records, take one
        unpack and go to the correlator as fields (Correlator.open_record), not as a decoded dict."""
        self.stats["batches"] += 1
        self.stats["records"] += len(batch)
        out: dict[int, list[SpoolRecord | bytes]] = {}  # records, and spool lines of lined runs
        hashing: set[int] = set()  # runs whose records may carry an exe hash still being computed
        sessions = self._sessions
        errors = stray = 0
        unpack = dec.OPEN_REC.unpack_from
        path_off = dec.OPEN_PATH_OFF
        open_kind = dec.OPEN_KIND
        kind_off = dec.KIND_OFF
        ts_of = _TS.unpack_from
        # The last open that made one record: its bytes after the time, and that record. An open whose
        # bytes after the time are the same (same run, cgroup, thread, flags, result, path) right after
        # it makes the same record at its own time: nothing between them changed what it depends on
        # (the process's exe and tables change only through other records, which reset this).
        # A repeat of a run whose spool takes lines (_takes_lines) is its spool line, made from the
        # last record's line with its own time: no dict, no serialisation (`lined`: such runs).
        last_tail = b""
        last_rec = cast("Correlated", {})  # read only once last_tail (empty now) has matched
        last_line: tuple[bytes, bytes] | None = None
        lined: set[int] = set()
        session = None
        run = flags = 0
        first: tuple[int, ...] = ()  # the kernel's aggregation key of a record marked F_FIRST
        for raw in batch:
            recs: Sequence[Correlated | bytes]
            if raw[kind_off : kind_off + 2] == open_kind and len(raw) >= path_off:
                tail = raw[8:]
                if tail == last_tail and session is not None and not session.finished:
                    t = ts_of(raw)[0] + session.correlator.wall_offset_ns
                    if last_line is None and _takes_lines(session, flags):
                        last_line = _line_around_time(last_rec)
                    if last_line is not None:
                        recs = [last_line[0] + b"%d" % t + last_line[1]]
                        lined.add(run)
                    else:
                        rec = last_rec.copy()
                        rec["t"] = t
                        recs = [rec]
                else:
                    (
                        ts,
                        cgid,
                        run,
                        tgid,
                        _,
                        _,
                        flags,
                        ret,
                        exe_tok,
                        tok,
                        dfd,
                        oflags,
                        mode,
                        nlink,
                        _,
                        plen,
                        dino,
                        rino,
                    ) = unpack(raw)
                    session = sessions.get(run)
                    if session is None or session.finished:
                        stray += 1
                        last_tail = b""
                        continue
                    recs = session.correlator.open_record(
                        ts,
                        cgid,
                        tgid,
                        flags,
                        ret,
                        dfd,
                        oflags,
                        mode,
                        raw[path_off : path_off + plen],
                        dino,
                        rino,
                        kname=raw[path_off + plen :] if flags & dec.F_KNAME else b"",
                        nlink=nlink,
                    )
                    if len(recs) == 1 and not flags & dec.F_STATE:
                        last_tail, last_rec, last_line = tail, recs[0].copy(), None
                    else:
                        last_tail = b""
                if flags & dec.F_FIRST:
                    first = (
                        exe_tok,
                        tok,
                        cgid,
                        dec.EV_OPEN,
                        oflags & dec.ACCESS_BITS,
                        min(ret, 0),
                        rino if ret >= 0 else 0,
                    )
            else:
                last_tail = b""
                try:
                    ev = dec.decode(raw)
                except (dec.DecodeError, ValueError, struct.error):
                    errors += 1
                    continue
                run = ev["run"]
                session = sessions.get(run)
                if session is None or session.finished:
                    stray += 1
                    continue
                correlated = session.correlator.feed(ev)
                if not correlated:
                    continue
                recs = correlated
                hashing.add(run)
                flags = ev["flags"]
                if flags & dec.F_FIRST and ev["kind"] in ("open", "connect"):  # the kernel's only
                    first = dec.agg_key(ev)
            if flags & dec.F_STATE:  # counted by the kernel already: it only updated the tables
                if not recs:
                    continue
                # what is left is a degradation (a write to another cgroup's procs): kept
            elif flags & dec.F_FIRST:
                self._first(session, first, recs)
            elif session.max_distinct:
                recs = _capped_batch(session, recs)
            got = out.get(run)
            if got is None:
                out[run] = got = []
            got += recs
        self.stats["decode_errors"] += errors
        self.stats["stray"] += stray
        for slot, spooled in out.items():
            session = sessions.get(slot)
            if session is not None and not session.finished:
                self._write(session, spooled, settle=slot in hashing, lines=slot in lined)

    @staticmethod
    def _first(session: Session, key: tuple[int, ...], recs: Sequence[Correlated | bytes]) -> None:
        """Keep what the first record of a key the kernel aggregates said (its count comes later).
        (No line among `recs`: a first is never a repeat.)"""
        for r in recs:
            # the fields are named at run time (_FIRST_FIELDS): read through a plain mapping
            rec = cast(Mapping[str, object], r)
            fields = _FIRST_FIELDS.get(cast(str, rec["k"]))
            if fields is not None:
                session.firsts[key] = {f: rec[f] for f in fields if f in rec}

    def _write(
        self, session: Session, recs: Sequence[SpoolRecord | bytes], settle: bool = True, lines: bool = False
    ) -> None:
        """Spool `recs` after the records held back (in order), up to the first exec whose hash is
        still being computed (exe_hash.settle). `settle=False`: no record of `recs` is an exec (none
        can wait for a hash), so only records held back before need it. `lines`: some of `recs` are
        spool lines already (bytes), for a SpoolWriter; they become records again if anything else
        is to look at them (a hash to settle, records held back, an observer set meanwhile)."""
        if lines and not (settle or session.held or session.observer is not None):
            # spool lines, only ever for a plain SpoolWriter (_takes_lines), and nothing to look at them
            cast(SpoolWriter, session.spool).write_many(recs)
            session.records += len(recs)
            session.dirty = True
            return
        records: list[SpoolRecord]
        if lines:
            records = [orjson.loads(r) if isinstance(r, bytes) else r for r in recs]
        else:
            records = cast("list[SpoolRecord]", recs)  # no line among them: records only
        if session.held:
            session.held.extend(records)
            records = session.held
            settle = True
        if settle:
            ready = exe_hash.settle(records)  # returns at the first hash not ready: 0 while still held
            if ready == 0:
                session.held = records
                return
            records, session.held = (
                (records, []) if ready == len(records) else (records[:ready], records[ready:])
            )
        if session.observer is not None:
            records += session.observer(records)
        session.spool.write_many(records)
        session.records += len(records)
        session.dirty = True


_TS = struct.Struct("<Q")  # struct hdr: ts
_OPEN_LINE_HEAD = b'{"k":"open","t":'


def _takes_lines(session: Session, flags: int) -> bool:
    """Whether a repeated open of `session` may go to its spool as a line (bytes), not a record:
    every operation is kept (full detail: nothing to cap or count first), nothing looks at the
    records on their way (no observer), and the spool is a plain SpoolWriter (a wrapper passes
    records on)."""
    return (
        session.max_distinct == 0
        and not flags & (dec.F_FIRST | dec.F_STATE)
        and session.observer is None
        and type(session.spool) is SpoolWriter
    )


def _line_around_time(rec: Correlated) -> tuple[bytes, bytes]:
    """An open record's spool line without its time: (before, after), the line being before + the
    time in decimal + after (with the newline)."""
    line = orjson.dumps(rec)
    if not line.startswith(_OPEN_LINE_HEAD):  # pragma: no cover - correlate.py makes "k", then "t"
        raise ValueError("an open record that does not start with its kind and time")
    comma = line.index(b",", len(_OPEN_LINE_HEAD))
    return _OPEN_LINE_HEAD, line[comma:] + b"\n"


def _capped(session: Session, recs: Sequence[Correlated]) -> list[Correlated | bytes]:
    """Plain records of a summary run (not aggregated in the kernel: an unknown dirfd, a long path,
    a full map) under the same cap on distinct keys: past it, counted by kind and not kept."""
    out: list[Correlated | bytes] = []
    for r in recs:
        key = summary_key(r) if r["k"] in _CAPPED else None
        if key is not None and key not in session.plain_keys:
            if len(session.plain_keys) >= session.max_distinct:
                kind = f"{r['k']}_past_cap"
                session.past_cap[kind] = session.past_cap.get(kind, 0) + 1
                continue
            session.plain_keys.add(key)
        out.append(r)
    return out


# _process calls _capped with what its variable `recs` holds, records and spool lines to mypy; for a
# summary run (the only one capped) records only, as a summary run's spool takes no lines
# (_takes_lines). Said once here, not with a cast per record.
_capped_batch = cast("Callable[[Session, Sequence[Correlated | bytes]], list[Correlated | bytes]]", _capped)


def _host() -> dict[str, str]:
    from evidence.agent.recorder.kernel import host_info

    return host_info()
