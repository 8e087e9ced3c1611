"""What an exec would run, read from the caller and resolved as the kernel will (issue 24): the
exec supervisor's (exec_supervisor.py) first step on each notification.

`read_request` reads the path and argv from the caller's memory (process_vm_readv, a page at a
time, each page read once per request; /proc/PID/mem when process_vm_readv is refused) and
resolves what they name for the caller: relative to its cwd or to the execveat descriptor,
`/proc/self/...` as the caller's own, symlinks resolved through the caller's root; a `#!` line's
interpreter; the program the dynamic loader run as a program would load. It also says by whose
identity the kernel's check (exec_check.py) will know the file: (st_dev, st_ino) of what the name
leads to in the caller's own root and mount namespace (openat2 RESOLVE_IN_ROOT), and `foreign`
when that is not the file the same name leads to here (a mount namespace or chroot of the job's
own, a bind mount in it: the name says nothing of what runs).

`proc_depth` is the caller's depth in the run's process tree (forks below the run's first
process), from /proc's parent links.

Everything here reads the caller while its notification is pending; the supervisor checks that it
still is (SECCOMP_IOCTL_NOTIF_ID_VALID) before it acts on what was read.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import stat
import struct
import threading
from dataclasses import dataclass
from typing import Any

from evidence.agent.recorder.exec_check import bprm_filename, shebang
from evidence.bundle import native
from evidence.probes.abi import script_argv

# The kernel ABI, x86_64
NR_EXECVE = 59
NR_EXECVEAT = 322
AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000

MAX_ARGC = 1000  # arguments read before the argv counts as truncated
MAX_ARGV_BYTES = 65536
PATH_MAX = 4096
PAGE = 4096
HEAD = 256  # bytes of a program read for its `#!` line (fs/binfmt_script.c: BINPRM_BUF_SIZE)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_readv.argtypes = [
    ctypes.c_int,
    ctypes.POINTER(_IoVec),
    ctypes.c_ulong,
    ctypes.POINTER(_IoVec),
    ctypes.c_ulong,
    ctypes.c_ulong,
]
_libc.syscall.restype = ctypes.c_long
_PTR = struct.Struct("=Q")


def read_memory(pid: int, addr: int, size: int) -> bytes:
    """Up to `size` bytes of the caller's memory at `addr` (fewer at the end of a mapping)."""
    buf = ctypes.create_string_buffer(size)
    local, remote = _IoVec(ctypes.cast(buf, ctypes.c_void_p), size), _IoVec(addr, size)
    n = _libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if n > 0:
        return buf.raw[:n]
    # a range crossing into an unmapped page, or process_vm_readv refused: /proc/PID/mem reads
    # what is there up to the first unreadable byte
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return b""
    try:
        return os.pread(fd, size, addr)
    except (OSError, OverflowError):  # OverflowError: an address past a signed offset (the job's)
        return b""
    finally:
        os.close(fd)


def compiled() -> Any:
    """The exec supervisor's C (src/fast/_exec.c: the usual request, its wait, an allowed exec's
    answer), or None (bundle/native.py): the Python path, which it matches, then does it all."""
    return native.compiled("evidence.agent.recorder._exec")


_fast = compiled()

_PREFETCH = 2  # pages prefetched at once
_local = threading.local()


def _prefetch_buffers() -> tuple[ctypes.Array[ctypes.c_char], ctypes.Array[_IoVec], ctypes.Array[_IoVec]]:
    """This thread's buffers for `CallerMemory.prefetch`, made once (a supervisor reads on one)."""
    got = getattr(_local, "buffers", None)
    if got is None:
        buf = ctypes.create_string_buffer(PAGE * _PREFETCH)
        local = (_IoVec * _PREFETCH)(
            *(_IoVec(ctypes.addressof(buf) + i * PAGE, PAGE) for i in range(_PREFETCH))
        )
        got = _local.buffers = (buf, local, (_IoVec * _PREFETCH)())
    return got


