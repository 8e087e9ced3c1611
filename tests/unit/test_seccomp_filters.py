"""The classic BPF seccomp programs the job gets (policy/landlock_syscalls.py), run on a small
interpreter of the four instructions they use: what they refuse and what they let through."""

from __future__ import annotations

import errno
import os
import struct

from evidence.policy import landlock_syscalls as ll

X86_64, I386, AARCH64, OTHER = 0xC000003E, 0x40000003, 0xC00000B7, 0x80000016
ALLOW, DENY = 0x7FFF0000, 0x00050000 | errno.EPERM


def run(prog: list[tuple[int, int, int, int]], arch: int, nr: int, arg1: int = 0) -> int:
    data = struct.pack("<iIQ6Q", nr, arch, 0, 0, arg1, 0, 0, 0, 0)  # struct seccomp_data
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = prog[pc]
        if code == 0x20:  # BPF_LD|BPF_W|BPF_ABS
            acc = struct.unpack_from("<I", data, k)[0]
            pc += 1
        elif code == 0x15:  # BPF_JMP|BPF_JEQ|BPF_K
            pc += 1 + (jt if acc == k else jf)
        elif code == 0x45:  # BPF_JMP|BPF_JSET|BPF_K
            pc += 1 + (jt if acc & k else jf)
        elif code == 0x06:  # BPF_RET|BPF_K
            return k
        else:
            raise AssertionError(f"unexpected instruction {code:#x}")


def test_io_uring_setup_is_refused_on_every_architecture_the_kernel_may_run() -> None:
    prog = ll.deny_filter(ll._IO_URING_SETUP)
    for arch, nr in ((X86_64, 425), (X86_64, 0x40000000 | 425), (I386, 425), (AARCH64, 425)):
        assert run(prog, arch, nr) == DENY, (hex(arch), nr)
    for arch, nr in ((X86_64, 0), (X86_64, 426), (X86_64, 257), (I386, 5), (AARCH64, 56), (OTHER, 425)):
        assert run(prog, arch, nr) == ALLOW, (hex(arch), nr)


def test_the_tty_filter_refuses_tiocsti_and_tioclinux_only() -> None:
    prog = ll.tty_filter()
    for cmd in ll.TTY_INJECTION:
        assert run(prog, X86_64, 16, cmd) == DENY
        assert run(prog, X86_64, 0x40000000 | 514, cmd) == DENY
        assert run(prog, I386, 54, cmd) == DENY
    assert run(prog, X86_64, 16, 0x5401) == ALLOW  # TCGETS
    assert run(prog, X86_64, 0, 0x5412) == ALLOW  # read(), whatever its arguments
    assert run(prog, X86_64, 425) == ALLOW


ARM = 0x40000028
TRAP = 0x00030000 | errno.ENOSYS  # SECCOMP_RET_TRAP: SIGSYS, the call not made


def test_the_compat_filter_traps_every_32bit_entry_and_nothing_native() -> None:
    """i386 (int $0x80, sysenter, syscall from 32-bit code: all AUDIT_ARCH_I386), x32 (bit 30 of an
    x86_64 number) and 32-bit ARM are trapped whatever the call; native calls all pass."""
    prog = ll.compat_filter()
    for arch, nr in ((I386, 5), (I386, 0), (I386, 11), (I386, -1), (ARM, 322), (OTHER, 0)):
        assert run(prog, arch, nr) == TRAP, (hex(arch), nr)
    for nr in (0, 2, 257, 59, 0x1FF):
        assert run(prog, X86_64, 0x40000000 | nr) == TRAP, nr
    for arch, nr in ((X86_64, 0), (X86_64, 257), (X86_64, 59), (X86_64, 435), (AARCH64, 56), (AARCH64, 221)):
        assert run(prog, arch, nr) == ALLOW, (hex(arch), nr)


def test_a_filter_counts_only_when_it_is_exactly_evidences() -> None:
    """seccomp_check.missing: the agent's reading of a client's child's filters (newest first)."""
    from evidence.agent.recorder import seccomp_check as sc

    ours = [ll.compat_filter(), ll.io_uring_filter(), ll.tty_filter()]
    assert sc.missing(ours) == []
    assert sc.missing([*ours, [(0x06, 0, 0, ALLOW)]]) == []  # a filter of the job's own as well
    assert sc.missing([]) == list(sc.EXPECTED)
    # a filter of the same length that allows everything is not ours
    fake = [(0x06, 0, 0, ALLOW)] * len(ll.compat_filter())
    assert sc.missing([fake, *ours[1:]]) == ["32-bit system calls"]
    # a tampered instruction (the x32 bit not trapped) is not ours either
    tampered = [*ll.compat_filter()]
    tampered[7] = (0x06, 0, 0, ALLOW)
    assert sc.missing([tampered, *ours[1:]]) == ["32-bit system calls"]


def test_a_process_that_does_not_stop_in_time_is_killed_not_left_traced() -> None:
    """seccomp_check._stopped: the wait for a seized process to stop is bounded (one held in an
    uninterruptible wait never stops); past it the process, not started yet, is killed."""
    import subprocess

    import pytest

    from evidence.agent.recorder import seccomp_check as sc

    p = subprocess.Popen(["sleep", "30"])  # never stops: nothing asked it to
    with pytest.raises(OSError, match="did not stop"):
        sc._stopped(p.pid, timeout=0.05)
    with pytest.raises(ChildProcessError):
        os.waitpid(p.pid, os.WNOHANG)  # killed and reaped already
