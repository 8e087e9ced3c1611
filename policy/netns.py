"""`--net none|loopback`: run the command in a network namespace of its own.

Choice: the namespace is created by the recorder with pyroute2 as a named netns (/run/netns/NAME),
set up (loopback up for `loopback`, left down for `none`), and the process that becomes the
command enters it before it execs, with setns(2) on the descriptor `PrivateNetns.fd` opened
beforehand (`evidence run`'s launcher, agent/recorder/exec_helper.py; `PrivateNetns.enter` does the
same in the calling process). Creating it in the parent means the setup runs with the recorder's
privileges and errors are reported before anything is run; the child only does one syscall. The
namespace is removed afterwards; sockets still open in it keep it alive until they close. Network
first, then Landlock. A recorder killed before it removed its namespace (SIGKILL, a crash) leaves it
named after its pid: the next one to create a namespace removes those whose recorder is gone
(`remove_stale`), so that killed runs do not pile namespaces up in /run/netns.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import secrets
from pathlib import Path
from typing import Literal

from evidence.errors import SetupError

logger = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
NET_MODES = ("none", "loopback")

_libc = ctypes.CDLL(None, use_errno=True)
_setns = _libc.setns
_setns.argtypes = [ctypes.c_int, ctypes.c_int]
_setns.restype = ctypes.c_int


def private_network_problem(pid: int, client: int, proc_root: Path = Path("/proc")) -> str | None:
    """Why process `pid` does not have a network of its own (`--net` through the agent: the client's
    child made it, policy/landlock_syscalls.py private_network), None when it does: a network
    namespace that is neither its client's nor this process's, with no interface but loopback."""
    try:
        own = os.stat(proc_root / str(pid) / "ns" / "net").st_ino
        shared = {os.stat(proc_root / str(p) / "ns" / "net").st_ino for p in (client, os.getpid())}
        dev = (proc_root / str(pid) / "net" / "dev").read_text()
    except OSError as e:
        return f"its network namespace cannot be read: {e.strerror}"
    if own in shared:
        return "it shares its client's (or the agent's) network namespace"
    names = {line.split(":", 1)[0].strip() for line in dev.splitlines()[2:] if ":" in line}
    if names - {"lo"}:
        return f"its network namespace has interfaces besides loopback: {', '.join(sorted(names - {'lo'}))}"
    return None


_NAME = re.compile(r"evidence-(\d+)-[0-9a-f]{8}")  # PrivateNetns's names: its creator's pid, 4 random bytes


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - the recorder runs as root
        return True
    return True


def remove_stale(run_dir: Path = Path("/run/netns")) -> list[str]:
    """Remove the namespaces PrivateNetns left when its process died before removing them (their
    names: PrivateNetns's, with the pid of a process that is gone); the names removed. A pid
    taken again by another process keeps its namespace until that one is gone too."""
    try:
        names = sorted(os.listdir(run_dir))
    except OSError:
        return []
    removed = []
    for name in names:
        m = _NAME.fullmatch(name)
        if m is None or _alive(int(m[1])):
            continue
        try:
            from pyroute2 import netns

            netns.remove(name)
        except OSError as e:
            logger.warning("cannot remove the stale network namespace %s: %s", name, e)
            continue
        removed.append(name)
    if removed:
        logger.info("removed %d network namespaces of recorders that are gone", len(removed))
    return removed


class PrivateNetns:
    """A throwaway network namespace: empty (`none`) or with loopback up (`loopback`)."""

    def __init__(self, mode: Literal["none", "loopback"], name: str | None = None) -> None:
        if mode not in NET_MODES:
            raise ValueError(f"--net must be one of {', '.join(NET_MODES)}, not {mode!r}")
        self.mode = mode
        self.name = name or f"evidence-{os.getpid()}-{secrets.token_hex(4)}"
        self.fd: int | None = None

    @property
    def path(self) -> str:
        return f"/run/netns/{self.name}"

    def create(self) -> None:
        try:
            from pyroute2 import NetNS, netns
        except ImportError as e:  # pragma: no cover - pyroute2 is a dependency
            raise SetupError("pyroute2 is not available") from e
        remove_stale()
        try:
            netns.create(self.name)
        except OSError as e:
            raise SetupError(
                f"cannot create network namespace {self.name}: {e}", hint="needs CAP_SYS_ADMIN"
            ) from e
        try:
            if self.mode == "loopback":
                with NetNS(self.name) as ns:
                    idx = ns.link_lookup(ifname="lo")[0]
                    ns.link("set", index=idx, state="up")
            self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except Exception as e:
            self.remove()
            raise SetupError(f"cannot set up network namespace {self.name}: {e}") from e
        logger.info("network namespace %s (%s) created", self.name, self.mode)

    def enter(self) -> None:
        """setns into the namespace. For the child between fork and exec. Raises OSError."""
        if self.fd is None:
            raise OSError(0, "network namespace not created")
        if _setns(self.fd, CLONE_NEWNET) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"setns({self.path}): {os.strerror(e)}")

    def remove(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        from pyroute2 import netns

        try:
            netns.remove(self.name)
        except OSError as e:
            if os.path.exists(self.path):
                logger.warning("cannot remove network namespace %s: %s", self.name, e)

    def summary(self) -> dict[str, str]:
        return {"mode": self.mode, "name": self.name}

    def __enter__(self) -> PrivateNetns:
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