class CallerMemory:
    """One request's view of the caller's memory, read a whole page at a time and each page once
    (a path, the argv array and its strings usually share one or two pages)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._pages: dict[int, bytes] = {}

    def prefetch(self, *addrs: int) -> None:
        """Read the pages holding `addrs` in one process_vm_readv (what a request needs first: the
        path's page and the argv array's); a page that cannot be read so is left to `page`."""
        bases = sorted({a & ~(PAGE - 1) for a in addrs if a} - self._pages.keys())
        if not bases or len(bases) > _PREFETCH:
            return
        n = len(bases)
        buf, local, remote = _prefetch_buffers()
        for i, b in enumerate(bases):
            remote[i].base, remote[i].len = b, PAGE
        got = _libc.process_vm_readv(self.pid, local, n, remote, n, 0)
        if got <= 0:
            return
        raw = buf.raw
        for i in range(got // PAGE):  # whole pages, in order, up to the first that failed
            self._pages[bases[i]] = raw[i * PAGE : (i + 1) * PAGE]

    def page(self, addr: int) -> bytes:
        """The page holding `addr` (b"" when it cannot be read)."""
        base = addr & ~(PAGE - 1)
        got = self._pages.get(base)
        if got is None:
            got = self._pages[base] = read_memory(self.pid, base, PAGE)
        return got

    def string(self, addr: int, limit: int = PATH_MAX) -> tuple[bytes, bool]:
        """A NUL-terminated string, and whether it was cut at `limit`."""
        parts: list[bytes] = []
        got = 0
        while got < limit:
            at = addr + got
            page = self.page(at)
            off = at & (PAGE - 1)
            if len(page) <= off:
                raise OSError(errno.EFAULT, "bad address in the caller")
            chunk = page[off : off + (limit - got)]
            end = chunk.find(b"\0")
            if end >= 0:
                parts.append(chunk[:end])
                return b"".join(parts), False
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts), True

    def pointer(self, addr: int) -> int:
        off = addr & (PAGE - 1)
        page = self.page(addr)
        if off + 8 <= len(page):
            return int(_PTR.unpack_from(page, off)[0])
        raw = page[off:] + self.page(addr + 8 - 1)[: off + 8 - PAGE]  # across two pages
        if len(raw) != 8:
            raise OSError(errno.EFAULT, "bad argv in the caller")
        return int(_PTR.unpack(raw)[0])

    def argv(self, addr: int) -> tuple[list[bytes], bool]:
        """argv (a NULL-terminated array of pointers) and whether it was cut at MAX_ARGC or
        MAX_ARGV_BYTES."""
        if addr == 0:
            return [], False
        argv: list[bytes] = []
        total = 0
        for i in range(MAX_ARGC + 1):
            ptr = self.pointer(addr + 8 * i)
            if ptr == 0:
                return argv, False
            if i == MAX_ARGC:
                break
            arg, cut = self.string(ptr, min(PATH_MAX * 32, MAX_ARGV_BYTES - total))
            argv.append(arg)
            total += len(arg) + 1
            if cut or total >= MAX_ARGV_BYTES:
                break
        return argv, True


@dataclass(frozen=True)
class ExecRequest:
    """What an exec asks for, as the supervisor read and resolved it."""

    pid: int
    path: str  # as passed (decoded with surrogateescape)
    program: str  # absolute, symlinks resolved in the caller's root
    argv: tuple[str, ...]
    truncated: bool
    interpreter: str | None = None  # a `#!` script's interpreter, resolved likewise
    # the caller's name leads to another file (or none) for it than `program` is here: a mount
    # namespace or chroot of the job's own, a bind mount in it; the name cannot be trusted
    foreign: bool = False
    loads: str | None = None  # the program the dynamic loader run as a program would load
    # the argv the kernel gives a `#!` script's interpreter (its arguments are judged in it: the
    # line's optional argument, the script's name, then argv[1:])
    interpreter_argv: tuple[str, ...] = ()
    # the `#!` interpreter's name leads to another file (or none) for the caller than
    # `interpreter` is here (a bind mount in a namespace of the job's own): as `foreign`
    interpreter_foreign: bool = False
    # the loader opens `loads` by name after the exec, where nothing checks what it opened: the
    # name is trusted only when the job cannot change where it leads (`stable_name`); otherwise
    # it counts as `foreign`
    loads_foreign: bool = False
    # the arguments the loader's program gets (what follows it in the loader's argv: for a `#!`
    # script whose interpreter is the loader, in the argv the kernel makes)
    loads_argv: tuple[str, ...] = ()
    # for the no-race check (exec_check.py): how the call named the file, the file it names for the
    # caller (st_dev, st_ino), and a `#!` line's (interpreter, argument) as the kernel splits them,
    # with the interpreter's identity
    dirfd: int = AT_FDCWD
    empty_path: bool = False
    identity: tuple[int, int] | None = None
    shebang: tuple[bytes, bytes | None] | None = None
    interpreter_identity: tuple[int, int] | None = None


_LDSO_WITH_ARG = frozenset(
    (
        "--library-path",
        "--preload",
        "--argv0",
        "--audit",
        "--inhibit-rpath",
        "--glibc-hwcaps-prepend",
        "--glibc-hwcaps-mask",
    )
)


def is_dynamic_loader(program: str) -> bool:
    name = program.rsplit("/", 1)[-1]
    return name.startswith("ld-linux") or (name.startswith("ld-") and ".so" in name) or name == "ld.so"


def loader_payload(argv: tuple[str, ...]) -> str | None:
    """The program `ld.so [OPTIONS] PROGRAM [ARGS]` runs: the first argument after its options."""
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return argv[i + 1] if i + 1 < len(argv) else None
        if not arg.startswith("--"):
            return arg
        i += 2 if arg in _LDSO_WITH_ARG else 1
    return None


def _decode(b: bytes) -> str:
    return b.decode("utf-8", "surrogateescape")


def resolve(pid: int, path: str, dirfd: int, empty_path: bool, root: str | None = None) -> str:
    """The absolute path, symlinks resolved, of what `path` names for the caller (`root`: its
    /proc/PID/root, read when not given)."""
    if empty_path and not path:
        base = f"/proc/{pid}/fd/{dirfd}"
        return os.readlink(base) if os.path.islink(base) else base
    path = _caller_path(pid, path)
    if not path.startswith("/"):
        base = f"/proc/{pid}/cwd" if dirfd == AT_FDCWD else f"/proc/{pid}/fd/{dirfd}"
        path = os.path.join(os.readlink(base), path)
    if root is None:
        root = os.readlink(f"/proc/{pid}/root")
    if root == "/":
        return os.path.realpath(path)
    return os.path.realpath(root + path)  # a caller in a chroot: its names, on this side


_NR_OPENAT2 = 437
_RESOLVE_IN_ROOT = 0x10
_O_PATH = 0o10000000


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _openat2(dirfd: int, path: str, resolve: int) -> int:
    how = _OpenHow(_O_PATH | os.O_CLOEXEC, 0, resolve)
    fd = _libc.syscall(
        _NR_OPENAT2,
        ctypes.c_int(dirfd),
        ctypes.c_char_p(os.fsencode(path)),
        ctypes.byref(how),
        ctypes.c_size_t(ctypes.sizeof(how)),
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(fd)


def _caller_path(pid: int, path: str) -> str:
    """`path` with `/proc/self/` and `/proc/thread-self/` made the caller's (`pid`, a thread id), not
    the supervisor's, as the kernel reads them for it: its process's (/proc/TGID/: a thread with
    descriptors or a cwd of its own, after unshare, still names its process's) and its thread's
    (/proc/TGID/task/TID/). Other spellings of them (`/proc/./self`, a link to /proc/self) are read
    as the supervisor's own: the file the kernel loads is not the one decided on, and the exec
    check kills it."""
    if path.startswith("//"):  # the same name for the kernel
        path = "/" + path.lstrip("/")
    if path.startswith("/proc/self/"):
        return f"/proc/{_tgid(pid) or pid}/" + path[len("/proc/self/") :]
    if path.startswith("/proc/thread-self/"):
        return f"/proc/{_tgid(pid) or pid}/task/{pid}/" + path[len("/proc/thread-self/") :]
    return path


def _open_for_caller(pid: int, path: str, dirfd: int) -> int:
    """An O_PATH descriptor of the file `path` names for the caller, resolved in its own root and
    mount namespace (openat2 RESOLVE_IN_ROOT from /proc/PID/root, or from its cwd or descriptor
    for a relative name). Raises OSError when it names nothing."""
    if path.startswith("/"):
        base, how = f"/proc/{pid}/root", _RESOLVE_IN_ROOT
    else:
        base, how = (f"/proc/{pid}/cwd" if dirfd == AT_FDCWD else f"/proc/{pid}/fd/{dirfd}"), 0
    dfd = os.open(base, _O_PATH | os.O_CLOEXEC)
    try:
        return _openat2(dfd, path, how)
    finally:
        os.close(dfd)


def caller_identity(pid: int, path: str, dirfd: int, empty_path: bool) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the file `path` names for the caller, resolved in its own root and mount
    namespace; None when it names nothing."""
    try:
        if empty_path and not path:
            st = os.stat(f"/proc/{pid}/fd/{dirfd}")
            return st.st_dev, st.st_ino
        fd = _open_for_caller(pid, path, dirfd)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        return st.st_dev, st.st_ino
    except OSError:
        return None


_own_mntns: list[int] = []


def _our_mount_namespace() -> int:
    """The inode of this process's mount namespace (0 when it cannot be read: no caller's is)."""
    if not _own_mntns:
        try:
            _own_mntns.append(os.stat("/proc/self/ns/mnt").st_ino)
        except OSError:
            return 0
    return _own_mntns[0]


def _in_our_mount_namespace(pid: int) -> bool:
    """Whether the caller's mount namespace is this process's: only then does a name it passes
    lead where the same name leads here (a job can make a namespace of its own and bind another
    program over an allowed one's name)."""
    try:
        ours = _our_mount_namespace()
        return ours != 0 and os.stat(f"/proc/{pid}/ns/mnt").st_ino == ours
    except OSError:
        return False


_STATX_INO = 0x100
_STATX_MNT_ID = 0x1000
_STATX = struct.Struct("=I28xQ96xIIQ")  # struct statx: mask, ino, dev major/minor, mnt_id
_own_root_mount: list[tuple[int, int, int]] = []
_libc.statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]


