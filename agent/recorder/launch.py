"""Start a run's command without `preexec_fn`: the recorder's side of agent/recorder/exec_helper.py.

Python documents that `subprocess.Popen(preexec_fn=...)` can deadlock when threads are running, and
`evidence run` has several (ring-buffer poller, correlator, signal forwarder). So the command is
started as `python -I -m evidence.agent.recorder.exec_helper`, which Popen spawns without running any
Python code between fork and exec; the helper does the set-up in its own process and execs the
command, keeping its pid. The helper is started early and waits, so its interpreter's start overlaps
with the probes' compile. The two talk over two pipes: the instructions go in as JSON, and the
helper's answer comes back on a close-on-exec pipe: `R` then EOF means the command is running.

A run's command gets System V IPC and a /dev/shm of its own (`private_ipc`): the helper makes them
first thing, in its own process, which becomes the command; they die with the run's last process,
and with them what the job left there and the memory it held (issue 24's red team). `ready` waits
until they are made: from then on the helper's root (/proc/PID/root) is what the run's names mean.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from evidence.agent.recorder.exec_helper import LandlockSpec, LaunchMessage
    from evidence.bundle.format import Degradation
    from evidence.policy.landlock import LandlockPlan
from evidence.policy.landlock_syscalls import SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL

logger = logging.getLogger(__name__)

SCOPES = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL

HELPER = "evidence.agent.recorder.exec_helper"
WATCHDOG = "evidence.agent.recorder.watchdog"


class LaunchError(Exception):
    """The helper could not set the command up (netns, Landlock): it exited before joining the run's
    cgroup, so nothing ran."""


@dataclasses.dataclass(frozen=True)
class Landlock:
    """A Landlock domain for the command: rights handled, scopes, and (path, rights) rules."""

    abi: int
    handled_fs: int
    scoped: int
    rules: tuple[tuple[str, int], ...]
    file_rights: int

    @classmethod
    def of_plan(cls, plan: LandlockPlan) -> Landlock | None:
        """The domain a policy's LandlockPlan asks for (None: no Landlock on this kernel)."""
        from evidence.policy.landlock import FILE_RIGHTS

        if not plan.enforced:
            return None
        return cls(plan.abi, plan.handled_fs, plan.scoped, tuple(plan.rule_pairs()), FILE_RIGHTS)

    def as_json(self) -> LandlockSpec:
        return {
            "abi": self.abi,
            "handled_fs": self.handled_fs,
            "scoped": self.scoped,
            "rules": [list(r) for r in self.rules],
            "file_rights": self.file_rights,
        }


# what the bundle says of 32-bit system calls (policy/landlock_syscalls.py compat_filter): refused
# by the filter every launched command gets, unless `--allow-32bit`; a process evidence did not
# launch (an agent's `start --pid/--cgroup`, a pod) has no such filter
COMPAT_REFUSED = "refused (SIGSYS, recorded as policy.denial)"
_COMPAT = {
    "COMPAT_ALLOWED": (
        "--allow-32bit: the command may make 32-bit (i386, x32) system calls",
        "the kernel's syscall tracepoints skip them: what the job does through them (opens, writes, "
        "execs, connects) is not recorded",
    ),
    "COMPAT_NOT_REFUSED": (
        "the run's processes were not started by evidence: 32-bit (i386, x32) system calls are not refused",
        "the kernel's syscall tracepoints skip them: what a process does through them (opens, writes, "
        "execs, connects) is not recorded",
    ),
    "IPC_NOT_PRIVATE": (
        "the run's processes were not started by evidence: they keep the IPC namespace and /dev/shm "
        "they had (the host's, or their container's)",
        "they can use the System V segments, semaphores, message queues and /dev/shm files of every "
        "process that shares them, and what they leave there outlives the run, outside its limits.memory",
    ),
}
_made: dict[str, Degradation] = {}


def __getattr__(name: str) -> Degradation:
    """COMPAT_ALLOWED and COMPAT_NOT_REFUSED, made the first time they are asked for: this module is
    imported before a start's probes load, and the bundle's models (pydantic) are imported while
    they do (issue 27)."""
    if name not in _COMPAT:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _made:
        from evidence.bundle.format import Degradation

        reason, impact = _COMPAT[name]  # IPC_NOT_PRIVATE too
        _made[name] = Degradation(component="isolation", reason=reason, impact=impact)
    return _made[name]


# capabilities.32bit_syscalls of a run of processes evidence did not start (with COMPAT_NOT_REFUSED)
COMPAT_ADOPTED = "not refused, not recorded (processes evidence did not start: see the degradation)"

