"""Hashes of the programs that ran: sha256 and size of the file an exec ran, read through
/proc/<pid>/exe (the very file the kernel mapped: a replaced or bind-mounted path cannot lie about
it), cached by (device, inode, mtime, size, ctime) so a program run 10,000 times is hashed once.

The /proc reads go through `proc_root` (a fake tree in unit tests). What a successful exec record
gains (docs/bundle-format.md, process.exec):

- `sha256`, `size`, `hash_source`: of the file the exec named. `hash_source` is "exe" when it was read
  through /proc/<pid>/exe; "inode" when the process was gone (or had exec'd again) by the time it
  was hashed and the file was read by its path and found to be the very file the kernel mapped at
  the exec (the exec record's device, inode, size and ctime, agent/recorder/decode.py); "path" when
  it was read by its path and that could not be shown: a `#!` script (the kernel maps its
  interpreter, so the script itself has no /proc name and no identity in the record), or a path
  that names a file other than the one that ran (replaced since, or a file system whose stat
  reports other numbers than its inodes hold);
- `not_hashed` instead of `sha256` when it could not be hashed, with the reason;
- for a `#!` script also `interpreter` (the first word of its `#!` line), `interpreter_sha256`,
  `interpreter_size`, `interpreter_hash_source` (as above) or `interpreter_not_hashed`.

Hashing a file not seen before runs on a worker thread (`Hasher`): the correlator only pays for a
stat or two, and a cache hit is answered at once (for a process gone already, by its path).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, cast

if TYPE_CHECKING:
    from evidence.bundle.record_types import ExecRecord, SpoolRecord

logger = logging.getLogger(__name__)

DEFAULT_MAX_SIZE = 256 * 1024 * 1024  # EVIDENCE_HASH_MAX_SIZE (bytes) overrides it
CACHE_ENTRIES = 65536
_CHUNK = 1024 * 1024
SHEBANG_MAX = 256  # the kernel reads at most this much of a `#!` line (BINPRM_BUF_SIZE)

# reasons in `not_hashed`
TOO_LARGE = "too_large"  # above the size limit (the size is still recorded)
GONE = "gone"  # the process was gone and the path no longer names a file
UNREADABLE = "unreadable"  # neither /proc/<pid>/exe nor the path could be read
NOT_REGULAR = "not_regular"  # the path names no regular file (a directory, a device)
TIMEOUT = "timeout"  # not hashed within HASH_SECONDS (a file on a stalled file system, a queue)

# An exec's hash is given up after this long, so that a read that never returns (a FUSE file the
# job serves itself) cannot hold the run's records back for ever.
HASH_SECONDS = 10.0


@dataclasses.dataclass(frozen=True)
class FileHash:
    sha256: str | None
    size: int | None
    source: str | None  # "exe", "inode" or "path"
    reason: str | None = None  # why not hashed

    def fields(self, prefix: str = "") -> dict[str, Any]:
        if self.sha256 is None:
            out: dict[str, Any] = {f"{prefix}not_hashed": self.reason or UNREADABLE}
            if self.size is not None:
                out[f"{prefix}size"] = self.size
            return out
        return {
            f"{prefix}sha256": self.sha256,
            f"{prefix}size": self.size,
            f"{prefix}hash_source": self.source,
        }


FileKey = tuple[int, int, int, int, int]  # (st_dev, st_ino, st_mtime_ns, st_size, st_ctime_ns)
# the file an exec mapped, as the kernel knew it at the exec: (st_dev, st_ino, st_size, st_ctime_ns)
Ident = tuple[int, int, int, int]


def max_size_setting() -> int:
    """The size limit: EVIDENCE_HASH_MAX_SIZE (bytes), else DEFAULT_MAX_SIZE."""
    raw = os.environ.get("EVIDENCE_HASH_MAX_SIZE", "")
    try:
        return int(raw) if raw else DEFAULT_MAX_SIZE
    except ValueError:
        logger.warning("EVIDENCE_HASH_MAX_SIZE=%r is not a number: %d is used", raw, DEFAULT_MAX_SIZE)
        return DEFAULT_MAX_SIZE


def read_head(path: str, size: int) -> tuple[bytes, os.stat_result] | None:
    """The first `size` bytes of the regular file at `path` (and its stat), None when it is not one
    or cannot be read. Opened without blocking: the job can put a FIFO at the path of a program it
    ran (rename is atomic), and a plain open of it as root would wait for a writer for ever (found by
    the red team: `evidence run` hung after writing its bundle, the agent's hash workers for good)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        return os.read(fd, size), st
    except OSError:
        return None
    finally:
        os.close(fd)


def _key(st: os.stat_result) -> FileKey:
    # the ctime too: the owner of a file can rewrite it in place and put its mtime back (utimensat),
    # but no user can set the ctime (red team: a program rewritten so got the old one's hash)
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size, st.st_ctime_ns)


