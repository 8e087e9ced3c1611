"""What a system call's record says, from its decoded fields: results (errno names), open flags,
exit statuses, file changes and namespace, mount, chroot and ptrace calls (their flags named, their
paths resolved like an open's through the process's tables: agent/recorder/names.py). Pure: the
correlator (agent/recorder/correlate.py) keeps the process table and calls these."""

from __future__ import annotations

import errno
import functools
import os
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from evidence.agent.recorder import decode as d
from evidence.agent.recorder.names import MAGIC, UNREADABLE, Names
from evidence.bundle.record_types import Access, ChangeRecord, NamespaceRecord, Result

if TYPE_CHECKING:
    from evidence.agent.recorder.correlate import Proc

_FLAG_NAMES = [
    (getattr(os, name), name)
    for name in (
        "O_CREAT",
        "O_EXCL",
        "O_NOCTTY",
        "O_TRUNC",
        "O_APPEND",
        "O_NONBLOCK",
        "O_DSYNC",
        "O_ASYNC",
        "O_DIRECT",
        "O_LARGEFILE",
        "O_DIRECTORY",
        "O_NOFOLLOW",
        "O_NOATIME",
        "O_CLOEXEC",
        "O_PATH",
    )
    if hasattr(os, name)
]
_O_TMPFILE = getattr(os, "O_TMPFILE", 0o20200000)
_O_SYNC_ONLY = getattr(os, "O_SYNC", 0o4010000) & ~getattr(os, "O_DSYNC", 0o10000)


# the kernel's own codes for a system call interrupted by a signal and restarted (include/linux/errno.h):
# the restarted call is recorded again, with its own result
_RESTART = {512: "ERESTARTSYS", 513: "ERESTARTNOINTR", 514: "ERESTARTNOHAND", 516: "ERESTART_RESTARTBLOCK"}
# not a kernel code: the result of a call whose result never came (lost, or still in progress at the end)
NO_RESULT = d.NO_RESULT  # the probes write it (probes/abi.py)
_RESTART[-NO_RESULT] = "NO_RESULT"


@functools.lru_cache(maxsize=512)
def errno_name(code: int) -> str:
    return errno.errorcode.get(code) or _RESTART.get(code) or f"E{code}"


def result_of(ret: int) -> Result:
    return 0 if ret >= 0 else errno_name(-ret)


@functools.lru_cache(maxsize=4096)
def decode_open_flags(flags: int) -> tuple[tuple[str, ...], tuple[Access, ...]]:
    """(flag names, access classes) of open(2) flags. Cached: a run uses few distinct values, and
    the tuples are shared by the records (never mutate them)."""
    acc = flags & os.O_ACCMODE
    names = [{os.O_RDONLY: "O_RDONLY", os.O_WRONLY: "O_WRONLY", os.O_RDWR: "O_RDWR"}.get(acc, "O_ACCMODE3")]
    rest = flags & ~os.O_ACCMODE
    if rest & _O_TMPFILE == _O_TMPFILE:
        names.append("O_TMPFILE")
        rest &= ~_O_TMPFILE
    if rest & _O_SYNC_ONLY:
        names.append("O_SYNC")
        rest &= ~_O_SYNC_ONLY
    for bit, name in _FLAG_NAMES:
        if rest & bit:
            names.append(name)
            rest &= ~bit
    if rest:
        names.append(f"0x{rest:x}")
    access: list[Access] = []
    is_path = bool(flags & getattr(os, "O_PATH", 0))
    if not is_path and acc in (os.O_RDONLY, os.O_RDWR):
        access.append("read")
    if not is_path and (acc in (os.O_WRONLY, os.O_RDWR) or flags & os.O_TRUNC):
        access.append("write")
    if flags & os.O_CREAT or flags & _O_TMPFILE == _O_TMPFILE:
        access.append("create")
    return tuple(names), tuple(access)


def split_status(status: int) -> tuple[int | None, str | None]:
    """(exit code, signal name) from a wait status."""
    sig = status & 0x7F
    if sig:
        try:
            return None, signal.Signals(sig).name
        except ValueError:
            return None, f"SIG{sig}"
    return (status >> 8) & 0xFF, None


