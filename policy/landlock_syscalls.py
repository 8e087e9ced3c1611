"""Landlock, no_new_privs, network namespaces and signal dispositions as plain system calls: standard library only.

The command launcher (agent/recorder/exec_helper.py) runs this in the process that becomes the
command, before it execs; it must start fast and touch nothing else, so this module imports nothing
of evidence's and no third-party package. policy/landlock.py plans what to restrict; this applies it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections.abc import Iterable

# Syscall numbers (the same on every architecture that has Landlock, from the generic table).
SYS_LANDLOCK_CREATE_RULESET = 444
SYS_LANDLOCK_ADD_RULE = 445
SYS_LANDLOCK_RESTRICT_SELF = 446
LANDLOCK_CREATE_RULESET_VERSION = 1 << 0
LANDLOCK_RULE_PATH_BENEATH = 1
PR_SET_NO_NEW_PRIVS = 38
PR_SET_DUMPABLE = 4
PR_GET_DUMPABLE = 3
CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1

# Scopes (ABI 6): a scoped domain cannot signal, or connect to abstract unix sockets of, processes
# outside it; a Landlock domain also confines ptrace to itself and the domains nested in it.
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0
SCOPE_SIGNAL = 1 << 1


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_prctl = _libc.prctl
_prctl.restype = ctypes.c_int
_setns = _libc.setns
_setns.argtypes = [ctypes.c_int, ctypes.c_int]
_setns.restype = ctypes.c_int
_unshare = _libc.unshare
_unshare.argtypes = [ctypes.c_int]
_unshare.restype = ctypes.c_int


def _errno_error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def abi_version() -> int:
    """The Landlock ABI the kernel offers; 0 when Landlock is missing or disabled."""
    res = _syscall(
        ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET),
        None,
        ctypes.c_size_t(0),
        ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION),
    )
    return int(res) if res > 0 else 0


def _attr_size(abi: int) -> int:
    if abi >= 6:
        return 24
    if abi >= 4:
        return 16
    return 8


def no_new_privs() -> None:
    if _prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise _errno_error("prctl(PR_SET_NO_NEW_PRIVS)")


def not_dumpable() -> None:
    """Make the calling process non-dumpable: a process of the same uid can no longer ptrace it
    or read its memory through /proc (until it execs a new program)."""
    if _prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise _errno_error("prctl(PR_SET_DUMPABLE)")


_RT_SIGACTION = {"x86_64": 13, "aarch64": 134}.get(os.uname().machine)


def default_disposition(sig: int) -> None:
    """Set a signal to SIG_DFL with the raw system call: the C library refuses the signals it keeps
    for itself (32 and 33 in glibc), which Python's subprocess leaves ignored in a vfork'd child."""
    if _RT_SIGACTION is None:
        return
    act = (ctypes.c_ulong * 4)(0, 0, 0, 0)  # handler SIG_DFL, flags, restorer, mask
    _syscall(ctypes.c_long(_RT_SIGACTION), ctypes.c_int(sig), ctypes.byref(act), None, ctypes.c_size_t(8))


# seccomp: a filter that refuses the two ioctls that push input into a terminal (TIOCSTI) or act on
# the console (TIOCLINUX). A job that shares evidence's controlling terminal could otherwise type a
# command into the shell that started `evidence run`, which runs it outside the run, as its user
# (CVE-2017-5226 in bubblewrap). Landlock does not cover ioctls on descriptors the job inherited.
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
_AUDIT_ARCH_X86_64, _AUDIT_ARCH_I386 = 0xC000003E, 0x40000003
_IOCTL = {_AUDIT_ARCH_X86_64: (16, 0x40000000 | 514), _AUDIT_ARCH_I386: (54,)}  # x86_64, x32; i386
TTY_INJECTION = (0x5412, 0x541C)  # TIOCSTI, TIOCLINUX


class SockFilter(ctypes.Structure):
    """struct sock_filter: one classic BPF instruction (a seccomp filter's)."""

    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


Insn = tuple[int, int, int, int]  # a classic BPF instruction: (code, jt, jf, k)
_LD, _JEQ, _RET = 0x20, 0x15, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_RET|K
_ALLOW, _DENY = 0x7FFF0000, 0x00050000 | errno.EPERM  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO(EPERM)


def _calls(table: dict[int, tuple[int, ...]], match_at: int, other_at: int) -> list[Insn]:
    """The program's head, from index 0: per architecture `ld arch; jeq arch; ld nr; jeq nr...`. A
    call `table` lists for its architecture jumps to `match_at`, any other call (or architecture) to
    `other_at` (absolute indexes, after the head)."""
    blocks = list(table.items())
    prog: list[Insn] = []
    at = 0
    for n, (arch, nrs) in enumerate(blocks):
        nxt = at + 3 + len(nrs)
        other = nxt if n < len(blocks) - 1 else other_at  # another architecture: the next block
        prog.append((_LD, 0, 0, 4))  # seccomp_data.arch
        prog.append((_JEQ, 0, other - (at + 2), arch))
        prog.append((_LD, 0, 0, 0))  # seccomp_data.nr
        for i, nr in enumerate(nrs):
            here = at + 3 + i
            last = i == len(nrs) - 1
            prog.append((_JEQ, match_at - (here + 1), (other_at - (here + 1)) if last else 0, nr))
        at = nxt
    return prog


def _head_size(table: dict[int, tuple[int, ...]]) -> int:
    return sum(3 + len(nrs) for nrs in table.values())


def tty_filter() -> list[Insn]:
    """Refuses (EPERM) the ioctls TTY_INJECTION lists; everything else is allowed."""
    check = _head_size(_IOCTL)  # the ioctl's command is checked there
    allow_at, deny_at = check + 1 + len(TTY_INJECTION), check + 2 + len(TTY_INJECTION)
    prog = _calls(_IOCTL, check, allow_at)
    prog.append((_LD, 0, 0, 24))  # low half of seccomp_data.args[1]: the ioctl's command
    for i, cmd in enumerate(TTY_INJECTION):
        prog.append((_JEQ, deny_at - (check + 1 + i + 1), 0, cmd))
    return [*prog, (_RET, 0, 0, _ALLOW), (_RET, 0, 0, _DENY)]


# seccomp: a filter that refuses io_uring_setup. io_uring operations (IORING_OP_OPENAT, CONNECT,
# RENAMEAT, ...) run in the kernel without system calls of their own, so the syscall tracepoints the
# recorder uses never see them: a job could open, write and connect unrecorded. Docker's and
# containerd's default seccomp profiles refuse it too; programs fall back to plain system calls.
_AUDIT_ARCH_AARCH64 = 0xC00000B7
_IO_URING_SETUP = {
    _AUDIT_ARCH_X86_64: (425, 0x40000000 | 425),  # x86_64, x32
    _AUDIT_ARCH_I386: (425,),
    _AUDIT_ARCH_AARCH64: (425,),
}


def deny_filter(table: dict[int, tuple[int, ...]]) -> list[Insn]:
    """Refuses (EPERM) the system calls `table` lists per architecture (AUDIT_ARCH -> numbers);
    everything else is allowed."""
    allow_at = _head_size(table)
    return [*_calls(table, allow_at + 1, allow_at), (_RET, 0, 0, _ALLOW), (_RET, 0, 0, _DENY)]


# seccomp: a filter that refuses every system call made through a compatibility entry: the i386 ABI
# (`int $0x80`, `sysenter`, or `syscall` from 32-bit code, which a 64-bit program can use as well as
# a 32-bit one), x32 (the x86_64 entry with bit 30 of the number set) and 32-bit ARM on arm64. The
# kernel's syscalls:* tracepoints skip such calls (ftrace takes their numbers for another table's),
# so a job could open, write, exec and connect through them with nothing recorded. The call is not
# made: the thread gets SIGSYS (SECCOMP_RET_TRAP: si_code SYS_SECCOMP, si_arch, si_syscall), which
# kills it unless it handles SIGSYS, and the recorder's probe on signal_generate records the attempt.
# Only the native architectures' own entries pass.
_AUDIT_ARCH_ARM = 0x40000028
X32_SYSCALL_BIT = 0x40000000
TRAP_COMPAT = 0x00030000 | errno.ENOSYS  # SECCOMP_RET_TRAP, its data (si_errno): ENOSYS
_JSET = 0x45  # BPF_JMP|BPF_JSET|BPF_K


def compat_filter() -> list[Insn]:
    """Traps (SIGSYS) every system call of a compatibility ABI (i386, x32, arm): only x86_64's and
    aarch64's own entries are allowed."""
    return [
        (_LD, 0, 0, 4),  # 0: seccomp_data.arch
        (_JEQ, 3, 0, _AUDIT_ARCH_X86_64),  # 1: -> 5
        (_JEQ, 1, 0, _AUDIT_ARCH_AARCH64),  # 2: -> 4
        (_RET, 0, 0, TRAP_COMPAT),  # 3: i386, arm, anything else
        (_RET, 0, 0, _ALLOW),  # 4
        (_LD, 0, 0, 0),  # 5: seccomp_data.nr
        (_JSET, 0, 1, X32_SYSCALL_BIT),  # 6: x32 -> 7, else -> 8
        (_RET, 0, 0, TRAP_COMPAT),  # 7
        (_RET, 0, 0, _ALLOW),  # 8
    ]


def deny_compat_syscalls() -> None:
    """Install compat_filter() on the calling process (kept across exec, inherited, cannot be
    removed). Needs no_new_privs, or CAP_SYS_ADMIN."""
    _install(compat_filter())


def _install(insns: list[Insn]) -> None:
    arr = (SockFilter * len(insns))(*[SockFilter(*i) for i in insns])
    prog = _SockFprog(len(insns), arr)
    if _prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise _errno_error("prctl(PR_SET_SECCOMP)")


def io_uring_filter() -> list[Insn]:
    """Refuses (EPERM) io_uring_setup on every architecture the kernel may run."""
    return deny_filter(_IO_URING_SETUP)


def deny_io_uring() -> None:
    """Install io_uring_filter() on the calling process (kept across exec, inherited, cannot be
    removed). Needs no_new_privs, or CAP_SYS_ADMIN."""
    _install(io_uring_filter())


def deny_tty_injection() -> None:
    """Install tty_filter() on the calling process (kept across exec, inherited by children, cannot
    be removed). Needs no_new_privs, or CAP_SYS_ADMIN."""
    _install(tty_filter())


def enter_netns(fd: int) -> None:
    if _setns(fd, CLONE_NEWNET) != 0:
        raise _errno_error("setns(CLONE_NEWNET)")


def private_network(loopback: bool) -> None:
    """Move the calling process into a network namespace of its own: empty, or with loopback up.
    Without CAP_SYS_ADMIN (a client that is not root), inside a new user namespace in which the
    caller's uid and gid map to themselves and nothing else: the command keeps its identity, has
    no capability once it execs (its uid is not 0 there), and sees files of other users as owned by
    the overflow uid (65534). Raises OSError."""
    if _unshare(CLONE_NEWNET) != 0:
        if ctypes.get_errno() != errno.EPERM:
            raise _errno_error("unshare(CLONE_NEWNET)")
        uid, gid = os.getuid(), os.getgid()
        if _unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
            raise _errno_error("unshare(CLONE_NEWUSER|CLONE_NEWNET)")
        # a non-dumpable process's /proc/self files are root's: dumpable for the three writes only
        dumpable = _prctl(PR_GET_DUMPABLE, 0, 0, 0, 0)
        if dumpable == 0 and _prctl(PR_SET_DUMPABLE, 1, 0, 0, 0) != 0:
            raise _errno_error("prctl(PR_SET_DUMPABLE)")
        try:
            for name, text in (
                ("setgroups", "deny"),
                ("uid_map", f"{uid} {uid} 1"),
                ("gid_map", f"{gid} {gid} 1"),
            ):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        finally:
            if dumpable == 0:
                not_dumpable()
    if loopback:
        import fcntl
        import socket
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            req = struct.pack("16sH22x", b"lo", 0)
            flags = struct.unpack("16sH22x", fcntl.ioctl(sock, _SIOCGIFFLAGS, req))[1]
            fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | _IFF_UP))


