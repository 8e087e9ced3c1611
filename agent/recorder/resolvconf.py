"""---- dns: the resolvers a run is configured with, the nameservers of /etc/resolv.conf as the run's
first process sees it (its mount namespace and root: a container's own file), read when the run
starts. An answer from any other server is marked (agent/recorder/dns.py), and names only as
`other_names`.

A job cannot change that file for the run: it is root's, and a file the job bind-mounts over it in
a mount namespace of its own is seen by the job's processes there only (marked `mntns: other`,
whose answers are never counted as a configured resolver's). RES_OPTIONS and LOCALDOMAIN change
options and search domains, not servers.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import stat
import struct

logger = logging.getLogger(__name__)

MAX_SIZE = 64 * 1024  # bytes of the file read
MAX_SERVERS = 16  # nameservers kept (glibc uses the first 3; other resolvers read more)
# no nameserver line: glibc (and musl, Go) ask the local machine
DEFAULT = ("127.0.0.1",)

_SYS_OPENAT2 = 437  # the same number on every architecture (a syscall added after the unified table)
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def nameservers(text: str) -> list[str]:
    """The nameservers of a resolv.conf's text, as glibc reads them (`nameserver ADDRESS` lines; `#`
    and `;` begin comments), each an IP address (an IPv6 zone is dropped); DEFAULT when there is none."""
    out: list[str] = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 2 or fields[0] != "nameserver":
            continue
        try:
            address = str(ipaddress.ip_address(fields[1].split("%")[0]))
        except ValueError:
            continue
        if address not in out and len(out) < MAX_SERVERS:
            out.append(address)
    return out or list(DEFAULT)


def _open_in_root(root: int, name: str) -> int:
    """openat2(root, name, RESOLVE_IN_ROOT): a symlink in the name (/etc/resolv.conf ->
    /run/systemd/resolve/stub-resolv.conf) resolves below the process's root, not the recorder's."""
    how = ctypes.create_string_buffer(
        struct.pack(
            "<QQQ",
            os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY,
            0,
            _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS,
        ),
        24,
    )
    fd = int(
        _libc.syscall(
            ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(root), name.encode(), how, ctypes.c_size_t(24)
        )
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return fd


def read_resolvers(pid: int) -> list[str] | None:
    """The nameservers of /etc/resolv.conf as process `pid` sees it (DEFAULT when there is no such
    file), None when it cannot be read (the process gone, not a regular file: then no resolver
    counts as configured)."""
    try:
        root = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        logger.warning("cannot read the resolvers of process %d: %s", pid, e)
        return None
    try:
        fd = _open_in_root(root, "etc/resolv.conf")
    except FileNotFoundError:
        return list(DEFAULT)  # what the resolvers then ask
    except OSError as e:
        logger.warning("cannot read /etc/resolv.conf of process %d: %s", pid, e.strerror)
        return None
    finally:
        os.close(root)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # never wait on a FIFO
            return None
        data = os.read(fd, MAX_SIZE)
    except OSError:
        return None
    finally:
        os.close(fd)
    return nameservers(data.decode("utf-8", "replace"))
