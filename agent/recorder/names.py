"""How the recorder names what a process names (pure: no BCC, no root): a name resolved against
the process's cwd or a descriptor it gave, the kernel's own name of what an open or chdir reached
(record.bpf.c kernel_name), and the directories chdirs entered (the name of a cwd changed unseen).
The process's tables (its cwd and descriptors) live in correlate.Proc; this reads and updates them.
"""

from __future__ import annotations

import posixpath
import re
from typing import TYPE_CHECKING, Final

from evidence.agent.recorder import decode as d
from evidence.bundle.format import has_dotdot
from evidence.probes import abi

if TYPE_CHECKING:
    from evidence.agent.recorder.correlate import Proc

AT_FDCWD = -100
UNREADABLE = "<unreadable path>"
_CWD_PATHS = 4096  # directories entered by a chdir, by identity (Names._cwd_paths)
# names through magic links: /proc/self/fd/N, /proc/thread-self/fd/N, /proc/<pid>/fd/N (and
# /proc/<pid>/task/<tid>/fd/N, what /proc/thread-self is), /dev/fd/N; and names below them
MAGIC: Final = ("/proc/", "/dev/fd/")
_FD_LINK: Final = re.compile(
    r"/(?:proc/(?:self|thread-self|([0-9]+)(?:/task/[0-9]+)?)/fd|dev/fd)/([0-9]+)(/.*)?", re.DOTALL
)
_MAGIC_SCAN = abi.MAGIC_SCAN  # what the probe scans (bpf/changes.bpf.c magic_fd)
_FD_NUMBER: Final = re.compile(r"[0-9]{1,9}(?=/|$)")


def magic_fd(raw: str) -> int | None:
    """The descriptor number the probe read in a change's name as given (record.bpf.c magic_fd,
    the same reading: change both together): the number of the name's first component of digits
    that is its first component or follows a component `fd`, within its first 48 characters (the
    probe reads 48 bytes: where the two differ, one of them finds nothing and the name is not
    resolved), None when there is none. Whether the name reaches that descriptor through a magic
    link is the resolved name's to say (`Names.through_magic`)."""
    for i, ch in enumerate(raw[:_MAGIC_SCAN]):
        if "0" <= ch <= "9" and (
            i == 0 or (i >= 3 and raw[i - 3 : i] == "fd/" and (i == 3 or raw[i - 4] == "/"))
        ):
            m = _FD_NUMBER.match(raw, i)
            return int(m.group()) if m else None
    return None


def normal(name: str) -> str:
    """An absolute name without '.' and empty components, and without '..' at the root (/.. is /).
    A '..' after a component stays: that component may be a symlink (or a /proc magic link), and
    `/tmp/l/../passwd` with l -> /etc/ssh is /etc/passwd, not /tmp/passwd (threat model row 26).
    Such an open, and every cwd, are named by the kernel (record.bpf.c kernel_name); what is left
    is named as given, never as a third file."""
    if not has_dotdot(name):
        return posixpath.normpath(name).replace("//", "/")
    parts: list[str] = []
    for c in name.split("/"):
        if c in ("", ".") or (c == ".." and not parts):
            continue
        parts.append(c)
    return "/" + "/".join(parts)


def join(base: str, name: str, real: bool) -> str:
    """A relative `name` against the directory `base` (absolute, normal). `real`: `base` is the
    kernel's name of the directory (no symlink in it), so the name's leading '..' are its real
    ancestors; else they stay."""
    if real and name.startswith("."):
        comps = name.split("/")
        i = 0
        while i < len(comps) and comps[i] in ("", ".", ".."):
            if comps[i] == ".." and base != "/":
                base = posixpath.dirname(base)
            i += 1
        name = "/".join(comps[i:])
    return normal(base + "/" + name) if name else base