def _ident(st: os.stat_result) -> Ident:
    return (st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns)


def shebang_interpreter(head: bytes) -> str | None:
    """The interpreter a `#!` line names (its first word), or None when `head` is not a script."""
    if not head.startswith(b"#!"):
        return None
    line = head[2:SHEBANG_MAX].split(b"\n", 1)[0].strip(b" \t\r")
    word = line.split(None, 1)[0] if line.split() else b""
    return os.fsdecode(word) if word else None


class ExeHasher:
    """Identifies and hashes the file a process runs. Thread-safe; blocking (hashes on the caller's
    thread): `Hasher` puts it behind a worker thread."""

    def __init__(self, max_size: int = DEFAULT_MAX_SIZE, proc_root: str = "/proc") -> None:
        self.max_size = max_size
        self.proc_root = proc_root
        self._cache: dict[FileKey, FileHash] = {}
        self._scripts: set[FileKey] = set()  # files seen to start with `#!`
        self._lock = threading.Lock()
        self.stats = {"hashed": 0, "hits": 0, "bytes": 0}

    # -- the /proc side ---------------------------------------------------------------------------

    def _exe(self, pid: int) -> str:
        return f"{self.proc_root}/{pid}/exe"

    def _matches(self, pid: int, filename: str, exe_st: os.stat_result) -> bool:
        """Whether /proc/<pid>/exe (stat `exe_st`) still names the file `filename` names: the same
        inode (a symlink, a bind mount), or the name it had when it was replaced or removed."""
        try:
            st = os.stat(filename)
            if (st.st_dev, st.st_ino) == (exe_st.st_dev, exe_st.st_ino):
                return True
        except OSError:
            pass
        try:
            target = os.readlink(self._exe(pid))
        except OSError:
            return False
        target = target.removesuffix(" (deleted)")
        return target in (filename, os.path.realpath(filename))

    def lookup(self, pid: int, filename: str, ident: Ident | None = None) -> FileHash | None:
        """A cached answer for the program `pid` runs when /proc/<pid>/exe still names `filename`'s
        file, else None (not cached, a script, a process gone or moved on: see `hash`)."""
        try:
            st = os.stat(self._exe(pid))
        except OSError:
            return self._gone(filename, ident)
        with self._lock:
            hit = self._cache.get(_key(st))
        if hit is None or not self._matches(pid, filename, st):
            return None
        self.stats["hits"] += 1
        return dataclasses.replace(hit, source="exe") if hit.source != "exe" else hit

    def _gone(self, filename: str, ident: Ident | None) -> FileHash | None:
        """A process gone already (most short-lived ones are, by the time their record is read): its
        file is read by path, so a cached answer for the file at that path, unless it is a script
        (whose record needs its interpreter too)."""
        try:
            st = os.stat(filename)
        except OSError:
            return None
        key = _key(st)
        with self._lock:
            hit = None if key in self._scripts else self._cache.get(key)
        if hit is None:
            return None
        self.stats["hits"] += 1
        source = "inode" if ident is not None and _ident(st) == ident else "path"
        return dataclasses.replace(hit, source=source) if hit.sha256 and hit.source != source else hit

    def hash_exec(self, pid: int, filename: str, ident: Ident | None = None) -> dict[str, Any]:
        """The fields a successful exec record gains (see the module's docstring). `ident`: the file
        the kernel mapped (for a script, its interpreter)."""
        head, key = self._head(filename)
        interp = shebang_interpreter(head) if head else None
        if interp is not None and key is not None:
            with self._lock:
                if len(self._scripts) >= CACHE_ENTRIES:
                    self._scripts.clear()
                self._scripts.add(key)
        if interp is None:
            return self._program(pid, filename, ident).fields()
        # a script: the kernel runs the interpreter (/proc/<pid>/exe) with the script as argument
        out = self._file(filename).fields()
        out["interpreter"] = interp
        out.update(self._program(pid, interp, ident).fields("interpreter_"))
        return out

    def _program(self, pid: int, filename: str, ident: Ident | None = None) -> FileHash:
        got = self._via_exe(pid, filename)
        if got is not None:
            return got
        by_path = self._file(filename, ident)  # gone, or already running something else: by its path
        if by_path.reason == UNREADABLE:
            return dataclasses.replace(by_path, reason=GONE)
        return by_path

    def _via_exe(self, pid: int, filename: str) -> FileHash | None:
        try:
            fd = os.open(self._exe(pid), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not self._matches(pid, filename, st):
                return None
            # the process may have exec'd again between the open and the check
            try:
                now = os.stat(self._exe(pid))
            except OSError:
                now = st  # gone since: the descriptor still holds the file it ran
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                return None
            return self._hash_fd(fd, st, "exe")
        finally:
            os.close(fd)

    # -- files --------------------------------------------------------------------------------------

    def _head(self, filename: str) -> tuple[bytes, FileKey | None]:
        head = read_head(filename, SHEBANG_MAX)
        return (head[0], _key(head[1])) if head is not None else (b"", None)

    def _file(self, path: str, ident: Ident | None = None) -> FileHash:
        """By its path: "inode" when it is the file `ident` says ran, else "path"."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return FileHash(None, None, None, UNREADABLE)
        try:
            st = os.fstat(fd)
            return self._hash_fd(fd, st, "inode" if ident is not None and _ident(st) == ident else "path")
        finally:
            os.close(fd)

    def _hash_fd(self, fd: int, st: os.stat_result, source: str) -> FileHash:
        if not stat.S_ISREG(st.st_mode):
            return FileHash(None, None, None, NOT_REGULAR)
        key = _key(st)
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            self.stats["hits"] += 1
            return dataclasses.replace(hit, source=source) if hit.source != source else hit
        if st.st_size > self.max_size:
            got = FileHash(None, st.st_size, None, TOO_LARGE)
        else:
            h = hashlib.sha256()
            size = 0
            try:
                while chunk := os.pread(fd, _CHUNK, size):
                    h.update(chunk)
                    size += len(chunk)
            except OSError:
                return FileHash(None, None, None, UNREADABLE)
            if size != st.st_size:  # written to while hashed: say what was read, do not cache it
                return FileHash(h.hexdigest(), size, source)
            got = FileHash(h.hexdigest(), size, source)
            self.stats["hashed"] += 1
            self.stats["bytes"] += size
        with self._lock:
            if len(self._cache) >= CACHE_ENTRIES:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = got
        return got


class Pending:
    """An exec record's hash fields, on their way: `ready()` says whether `apply()` can fill them."""

    def __init__(
        self, future: concurrent.futures.Future[dict[str, Any]], deadline: float | None = None
    ) -> None:
        self.future = future
        self.deadline = time.monotonic() + HASH_SECONDS if deadline is None else deadline

    def ready(self) -> bool:
        return self.future.done() or time.monotonic() >= self.deadline

    def apply(self, rec: ExecRecord) -> None:
        try:
            # fields named at run time (FileHash.fields' prefix): typed as the record's own
            rec.update(cast("ExecRecord", self.future.result(max(0.0, self.deadline - time.monotonic()))))
        except concurrent.futures.TimeoutError:
            logger.warning("hash of %s: given up after %.0f s", rec.get("filename"), HASH_SECONDS)
            rec["not_hashed"] = TIMEOUT
        except Exception as e:  # a hashing bug must never lose the exec record
            logger.warning("hash of %s failed: %s", rec.get("filename"), e)
            rec["not_hashed"] = UNREADABLE


PENDING: Final = "_hash"  # the key an exec record holds its Pending under until it is spooled


class Hasher:
    """The correlator's side: `__call__(pid, filename)` returns the fields at once on a cache hit,
    else a `Pending` whose hashing runs on a worker thread."""

    def __init__(self, hasher: ExeHasher | None = None, workers: int = 2) -> None:
        self.hasher = hasher or ExeHasher()
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="exe-hash")

    def __call__(self, pid: int, filename: str, ident: Ident | None = None) -> dict[str, Any] | Pending:
        hit = self.hasher.lookup(pid, filename, ident)
        if hit is not None:
            return hit.fields()
        return Pending(self._pool.submit(self.hasher.hash_exec, pid, filename, ident))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=False)


def settle(recs: Sequence[SpoolRecord], wait: bool = False) -> int:
    """Fill in the hashes that are ready (all of them with `wait`, each within its deadline) and return
    how many of `recs`, from the start, can be spooled now: records stay in order, so those after a
    pending one wait too."""
    for i, rec in enumerate(recs):
        if rec["k"] != "exec":  # only an exec's record waits for a hash
            continue
        pending = rec.get(PENDING)
        if not isinstance(pending, Pending):  # None: its fields are there already
            continue
        if not wait and not pending.ready():
            return i
        del rec[PENDING]
        pending.apply(rec)
    return len(recs)


HashOf = Callable[[int, str, "Ident | None"], "dict[str, Any] | Pending"]