# what a file change needs, by operation: the access class of its (first) path; every change also
# needs write access to the directory that holds the name it adds or removes (policy/profile.py)
CHANGE_ACCESS: dict[str, tuple[Access, ...]] = {
    "rename": ("write", "create"),
    "unlink": ("write",),
    "rmdir": ("write",),
    "link": ("create",),
    "symlink": ("create",),
    "truncate": ("write",),
    "chmod": ("write",),
    "chown": ("write",),
    "mkdir": ("create",),
    "mknod": ("create",),
}
# changes of the file itself, which its other names (hard links) see too: they carry its link count
# when a descriptor names it (fchmod, fchown, a magic link: record.bpf.c inode_nlink)
_OF_THE_FILE: Final = ("truncate", "chmod", "chown")

# namespace calls (record.bpf.c ---- namespaces and mounts): the names of their flags
_CLONE_FLAGS = (
    (0x00000080, "CLONE_NEWTIME"),
    (0x00020000, "CLONE_NEWNS"),
    (0x02000000, "CLONE_NEWCGROUP"),
    (0x04000000, "CLONE_NEWUTS"),
    (0x08000000, "CLONE_NEWIPC"),
    (0x10000000, "CLONE_NEWUSER"),
    (0x20000000, "CLONE_NEWPID"),
    (0x40000000, "CLONE_NEWNET"),
)
_MOUNT_FLAGS = (
    (0x1, "MS_RDONLY"),
    (0x2, "MS_NOSUID"),
    (0x4, "MS_NODEV"),
    (0x8, "MS_NOEXEC"),
    (0x20, "MS_REMOUNT"),
    (0x1000, "MS_BIND"),
    (0x2000, "MS_MOVE"),
    (0x4000, "MS_REC"),
    (0x20000, "MS_UNBINDABLE"),
    (0x40000, "MS_PRIVATE"),
    (0x80000, "MS_SLAVE"),
    (0x100000, "MS_SHARED"),
)
_MOVE_MOUNT_FLAGS = (
    (0x1, "MOVE_MOUNT_F_SYMLINKS"),
    (0x4, "MOVE_MOUNT_F_EMPTY_PATH"),
    (0x100, "MOVE_MOUNT_T_EMPTY_PATH"),
)
_OPEN_TREE_FLAGS = ((0x1, "OPEN_TREE_CLONE"), (0x8000, "AT_RECURSIVE"), (0x1000, "AT_EMPTY_PATH"))
_PTRACE_REQUESTS = {
    4: "PTRACE_POKETEXT",
    5: "PTRACE_POKEDATA",
    6: "PTRACE_POKEUSER",
    16: "PTRACE_ATTACH",
    0x4206: "PTRACE_SEIZE",
}
_MS_BIND, _MS_MOVE = 0x1000, 0x2000


def _bit_names(value: int, table: tuple[tuple[int, str], ...]) -> list[str]:
    names = [name for bit, name in table if value & bit]
    rest = value & ~functools.reduce(lambda a, b: a | b, (bit for bit, _ in table), 0)
    if rest:
        names.append(f"0x{rest:x}")
    return names


def namespace_flags(op: str, flags: int) -> list[str]:
    """The names of a namespace call's flags (clone/unshare/setns: CLONE_*; mount: MS_*; ptrace:
    its request)."""
    if op in ("clone", "unshare", "setns"):
        return _bit_names(flags, _CLONE_FLAGS)  # clone's exit signal is not recorded
    if op == "mount":
        return _bit_names(flags, _MOUNT_FLAGS)
    if op == "move_mount":
        return _bit_names(flags, _MOVE_MOUNT_FLAGS)
    if op == "open_tree":
        return _bit_names(flags, _OPEN_TREE_FLAGS)
    if op == "ptrace":
        return [_PTRACE_REQUESTS.get(flags, f"request {flags}")]
    return _bit_names(flags, ()) if flags else []


