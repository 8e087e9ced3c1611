"""What the recorder reads of a process or a cgroup from /proc and the cgroup filesystem, for
processes first seen mid-life (their parent, cwd, program), threads (their process), nested cgroups
(the container a scope names) and 32-bit programs. Each returns None for what is gone."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from evidence.agent.recorder import decode as dec
from evidence.agent.recorder import exe_hash
from evidence.errors import SetupError


def proc_lookup(pid: int) -> tuple[int, str | None, str | None] | None:
    """(ppid, cwd, exe) of a live process, for processes first seen mid-life."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
    cwd = exe = None
    try:
        cwd = dec.path_text(os.readlink(f"/proc/{pid}/cwd"))
        exe = dec.path_text(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        pass
    return ppid, cwd, exe


def tgid_of(tid: int) -> int | None:
    """The process id of thread `tid` (from /proc), None when it is gone."""
    try:
        with open(f"/proc/{tid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def cgroup_of(pid: int) -> str | None:
    """The cgroup2 path of process `pid` (from /proc), None when it is gone."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                if line.startswith("0::"):
                    return line[3:].rstrip("\n")
    except OSError:
        return None
    return None


def container_namer(cgroup_path: Path) -> Callable[[str], str | None] | None:
    """A nested cgroup's name (relative to the run's) -> the container id its scope name carries."""
    from evidence.agent.recorder.cgroups import find_cgroup2_mount
    from evidence.agent.recorder.pod_cgroups import parse_cgroup_path

    try:
        base = str(cgroup_path.relative_to(find_cgroup2_mount()))
    except (ValueError, OSError, SetupError):
        return None
    cache: dict[str, str | None] = {}

    def container_of(rel: str) -> str | None:
        if rel not in cache:
            ref = None if rel.startswith("cgroup-id:") else parse_cgroup_path(f"{base}/{rel}")
            cache[rel] = ref.container_id if ref else None
        return cache[rel]

    return container_of


def elf_abi(pid: int, filename: str) -> str | None:
    """ "ia32" when the program a process runs is a 32-bit x86 ELF (read from /proc/<pid>/exe, the
    very file it runs, or from its path if it is gone already), else None."""
    head = b""
    for path in (f"/proc/{pid}/exe", filename):
        got = exe_hash.read_head(path, 20)  # never blocks (a FIFO the job put at the path)
        if got is not None:
            head = got[0]
            break
    if len(head) >= 20 and head[:4] == b"\x7fELF" and head[4] == 1 and head[18:20] == b"\x03\x00":
        return "ia32"
    return None


def cgroup_mount_of(path: Path) -> str | None:
    """The cgroup2 mount `path` is under (the nearest ancestor whose parent is another filesystem)."""
    try:
        dev = os.stat(path).st_dev
        mount = path
        while mount.parent != mount and os.stat(mount.parent).st_dev == dev:
            mount = mount.parent
    except OSError:
        return None
    return str(mount)
