"""What the kernel offers, and the set-up the probes need: tracefs and BPF features (headers for BCC:
probes/headers.py).

Everything here reads the real machine; `evidence doctor` prints it.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from evidence.probes.objcache import TRACEFS as TRACEFS  # doctor reads it here

if TYPE_CHECKING:
    from evidence.agent.recorder.description import Capabilities
    from evidence.probes.headers import Headers

logger = logging.getLogger(__name__)

BTF_PATH = Path("/sys/kernel/btf/vmlinux")
# the process's own symbols, libc's among them: not ctypes.util.find_library, which runs
# `ldconfig -p` (and gcc when that fails) at every start of `evidence run`
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

SYS_BPF = 321
SYS_LANDLOCK_CREATE_RULESET = 444
BPF_MAP_CREATE, BPF_PROG_LOAD = 0, 5
BPF_MAP_TYPE_RINGBUF = 27

# prog type -> (name, expected_attach_type)
PROG_TYPES = {
    5: ("tracepoint", 0),
    17: ("raw_tracepoint", 0),
    18: ("cgroup_sock_addr", 10),  # BPF_CGROUP_INET4_CONNECT
    2: ("kprobe", 0),
    26: ("tracing", 24),  # BPF_TRACE_FENTRY (needs a BTF id: fails when unavailable)
    29: ("lsm", 27),  # BPF_LSM_MAC
}


def kernel_ready(*, hints: bool = True) -> Headers:
    """tracefs mounted and kernel headers for BCC found, or SetupError saying what is missing."""
    from evidence.errors import SetupError
    from evidence.probes.headers import ensure_headers

    if not mount_tracefs():
        raise SetupError(
            "tracefs is not available at /sys/kernel/tracing",
            "mount -t tracefs tracefs /sys/kernel/tracing" if hints else None,
        )
    headers = ensure_headers()
    if headers.path is None:
        raise SetupError(
            "no kernel headers for BCC",
            "apt-get install linux-headers-$(uname -r) (or the distro's generic headers)" if hints else None,
        )
    return headers


def mount_tracefs() -> bool:
    """Mount tracefs at /sys/kernel/tracing if needed. True when it is usable."""
    if (TRACEFS / "events").is_dir():
        return True
    rc = _libc.mount(b"tracefs", str(TRACEFS).encode(), b"tracefs", 0, None)
    if rc != 0:
        logger.warning("cannot mount tracefs at %s: %s", TRACEFS, os.strerror(ctypes.get_errno()))
        return False
    logger.info("mounted tracefs at %s", TRACEFS)
    return (TRACEFS / "events").is_dir()


def tracepoint_format(category: str, event: str) -> str | None:
    try:
        return (TRACEFS / "events" / category / event / "format").read_text()
    except OSError:
        return None


def _bpf(cmd: int, attr: ctypes.Array[ctypes.c_char]) -> int:
    fd = _libc.syscall(SYS_BPF, cmd, attr, len(attr))
    if fd < 0:
        return -ctypes.get_errno()
    os.close(fd)
    return 0


def prog_type_loads(prog_type: int, expected_attach: int = 0) -> tuple[bool, str]:
    insns = (ctypes.c_uint64 * 2)(0x00000000000000B7, 0x0000000000000095)  # r0 = 0; exit
    license_ = ctypes.create_string_buffer(b"GPL")
    attr = ctypes.create_string_buffer(128)
    ctypes.memmove(ctypes.addressof(attr), ctypes.byref(ctypes.c_uint32(prog_type)), 4)
    ctypes.memmove(ctypes.addressof(attr) + 4, ctypes.byref(ctypes.c_uint32(2)), 4)
    ctypes.memmove(ctypes.addressof(attr) + 8, ctypes.byref(ctypes.c_uint64(ctypes.addressof(insns))), 8)
    ctypes.memmove(ctypes.addressof(attr) + 16, ctypes.byref(ctypes.c_uint64(ctypes.addressof(license_))), 8)
    ctypes.memmove(ctypes.addressof(attr) + 68, ctypes.byref(ctypes.c_uint32(expected_attach)), 4)
    rc = _bpf(BPF_PROG_LOAD, attr)
    return rc == 0, "ok" if rc == 0 else errno.errorcode.get(-rc, str(-rc))


def ringbuf_available() -> tuple[bool, str]:
    attr = ctypes.create_string_buffer(128)
    for off, val in ((0, BPF_MAP_TYPE_RINGBUF), (4, 0), (8, 0), (12, 4096)):
        ctypes.memmove(ctypes.addressof(attr) + off, ctypes.byref(ctypes.c_uint32(val)), 4)
    rc = _bpf(BPF_MAP_CREATE, attr)
    return rc == 0, "ok" if rc == 0 else errno.errorcode.get(-rc, str(-rc))


def landlock_abi() -> int:
    """The Landlock ABI version, or 0 when Landlock is unavailable."""
    rc = _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
    return int(rc) if rc > 0 else 0


def lockdown_mode() -> str:
    p = Path("/sys/kernel/security/lockdown")
    if not p.exists() and os.geteuid() == 0 and not Path("/sys/kernel/security/lsm").exists():
        _libc.mount(b"securityfs", b"/sys/kernel/security", b"securityfs", 0, None)
    try:
        m = re.search(r"\[(\w+)\]", p.read_text())
        return m.group(1) if m else "unknown"
    except OSError:
        return "unknown (securityfs not mounted)"


def host_info() -> dict[str, str]:
    u = os.uname()
    return {"hostname": u.nodename, "kernel": u.release, "arch": u.machine}


def capabilities_in_force() -> Capabilities:
    """The subset of `evidence doctor`'s checks worth keeping in a bundle's manifest."""
    return {
        "btf": BTF_PATH.exists(),
        "lockdown": lockdown_mode(),
        "landlock_abi": landlock_abi(),
        "tracefs": str(TRACEFS),
        "kprobes": (Path(TRACEFS) / "kprobe_events").exists(),
    }