def namespace_record(
    names: Names, p: Proc, ev: d.NamespaceEvent, ret: int, t: int, in_run: Callable[[int], bool]
) -> NamespaceRecord:
    """A namespace, mount, chroot or ptrace call. `paths`: what the call names, resolved like an
    open's (mount: source and target, the source only when a bind or move names a path;
    move_mount: from and to; pivot_root: new root and put_old)."""
    op = ev["op"]
    paths: list[str] = []
    for i, (raw, dfd, ino, fault) in enumerate(
        (
            (ev["path"], ev["dfd"], ev["dino"], d.F_FNAME_FAULT),
            (ev["path2"], ev["dfd2"], ev["dino2"], d.F_PATH2_FAULT),
        )
    ):
        if raw is None:
            continue
        if ev["flags"] & fault:
            paths.append(UNREADABLE)
        elif op == "mount" and i == 0 and not (ev["ns_flags"] & (_MS_BIND | _MS_MOVE)):
            paths.append(raw)  # a device or a name ("none", "proc", "overlay"), not a path
        else:
            paths.append(names.resolve(p, raw, dfd, ino))
    rec: NamespaceRecord = {
        "k": "namespace",
        "t": t,
        "pid": p.pid,
        "ppid": p.ppid,
        "exe": p.exe,
        "operation": op,
        "flags": namespace_flags(op, ev["ns_flags"]),
        "paths": paths,
        "result": result_of(ret),
    }
    fstype = ev.get("fstype")
    if fstype:
        rec["fstype"] = fstype
    if op in ("ptrace", "process_vm_writev"):
        rec["target_pid"] = ev["target"]
        rec["target_in_run"] = in_run(ev["target"])
        if op == "process_vm_writev" and ret >= 0:
            rec["written"] = ret  # bytes
    elif op == "clone" and ret > 0:
        rec["target_pid"] = ret  # the child
    return rec


def change_record(names: Names, p: Proc, ev: d.ChangeEvent, ret: int, t: int) -> ChangeRecord:
    """A file change that is not an open, its paths resolved like an open's (cwd, dirfd). `path`
    is the name the call changes (rename's and link's old name, symlink's new link) and `target`
    the second name (rename's and link's new name, symlink's content as given, unresolved); a
    call on a descriptor (fchmod, fchown) names the path the descriptor was opened as. A rename
    does not rename descriptors in the table: a descriptor stays named as it was opened (as the
    kernel's tokens do)."""
    op = ev["op"]
    flags = ev["flags"]
    raw: str | None
    if ev["path"] is None:  # fchmod/fchown: the descriptor's path
        path = names.fd_path(p, ev["dfd"], ev["dino"]) or f"<unknown fd {ev['dfd']}>"
        raw = None
    elif flags & d.F_FNAME_FAULT:
        path = raw = UNREADABLE
    elif op == "symlink":  # path 1 is the link's content, as given: it names nothing yet
        path = raw = ev["path"]
    else:
        raw = ev["path"]
        path = names.resolve(p, raw, ev["dfd"], ev["dino"])
        if path.startswith(MAGIC):  # through a magic link: what its descriptor names
            path = names.through_magic(p, path, raw, ev["mino"])
    rec: ChangeRecord = {
        "k": "change",
        "t": t,
        "pid": p.pid,
        "ppid": p.ppid,
        "exe": p.exe,
        "operation": op,
        "path": path,
        "raw_path": raw,
        "access": CHANGE_ACCESS.get(op, ("write",)),
        "result": result_of(ret),
    }
    if ev["path2"] is not None or op in ("rename", "link", "symlink"):
        raw2 = ev["path2"] or ""
        path2 = UNREADABLE if flags & d.F_PATH2_FAULT else names.resolve(p, raw2, ev["dfd2"], ev["dino2"])
        if path2.startswith(MAGIC):
            path2 = names.through_magic(p, path2, raw2, ev["mino2"])
        if op == "symlink":  # the link made is the path; its content is the target
            rec["path"], rec["target"] = path2, path
            rec["raw_path"] = UNREADABLE if flags & d.F_PATH2_FAULT else raw2
        else:
            rec["target"] = path2  # rename's new name, link's new link
    if op in ("chmod", "mkdir", "mknod"):
        rec["mode"] = ev["mode"] & 0o7777 if op != "mknod" else ev["mode"]
    if op == "chown":
        rec["uid"] = None if ev["uid"] == 0xFFFFFFFF else ev["uid"]
        rec["gid"] = None if ev["gid"] == 0xFFFFFFFF else ev["gid"]
    if ev["at_flags"]:
        rec["at_flags"] = ev["at_flags"]
    if ev["nlink"] > 1 and op in _OF_THE_FILE:  # the file a descriptor names has other names
        rec["nlink"] = ev["nlink"]
    return rec
