"""The long-lived recorder: probes loaded once, a ring-buffer poller, correlation, one spool per run.

Threads:
- poller: waits on the ring buffer (wakeups are batched by the probes, and it polls on a short timer),
  collects raw records into a batch and hands whole batches to a bounded queue. When the queue is
  full it stops reading, so back-pressure lands in the kernel's ring buffer, where every record that
  does not fit is counted as lost, per run and kind. Nothing is dropped in user space.
- correlator: decodes each batch, routes records to their run by slot, correlates them and appends
  the results to the run's zstandard spool on disk, so memory stays flat however long the run is.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from agent import decode as dec
from agent.correlate import Correlator
from agent.kernel import Headers
from bundle.spool import SpoolWriter, read_spool
from bundle.writer import RunMeta, write_bundle
from evidence.errors import SetupError

if TYPE_CHECKING:
    from probes.loader import RecorderProbes

logger = logging.getLogger(__name__)

POLL_MS = 50
QUEUE_BATCHES = 256


def proc_lookup(pid: int) -> tuple[int, str | None, str | None] | None:
    """(ppid, cwd, exe) of a live process, for processes first seen mid-life."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
    cwd = exe = None
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        pass
    return ppid, cwd, exe


def _container_namer(cgroup_path: Path) -> Any:
    """A nested cgroup's name (relative to the run's) -> the container id its scope name carries."""
    from agent.cgroups import find_cgroup2_mount
    from agent.k8s import parse_cgroup_path

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
        try:
            with open(path, "rb") as f:
                head = f.read(20)
            break
        except OSError:
            continue
    if len(head) >= 20 and head[:4] == b"\x7fELF" and head[4] == 1 and head[18:20] == b"\x03\x00":
        return "ia32"
    return None


class Spool(Protocol):
    """Where a run's records go: a SpoolWriter, or something wrapping one (Recorder.start)."""

    @property
    def path(self) -> Path: ...

    def write_many(self, recs: list[dict[str, Any]]) -> None: ...

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
    command: list[str]
    cwd: str
    detail: str
    labels: dict[str, str]
    spool: Spool
    correlator: Correlator
    started_ns: int
    attached_late: bool = False
    pid: int = 0
    records: int = 0
    policy: dict[str, Any] | None = None
    degradations: list[dict[str, str]] = dataclasses.field(default_factory=list)
    extra_records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    roots: dict[str, str] = dataclasses.field(default_factory=dict)
    finished: bool = False
    cgroup_names: Any = None  # agent.cgroups.CgroupNames for this run's subtree
    # Called with each batch of correlated records; returns records to add (policy denials).
    observer: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None


