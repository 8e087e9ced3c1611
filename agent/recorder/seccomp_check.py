"""Which of evidence's seccomp filters a process runs under, read from the kernel.

`evidence run --agent`'s client forks the command's process, which installs the filters every
recorded command gets (policy/landlock_syscalls.py: the terminal-injection ioctls, io_uring_setup,
the 32-bit system call entries) before it asks the agent to isolate it. A client of the agent is not
trusted: one of the job's own can skip them, and its job would then act through `int $0x80` or
io_uring with nothing recorded. So the agent reads the process's filters back (ptrace
PTRACE_SECCOMP_GET_FILTER: the classic BPF the process installed, as it gave it) while the process
waits for its go, and the run says which are missing, or that they could not be read.

`missing` is pure; `installed_filters` needs CAP_SYS_ADMIN and CAP_SYS_PTRACE in the initial user
namespace, and an agent that runs under no seccomp filter itself (the kernel's conditions).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import time
from collections.abc import Mapping, Sequence

from evidence.policy import landlock_syscalls as ll

Insn = tuple[int, int, int, int]

_PTRACE_DETACH = 17
_PTRACE_SEIZE = 0x4206
_PTRACE_INTERRUPT = 0x4207
_PTRACE_SECCOMP_GET_FILTER = 0x420C
_WALL = 0x40000000
_MAX_FILTERS = 256
STOP_SECONDS = 5.0  # how long a process may take to stop for the reading

_libc = ctypes.CDLL(None, use_errno=True)
_ptrace = _libc.ptrace
_ptrace.restype = ctypes.c_long
_ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]


# evidence's filters, by the name a degradation gives each: its program, and what the job can do
# unrecorded (or to its client) when its process does not run under it
EXPECTED: Mapping[str, tuple[list[Insn], str]] = {
    "32-bit system calls": (
        ll.compat_filter(),
        "the kernel's syscall tracepoints skip 32-bit (i386, x32) system calls: what the job did through "
        "them (opens, writes, execs, connects) is not recorded",
    ),
    "io_uring": (
        ll.io_uring_filter(),
        "io_uring operations (open, write, connect) run without system calls: what the job did "
        "through them is not recorded",
    ),
    "terminal injection (TIOCSTI, TIOCLINUX)": (
        ll.tty_filter(),
        "the job could type into the terminal it shares with its client (TIOCSTI)",
    ),
}


def missing(installed: Sequence[Sequence[Insn]]) -> list[str]:
    """The names (EXPECTED's keys) of evidence's filters that are not among `installed`: a filter
    counts only when its instructions are exactly ours (more filters of the job's own are fine:
    seccomp applies every one, and the most restrictive answer wins)."""
    have = {tuple(tuple(i) for i in f) for f in installed}
    return [name for name, (prog, _) in EXPECTED.items() if tuple(prog) not in have]


def _call(request: int, pid: int, addr: int | None, data: object) -> int:
    ret = _ptrace(request, pid, addr, data)
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return int(ret)


def installed_filters(pid: int) -> list[list[Insn]]:
    """The seccomp filters process `pid` runs under, newest first. It is stopped for the reading
    (seized, interrupted) and let go at once. Raises OSError (EPERM/EACCES: the agent may not
    read them; ESRCH: it is gone)."""
    _call(_PTRACE_SEIZE, pid, None, None)
    try:
        _call(_PTRACE_INTERRUPT, pid, None, None)
        status = _stopped(pid)
        if not os.WIFSTOPPED(status):
            raise OSError(errno.ESRCH, "the process ended before its filters could be read")
        out: list[list[Insn]] = []
        for index in range(_MAX_FILTERS):
            try:
                n = _call(_PTRACE_SECCOMP_GET_FILTER, pid, index, None)
            except OSError as e:
                if e.errno == errno.ENOENT:  # past the oldest filter (or none at all)
                    break
                if e.errno == errno.EINVAL and index == 0:  # not in filter mode: no filter
                    break
                raise
            buf = (ll.SockFilter * n)()
            _call(_PTRACE_SECCOMP_GET_FILTER, pid, index, ctypes.addressof(buf))
            out.append([(f.code, f.jt, f.jf, f.k) for f in buf])
        return out
    finally:
        _ptrace(_PTRACE_DETACH, pid, None, None)  # (fails only if it is gone)


def _stopped(pid: int, timeout: float | None = None) -> int:
    """The wait status of seized process `pid` once it stops (or ends). One that does not stop in
    time (held in an uninterruptible wait, e.g. on a FUSE file of its client's) is killed: it is
    the command's process, not started yet, and a traced process left running would stop for good
    later with nobody to let it go. Raises OSError(ETIMEDOUT) then."""
    deadline = time.monotonic() + (STOP_SECONDS if timeout is None else timeout)
    while True:
        got, status = os.waitpid(pid, _WALL | os.WNOHANG)
        if got == pid:
            return status
        if time.monotonic() >= deadline:
            break
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, _WALL)  # its end, reported to us as its tracer
    raise OSError(errno.ETIMEDOUT, "the process did not stop to have its filters read: killed")


# ---- the exec filter of a policy's command rules (agent/recorder/exec_supervisor.py) -------------

AUDIT_ARCH_X86_64 = 0xC000003E
SECCOMP_RET_ACTION_FULL = 0xFFFF0000
SECCOMP_RET_USER_NOTIF = 0x7FC00000
_EXECS = (59, 322)  # execve, execveat


def run_filter(prog: Sequence[Insn], nr: int, arch: int = AUDIT_ARCH_X86_64) -> int | None:
    """What classic-BPF seccomp program `prog` returns for system call `nr` (arguments and ip 0),
    or None when it uses an instruction this small interpreter does not know (then it proves
    nothing). Loads of seccomp_data (nr, arch, the rest 0), ALU and jumps with constants, returns."""
    data = {0: nr, 4: arch}
    a = x = 0
    pc = 0
    for _ in range(4096):
        if pc >= len(prog):
            return None
        code, jt, jf, k = prog[pc]
        cls = code & 0x07
        if code == 0x20:  # ld [k] (BPF_LD|BPF_W|BPF_ABS)
            a = data.get(k, 0)
        elif code == 0x00:  # ld #k
            a = k
        elif code == 0x01:  # ldx #k
            x = k
        elif code == 0x06:  # ret #k
            return k
        elif code == 0x16:  # ret a
            return a
        elif cls == 0x04 and code & 0x08 == 0:  # alu with k
            op = code & 0xF0
            ops = {0x00: a + k, 0x10: a - k, 0x50: a & k, 0x40: a | k, 0xA0: a ^ k}
            if op not in ops:
                return None
            a = ops[op] & 0xFFFFFFFF
        elif code == 0x05:  # ja
            pc += k
        elif cls == 0x05 and code & 0x08 == 0:  # jeq/jgt/jge/jset with k
            op = code & 0xF0
            if op == 0x10:
                taken = a == k
            elif op == 0x20:
                taken = a > k
            elif op == 0x30:
                taken = a >= k
            elif op == 0x40:
                taken = bool(a & k)
            else:
                return None
            pc += jt if taken else jf
        elif code == 0x07:  # tax
            x = a
        elif code == 0x87:  # txa
            a = x
        else:
            return None
        pc += 1
    return None


def notifies_execs(installed: Sequence[Sequence[Insn]]) -> bool:
    """Whether one of `installed` sends execve and execveat to a listener (user notification)."""
    for prog in installed:
        results = [run_filter(prog, nr) for nr in _EXECS]
        if all(r is not None and r & SECCOMP_RET_ACTION_FULL == SECCOMP_RET_USER_NOTIF for r in results):
            return True
    return False
