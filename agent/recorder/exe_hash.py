"""Hashes of the programs that ran: sha256 and size of the file an exec ran, read through
/proc/<pid>/exe (the very file the kernel mapped: a replaced or bind-mounted path cannot lie about
it), cached by (device, inode, mtime, size, ctime) so a program run 10,000 times is hashed once.

The /proc reads go through `proc_root` (a fake tree in unit tests). A file read by its name is
read as the run's processes name it: from the run's root (`RunHashes.in_root_of`: a descriptor of
the root of its first process, taken before the command runs, in the command's own mount
namespace, where /dev/shm is the run's: openat2 RESOLVE_IN_ROOT), not as the recorder would. What a successful exec record
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

Hash work is shared fairly between runs (found by the red team: one run's 200 sparse 250 MiB
programs made every other run's execs `not_hashed: timeout`). Each run has a queue of its own
(`RunHashes`); the workers take the runs in turn, one file of a run at a time, so a run waits for at
most one file of each other run; a worker stuck on a read (a FUSE file the job serves itself) is
replaced. Each run has a budget (EVIDENCE_HASH_RUN_BYTES read, EVIDENCE_HASH_RUN_SECONDS of worker
time): past it, its execs are `not_hashed: over_budget` (cache hits are free), and an exec still
queued when its record can wait no longer (HASH_SECONDS) is `not_hashed: timeout` and is not hashed.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import dataclasses
import hashlib
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final, Literal, TypeVar, cast

from evidence.bundle.format import Degradation
from evidence.bundle.record_types import ExeHash

if TYPE_CHECKING:
    from evidence.bundle.record_types import ExecRecord, SpoolRecord

HashSource = Literal["exe", "inode", "path"]
_T = TypeVar("_T")

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
OVER_BUDGET = "over_budget"  # the run had spent its hashing budget (RUN_BYTES, RUN_SECONDS)

DEFAULT_RUN_BYTES = 4 * 1024 * 1024 * 1024  # EVIDENCE_HASH_RUN_BYTES overrides it
DEFAULT_RUN_SECONDS = 120.0  # EVIDENCE_HASH_RUN_SECONDS overrides it

# An exec's hash is given up after this long, so that a read that never returns (a FUSE file the
# job serves itself) cannot hold the run's records back for ever.
HASH_SECONDS = 10.0


@dataclasses.dataclass(frozen=True)
class FileHash:
    sha256: str | None
    size: int | None
    source: HashSource | None
    reason: str | None = None  # why not hashed

    def fields(self) -> ExeHash:
        """What an exec record says of its program file."""
        if self.sha256 is None:
            out = ExeHash(not_hashed=self.reason or UNREADABLE)
            if self.size is not None:
                out["size"] = self.size
            return out
        # (a hashed file's size and source are known; None is written as null all the same)
        return cast(ExeHash, {"sha256": self.sha256, "size": self.size, "hash_source": self.source})

    def interpreter_fields(self) -> ExeHash:
        """What a script's exec record says of its interpreter's file (`interpreter_` fields)."""
        if self.sha256 is None:
            out = ExeHash(interpreter_not_hashed=self.reason or UNREADABLE)
            if self.size is not None:
                out["interpreter_size"] = self.size
            return out
        return cast(
            ExeHash,
            {
                "interpreter_sha256": self.sha256,
                "interpreter_size": self.size,
                "interpreter_hash_source": self.source,
            },
        )


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


def run_budget_setting() -> tuple[int, float]:
    """A run's hashing budget: (bytes read, seconds of worker time), from EVIDENCE_HASH_RUN_BYTES and
    EVIDENCE_HASH_RUN_SECONDS, else the defaults."""
    out: list[float] = []
    for name, default in (
        ("EVIDENCE_HASH_RUN_BYTES", float(DEFAULT_RUN_BYTES)),
        ("EVIDENCE_HASH_RUN_SECONDS", DEFAULT_RUN_SECONDS),
    ):
        raw = os.environ.get(name, "")
        try:
            value = float(raw) if raw else default
            if value < 0:
                raise ValueError(raw)
        except ValueError:
            logger.warning("%s=%r is not a number of at least 0: %g is used", name, raw, default)
            value = default
        out.append(value)
    return int(out[0]), out[1]


_NR_OPENAT2 = 437
_RESOLVE_IN_ROOT = 0x10
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _here(root: int | None, path: str) -> bool:
    """Whether `path` is read here rather than in `root`: no root, a relative name, or a name
    through /proc (the correlator names the program of a process in a mount namespace of its own
    by its /proc/PID/root, a magic link that RESOLVE_IN_ROOT does not follow)."""
    return root is None or not path.startswith("/") or path.startswith("/proc/")


def open_in(root: int | None, path: str, flags: int) -> int:
    """Open `path` as a process whose root directory `root` is (a descriptor: openat2
    RESOLVE_IN_ROOT, so that `..` and absolute symlinks stay in it) names it; here when `_here`.
    Raises OSError."""
    if root is None or _here(root, path):
        return os.open(path, flags)
    how = _OpenHow(flags, 0, _RESOLVE_IN_ROOT)
    fd = _libc.syscall(
        _NR_OPENAT2,
        ctypes.c_int(root),
        ctypes.c_char_p(os.fsencode(path)),
        ctypes.byref(how),
        ctypes.c_size_t(24),
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return int(fd)


def _stat_in(root: int | None, path: str) -> os.stat_result:
    if _here(root, path):
        return os.stat(path)
    fd = open_in(root, path, _O_PATH | os.O_CLOEXEC)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


_O_PATH = 0o10000000


def read_head(path: str, size: int, root: int | None = None) -> tuple[bytes, os.stat_result] | None:
    """The first `size` bytes of the regular file at `path` (and its stat), None when it is not one
    or cannot be read (`root`: as open_in). Opened without blocking: the job can put a FIFO at the path of a program it
    ran (rename is atomic), and a plain open of it as root would wait for a writer for ever (found by
    the red team: `evidence run` hung after writing its bundle, the agent's hash workers for good)."""
    try:
        fd = open_in(root, path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
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
    """The interpreter a `#!` line names (its first word, as the kernel splits it: `#!/w/ok\r` runs
    `/w/ok\r`, which may be another file than `/w/ok`), or None when `head` is not a script."""
    from evidence.agent.recorder.exec_check import shebang

    bang = shebang(head)
    return os.fsdecode(bang[0]) if bang else None


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
        self._read = threading.local()  # bytes this thread read for its current exec (`read_bytes`)

    def read_bytes(self) -> int:
        """Bytes this thread has read to hash files (cache hits read none); `reset_read` starts over."""
        return int(getattr(self._read, "n", 0))

    def reset_read(self) -> None:
        self._read.n = 0

    # -- the /proc side ---------------------------------------------------------------------------

    def _exe(self, pid: int) -> str:
        return f"{self.proc_root}/{pid}/exe"

    def _matches(self, pid: int, filename: str, exe_st: os.stat_result, root: int | None = None) -> bool:
        """Whether /proc/<pid>/exe (stat `exe_st`) still names the file `filename` names: the same
        inode (a symlink, a bind mount), or the name it had when it was replaced or removed."""
        try:
            st = _stat_in(root, filename)
            if (st.st_dev, st.st_ino) == (exe_st.st_dev, exe_st.st_ino):
                return True
        except OSError:
            pass
        try:
            target = os.readlink(self._exe(pid))
        except OSError:
            return False
        target = target.removesuffix(" (deleted)")
        if not _here(root, filename):  # its name is the job's: not to be resolved here
            return target == filename
        return target in (filename, os.path.realpath(filename))

    def lookup(
        self, pid: int, filename: str, ident: Ident | None = None, root: int | None = None
    ) -> FileHash | None:
        """A cached answer for the program `pid` runs when /proc/<pid>/exe still names `filename`'s
        file, else None (not cached, a script, a process gone or moved on: see `hash`). `root`: the
        run's root (open_in)."""
        try:
            st = os.stat(self._exe(pid))
        except OSError:
            return self._gone(filename, ident, root)
        with self._lock:
            hit = self._cache.get(_key(st))
        if hit is None or not self._matches(pid, filename, st, root):
            return None
        self.stats["hits"] += 1
        return dataclasses.replace(hit, source="exe") if hit.source != "exe" else hit

    def _gone(self, filename: str, ident: Ident | None, root: int | None = None) -> FileHash | None:
        """A process gone already (most short-lived ones are, by the time their record is read): its
        file is read by path, so a cached answer for the file at that path, unless it is a script
        (whose record needs its interpreter too)."""
        try:
            st = _stat_in(root, filename)
        except OSError:
            return None
        key = _key(st)
        with self._lock:
            hit = None if key in self._scripts else self._cache.get(key)
        if hit is None:
            return None
        self.stats["hits"] += 1
        source: HashSource = "inode" if ident is not None and _ident(st) == ident else "path"
        return dataclasses.replace(hit, source=source) if hit.sha256 and hit.source != source else hit

    def hash_exec(
        self, pid: int, filename: str, ident: Ident | None = None, root: int | None = None
    ) -> ExeHash:
        """The fields a successful exec record gains (see the module's docstring). `ident`: the file
        the kernel mapped (for a script, its interpreter); `root`: the run's root (open_in)."""
        head, key = self._head(filename, root)
        interp = shebang_interpreter(head) if head else None
        if interp is not None and key is not None:
            with self._lock:
                if len(self._scripts) >= CACHE_ENTRIES:
                    self._scripts.clear()
                self._scripts.add(key)
        if interp is None:
            return self._program(pid, filename, ident, root).fields()
        # a script: the kernel runs the interpreter (/proc/<pid>/exe) with the script as argument
        out = self._file(filename, None, root).fields()
        out["interpreter"] = interp
        out.update(self._program(pid, interp, ident, root).interpreter_fields())
        return out

    def _program(
        self, pid: int, filename: str, ident: Ident | None = None, root: int | None = None
    ) -> FileHash:
        got = self._via_exe(pid, filename, root)
        if got is not None:
            return got
        by_path = self._file(filename, ident, root)  # gone, or already running something else: by its path
        if by_path.reason == UNREADABLE:
            return dataclasses.replace(by_path, reason=GONE)
        return by_path

    def _via_exe(self, pid: int, filename: str, root: int | None = None) -> FileHash | None:
        try:
            fd = os.open(self._exe(pid), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not self._matches(pid, filename, st, root):
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

    def _head(self, filename: str, root: int | None = None) -> tuple[bytes, FileKey | None]:
        head = read_head(filename, SHEBANG_MAX, root)
        return (head[0], _key(head[1])) if head is not None else (b"", None)

    def _file(self, path: str, ident: Ident | None = None, root: int | None = None) -> FileHash:
        """By its path: "inode" when it is the file `ident` says ran, else "path"."""
        try:
            fd = open_in(root, path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return FileHash(None, None, None, UNREADABLE)
        try:
            st = os.fstat(fd)
            return self._hash_fd(fd, st, "inode" if ident is not None and _ident(st) == ident else "path")
        finally:
            os.close(fd)

    def _hash_fd(self, fd: int, st: os.stat_result, source: HashSource) -> FileHash:
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
            limit = st.st_size + 1  # a byte past the size says it grew: never read a growing file on
            try:
                while size < limit and (chunk := os.pread(fd, min(_CHUNK, limit - size), size)):
                    h.update(chunk)
                    size += len(chunk)
            except OSError:
                return FileHash(None, None, None, UNREADABLE)
            finally:
                self._read.n = self.read_bytes() + size
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

    def __init__(self, future: concurrent.futures.Future[ExeHash], deadline: float | None = None) -> None:
        self.future = future
        self.deadline = time.monotonic() + HASH_SECONDS if deadline is None else deadline

    def ready(self) -> bool:
        return self.future.done() or time.monotonic() >= self.deadline

    def apply(self, rec: ExecRecord) -> None:
        try:
            # (mypy's update() takes no TypedDict with fewer keys: the fields are the record's own)
            rec.update(cast("ExecRecord", self.future.result(max(0.0, self.deadline - time.monotonic()))))
        except concurrent.futures.TimeoutError:
            logger.warning("hash of %s: given up after %.0f s", rec.get("filename"), HASH_SECONDS)
            rec["not_hashed"] = TIMEOUT
        except Exception as e:  # a hashing bug must never lose the exec record
            logger.warning("hash of %s failed: %s", rec.get("filename"), e)
            rec["not_hashed"] = UNREADABLE


PENDING: Final = "_hash"  # the key an exec record holds its Pending under until it is spooled


@dataclasses.dataclass
class _Job:
    future: concurrent.futures.Future[ExeHash]
    pid: int
    filename: str
    ident: Ident | None
    deadline: float


class RunHashes:
    """One run's side of the `Hasher`: its queue and its budget. Called as the correlator's
    `hash_of(pid, filename, ident)`: the fields at once (a cache hit, or the run over its budget),
    else a `Pending` whose file is hashed when the run's turn comes."""

    def __init__(self, owner: Hasher, name: str, max_bytes: int, max_seconds: float) -> None:
        self.owner = owner
        self.name = name
        self.max_bytes = max_bytes
        self.max_seconds = max_seconds
        self.queue: collections.deque[_Job] = collections.deque()
        self.scheduled = False  # in the owner's turn order, or a file of it being hashed
        self.closed = False
        self.spent_bytes = 0
        self.spent_seconds = 0.0
        self.not_hashed: collections.Counter[str] = collections.Counter()  # reason -> execs
        self._root = -1  # the run's root (in_root_of), -1: names are read here
        self._root_lock = threading.Lock()

    def in_root_of(self, pid: int) -> None:
        """The run's names are those process `pid` (its first, before its command runs) sees: read
        through its root directory, in its mount namespace, from now on (a descriptor held until
        the run's hashes are closed; the namespace's /dev/shm is gone once the run's last process
        is, and a name in it then names nothing). Kept as it was when the root cannot be read."""
        try:
            fd = os.open(f"/proc/{pid}/root", _O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            logger.warning("run %s: the root of process %d cannot be read: %s", self.name, pid, e.strerror)
            return
        with self._root_lock:
            old, self._root = self._root, fd
        if old >= 0:
            os.close(old)

    def _root_dup(self) -> int | None:
        """A descriptor of the run's root for one exec's reads (the caller closes it), None when
        there is none: the run's own can be closed meanwhile."""
        with self._root_lock:
            return os.dup(self._root) if self._root >= 0 else None

    def _with_root(self, read: Callable[[int | None], _T]) -> _T:
        root = self._root_dup()
        try:
            return read(root)
        finally:
            if root is not None:
                os.close(root)

    @property
    def over_budget(self) -> bool:
        return self.spent_bytes >= self.max_bytes or self.spent_seconds >= self.max_seconds

    def __call__(self, pid: int, filename: str, ident: Ident | None = None) -> ExeHash | Pending:
        hasher = self.owner.hasher
        hit = self._with_root(lambda root: hasher.lookup(pid, filename, ident, root))
        if hit is not None:
            return hit.fields()
        if self.over_budget:
            return self._skipped(pid)
        job = _Job(concurrent.futures.Future(), pid, filename, ident, time.monotonic() + HASH_SECONDS)
        self.owner.submit(self, job)
        return Pending(job.future, job.deadline)

    def _skipped(self, pid: int) -> ExeHash:
        self.not_hashed[OVER_BUDGET] += 1
        try:
            size: int | None = os.stat(f"{self.owner.hasher.proc_root}/{pid}/exe").st_size
        except OSError:
            size = None
        return FileHash(None, size, None, OVER_BUDGET).fields()

    def hash(self, job: _Job) -> None:
        """On a worker: the job's fields, unless its record has stopped waiting or the run is over
        its budget (then they say so and nothing is read)."""
        if self.closed or time.monotonic() >= job.deadline:  # the record says `timeout` already
            self.not_hashed[TIMEOUT] += 1
            job.future.set_result({"not_hashed": TIMEOUT})
            return
        if self.over_budget:
            job.future.set_result(self._skipped(job.pid))
            return
        hasher = self.owner.hasher
        hasher.reset_read()
        t0 = time.monotonic()
        try:
            job.future.set_result(
                self._with_root(lambda root: hasher.hash_exec(job.pid, job.filename, job.ident, root))
            )
        except Exception as e:  # a hashing bug must never lose the exec record (Pending.apply)
            job.future.set_exception(e)
        finally:
            self.spent_seconds += time.monotonic() - t0
            self.spent_bytes += hasher.read_bytes()

    def close(self) -> None:
        """The run is over: what is still queued is not hashed (its records were settled)."""
        self.owner.forget(self)
        with self._root_lock:
            root, self._root = self._root, -1
        if root >= 0:
            os.close(root)

    def degradation(self) -> Degradation | None:
        """What the bundle says when the budget kept execs of this run from being hashed."""
        n = self.not_hashed[OVER_BUDGET]
        if not n:
            return None
        return Degradation(
            component="exe-hash",
            reason=f"the run spent its hashing budget ({self.spent_bytes} bytes read, "
            f"{self.spent_seconds:.1f} s; at most {self.max_bytes} bytes and {self.max_seconds:g} s): "
            f"{n} program(s) run after that were not hashed",
            impact="their exec records say not_hashed: over_budget (with the size when it was known)",
        )


class Hasher:
    """The hash workers, shared by every run: `run(name)` gives a run its `RunHashes`. The workers
    take the runs with queued files in turn, one file of a run at a time (a run waits for at most
    one file of each other run, never for another run's whole queue); `workers` at most hash at once,
    not counting a worker busy longer than STUCK (on a read that does not return: another is started,
    at most one a run). Called directly it hashes for a run of its own (for callers with one run)."""

    IDLE_EXIT = 30.0  # an extra worker (beyond `workers`) ends after this long without work
    STUCK = HASH_SECONDS  # a worker on one file for longer is taken for stuck (another may start)

    def __init__(
        self,
        hasher: ExeHasher | None = None,
        workers: int = 2,
        budget: tuple[int, float] | None = None,
    ) -> None:
        self.hasher = hasher or ExeHasher()
        self.workers = workers
        self.budget = budget if budget is not None else run_budget_setting()
        self._cond = threading.Condition()
        self._turns: collections.deque[RunHashes] = collections.deque()  # runs with files to hash
        self._runs = 0  # runs not closed
        self._threads = 0
        self._idle = 0
        self._busy: dict[int, float] = {}  # worker thread id -> when its current file began
        self._closed = False
        self._own: RunHashes | None = None

    def run(self, name: str) -> RunHashes:
        with self._cond:
            self._runs += 1
        return RunHashes(self, name, *self.budget)

    def __call__(self, pid: int, filename: str, ident: Ident | None = None) -> ExeHash | Pending:
        if self._own is None:
            self._own = self.run("-")
        return self._own(pid, filename, ident)

    def submit(self, run: RunHashes, job: _Job) -> None:
        with self._cond:
            run.queue.append(job)
            if not run.scheduled:
                run.scheduled = True
                self._turns.append(run)
            self._wake()

    def forget(self, run: RunHashes) -> None:
        with self._cond:
            if run.closed:
                return
            run.closed = True
            self._runs -= 1
            dropped = list(run.queue)
            run.queue.clear()
            with_turn = run in self._turns
            if with_turn:
                self._turns.remove(run)
                run.scheduled = False
        for job in dropped:
            run.not_hashed[TIMEOUT] += 1
            job.future.set_result({"not_hashed": TIMEOUT})

    def _wake(self) -> None:
        """Under the lock: a worker for the next turn, an idle one or a new one."""
        if not self._turns:
            return
        if self._idle:
            self._cond.notify()
            return
        now = time.monotonic()
        working = sum(1 for since in self._busy.values() if now - since < self.STUCK)
        if working < self.workers and self._threads < self.workers + max(self._runs, 1):
            self._threads += 1
            threading.Thread(target=self._work, name="exe-hash", daemon=True).start()

    def _work(self) -> None:
        me = threading.get_ident()
        while True:
            with self._cond:
                while not self._turns and not self._closed:
                    self._idle += 1
                    extra = self._threads > self.workers
                    woken = self._cond.wait(self.IDLE_EXIT if extra else None)
                    self._idle -= 1
                    if not woken and extra and not self._turns:
                        self._threads -= 1
                        return
                if self._closed:
                    self._threads -= 1
                    return
                run = self._turns.popleft()
                job = run.queue.popleft()
                self._busy[me] = time.monotonic()
            try:
                run.hash(job)
            except Exception:  # a bug: the job's future may never be set; its deadline applies
                logger.exception("hashing %s failed", job.filename)
            finally:
                with self._cond:
                    del self._busy[me]
                    if run.queue and not run.closed:
                        self._turns.append(run)  # at the back: the other runs go first
                    else:
                        run.scheduled = False
                    self._wake()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def settle(recs: Sequence[SpoolRecord | bytes], wait: bool = False) -> int:
    """Fill in the hashes that are ready (all of them with `wait`, each within its deadline) and return
    how many of `recs`, from the start, can be spooled now: records stay in order, so those after a
    pending one wait too. (An item that is bytes is an open's spool line: it waits for nothing.)"""
    for i, rec in enumerate(recs):
        if isinstance(rec, bytes) or rec["k"] != "exec":  # only an exec's record waits for a hash
            continue
        pending = rec.get(PENDING)
        if not isinstance(pending, Pending):  # None: its fields are there already
            continue
        if not wait and not pending.ready():
            return i
        del rec[PENDING]
        pending.apply(rec)
    return len(recs)


HashOf = Callable[[int, str, "Ident | None"], "ExeHash | Pending"]
