"""How an isolated run's command ended, as the agent sees it through a pidfd (not as its client says).

The agent opens a pidfd of the process it isolates before moving it, and keeps it for the length
of the run. When the client finishes the run, `observe` asks the kernel (PIDFD_GET_INFO with
PIDFD_INFO_EXIT, Linux 6.15+) for the wait status the process exited with; the kernel keeps it for
every pidfd holder once the process has been reaped by its parent (the client, which waits for it
before it finishes the run). What the client reports is only compared with it.

    running   the process has not exited: the client finished the run early
    exited    the kernel's wait status: an exit code, or the signal that killed it
    unknown   it exited but its status cannot be read: not reaped yet, or a kernel before 6.15
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
import select
import signal
import struct
import time
from typing import Literal

from evidence.bundle.format import Degradation

logger = logging.getLogger(__name__)

# include/uapi/linux/pidfd.h: struct pidfd_info, first version (64 bytes)
_PIDFD_INFO = struct.Struct("=QQ11Ii")
_PIDFD_INFO_EXIT = 1 << 3
_PIDFD_GET_INFO = (3 << 30) | (_PIDFD_INFO.size << 16) | (0xFF << 8) | 11  # _IOWR(0xFF, 11, info)


@dataclasses.dataclass(frozen=True)
class Exit:
    """What became of the process: `state` (see the module), and for `exited` its status."""

    state: Literal["running", "exited", "unknown"]
    exit_code: int | None = None
    signal: str | None = None
    why: str = ""

    def same_as(self, exit_code: int | None, sig: str | None) -> bool:
        return (self.exit_code, self.signal) == (exit_code, sig)

    def describe(self) -> str:
        if self.signal is not None:
            return f"killed by {self.signal}"
        return f"exit {self.exit_code}"


def describe(exit_code: int | None, sig: str | None) -> str:
    if exit_code is None and sig is None:
        return "nothing"
    return Exit("exited", exit_code, sig).describe()


def from_wait_status(status: int) -> Exit:
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"SIG{-code}"
        return Exit("exited", None, name)
    return Exit("exited", code, None)


def _exited(pidfd: int) -> bool:
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(0))


def _exit_status(pidfd: int) -> int | None:
    """The wait status from PIDFD_GET_INFO, or None (not reaped yet); OSError when unsupported."""
    buf = bytearray(_PIDFD_INFO.pack(_PIDFD_INFO_EXIT, 0, *([0] * 11), 0))
    fcntl.ioctl(pidfd, _PIDFD_GET_INFO, buf)
    fields = _PIDFD_INFO.unpack(buf)
    if not fields[0] & _PIDFD_INFO_EXIT:
        return None
    return int(fields[-1])


def observe(pidfd: int, wait: float = 2.0) -> Exit:
    """How the process behind pidfd ended; waits up to `wait` seconds for its parent to reap it."""
    if not _exited(pidfd):
        return Exit("running", why="the command was still running when its run was finished")
    deadline = time.monotonic() + wait
    while True:
        try:
            status = _exit_status(pidfd)
        except OSError as e:
            if e.errno in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP):
                return Exit("unknown", why="this kernel does not give exit statuses to pidfds (Linux 6.15+)")
            return Exit("unknown", why=f"reading its exit status failed: {e.strerror}")
        if status is not None:
            return from_wait_status(status)
        if time.monotonic() >= deadline:
            return Exit("unknown", why="its parent had not reaped it when the run was finished")
        time.sleep(0.02)


def verdict(
    sid: str, observed: Exit | None, exit_code: int | None, sig: str | None
) -> tuple[int | None, str | None, bool, Degradation | None]:
    """(exit_code, signal, cut_short, what the bundle must say) for an isolated run's manifest: what
    the agent observed, never only what the client (`exit_code`, `sig`) says; a run whose end the
    agent could not see is cut short."""
    reported = describe(exit_code, sig)
    if observed is not None and observed.state == "exited":
        said = None
        if not observed.same_as(exit_code, sig):
            logger.warning(
                "run %s: the client reported %s, the agent observed %s", sid, reported, observed.describe()
            )
            said = Degradation(
                component="exit-status",
                reason=f"the client reported {reported}; the agent observed {observed.describe()}",
                impact="the manifest carries the status the agent observed",
            )
        return observed.exit_code, observed.signal, False, said
    why = observed.why if observed is not None else "the agent holds no pidfd of the command"
    logger.warning("run %s: exit status not observed (%s); the client reported %s", sid, why, reported)
    return (
        None,
        None,
        True,
        Degradation(
            component="exit-status",
            reason=f"the agent could not observe how the command ended: {why}",
            impact=f"the run is marked cut short; the client reported {reported}, which is not recorded",
        ),
    )
