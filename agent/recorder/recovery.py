"""Recovery: spools that a dead recorder (an agent, or `evidence run`) left become bundles.

Beside each spool, `<session>.run.json` (RUN_META_SUFFIX, written by `write_run_record` when a run
starts, and again on label changes or when its bundle could not be written) holds what the
bundle's manifest needs. A live `evidence run` holds a lock on its record, so recovery never takes
a running run's spool. `recover_spools` turns every other spool into a bundle, reading it up to the
first unreadable byte: marked cut short, with a degradation event, when the recorder died during
the run; complete, with the command's exit code, when only the bundle's writing failed (disk full).
A spool that cannot be turned into a bundle is moved to `<spool_dir>/failed/`, never deleted. The
agent recovers its own spools when it starts; `evidence recover` does it for `evidence run`'s.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from evidence.files import write_atomic

if TYPE_CHECKING:
    from evidence.bundle.record_types import SpoolRecord

BUNDLE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,200}\.tar\.gz")  # as the agent's API accepts

logger = logging.getLogger(__name__)

RUN_META_SUFFIX = ".run.json"
SPOOL_SUFFIX = ".spool.zst"


def unique_path(path: Path) -> Path:
    """path, or path with -2, -3 ... before .tar.gz when it is taken."""
    if not os.path.lexists(path):
        return path
    stem = path.name.removesuffix(".tar.gz")
    n = 2
    while os.path.lexists(path.with_name(f"{stem}-{n}.tar.gz")):
        n += 1
    return path.with_name(f"{stem}-{n}.tar.gz")


def tolerant_records(path: Path, state: dict[str, Any]) -> Callable[[], Iterator[SpoolRecord]]:
    """The records of a spool whose writer died: everything up to the first unreadable byte
    (state["error"] says what stopped the reading, if anything did)."""
    from evidence.bundle.spool import read_spool

    def gen() -> Iterator[SpoolRecord]:
        it = read_spool(path)
        while True:
            try:
                rec = next(it)
            except StopIteration:
                return
            except Exception as e:  # truncated frame or a half-written line: the end of what survived
                state["error"] = str(e) or type(e).__name__
                return
            if isinstance(rec, dict) and isinstance(rec.get("k"), str) and isinstance(rec.get("t"), int):
                yield rec

    return gen


def run_record(session: Any, **extra: Any) -> dict[str, Any]:
    """What recovery needs of a recorder Session, with extra fields (bundle_name, bundle_path, and
    exit_code, signal, finished_ns once the run has ended)."""
    return {
        "session_id": session.session_id,
        "cgroup": str(session.cgroup_path),
        "command": session.command,
        "cwd": session.cwd,
        "pid": session.pid,
        "started_ns": session.started_ns,
        "attached_late": session.attached_late,
        "detail": session.detail,
        "labels": dict(session.labels),
        "network": session.network,
        "resolvers": session.resolvers,
        **extra,
    }


def write_run_record(spool_dir: Path, session_id: str, record: dict[str, Any]) -> Path:
    """Write `<session>.run.json` beside the run's spool (atomically, 0600)."""
    path = spool_dir / f"{session_id}{RUN_META_SUFFIX}"
    write_atomic(path, json.dumps(record, sort_keys=True).encode(), mode=0o600)
    return path


