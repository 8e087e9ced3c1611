"""The long-lived recorder: probes loaded once, one spool per run; runs start and finish here.

The ring buffer's consumer (poller and correlator threads) is agent/recorder/pipeline.py, the run a
recorder holds while it records agent/recorder/session.py, what it reads from /proc
agent/recorder/procfs.py. `Recorder.start` makes a run's session and tracks its cgroup;
`Recorder.finish` untracks it, waits for the consumer, adds the kernel's counts and writes the bundle.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from evidence.agent.recorder import decode as dec
from evidence.agent.recorder import exe_hash
from evidence.agent.recorder.correlate import Correlator
from evidence.agent.recorder.description import Capabilities, Detail, Network
from evidence.agent.recorder.pipeline import DRAIN_SECONDS, FLUSH_SECONDS, Pipeline, release_free_memory
from evidence.agent.recorder.procfs import (
    cgroup_mount_of,
    cgroup_of,
    container_namer,
    elf_abi,
    proc_lookup,
    tgid_of,
)
from evidence.agent.recorder.recovery import JOURNAL_SUFFIX
from evidence.agent.recorder.session import Session, Spool
from evidence.bundle.command import judge
from evidence.bundle.format import Artifacts, Degradation
from evidence.bundle.premade import Premade
from evidence.bundle.record_types import SpoolRecord
from evidence.bundle.spool import SpoolWriter, read_spool, read_spool_lines
from evidence.bundle.writer import RECORDING_ITEMS, Behaviour, RunMeta, no_cycle_collection, write_bundle
from evidence.errors import SetupError
from evidence.probes.headers import Headers

if TYPE_CHECKING:
    from evidence.bundle.attestation import Signer
    from evidence.probes.loader import RecorderProbes

__all__ = ["FLUSH_SECONDS", "Recorder", "Session", "Spool", "elf_abi", "proc_lookup"]

logger = logging.getLogger(__name__)

# Per run (--detail summary): distinct (program, path or address, access, result, cgroup) keys kept.
# Past it, opens, connects and file changes are counted by kind (lost.by_kind "open_past_cap", ...), not
# kept, so a flood of distinct names cannot grow the recorder's memory or the bundle past what the
# reader accepts. EVIDENCE_MAX_DISTINCT sets it (tests use a small value).
MAX_DISTINCT = int(os.environ.get("EVIDENCE_MAX_DISTINCT", "100000"))


class Recorder(Pipeline):
    def __init__(
        self,
        spool_dir: str | Path,
        headers: Headers | None = None,
        capabilities: Capabilities | None = None,
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
        self.capabilities: Capabilities = capabilities or {}
        self.wall_offset_ns = time.time_ns() - time.monotonic_ns()
        # finished runs' slots whose aggregation entries are being removed (_release): not reused yet
        self._releasing: dict[int, threading.Thread] = {}
        self.hasher = exe_hash.Hasher(exe_hash.ExeHasher(max_size=exe_hash.max_size_setting()))
        self._start_pipeline()

    # ---- runs -------------------------------------------------------------------------------
    def start(
        self,
        cgroup_path: Path,
        command: list[str],
        cwd: str,
        *,
        detail: Detail = "summary",
        labels: Mapping[str, str] | None = None,
        attached_late: bool = False,
        session_id: str | None = None,
        wrap_spool: Callable[[SpoolWriter], Spool] | None = None,
        max_distinct: int | None = None,
        roots: Mapping[str, str] | None = None,
        network: Network = None,
        capabilities: Mapping[str, str] | None = None,
        degradations: Sequence[Degradation] = (),
        signed: bool = False,
    ) -> Session:
        """Start recording `cgroup_path` (a new run slot). `wrap_spool` wraps the run's spool before
        the cgroup is tracked, so that the wrapper sees every record the run gets. `max_distinct`:
        the run's cap on distinct summary keys (default: the recorder's). `roots`: the run's private
        tmp and workspace ({placeholder: path}), which its run id names by their placeholders.
        `network`, `capabilities` (over the recorder's) and `degradations`: what the run's command
        runs under, known before the run starts (agent/recorder/run.py: RunPlan). `signed`: its
        bundle will be signed (full detail's premade lines then feed the trace as they are made)."""
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
                capabilities={**self.capabilities, **(capabilities or {})},
                network=network,
                headers=self.headers.as_dict() if self.headers else {},
                max_distinct=0
                if detail == "full"
                else max(1, self.max_distinct if max_distinct is None else max_distinct),
            )
            session.journal = self.spool_dir / f"{sid}{JOURNAL_SUFFIX}"
            session.correlator.cgroup_name = names
            session.correlator.run_cgroup = str(cgroup_path)
            session.correlator.cgroup_mount = cgroup_mount_of(cgroup_path)
            session.correlator.container_of = container_namer(cgroup_path)
            session.correlator.tgid_of = tgid_of
            session.correlator.cgroup_of = cgroup_of
            self._sessions[slot] = session
            self.probes.reset_lost(slot)
            self.probes.set_aggregation(slot, session.max_distinct)
            try:  # ---- dns: before the cgroup is tracked, so that no delivery of the run is missed
                self.probes.attach_ingress(session.cgroup_id, cgroup_path)
            except OSError as e:
                logger.warning("run %s: DNS deliveries are not recorded: %s", sid, e)
                session.degrade(
                    Degradation(
                        component="dns",
                        reason=f"what the kernel delivers to the run's sockets could not be recorded: {e}",
                        impact="no DNS answer of the run is credited to its query: connects carry no names, "
                        "and diff, baseline and profile compare them by address",
                    )
                )
            session.degrade(*degradations)
            if detail == "full":  # its events' lines made as its records come (a plain spool sees them all)
                session.premade = Premade(
                    self.spool_dir, session.labels, 1 + len(session.degradations), signed=signed
                )
                raw.events = session.premade.add
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

    def finish(
        self,
        session: Session,
        bundle_path: str | Path,
        *,
        exit_code: int | None,
        signal: str | None = None,
        cut_short: bool = False,
        signer: Signer | None = None,
        artifacts: Artifacts | None = None,
    ) -> dict[str, Any]:
        """End the run and write its bundle; its manifest. The cyclic garbage collector is off
        meanwhile (writer.no_cycle_collection): the run's aggregates and first records, 100,000 of
        each past a flood, would make it walk every object alive again and again."""
        with no_cycle_collection():
            return self._finish(session, bundle_path, exit_code, signal, cut_short, signer, artifacts)

    def _finish(
        self,
        session: Session,
        bundle_path: str | Path,
        exit_code: int | None,
        signal: str | None,
        cut_short: bool,
        signer: Signer | None,
        artifacts: Artifacts | None = None,
    ) -> dict[str, Any]:
        with self._lock:
            self.probes.untrack(session.cgroup_id)
        # everything the kernel wrote for this run before untrack is now spooled, unless the consumer
        # is stuck: those records were written to the ring (no reservation failed, no loss counted)
        # and are not in the spool, so the bundle must say so
        began = time.monotonic()
        behind = self.queue_depth()
        drained = self.drain()
        finished_ns = time.time_ns()
        logger.info(
            "run %s: its records spooled %.2f s after its end (%d batches were waiting)",
            session.session_id,
            time.monotonic() - began,
            behind,
        )
        if not drained:
            session.degrade(
                Degradation(
                    component="recorder",
                    reason=f"the ring buffer's consumer finished no batch of records for {DRAIN_SECONDS} s after the run's end",
                    impact="records the kernel wrote for this run may be missing, and are not counted as lost",
                )
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
            session.degrade(
                Degradation(
                    component="recorder",
                    reason=f"correlating {session.failed} records failed (a bug: the recorder's log says where)",
                    impact="those records are not in the bundle (counted as lost, not_correlated); the rest is",
                )
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
            session.degrade(
                Degradation(
                    component="recorder",
                    reason=f"the kernel's aggregation map was full: {fallbacks} operations were recorded one by one",
                    impact="none on what is recorded; recording them cost more",
                )
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
                session.degrade(said)
        if session.observer is not None:  # held back behind an exec's hash: not observed yet
            held += session.observer(held)
        session.spool.write_many(held + pending + session.correlator.flush() + counted)
        with session.journal_lock:  # no record made from now on is lost to the spool
            session.spool.write_many(session.extra_records)
            session.spool.close()
        session.drop_journal()
        command, claimed = session.command, None
        if session.claimed:  # what the kernel executed, and the caller's claim beside it
            verdict = judge(session.command, session.correlator.root_exec)
            command, claimed = verdict.command, session.command
            if verdict.degradation is not None:
                logger.warning("run %s: %s", session.session_id, verdict.degradation["reason"])
                session.degrade(Degradation.model_validate(verdict.degradation))
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
            degradations=[d.model_dump() for d in session.degradations],
            roots=session.roots,
            artifacts=artifacts,  # `--subject`: collected by Run.finish once the command exited
        )
        spool_path = session.spool.path
        behaviour, session.behaviour = session.behaviour, None  # made into a run id once: a retry reads
        premade = session.premade.made() if session.premade is not None else None  # used once
        session.premade = None
        release_free_memory()  # the recording's free pages, before the writer's own come
        try:
            manifest = write_bundle(
                bundle_path,
                meta,
                lambda: read_spool(spool_path),
                signer=signer,
                behaviour=behaviour,
                lines=lambda: read_spool_lines(spool_path),
                premade=premade,
            )
        except BaseException:
            # never lose what was recorded: the spool stays for a retry or for recovery
            logger.info("run %s: bundle not written; its records stay in %s", session.session_id, spool_path)
            raise
        finally:
            if premade is not None:
                premade.close()
        spool_path.unlink(missing_ok=True)
        logger.info(
            "run %s: bundle written %.2f s after its end", session.session_id, time.monotonic() - began
        )
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
        self._stop_pipeline()
        self.hasher.close()
        self.probes.close(background=background)


def _host() -> dict[str, str]:
    from evidence.agent.recorder.kernel import host_info

    return host_info()