def restrict(
    abi: int, handled_fs: int, scoped: int, rules: Iterable[tuple[str, int]], file_rights: int
) -> None:
    """Restrict the calling process (and everything it will exec) to a Landlock domain that handles
    `handled_fs` (anything not granted by `rules` is denied) and `scoped`. Sets no_new_privs first,
    as landlock_restrict_self requires. Raises OSError.

    Each rule is (path, rights); a path is opened with O_PATH|O_NOFOLLOW; one that vanished since
    planning is skipped; on a file that is not a directory only `file_rights` are kept."""
    attr = _RulesetAttr(handled_fs, 0, scoped)
    ruleset = _syscall(
        ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET),
        ctypes.byref(attr),
        ctypes.c_size_t(_attr_size(abi)),
        ctypes.c_uint32(0),
    )
    if ruleset < 0:
        raise _errno_error("landlock_create_ruleset")
    try:
        pb = _PathBeneathAttr(0, -1)
        flags = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
        for path, access in rules:
            try:
                fd = os.open(path, flags)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EACCES):
                    continue
                raise
            try:
                mode = os.fstat(fd).st_mode
                if stat.S_ISLNK(mode):
                    continue
                pb.allowed_access = access if stat.S_ISDIR(mode) else access & file_rights
                pb.parent_fd = fd
                if (
                    pb.allowed_access
                    and _syscall(
                        ctypes.c_long(SYS_LANDLOCK_ADD_RULE),
                        ctypes.c_int(ruleset),
                        ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH),
                        ctypes.byref(pb),
                        ctypes.c_uint32(0),
                    )
                    < 0
                ):
                    raise _errno_error(f"landlock_add_rule {path}")
            finally:
                os.close(fd)
        no_new_privs()
        if _syscall(ctypes.c_long(SYS_LANDLOCK_RESTRICT_SELF), ctypes.c_int(ruleset), ctypes.c_uint32(0)) < 0:
            raise _errno_error("landlock_restrict_self")
    finally:
        os.close(ruleset)