class Names:
    """The names of one run's processes: resolution against their cwd and descriptor tables."""

    def __init__(self) -> None:
        # directory identity -> its name when a chdir or fchdir of the run entered it (the kernel's,
        # or the name as given when the kernel gave none): the name of a cwd changed unseen
        # (shared by clone(CLONE_FS), a thread's own after unshare(CLONE_FS), or changed while a
        # call was in flight); the newest _CWD_PATHS kept
        self._cwd_paths: dict[int, tuple[str, bool]] = {}  # (path, the kernel's name of it)

    @staticmethod
    def fd_path(proc: Proc, fd: int, ino: int) -> str | None:
        """The path descriptor `fd` was opened as, if it names now (`ino`, read by the kernel when
        the call used it) what it named then; else None, and the entry is dropped: another file was
        put at that number unseen (F_DUPFD, SCM_RIGHTS, pidfd_getfd, a shared table; close is not a
        record), and resolving against the old name would name the wrong file."""
        entry = proc.fds.get(fd)
        if entry is None:
            return None
        if ino and entry[1] == ino:
            return entry[0]
        del proc.fds[fd]
        return None

    def cwd(self, proc: Proc, ino: int) -> tuple[str | None, bool]:
        """The path of the directory `ino` (the cwd, as the kernel read it when the call began) for
        a name `proc` gave relative to its cwd, and whether it is the kernel's name of it; None when
        it cannot be named. The cwd can change without a chdir of this process: clone(CLONE_FS)
        shares it with another process, a thread makes its own with unshare(CLONE_FS), another
        thread's chdir lands while a call is in flight. A directory a chdir of the run entered is
        named by that chdir's name of it; else the process's first relative name ties its cwd to
        the directory."""
        if not ino or ino == proc.cwd_ino:
            return proc.cwd, proc.cwd_real
        known = self._cwd_paths.get(ino)
        if known is not None:
            return known
        if not proc.cwd_ino:
            proc.cwd_ino = ino
            return proc.cwd, proc.cwd_real
        return None, False

    def base(self, proc: Proc, dfd: int, ino: int) -> tuple[str | None, bool]:
        """What a relative name is resolved against: the cwd or descriptor dfd's path (while they
        name `ino`), and whether that is the kernel's name of it (only a cwd is)."""
        if dfd == AT_FDCWD:
            return self.cwd(proc, ino)
        return self.fd_path(proc, dfd, ino), False

    def entered(self, proc: Proc, ino: int, cwd: str | None, real: bool) -> None:
        """A chdir or fchdir of `proc` succeeded into the directory `ino` (read at its exit), named
        `cwd` (`real`: by the kernel)."""
        proc.cwd, proc.cwd_real, proc.cwd_ino = cwd, real, ino
        if ino and cwd is not None:
            self._cwd_paths.pop(ino, None)
            if len(self._cwd_paths) >= _CWD_PATHS:
                del self._cwd_paths[next(iter(self._cwd_paths))]
            self._cwd_paths[ino] = (cwd, real)

    @staticmethod
    def through_fd(proc: Proc, path: str, rino: int) -> str:
        """An open of /proc/self/fd/N (thread-self, the process's own pid, /dev/fd/N) opens what
        descriptor N names: named after the table's entry for N when the descriptor returned is
        that file (`rino`), else as given."""
        m = _FD_LINK.fullmatch(path)
        if m is None or m.group(3) or not rino or (m.group(1) is not None and int(m.group(1)) != proc.pid):
            return path
        entry = proc.fds.get(int(m.group(2)))
        return entry[0] if entry is not None and entry[1] == rino else path

    @staticmethod
    def through_magic(proc: Proc, path: str, raw: str, mino: int) -> str:
        """A change's name (resolved: `path`, as given: `raw`) through a magic link of the process's
        own descriptors (`truncate /proc/self/fd/3`, `mkdir /proc/self/fd/3/sub`; /dev/fd/N,
        /proc/thread-self/fd/N, /proc/<own pid>[/task/<tid>]/fd/N, or relative to a cwd or dirfd
        there) changes what descriptor N names: named after the table's entry for N, and what is
        below it, when the kernel says N named that file at the call's entry and exit (`mino`,
        record.bpf.c magic_fd); else as given (lint judges such a name outside: it may lead
        anywhere)."""
        m = _FD_LINK.fullmatch(path)
        if m is None or not mino or (m.group(1) is not None and int(m.group(1)) != proc.pid):
            return path
        n = int(m.group(2))
        if magic_fd(raw) != n:
            return path
        entry = proc.fds.get(n)
        if entry is None or entry[1] != mino or not entry[0].startswith("/"):
            return path
        return normal(entry[0] + (m.group(3) or ""))

    def resolve(self, proc: Proc, path: str, dfd: int = AT_FDCWD, ino: int = 0, in_root: bool = False) -> str:
        """`path` resolved against the cwd, or against descriptor `dfd`, when it names `ino` still.
        `in_root` (openat2's RESOLVE_IN_ROOT): the directory is the root of the name, absolute or not,
        and `..` stops there."""
        if in_root:
            path = normal("/" + path).lstrip("/")
        elif path.startswith("/"):
            return normal(path)
        base, real = self.base(proc, dfd, ino)
        if base is None:
            where = "cwd" if dfd == AT_FDCWD else f"fd {dfd}"
            return f"<unknown {where}>/{path}" if path else f"<unknown {where}>"
        return join(base, path, real and not in_root)

    def open_path(
        self, p: Proc, raw_path: str, dfd: int, dino: int, flags: int, rino: int, kname: str | None
    ) -> str:
        """The path an open names: the kernel's name of the file it opened (`kname`: given for a
        successful open that is a record: record.bpf.c kernel_name), else the name as given,
        resolved (the kernel had no name for it, or it failed, or it only updates the descriptor
        table: F_STATE)."""
        if kname is not None:
            return kname
        if flags & d.F_FNAME_FAULT:
            return UNREADABLE
        path = self.resolve(p, raw_path, dfd, dino, bool(flags & d.F_IN_ROOT))
        return self.through_fd(p, path, rino) if path.startswith(MAGIC) else path
