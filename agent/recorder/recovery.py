"""Recovery: spools that a dead recorder (an agent, or `evidence run`) left become bundles.

Beside each spool, `<session>.run.json` (RUN_META_SUFFIX) holds the run's description, whole
(agent/recorder/description.py: command, policy, roots, capabilities, network, the run's
degradations, its pid, ...), written by `write_run_record` when the run starts and rewritten when
any of it changes (the command's pid known, a policy attached, labels, the exit seen when the
bundle could not be written): a recovered bundle says what was in force and what was degraded, as
the run's own would have. A live `evidence run` holds a lock on its record, so recovery never takes
a running run's spool. `recover_spools` turns every other spool into a bundle, reading it up to the
first unreadable byte: marked cut short, with a degradation event, when the recorder died during
the run; complete, with the command's exit code, when only the bundle's writing failed (disk full).
A spool that cannot be turned into a bundle is moved to `<spool_dir>/failed/`, never deleted. The
agent recovers its own spools when it starts; `evidence recover` does it for `evidence run`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import re
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

from evidence.agent.recorder.description import DescriptionError, RunDescription
from evidence.bundle.format import Degradation
from evidence.files import write_atomic

if TYPE_CHECKING:
    from evidence.bundle.attestation import Signer
    from evidence.bundle.record_types import SpoolRecord

BUNDLE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,200}\.tar\.gz")  # as the agent's API accepts

logger = logging.getLogger(__name__)

RUN_META_SUFFIX = ".run.json"
SPOOL_SUFFIX = ".spool.zst"
# beside a run's spool: the records made outside the ring buffer, as they are made (Session.journal)
JOURNAL_SUFFIX = ".records.ndjson"


def unique_path(path: Path) -> Path:
    """path, or path with -2, -3 ... before .tar.gz when it is taken."""
    if not os.path.lexists(path):
        return path
    stem = path.name.removesuffix(".tar.gz")
    n = 2
    while os.path.lexists(path.with_name(f"{stem}-{n}.tar.gz")):
        n += 1
    return path.with_name(f"{stem}-{n}.tar.gz")


@dataclasses.dataclass
class ReadState:
    """What stopped the reading of a spool (tolerant_records), if anything did."""

    error: str | None = None


def tolerant_records(path: Path, state: ReadState) -> Callable[[], Iterator[SpoolRecord]]:
    """The records of a spool whose writer died: everything up to the first unreadable byte
    (state.error says what stopped the reading, if anything did)."""
    from evidence.bundle.spool import read_spool

    def gen() -> Iterator[SpoolRecord]:
        it = read_spool(path)
        while True:
            try:
                rec = next(it)
            except StopIteration:
                return
            except Exception as e:  # truncated frame or a half-written line: the end of what survived
                state.error = str(e) or type(e).__name__
                return
            if isinstance(rec, dict) and isinstance(rec.get("k"), str) and isinstance(rec.get("t"), int):
                yield rec

    return gen


def write_run_record(spool_dir: Path, description: RunDescription) -> Path:
    """Write `<session>.run.json` beside the run's spool: its description, whole (atomically, 0600;
    rewritten whenever it changes)."""
    path = spool_dir / f"{description.session_id}{RUN_META_SUFFIX}"
    write_atomic(path, description.to_json(), mode=0o600)
    return path


def read_run_record(path: Path, session_id: str) -> RunDescription:
    """The run record at `path`; one that is missing or unreadable is logged and gives a run that
    says no more than its session id (recovery writes the bundle with less)."""
    try:
        return RunDescription.from_json(path.read_bytes(), session_id)
    except FileNotFoundError:
        logger.warning("run %s has no recovery record: recovering with less", session_id)
    except (OSError, DescriptionError) as e:
        logger.warning("recovery record %s is unreadable (%s): recovering with less", path, e)
    return RunDescription(session_id=session_id)


def hold(path: Path) -> int:
    """Lock a run record for as long as the returned descriptor stays open: the run is alive."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