def root_mount(path: str) -> tuple[int, int, int]:
    """(st_dev, st_ino, mount id) of the directory `path` leads to (statx STATX_MNT_ID): a process's
    root and the mount it is on, through /proc/PID/root. Raises OSError."""
    buf = ctypes.create_string_buffer(256)
    if _libc.statx(AT_FDCWD, os.fsencode(path), 0, _STATX_INO | _STATX_MNT_ID, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    mask, ino, major, minor, mnt = _STATX.unpack_from(buf.raw)
    if not mask & _STATX_MNT_ID:  # before Linux 5.8: no mount id, never taken for ours
        mnt = -1
    return os.makedev(major, minor), ino, mnt


def _our_root_mount() -> tuple[int, int, int]:
    """root_mount of this process's root."""
    if not _own_root_mount:
        _own_root_mount.append(root_mount("/"))
    return _own_root_mount[0]


def forget_own_root() -> None:
    """This process has moved into another mount namespace (exec_process.join_mount_namespace):
    its root and namespace are read again when next needed."""
    _own_root_mount.clear()
    _own_mntns.clear()


def identity(path: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of `path` here, None when it names nothing."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _head(pid: int, program: str) -> bytes:
    """The first HEAD bytes of the program, read in the caller's root (b"": unreadable, or not a
    regular file)."""
    try:
        fd = os.open(f"/proc/{pid}/root{program}", _O_PATH | os.O_CLOEXEC)
    except OSError:
        return b""
    try:
        return _head_of(fd)
    finally:
        os.close(fd)


# (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns) -> the file's head, for _head_of: a program
# run again is not read again. A write changes the size or the times, but within one tick of the
# kernel's coarse clock it may not: a head read before such a write could be stale, and then the
# kernel's exec check (exec_check.py), which compares the file the kernel loads (a script's
# interpreter, or the file itself) with the pin, kills the exec: stale is refused, never let run
_HEADS: dict[tuple[int, int, int, int, int], bytes] = {}
_HEADS_MAX = 4096


def _head_of(fd: int, st: os.stat_result | None = None) -> bytes:
    """The first HEAD bytes of the file an O_PATH descriptor names (`st`: its fstat, when taken;
    b"": unreadable, or not a regular file: the job names what it likes, and opening a device or a
    FIFO can act or block, so only a regular file is opened for reading, through the descriptor
    that named it)."""
    try:
        if st is None:
            st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return b""
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        head = _HEADS.get(key)
        if head is not None:
            return head
        readable = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return b""
    try:
        head = os.read(readable, HEAD)
    except OSError:
        return b""
    finally:
        os.close(readable)
    if len(_HEADS) >= _HEADS_MAX:
        _HEADS.clear()
    _HEADS[key] = head
    return head


def _interpreter(pid: int, bang: tuple[bytes, bytes | None] | None, root: str) -> str | None:
    """A `#!` line's interpreter (`bang`: the line as the kernel splits it, exec_check.shebang),
    resolved for the caller (the name the rules judge). Split as the kernel splits it, and only so:
    `#!/w/ok\r` runs `/w/ok\r`, which the job may have made a link to another program than
    `/w/ok` (and a NUL ends the name, as it does for the kernel)."""
    if bang is None:
        return None
    return resolve(pid, _decode(bang[0]), AT_FDCWD, False, root)


def _root_owned_dirs(path: str) -> bool:
    """Whether every directory from / down to `path`'s own (followed: what a name's walk enters)
    belongs to root and is writable by nobody else (no group or other write, sticky or not)."""
    d = path
    while True:
        d = os.path.dirname(d)
        try:
            st = os.stat(d)
        except OSError:
            return False
        if st.st_uid != 0 or st.st_mode & 0o022:
            return False
        if d == "/":
            return True


def stable_name(written: str, resolved: str) -> bool:
    """Whether the job cannot change, after its exec was decided, which file the absolute name
    `written` (resolved here to `resolved`) leads to: every directory on both paths is root's and
    writable by nobody else, and neither is under /proc or /dev (a descriptor's magic link, which
    another thread can point elsewhere). A relative name is not stable (a process sharing the
    caller's cwd can move it). The caller must be in our root and mount namespace (one of the
    job's own can mount over any name at any time)."""
    if not written.startswith("/"):
        return False
    for name in (written, resolved):
        norm = "/" + os.path.normpath(name).lstrip("/")  # `//proc` is /proc (normpath keeps it)
        if norm.startswith(("/proc/", "/dev/")) or not _root_owned_dirs(norm):
            return False
    return True


def _loads(pid: int, program: str, argv: tuple[str, ...], root: str) -> str | None:
    if not is_dynamic_loader(program):
        return None
    payload = loader_payload(argv)
    if payload is None:
        return None
    try:
        return resolve(pid, payload, AT_FDCWD, False, root)
    except OSError:
        return payload  # a name that cannot be resolved is judged as written


# (raw path, raw argv, the file's name here, its st_dev and st_ino, its first bytes)
Usual = tuple[bytes, list[bytes], bytes, int, int, bytes]


def read_usual(pid: int, nr: int, args: tuple[int, ...]) -> Usual | None:
    """The usual request, read and resolved in C (src/fast/_exec.c read_usual) as read_request
    does it: an execve of an absolute name, argv whole, by a caller whose root is ours, naming a
    file of a name of its own; None for any other (read_request's other ways)."""
    if nr != NR_EXECVE or _fast is None:
        return None
    got: Usual | None = _fast.read_usual(pid, args[0], args[1], *usual_context())
    return got


def usual_context() -> tuple[int, int, int, dict[tuple[int, int, int, int, int], bytes], int]:
    """What src/fast/_exec.c's read_usual takes besides the request: our root's (st_dev, st_ino,
    mount id) and the heads cache with its bound (for the supervisor's `next_usual`)."""
    return (*_our_root_mount(), _HEADS, _HEADS_MAX)


def usual_request(pid: int, got: Usual) -> ExecRequest:
    """The request of a `read_usual`."""
    raw_path, raw_argv, named, dev, ino, head = got
    return _request(pid, raw_path, raw_argv, False, AT_FDCWD, False, "/", _decode(named), (dev, ino), head)


def read_request(pid: int, nr: int, args: tuple[int, ...]) -> ExecRequest:
    """Read and resolve what the exec system call `nr` with arguments `args` of thread `pid` asks
    for (raises OSError when it cannot be read)."""
    if nr == NR_EXECVE:
        dirfd, path_addr, argv_addr, flags = AT_FDCWD, args[0], args[1], 0
    elif nr == NR_EXECVEAT:
        dirfd = ctypes.c_int32(args[0] & 0xFFFFFFFF).value
        path_addr, argv_addr, flags = args[1], args[2], args[4]
    else:
        raise OSError(errno.ENOSYS, f"system call {nr} is not an exec")
    got = read_usual(pid, nr, args)
    if got is not None:  # the usual request, read and resolved in C as below
        return usual_request(pid, got)
    memory = CallerMemory(pid)
    memory.prefetch(path_addr, argv_addr)
    raw_path, cut = memory.string(path_addr)
    if cut:
        raise OSError(errno.ENAMETOOLONG, "path too long")
    raw_argv, truncated = memory.argv(argv_addr)
    path = _decode(raw_path)
    empty = bool(flags & AT_EMPTY_PATH)
    if root_mount(f"/proc/{pid}/root") == _our_root_mount() and not (empty and not path):
        # the usual caller: its root is ours, the same directory on the same mount (so the same
        # mounts below it: a mount namespace of its own has its own root mount), so the file the
        # kernel's own walk reaches for it (openat2) is named by that walk (d_path: what realpath
        # computes with a stat per component) and its head is read through the same descriptor
        root = "/"
        program, theirs, head = _resolve_as_ours(pid, path, dirfd)
    else:
        root = os.readlink(f"/proc/{pid}/root")
        program = resolve(pid, path, dirfd, empty, root)
        theirs = caller_identity(pid, path, dirfd, empty)
        head = _head(pid, program)
    return _request(pid, raw_path, raw_argv, truncated, dirfd, empty, root, program, theirs, head)


def _request(
    pid: int,
    raw_path: bytes,
    raw_argv: list[bytes],
    truncated: bool,
    dirfd: int,
    empty: bool,
    root: str,
    program: str,
    theirs: tuple[int, int] | None,
    head: bytes,
) -> ExecRequest:
    """The request of what was read (`raw_path`, `raw_argv`) and resolved (`program` in the
    caller's `root`, `theirs` its identity for the caller, `head` its first bytes)."""
    path = _decode(raw_path)
    argv = tuple(_decode(a) for a in raw_argv)
    bang = shebang(head)
    interpreter = _interpreter(pid, bang, root)
    interpreter_identity = caller_identity(pid, _decode(bang[0]), AT_FDCWD, False) if bang else None
    # what the loader is given: the caller's argv, or, when the loader is a script's interpreter,
    # the kernel's rewrite (`#!/lib64/ld-linux-x86-64.so.2 /usr/bin/id` runs id)
    runs, loader_argv = program, argv
    interpreter_argv: tuple[str, ...] = ()
    if bang is not None and interpreter is not None:
        filename = bprm_filename(raw_path, dirfd, empty)
        runs = interpreter
        interpreter_argv = tuple(
            _decode(a) for a in script_argv(bang[0], bang[1], filename, raw_argv or [b""])
        )
        loader_argv = interpreter_argv
    loads = _loads(pid, runs, loader_argv, root)
    payload = loader_payload(loader_argv) if loads is not None else None
    return ExecRequest(
        pid=pid,
        path=path,
        program=program,
        argv=argv,
        truncated=truncated,
        interpreter=interpreter,
        foreign=theirs is None or theirs != identity(program),
        loads=loads,
        dirfd=dirfd,
        empty_path=empty,
        identity=theirs,
        shebang=bang,
        interpreter_identity=interpreter_identity,
        interpreter_argv=interpreter_argv,
        interpreter_foreign=interpreter is not None
        and (interpreter_identity is None or interpreter_identity != identity(interpreter)),
        loads_foreign=loads is not None
        and not (
            root == "/"
            and _in_our_mount_namespace(pid)
            and stable_name(_caller_path(pid, payload or ""), loads)
        ),
        loads_argv=loader_argv[loader_argv.index(payload) :] if payload is not None else (),
    )


def _resolve_as_ours(pid: int, path: str, dirfd: int) -> tuple[str, tuple[int, int] | None, bytes]:
    """(program, the caller's identity of it, its head) for a caller whose root is ours (an
    absolute name walks from it as from ours), from one openat2 of the name (a plain walk, as the
    kernel's for the caller: magic links such as /proc/PID/exe followed); a name that leads
    nowhere is resolved as `resolve` does (it names no file: the supervisor fails it as the kernel
    would)."""
    name = _caller_path(pid, path)
    try:
        fd = _openat2(AT_FDCWD, name, 0) if name.startswith("/") else _open_for_caller(pid, name, dirfd)
    except OSError:
        return resolve(pid, path, dirfd, False, "/"), None, b""
    try:
        st = os.fstat(fd)
        named = os.readlink(f"/proc/self/fd/{fd}")
        if not named.startswith("/") or named.endswith(" (deleted)"):
            named = resolve(pid, path, dirfd, False, "/")  # no name of its own: as written
        return named, (st.st_dev, st.st_ino), _head_of(fd, st)
    finally:
        os.close(fd)


def proc_depth(pid: int, root: int) -> int:
    """Forks between `root` (depth 0) and `pid` (a thread id), from /proc's parent links; -1 when not
    below it. A thread of `root` other than its first is `root` (depth 0): its parent link is its
    process's, which leads past `root`."""
    depth = _walk(pid, root)
    if depth < 0 and _tgid(pid) == root:
        return 0
    return depth


def _tgid(tid: int) -> int | None:
    """The process thread `tid` is of (None: gone)."""
    try:
        with open(f"/proc/{tid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _walk(pid: int, root: int) -> int:
    depth = 0
    while pid != root:
        try:
            fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return -1
        try:
            stat = os.read(fd, 1024)
        except OSError:
            return -1
        finally:
            os.close(fd)
        pid = int(stat[stat.rindex(b")") + 2 :].split(maxsplit=2)[1])
        depth += 1
        if pid <= 1:
            return -1
    return depth