def hold(path: Path) -> int:
    """Lock a run record for as long as the returned descriptor stays open: the run is alive."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


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
    return [
        s
        for s in sorted(spool_dir.glob(f"*{SPOOL_SUFFIX}"))
        if not _alive(spool_dir / s.name.replace(SPOOL_SUFFIX, RUN_META_SUFFIX))
    ]


def recover_spools(
    spool_dir: Path, bundle_dir: Path | None, recorder: str = "agent", signer: Any = None
) -> list[Path]:
    """Turn every spool a dead recorder left in spool_dir into a bundle; returns them.

    A bundle goes into bundle_dir, or (None) where the run's record says its bundle was to be
    written (`evidence run --bundle`) when that directory is root's alone, else into
    <spool_dir>/../recovered (root is writing: a directory a job can change is not trusted). What a spool holds is what was flushed before the recorder
    died (at least once a second); the bundle says so with a degradation event. A spool that cannot
    be turned into a bundle is moved to <spool_dir>/failed/ and logged, never deleted. `signer`
    signs every bundle whose run record names no key of its own (the agent's key)."""
    from evidence.agent.recorder.kernel import host_info
    from evidence.bundle.writer import RunMeta, write_bundle

    if not spool_dir.is_dir():
        return []
    if bundle_dir is not None:
        bundle_dir.mkdir(parents=True, exist_ok=True)
        for tmp in bundle_dir.glob(".evidence-*.tmp"):  # a bundle or marker cut off mid-write
            logger.warning("removing %s, a partial write of an agent that stopped", tmp)
            tmp.unlink(missing_ok=True)
    out = []
    for spool in leftovers(spool_dir):
        sid = spool.name.removesuffix(SPOOL_SUFFIX)
        meta_path = spool_dir / f"{sid}{RUN_META_SUFFIX}"
        try:
            info: dict[str, Any] = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        except (OSError, ValueError) as e:
            logger.warning("recovery record %s is unreadable (%s): recovering with less", meta_path, e)
            info = {}
        state: dict[str, Any] = {}
        records = tolerant_records(spool, state)
        last_t = first_t = count = 0
        for r in records():
            count += 1
            last_t = max(last_t, r["t"])
            first_t = r["t"] if not first_t else min(first_t, r["t"])
        mtime = spool.stat().st_mtime_ns
        if count == 0 and state.get("error"):
            move_aside(spool, meta_path, spool_dir, state["error"])
            continue
        started = int(info.get("started_ns") or first_t or mtime)
        name = info.get("bundle_name") or f"{sid}.tar.gz"
        if not BUNDLE_NAME.fullmatch(str(name)):
            name = f"{sid}.tar.gz"
        where = bundle_dir
        if where is None:
            asked = Path(str(info.get("bundle_path") or ""))
            where = _safe_dir(asked.parent) if asked.is_absolute() else None
            if where is None:  # a directory a job could have swapped: root's own instead
                where = spool_dir.parent / "recovered"
                where.mkdir(mode=0o700, exist_ok=True)
        target = unique_path(where / str(name))
        # the run ended and only its bundle could not be written: complete, with its exit status
        ended = "finished_ns" in info
        degradation = (
            {
                "component": recorder,
                "reason": "written later by `evidence recover`: the bundle could not be written when the run ended",
                "impact": "the kernel's loss counts are missing",
            }
            if ended
            else {
                "component": recorder,
                "reason": f"recovered from the spool of {'an agent' if recorder == 'agent' else 'an evidence run'} "
                "that stopped without finishing this run (crash, kill -9, node reboot)",
                "impact": "events after the spool's last flush, and the kernel's loss counts, are missing",
            }
        )
        meta = RunMeta(
            session_id=str(info.get("session_id") or sid),
            command=[str(a) for a in info.get("command") or []],
            cwd=str(info.get("cwd") or ""),
            pid=int(info.get("pid") or 0),
            cgroup=str(info.get("cgroup") or ""),
            started_ns=started,
            finished_ns=int(info["finished_ns"])
            if ended
            else max(started, last_t, mtime if not last_t else 0),
            exit_code=info.get("exit_code") if ended else None,
            signal=info.get("signal") if ended else None,
            cut_short=not ended,
            attached_late=bool(info.get("attached_late", True)),
            detail="full" if info.get("detail") == "full" else "summary",
            host=host_info(),
            capabilities={},
            headers={},
            labels={str(k): str(v) for k, v in (info.get("labels") or {}).items()},
            network=info.get("network") if info.get("network") in ("none", "loopback") else None,
            resolvers=_resolvers(info.get("resolvers")),
            degradations=[degradation],
        )
        try:
            write_bundle(target, meta, records, signer=_signer(info.get("sign_key")) or signer)
        except Exception as e:
            move_aside(spool, meta_path, spool_dir, str(e))
            continue
        spool.unlink(missing_ok=True)
        meta_path.unlink(missing_ok=True)
        logger.warning("recovered run %s into %s%s", sid, target, "" if ended else " (cut short)")
        out.append(target)
    for orphan in spool_dir.glob(f"*{RUN_META_SUFFIX}"):  # a run whose spool was never created
        if not (spool_dir / orphan.name.replace(RUN_META_SUFFIX, SPOOL_SUFFIX)).exists() and not _alive(
            orphan
        ):
            orphan.unlink(missing_ok=True)
    return out


def _resolvers(value: Any) -> list[str] | None:
    """A run record's resolvers (a list of addresses), None when it has none or they are not that."""
    if isinstance(value, list) and all(isinstance(a, str) for a in value):
        return list(value)
    return None


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


def _signer(key: Any) -> Any:
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
    failed.mkdir(exist_ok=True)
    shutil.move(str(spool), failed / spool.name)
    if meta_path.exists():
        shutil.move(str(meta_path), failed / meta_path.name)
    logger.error("cannot recover %s (%s): moved to %s", spool, why, failed)
