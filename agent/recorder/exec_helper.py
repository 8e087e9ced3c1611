"""The command launcher's child side: `python -I -m evidence.agent.recorder.exec_helper SPEC_FD [STATUS_FD]`.

`evidence run` starts this with `subprocess.Popen` and no `preexec_fn` (which is unsafe while the
recorder's threads run). It is started early and waits; then it becomes the command: it reads its
instructions as JSON from SPEC_FD (EOF: exit, run nothing), opens the run's `cgroup.procs`, enters
the network namespace, sets no_new_privs and the Landlock domain, joins the cgroup, restores the
signal mask and dispositions a command expects, and execs. The cgroup is joined last, through the
descriptor opened first, so nothing of this helper's own start is recorded and Landlock cannot stand
in the way of the join.

Given STATUS_FD, the helper first gives itself the run's own System V IPC and /dev/shm
(`private_ipc`: an IPC namespace, and a mount namespace whose /dev/shm and /dev/mqueue are fresh),
before it reads its instructions, and says `N` on STATUS_FD once they are made (the recorder then
takes the helper's root for the run: what its names mean), or `S<text>` and exits when they cannot
be. Everything after (Landlock's rules, which name paths) is made inside them.

The answer goes to STATUS_FD, which is close-on-exec: `R` just before the exec, then EOF when it
succeeded or `E<errno>` when it failed (after the join: the failed exec is recorded); `S<text>` when
the set-up failed (before the join: nothing ran). No answer at all: the helper died. Standard library only, and no import of
evidence's beyond the system-call module (and, for a run with command rules, the exec filter's), so
it starts in a few tens of milliseconds.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn, TypedDict

from evidence.policy import landlock_syscalls as ll


class LandlockSpec(TypedDict):
    """agent/recorder/launch.py `Landlock`, as JSON."""

    abi: int
    handled_fs: int
    scoped: int
    rules: list[list[str | int]]  # [path, rights]
    file_rights: int


class LaunchMessage(TypedDict):
    """What the recorder tells the helper on SPEC_FD (agent/recorder/launch.py: Launcher.go)."""

    argv: list[str]
    oom_score_adj: int | None
    status_fd: int
    procs: str | None
    netns_fd: int | None
    landlock: LandlockSpec | None
    no_new_privs: bool
    allow_32bit: bool
    # the policy's command rules: a Unix socket to hand the exec filter's listener to the recorder
    exec_listener_sock: int | None


_CLONE_NEWNS = 0x00020000
_CLONE_NEWIPC = 0x08000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_SLAVE = 0x2, 0x4, 0x8, 0x4000, 0x80000
SHM = "/dev/shm"
MQUEUE = "/dev/mqueue"


def private_ipc() -> None:
    """Give the calling process (single-threaded, CAP_SYS_ADMIN in its user namespace) System V IPC
    and POSIX shared memory of its own, which die with the last process that uses them: a new IPC
    namespace (segments, semaphores, message queues), a new mount namespace whose mounts are slaves
    of the caller's (the host's later mounts still reach it, nothing mounted in it reaches the host)
    with a fresh tmpfs on /dev/shm (nosuid, nodev, mode 1777: its pages are charged to the cgroup of
    whoever writes them, the run's) and the new namespace's mqueue on /dev/mqueue (a host queue is
    not reachable by its name there). Where the caller has no /dev/shm (or /dev/mqueue) there is
    none to share. Raises OSError."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(ret: int, what: str) -> None:
        if ret != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    check(libc.unshare(_CLONE_NEWIPC | _CLONE_NEWNS), "unshare(CLONE_NEWIPC|CLONE_NEWNS)")
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "mount --make-rslave /")
    if os.path.isdir(SHM):
        check(
            libc.mount(b"tmpfs", SHM.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"mode=1777"),
            f"mount tmpfs on {SHM}",
        )
    if os.path.isdir(MQUEUE):
        flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
        check(libc.mount(b"mqueue", MQUEUE.encode(), b"mqueue", flags, None), f"mount mqueue on {MQUEUE}")


