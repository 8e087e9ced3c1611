"""The seccomp filter that sends a job's execve and execveat to the exec supervisor (command rules),
loaded in the process about to exec the command, and its listener handed over.

Standard library only, and Debian's python3-seccomp passed in: the launcher (exec_helper.py) imports
the binding before it joins the run's cgroup and uses this module after; the agent's client
(run_agent.py, in job containers: a plain install) and `doctor` call `install_exec_filter`.
"""

from __future__ import annotations

import errno
import os
import socket
from types import ModuleType


def load_exec_filter(seccomp: ModuleType) -> int:
    """Load a filter sending execve/execveat to a listener; return the listener's descriptor
    (close-on-exec). Sets no_new_privs, as an unprivileged filter needs. It applies to this process
    and everything it starts."""
    f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    f.add_rule(seccomp.NOTIFY, "execve")
    f.add_rule(seccomp.NOTIFY, "execveat")
    f.load()
    fd = int(f.get_notify_fd())
    if fd < 0:
        raise OSError(errno.ENOSYS, "seccomp gave no listener descriptor")
    return fd


def install_exec_filter() -> int:
    """Load a seccomp filter sending execve/execveat to a listener; return the listener's descriptor
    (close-on-exec). Sets no_new_privs, as an unprivileged filter needs. Call it in the process that
    is about to exec the command: it applies to that process and everything it starts."""
    import seccomp  # Debian's python3-seccomp: in scripts/setup.sh's apt list

    return load_exec_filter(seccomp)


def send_listener(sock: socket.socket, fd: int) -> None:
    """Hand the listener to the supervisor and close this process's copy: a job holding one could
    answer its own execs."""
    try:
        socket.send_fds(sock, [b"L"], [fd])
    finally:
        os.close(fd)