# capabilities.ipc: System V IPC, POSIX message queues and /dev/shm (exec_helper.private_ipc)
IPC_PRIVATE = (
    "private: an IPC namespace and a tmpfs on /dev/shm of the run's own (a mount namespace, slave "
    "of the host's), gone with its last process"
)
IPC_SHARED = "shared with the host (see the degradation)"
IPC_ADOPTED = "not made private (processes evidence did not start: see the degradation)"
_SHARED_IMPACT = (
    "the job can read and write the host's System V segments, semaphores and message queues and its "
    "/dev/shm files as its uid allows, and what it leaves there (files, segments, their memory) "
    "outlives the run, outside its limits.memory, for a later run of another user to find"
)


def ipc_shared(reason: str) -> Degradation:
    """What a run says when its command shares the host's IPC and /dev/shm, and why."""
    from evidence.bundle.format import Degradation

    return Degradation(component="isolation", reason=reason, impact=_SHARED_IMPACT)


def private_ipc_unavailable() -> str | None:
    """Why this process cannot give a command IPC and /dev/shm of its own (exec_helper.private_ipc:
    unshare and mount need CAP_SYS_ADMIN), None when it can."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"CapEff:"):
                    if int(line.split()[1], 16) & (1 << 21):  # CAP_SYS_ADMIN
                        return None
                    return "evidence runs without CAP_SYS_ADMIN: the command's IPC namespace and /dev/shm are the host's"
    except (OSError, ValueError):
        pass
    return "evidence's capabilities cannot be read: the command's IPC namespace and /dev/shm are the host's"


_NS_GET_USERNS = 0xB701  # ioctl on a namespace's descriptor: its owning user namespace


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def ipc_isolation(pid: int) -> tuple[str, list[Degradation]]:
    """capabilities.ipc of a run whose first process `pid` was set up by a client (`run --agent`),
    read back from the kernel rather than taken from the client: its IPC namespace is not this
    process's, and /dev/shm in its mount namespace is a file system other than this process's
    /dev/shm (and the degradation when not)."""
    try:
        theirs = os.stat(f"/proc/{pid}/ns/ipc")
        private = not _same_file(theirs, os.stat("/proc/self/ns/ipc"))
        if private and os.path.isdir(f"/proc/{pid}/root/dev/shm") and os.path.isdir("/dev/shm"):
            private = os.stat(f"/proc/{pid}/root/dev/shm").st_dev != os.stat("/dev/shm").st_dev
    except OSError as e:
        return IPC_SHARED, [
            ipc_shared(f"the namespaces of the command's process cannot be read: {e.strerror}")
        ]
    if private:
        return IPC_PRIVATE, []
    return IPC_SHARED, [
        ipc_shared(
            "the command's process has the host's IPC namespace or /dev/shm: its client could not "
            "make its own (not root and no --net, which runs it in a user namespace; or not "
            "`evidence run --agent`, or an older one)"
        )
    ]


def joinable_mount_namespace(pid: int) -> int | None:
    """A descriptor of the mount namespace of process `pid` (the run's first, before its command
    runs) for the exec supervisor to join (exec_process.py), when it is not this process's and is
    owned by this process's user namespace: only a process with CAP_SYS_ADMIN there (root, evidence's
    launcher) could have made its mounts or can change them. None otherwise: a namespace made in a
    user namespace of a client's own (`run --agent` by a user) has mounts that client can change at
    any time, so names in it are judged from outside, as any namespace of the job's own (its
    execs' names that lead elsewhere than here count as `foreign`). Raises OSError when the process
    cannot be read."""
    fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _same_file(os.fstat(fd), os.stat("/proc/self/ns/mnt")):
            os.close(fd)
            return None
        import fcntl

        owner = fcntl.ioctl(fd, _NS_GET_USERNS)
        try:
            ours = _same_file(os.fstat(owner), os.stat("/proc/self/ns/user"))
        finally:
            os.close(owner)
    except BaseException:
        os.close(fd)
        raise
    if not ours:
        os.close(fd)
        return None
    return fd


MAKE_BLOCK = 1 << 11  # LANDLOCK_ACCESS_FS_MAKE_BLOCK: handled and granted everywhere, restricts nothing


def isolation(abi: int, allow_setuid: bool = False) -> tuple[Landlock | None, bool, list[Degradation]]:
    """The domain every recorded command runs in when no policy gives it one: (Landlock domain,
    no_new_privs, degradations). A Landlock domain confines ptrace to itself, and with scopes (ABI 6)
    signals and abstract unix sockets too, so a job cannot make a process of its uid outside the run
    act for it unrecorded. Before ABI 6 a domain that restricts nothing (MAKE_BLOCK handled and
    granted on /) still confines ptrace."""
    from evidence.bundle.format import Degradation

    if allow_setuid:
        return (
            None,
            False,
            [
                Degradation(
                    component="isolation",
                    reason="--allow-setuid: the command runs without no_new_privs or a Landlock domain",
                    impact="the job can ptrace and signal processes of its own uid outside the run and "
                    "make them act unrecorded; setuid programs gain privileges",
                )
            ],
        )
    if abi >= 6:
        return Landlock(abi, 0, SCOPES, (), 0), True, []
    if abi >= 1:
        return (
            Landlock(abi, MAKE_BLOCK, 0, (("/", MAKE_BLOCK),), MAKE_BLOCK),
            True,
            [
                Degradation(
                    component="isolation",
                    reason=f"Landlock ABI {abi} has no scopes (ABI 6)",
                    impact="the job can signal processes of its own uid outside the run (ptrace is confined)",
                )
            ],
        )
    return (
        None,
        True,
        [
            Degradation(
                component="isolation",
                reason="Landlock is not available on this kernel",
                impact="the job can ptrace and signal processes of its own uid outside the run and make "
                "them act unrecorded",
            )
        ],
    )


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    argv: Sequence[str]
    cgroup_procs: Path | None  # the run's cgroup.procs; None: stay in the caller's cgroup
    landlock: Landlock | None = None
    no_new_privs: bool = False
    oom_score_adj: int | None = None  # the command's (the recorder protects itself, not the job)
    allow_32bit: bool = False  # no compat_filter: 32-bit system calls are made, unrecorded
    # the policy's command rules: called with the exec filter's listener (the helper loads the
    # filter last and its exec of the command waits for the answer: start the supervisor here)
    supervise: Callable[[int], None] | None = None


@dataclasses.dataclass
class Launched:
    process: subprocess.Popen[bytes]
    exec_errno: int | None  # the exec failed with this errno (the helper exits 126 or 127)

    @property
    def pid(self) -> int:
        return self.process.pid


class Launcher:
    """The helper, started early (its interpreter starts while BCC compiles the probes) and waiting
    for its instructions; `go` sends them and returns once the command runs, `abort` lets it exit
    without running anything.

    `env` is the command's environment and `cwd` its working directory (given explicitly: BCC
    changes the process's directory while it compiles); `keep_fds` the descriptors it inherits
    besides 0-2 (`evidence run --pass-fd`: a make jobserver's pipe; never one of the recorder's
    own); `netns_fd` a network namespace to enter (a descriptor of the caller's, which stays open). Raises OSError when the helper cannot be
    started."""

    def __init__(
        self,
        env: Mapping[str, str],
        cwd: str,
        keep_fds: Sequence[int] = (),
        netns_fd: int | None = None,
        *,
        exec_rules: bool = False,
        private_ipc: bool = False,
    ) -> None:
        """`exec_rules`: the command's execs are decided by the recorder (LaunchSpec.supervise);
        `private_ipc`: the helper gives itself IPC and /dev/shm of its own first (`ready`)."""
        spec_r, self._spec_w = os.pipe()
        self._status_r, status_w = os.pipe()
        self._status_fd = status_w
        self._early = b""  # what the helper said before its instructions (`ready`)
        self._waiting = private_ipc
        self._netns_fd = netns_fd
        self._sock: socket.socket | None = None
        theirs: socket.socket | None = None
        if exec_rules:
            self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock_fd = theirs.fileno() if theirs is not None else None
        ours = [fd for fd in (spec_r, status_w, netns_fd, self._sock_fd) if fd is not None]
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-m", HELPER, str(spec_r), *([str(status_w)] if private_ipc else [])],
                env=dict(env),
                cwd=cwd,
                pass_fds=(*keep_fds, *ours),
                close_fds=True,
            )
        except BaseException:
            os.close(self._spec_w)
            os.close(self._status_r)
            if self._sock is not None:
                self._sock.close()
            raise
        finally:
            os.close(spec_r)
            os.close(status_w)
            if theirs is not None:
                theirs.close()

    def ready(self) -> None:
        """Wait until the helper has made its private IPC and /dev/shm (Launcher's `private_ipc`):
        from then on its root and mount namespace are the command's. Its failure is `go`'s to
        report (LaunchError)."""
        if not self._waiting:
            return
        self._waiting = False
        with contextlib.suppress(OSError):
            self._early = os.read(self._status_r, 1)
        if self._early == b"N":
            self._early = b""

    def go(self, spec: LaunchSpec) -> Launched:
        """Start the command; returns once it runs (or its exec failed). Raises LaunchError when the
        set-up failed."""
        self.ready()
        message: LaunchMessage = {
            "argv": list(spec.argv),
            "oom_score_adj": spec.oom_score_adj,
            "status_fd": self._status_fd,
            "procs": str(spec.cgroup_procs) if spec.cgroup_procs else None,
            "netns_fd": self._netns_fd,
            "landlock": spec.landlock.as_json() if spec.landlock else None,
            "no_new_privs": spec.no_new_privs,
            "allow_32bit": spec.allow_32bit,
            "exec_listener_sock": self._sock_fd,
        }
        try:
            with os.fdopen(self._spec_w, "wb") as w:
                w.write(json.dumps(message).encode())
        except BrokenPipeError:
            pass  # the helper died before reading: its status pipe says so
        if self._sock is not None:
            self._take_listener(spec)
        answer = self._early
        with os.fdopen(self._status_r, "rb") as r:
            while chunk := r.read(4096):
                answer += chunk
        process = self.process
        if answer == b"R":
            return Launched(process, None)
        if answer.startswith(b"RE"):
            return Launched(process, int(answer[2:] or errno.ENOENT))
        process.wait()
        if answer.startswith(b"S"):
            raise LaunchError(answer[1:].decode(errors="replace"))
        raise LaunchError(f"the launcher exited {process.returncode} before starting the command")

    def _take_listener(self, spec: LaunchSpec) -> None:
        """The exec filter's listener, from the helper (none: its set-up failed, its status says
        why), to `spec.supervise`, before the helper's exec of the command, which waits for it."""
        assert self._sock is not None
        sock, self._sock = self._sock, None
        try:
            _msg, fds, _flags, _addr = socket.recv_fds(sock, 1, 1)
        except OSError:
            fds = []
        finally:
            sock.close()
        if fds and spec.supervise is not None:
            spec.supervise(fds[0])
        else:
            for fd in fds:
                os.close(fd)

    def abort(self) -> None:
        """Nothing will run: the helper reads no instructions and exits."""
        for fd in (self._spec_w, self._status_r):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self.process.wait()


def protect(pid: int | str, score: int) -> int | None:
    """Set a process's oom_score_adj (root may lower it); returns the value it had, None if unknown.
    A job that fills memory must not get its recorder killed first and so erase its own record."""
    path = f"/proc/{pid}/oom_score_adj"
    try:
        with open(path) as f:
            before = int(f.read())
        with open(path, "w") as f:
            f.write(str(score))
    except (OSError, ValueError):
        return None
    return before


def inherited_fds() -> list[int]:
    """The inheritable descriptors above 2 this process holds: call it first thing, before anything of
    the recorder's (BCC leaves some of its own inheritable) is opened."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:
            with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
                if os.get_inheritable(fd):
                    out.append(fd)
    return sorted(out)


def launch(spec: LaunchSpec, env: Mapping[str, str], cwd: str, keep_fds: Sequence[int] = ()) -> Launched:
    """Start the helper and the command in one call (when there is nothing to overlap with)."""
    return Launcher(env, cwd, keep_fds).go(spec)


class Watchdog:
    """The parent side of agent/recorder/watchdog.py: started early, told the run's cgroup once it
    exists, told `done` when the run is finished. If this process dies first, the watchdog kills
    the run's processes. Raises OSError when it cannot be started."""

    def __init__(self, parent_death: bool = False) -> None:
        """`parent_death`: the watchdog also acts as soon as this process is exiting, not only once
        the pipe's last holder is gone (see agent/recorder/watchdog.py)."""
        r, self._w = os.pipe()
        parent = [str(os.getpid())] if parent_death else []
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-m", WATCHDOG, str(r), *parent],
                pass_fds=(r,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # a terminal's Ctrl-C to the run is not for the watchdog
            )
        except BaseException:
            os.close(self._w)
            raise
        finally:
            os.close(r)
        protect(self.process.pid, -1000)  # the OOM killer takes it last: it is what kills the job

    def watch(self, cgroup: Path, session_id: str) -> None:
        os.write(self._w, json.dumps({"cgroup": str(cgroup), "session": session_id}).encode() + b"\n")

    def unwatch(self, cgroup: Path) -> None:
        """That cgroup is gone (its run finished): not to be killed any more."""
        with contextlib.suppress(OSError):
            os.write(self._w, json.dumps({"unwatch": str(cgroup)}).encode() + b"\n")

    def done(self) -> None:
        """The run is finished (or never started): the watchdog exits without touching anything."""
        if self._w < 0:
            return
        with contextlib.suppress(OSError):
            os.write(self._w, b"done\n")
        os.close(self._w)
        self._w = -1