EXIT_SETUP = 71  # the recorder reports set-up failures itself; this code is only seen if it cannot
_RESET = ("SIGPIPE", "SIGXFSZ")  # Python ignores these; a command expects them at their default
_LIBC_SIGNALS = (32, 33)  # glibc's own; Python's subprocess leaves them ignored after a vfork


def _fail(status: int, message: bytes, code: int) -> NoReturn:
    try:
        os.write(status, message)
    finally:
        os._exit(code)


def _exec_listener_hand_over() -> Callable[[int], None]:
    """What a run with command rules needs last, imported first: Debian's python3-seccomp and the
    exec filter's module (agent/recorder/exec_filter.py), before Landlock and the cgroup join (their
    files are not the job's, and the job's domain may not let them be read); the hand-over of the
    listener to the recorder over a socket descriptor, keeping no copy."""
    import importlib
    import socket

    try:
        seccomp = importlib.import_module("seccomp")
    except ImportError as e:
        raise OSError(38, f"command rules need python3-seccomp: {e}") from None
    from evidence.agent.recorder.exec_filter import load_exec_filter, send_listener

    def hand_over(sock_fd: int) -> None:
        sock = socket.socket(fileno=sock_fd)
        try:
            send_listener(sock, load_exec_filter(seccomp))
        finally:
            sock.close()

    return hand_over


def main(spec_fd: int, private_status: int | None = None) -> NoReturn:
    if private_status is not None:  # first, alone: nothing of the run is made outside them
        try:
            private_ipc()
        except OSError as e:
            _fail(private_status, b"S" + str(e).encode(errors="replace"), EXIT_SETUP)
        os.write(private_status, b"N")
    with os.fdopen(spec_fd, "rb") as f:
        raw = f.read()
    if not raw:  # the recorder gave up before the command was to run: run nothing
        os._exit(EXIT_SETUP)
    spec: LaunchMessage = json.loads(raw)
    status = int(spec["status_fd"])
    os.set_inheritable(status, False)  # closed by a successful exec: EOF tells the recorder
    try:
        procs_path, netns_fd, oom = spec.get("procs"), spec.get("netns_fd"), spec.get("oom_score_adj")
        sock = spec.get("exec_listener_sock")
        hand_over = _exec_listener_hand_over() if sock is not None else None
        procs = os.open(procs_path, os.O_WRONLY | os.O_CLOEXEC) if procs_path else None
        if netns_fd is not None:
            ll.enter_netns(int(netns_fd))
            os.close(int(netns_fd))
        landlock = spec.get("landlock")
        if landlock:
            ll.restrict(
                int(landlock["abi"]),
                int(landlock["handled_fs"]),
                int(landlock["scoped"]),
                [(str(p), int(a)) for p, a in landlock["rules"]],
                int(landlock["file_rights"]),
            )
        elif spec.get("no_new_privs"):
            ll.no_new_privs()
        ll.deny_tty_injection()  # the job cannot type into the terminal it shares with its caller
        ll.deny_io_uring()  # nor act through io_uring, which no system call tracepoint sees
        if not spec.get("allow_32bit"):  # nor through a 32-bit entry, which they skip (SIGSYS)
            ll.deny_compat_syscalls()
        if oom is not None:  # the job's own, not the recorder's protection
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write(str(int(oom)))
        if procs is not None:  # opened before Landlock, written after: the last step before exec
            os.write(procs, str(os.getpid()).encode())
            os.close(procs)
        if hand_over is not None and sock is not None:  # last: every exec from here on is decided
            hand_over(int(sock))
    except OSError as e:
        _fail(status, b"S" + str(e).encode(errors="replace"), EXIT_SETUP)
    for name in _RESET:
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    for sig in _LIBC_SIGNALS:
        ll.default_disposition(sig)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    argv = [str(a) for a in spec["argv"]]
    os.write(status, b"R")
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        code = 126 if e.errno in (13, 8, 1) else 127  # EACCES, ENOEXEC, EPERM: found, cannot run
        _fail(status, b"E" + str(e.errno or 0).encode(), code)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None)