@contextlib.contextmanager
def spool_dir_lock(spool_dir: Path, *, exclusive: bool) -> Iterator[None]:
    """The spool directory's own lock (flock of the directory): shared by a live run while its
    spool has no locked run record (from the spool's creation until its record is written and held,
    and while the record is replaced by a new file), exclusive while `leftovers` are chosen, so that
    a concurrent `evidence recover` never takes the spool of a run that is still alive. Nothing is
    locked when the directory cannot be opened (it does not exist yet: nothing to recover)."""
    try:
        fd = os.open(spool_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def _alive(meta_path: Path) -> bool:
    try:
        fd = os.open(meta_path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def leftovers(spool_dir: Path) -> list[Path]:
    """The spools in spool_dir whose recorder is gone (none of a live run)."""
    if not spool_dir.is_dir():
        return []
    with spool_dir_lock(spool_dir, exclusive=True):  # no live run between its spool and its record
        # a run that ends removes its spool, then its record: a record gone since the spool was
        # listed is a finished run's, whose spool is gone too (looked at again, after the record)
        return [
            s
            for s in sorted(spool_dir.glob(f"*{SPOOL_SUFFIX}"))
            if not _alive(spool_dir / s.name.replace(SPOOL_SUFFIX, RUN_META_SUFFIX)) and s.exists()
        ]


def recover_spools(
    spool_dir: Path, bundle_dir: Path | None, recorder: str = "agent", signer: Signer | None = None
) -> list[Path]:
    """Turn every spool a dead recorder left in spool_dir into a bundle; returns them.

    A bundle goes into bundle_dir, or (None) where the run's record says its bundle was to be
    written (`evidence run --bundle`) when that directory is root's alone, else into
    <spool_dir>/../recovered (root is writing: a directory a job can change is not trusted). What a spool holds is what was flushed before the recorder
    died (at least once a second); the bundle says so with a degradation event. A spool that cannot
    be turned into a bundle is moved to <spool_dir>/failed/ and logged, never deleted. `signer`
    signs every bundle whose run record names no key of its own (the agent's key)."""
    from evidence.agent.recorder.kernel import host_info
    from evidence.bundle.command import judge
    from evidence.bundle.writer import RunMeta, write_bundle

    if not spool_dir.is_dir():
        return []
    if bundle_dir is not None:
        bundle_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # the agent's is private_dir already
        for tmp in bundle_dir.glob(".evidence-*.tmp"):  # a bundle or marker cut off mid-write
            logger.warning("removing %s, a partial write of an agent that stopped", tmp)
            tmp.unlink(missing_ok=True)
    out = []
    for spool in leftovers(spool_dir):
        sid = spool.name.removesuffix(SPOOL_SUFFIX)
        meta_path = spool_dir / f"{sid}{RUN_META_SUFFIX}"
        info = read_run_record(meta_path, sid)
        state = ReadState()
        journal = spool_dir / f"{sid}{JOURNAL_SUFFIX}"
        records = _with_journal(tolerant_records(spool, state), journal)
        last_t = first_t = count = 0
        root: SpoolRecord | None = None  # the first exec of the process that started the command
        for r in records():
            count += 1
            last_t = max(last_t, r["t"])
            first_t = r["t"] if not first_t else min(first_t, r["t"])
            if root is None and r["k"] == "exec" and r["pid"] == info.pid and r["result"] == 0:
                root = r
        mtime = spool.stat().st_mtime_ns
        if count == 0 and state.error:
            move_aside(spool, meta_path, spool_dir, state.error)
            continue
        started = info.started_ns or first_t or mtime
        name = info.bundle_name or f"{sid}.tar.gz"
        if not BUNDLE_NAME.fullmatch(name):
            name = f"{sid}.tar.gz"
        where = bundle_dir
        if where is None:
            asked = Path(info.bundle_path or "")
            where = _safe_dir(asked.parent) if asked.is_absolute() else None
            if where is None:  # a directory a job could have swapped: root's own instead
                where = spool_dir.parent / "recovered"
                where.mkdir(mode=0o700, exist_ok=True)
        target = unique_path(where / name)
        # the run ended and only its bundle could not be written: complete, with its exit status
        degradation = (
            Degradation(
                component=recorder,
                reason="written later by `evidence recover`: the bundle could not be written when the run ended",
                impact="the kernel's loss counts are missing",
            )
            if info.ended
            else Degradation(
                component=recorder,
                reason=f"recovered from the spool of {'an agent' if recorder == 'agent' else 'an evidence run'} "
                "that stopped without finishing this run (crash, kill -9, node reboot)",
                impact="events after the spool's last flush, and the kernel's loss counts, are missing",
            )
        )
        # what was in force and degraded during the run, as its own bundle would have said, then this
        degradations = [*info.degradations, degradation]
        command, claimed = info.command, None
        if info.claimed:  # as the recorder would have: the kernel's, and the claim
            verdict = judge(info.command, root)
            command, claimed = verdict.command, info.command
            if verdict.degradation is not None:
                degradations.append(Degradation.model_validate(verdict.degradation))
        meta = RunMeta(
            session_id=info.session_id,
            command=command,
            claimed_command=claimed,
            cwd=info.cwd,
            pid=info.pid,
            cgroup=info.cgroup,
            started_ns=started,
            finished_ns=info.finished_ns
            if info.finished_ns is not None
            else max(started, last_t, mtime if not last_t else 0),
            exit_code=info.exit_code if info.ended else None,
            signal=info.signal if info.ended else None,
            cut_short=not info.ended,
            attached_late=info.attached_late,
            detail=info.detail,
            host=host_info(),
            capabilities=info.capabilities,
            headers=info.headers,
            labels=info.labels,
            policy=info.policy,
            network=info.network,
            resolvers=info.resolvers,
            degradations=[d.model_dump() for d in degradations],
            roots=info.roots,
        )
        try:
            write_bundle(target, meta, records, signer=_signer(info.sign_key) or signer)
        except Exception as e:
            move_aside(spool, meta_path, spool_dir, str(e))
            continue
        spool.unlink(missing_ok=True)
        journal.unlink(missing_ok=True)
        meta_path.unlink(missing_ok=True)
        logger.warning("recovered run %s into %s%s", sid, target, "" if info.ended else " (cut short)")
        out.append(target)
    for orphan in spool_dir.glob(f"*{RUN_META_SUFFIX}"):  # a run whose spool was never created
        if not (spool_dir / orphan.name.replace(RUN_META_SUFFIX, SPOOL_SUFFIX)).exists() and not _alive(
            orphan
        ):
            orphan.unlink(missing_ok=True)
    return out


def _with_journal(
    spooled: Callable[[], Iterator[SpoolRecord]], journal: Path
) -> Callable[[], Iterator[SpoolRecord]]:
    """The spool's records, then those of the run's journal (Session.add_records: denials,
    approvals, limit events made outside the ring buffer; a finished run's are in its spool and
    its journal is gone), up to its first unreadable line."""
    import orjson

    def gen() -> Iterator[SpoolRecord]:
        yield from spooled()
        try:
            with open(journal, "rb") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return
        for line in lines:
            try:
                loaded: object = orjson.loads(line)
            except orjson.JSONDecodeError:  # a line cut off mid-write: the end of what survived
                return
            if (
                isinstance(loaded, dict)
                and isinstance(loaded.get("k"), str)
                and isinstance(loaded.get("t"), int)
            ):
                yield cast("SpoolRecord", loaded)  # the recorder's own file, like the spool

    return gen


def _safe_dir(path: Path) -> Path | None:
    """path (resolved) when it and every directory above it are root's and writable by nobody else:
    a place a job cannot have pointed somewhere else. None otherwise."""
    try:
        real = Path(os.path.realpath(path))
        for d in (real, *real.parents):
            st = os.lstat(d)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
                return None
    except OSError:
        return None
    return real


def _signer(key: str | None) -> Signer | None:
    """The signer the run asked for (`evidence run --sign-key`), if its key can still be used; else
    the bundle is written unsigned, with a warning (lint --require-signature will refuse it)."""
    if not key:
        return None
    from evidence.bundle.signing import load_signer
    from evidence.errors import Error

    try:
        return load_signer(str(key))
    except Error as e:
        logger.warning("cannot sign the recovered bundle with %s (%s): writing it unsigned", key, e.message)
        return None


def move_aside(spool: Path, meta_path: Path, spool_dir: Path, why: str) -> None:
    failed = spool_dir / "failed"
    failed.mkdir(mode=0o700, exist_ok=True)
    shutil.move(str(spool), failed / spool.name)
    if meta_path.exists():
        shutil.move(str(meta_path), failed / meta_path.name)
    logger.error("cannot recover %s (%s): moved to %s", spool, why, failed)