class Recorder:
    def __init__(
        self,
        spool_dir: str | Path,
        headers: Headers | None = None,
        capabilities: dict[str, Any] | None = None,
        probes: RecorderProbes | None = None,
    ) -> None:
        if probes is None:
            from probes.loader import load_probes

            probes = load_probes()
        self.probes: RecorderProbes = probes
        self.spool_dir = Path(spool_dir)
        self.headers = headers
        self.capabilities: dict[str, Any] = capabilities or {}
        self.wall_offset_ns = time.time_ns() - time.monotonic_ns()
        self._sessions: dict[int, Session] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[list[bytes] | threading.Event | None] = queue.Queue(QUEUE_BATCHES)
        self._barriers: queue.SimpleQueue[threading.Event] = queue.SimpleQueue()
        self._stop = threading.Event()
        self.stats = {"records": 0, "batches": 0, "stray": 0, "decode_errors": 0}
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
    ) -> Session:
        """Start recording `cgroup_path` (a new run slot). `wrap_spool` wraps the run's spool before
        the cgroup is tracked, so that the wrapper sees every record the run gets."""
        from agent.cgroups import CgroupNames, cgroup_id

        with self._lock:
            slot = next((s for s in range(1, self.probes.config.max_runs) if s not in self._sessions), None)
            if slot is None:
                raise SetupError("too many concurrent runs", f"at most {self.probes.config.max_runs - 1}")
            sid = session_id or uuid.uuid4().hex
            cgid = cgroup_id(cgroup_path)  # first: a cgroup already gone leaves no spool behind
            names = CgroupNames(cgroup_path, cgid)
            self.spool_dir.mkdir(parents=True, exist_ok=True)
            raw = SpoolWriter(self.spool_dir / f"{sid}.spool.zst")
            spool: Spool = raw if wrap_spool is None else wrap_spool(raw)
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
                correlator=Correlator(self.wall_offset_ns, proc_lookup, abi_of=elf_abi),
                cgroup_names=names,
                started_ns=time.time_ns(),
                attached_late=attached_late,
            )
            session.correlator.cgroup_name = session.cgroup_names
            session.correlator.run_cgroup = str(cgroup_path)
            session.correlator.cgroup_mount = _cgroup_mount_of(cgroup_path)
            session.correlator.container_of = _container_namer(cgroup_path)
            self._sessions[slot] = session
            self.probes.reset_lost(slot)
            self.probes.track(session.cgroup_id, slot)
        logger.info("run %s: recording cgroup %s (slot %d)", sid, cgroup_path, slot)
        return session

    def drain(self) -> None:
        """Return once every record the kernel had written before this call is in its spool."""
        ev = threading.Event()
        self._barriers.put(ev)
        self._ring.wake()
        if not ev.wait(timeout=30):
            logger.warning("drain timed out: the consumer is stuck")

    def finish(
        self,
        session: Session,
        bundle_path: str | Path,
        *,
        exit_code: int | None,
        signal: str | None = None,
        cut_short: bool = False,
    ) -> dict[str, Any]:
        with self._lock:
            self.probes.untrack(session.cgroup_id)
        self.drain()  # everything the kernel wrote for this run before untrack is now spooled
        finished_ns = time.time_ns()
        with self._lock:
            lost = self.probes.read_lost(session.slot)
            session.finished = True
            del self._sessions[session.slot]
        if session.correlator.unpaired:
            lost["unpaired_results"] = session.correlator.unpaired
        session.spool.write_many(session.correlator.flush())  # calls whose result never came
        session.spool.write_many(session.extra_records)
        session.spool.close()
        meta = RunMeta(
            session_id=session.session_id,
            command=session.command,
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
            capabilities=self.capabilities,
            headers=self.headers.as_dict() if self.headers else {},
            lost=lost,
            labels=session.labels,
            policy=session.policy,
            degradations=session.degradations,
            roots=session.roots,
        )
        spool_path = session.spool.path
        try:
            manifest = write_bundle(bundle_path, meta, lambda: read_spool(spool_path))
        except BaseException:
            # never lose what was recorded: the spool stays for a retry or for recovery
            logger.error("run %s: bundle not written; its records stay in %s", session.session_id, spool_path)
            raise
        spool_path.unlink(missing_ok=True)
        return manifest

    def close(self, background: bool = False) -> None:
        self._stop.set()
        self._ring.wake()
        self._poller.join(timeout=2)
        self._queue.put(None)
        self._worker.join(timeout=5)
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
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            self._process(item)

    def _process(self, batch: list[bytes]) -> None:
        self.stats["batches"] += 1
        self.stats["records"] += len(batch)
        out: dict[int, list[dict[str, Any]]] = {}
        for raw in batch:
            try:
                ev = dec.decode(raw)
            except (dec.DecodeError, ValueError):
                self.stats["decode_errors"] += 1
                continue
            session = self._sessions.get(ev["run"])
            if session is None or session.finished:
                self.stats["stray"] += 1
                continue
            recs = session.correlator.feed(ev)
            if recs:
                out.setdefault(ev["run"], []).extend(recs)
        for slot, recs in out.items():
            session = self._sessions.get(slot)
            if session is not None and not session.finished:
                if session.observer is not None:
                    recs += session.observer(recs)
                session.spool.write_many(recs)
                session.records += len(recs)


def _host() -> dict[str, str]:
    from agent.kernel import host_info

    return host_info()
