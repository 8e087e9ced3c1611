"""Who may use the agent, and on what: peer credentials, processes a peer may isolate, cgroups, bundle paths.

Who may connect: the socket is created mode 0660 (owner and, with `socket_gid`, one group), and
every connection's peer is checked with SO_PEERCRED (`peer_of`, `PeerPolicy`): allowed when its uid
is in `allowed_uids`, its primary or a supplementary gid in `allowed_gids`, it is the agent's own
uid, or it is root (uid 0) while `allow_root` is on (root could read the bundle directory and the
kernel's state anyway). Anyone else gets 403 and nothing is done for them.

Which process (`claim_pid`, for isolated runs): only a process the peer owns may be moved: root, or
a peer whose uid is the process's real, effective, saved and filesystem uid (the rule ptrace uses);
anything else is 403. A peer in a child pid namespace names the pid as it sees it: the agent looks
for it among the peer's own children.

Which cgroup (`resolve_cgroup`): a directory with cgroup.procs under the cgroup mount, named by its
path or by a process in it (seen through a cgroup namespace: `find_cgroup_by_inode`). Whether the
peer may have it recorded (`check_start`): for a peer other than root, the process it names is its
own, a cgroup it names by path is delegated to it, and every process in the cgroup is its own.

Never, for any peer (`protected_pids`): PID 1, the agent, or an ancestor of the agent, isolated or
recorded, nor a cgroup that holds one of them.

Who may answer an exec held for approval (`answer_from_outside`): root or the run's owner (the
broker checks that), and only from outside every run the agent records. The job under record
usually runs as its run's owner, and can reach the socket: an answer from a process inside a
recorded cgroup would be the job approving itself. The peer's cgroup is read once, at connect
(`Peer.cgroup`), through a pidfd of the peer (SO_PEERPIDFD, Linux 6.5) that is checked to be still
alive after /proc/PID/cgroup is read, so a pid reused meanwhile is never taken for the peer; where
it cannot be read (the peer exited, is in a pid namespace the agent cannot see into) the answer is
refused.

Where bundles go (`bundle_target`): always into the agent's bundle directory, under the name the
client asks for (a plain file name) or `<session>.tar.gz`. Only a root peer may name an absolute
path: the agent runs as root, and writing where an unprivileged client says would let it overwrite
any file. A client in another mount namespace (a sidecar's job container) downloads the bundle over
the socket instead, and writes it with its own credentials (`evidence finish --bundle`).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import socket
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from evidence.agent.daemon import k8s
from evidence.agent.daemon.models import BUNDLE_NAME
from evidence.errors import UsageError


class Forbidden(UsageError):
    """The peer may use the agent, but not on that process (someone else's, or out of its sight)."""


@dataclasses.dataclass(frozen=True)
class PeerPolicy:
    """Which peers may use the agent at all (see the module's docstring)."""

    allowed_uids: frozenset[int] = frozenset()
    allowed_gids: frozenset[int] = frozenset()
    allow_root: bool = True
    own_uid: int = dataclasses.field(default_factory=os.geteuid)

    def allows(self, uid: int, gids: Sequence[int]) -> bool:
        if uid == 0:
            return self.allow_root
        if uid == self.own_uid or uid in self.allowed_uids:
            return True
        return any(g in self.allowed_gids for g in gids)


@dataclasses.dataclass(frozen=True)
class Peer:
    """A connected client's credentials from SO_PEERCRED (pid 0: its pid namespace hides it)."""

    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()
    cgroup: str | None = None  # its cgroup v2 path at connect, as /proc/PID/cgroup says; None: unknown


SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13; Python names it only on some builds
_NGROUPS_MAX = 65536


def peer_of(sock: socket.socket) -> Peer:
    """The connecting process's credentials and supplementary groups, both as they were at connect()
    (SO_PEERCRED, SO_PEERGROUPS): two system calls, nothing read from /proc (its pid may be reused,
    or be 0 from another pid namespace)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Peer(pid, uid, gid, _peer_groups(sock), peer_cgroup(sock))


def peer_cgroup(sock: socket.socket, proc_root: Path = Path("/proc")) -> str | None:
    """The connecting process's cgroup v2 path, or None when it cannot be told for sure: read
    through a pidfd of the peer (SO_PEERPIDFD), and kept only if the process is still alive after
    the read (then the pid was not reused)."""
    import signal

    try:
        pidfd = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError:
        return None  # a kernel before 6.5: the pid could be reused under us, so: unknown
    try:
        pid = 0
        with open(proc_root / "self" / "fdinfo" / str(pidfd)) as f:
            for line in f:
                if line.startswith("Pid:"):
                    pid = int(line.split()[1])
        if pid <= 0:  # exited (-1), or in a pid namespace the agent does not see (0)
            return None
        rel = k8s.parse_proc_cgroup((proc_root / str(pid) / "cgroup").read_text())
        signal.pidfd_send_signal(pidfd, 0)  # still the peer: raises once it is gone
        return rel
    except (OSError, ValueError):
        return None
    finally:
        os.close(pidfd)


def answer_from_outside(peer: Peer, run_cgroups: Sequence[str], cgroup_root: Path, ns_base: str = "") -> None:
    """Forbidden unless the peer is known to be outside every cgroup in `run_cgroups` (absolute
    paths under cgroup_root): the job under record must not answer for a person."""
    if peer.cgroup is None:
        raise Forbidden(
            "the agent cannot tell whether you are inside a recorded run (your process is gone, or "
            "in a pid namespace it cannot see): approvals are answered only from outside the runs",
            hint="answer from a shell on the host, or at the terminal of evidence run",
        )
    root = Path(os.path.realpath(cgroup_root))
    where = Path(os.path.normpath(f"{root}/{ns_base.strip('/')}/{peer.cgroup.lstrip('/')}"))
    for c in run_cgroups:
        run = Path(c)
        if where == run or run in where.parents:
            raise Forbidden(
                "an answer from inside a recorded run is refused: approvals come from people, not from "
                "the jobs they govern",
                hint="answer from outside the run: a shell on the host, or the terminal of evidence run",
            )


def _peer_groups(sock: socket.socket) -> tuple[int, ...]:
    for size in (64, _NGROUPS_MAX):
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * size)
        except OSError as e:
            if e.errno == errno.ERANGE:  # more groups than the first buffer holds
                continue
            return ()
        return struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4])
    return ()


def resolve_cgroup(
    cgroup: str | None,
    pid: int | None,
    cgroup_root: Path,
    proc_root: Path = Path("/proc"),
    ns_base: str = "",
) -> Path:
    """The cgroup directory a start request names, checked to be a cgroup under cgroup_root.

    `cgroup` may be absolute under cgroup_root, or relative to it (with or without a leading '/',
    as /proc/PID/cgroup shows it). For `pid`, its /proc/PID/cgroup line is used; in a cgroup
    namespace that path is relative to the namespace's root, whose path under cgroup_root is
    `ns_base` (see find_cgroup_by_inode).
    """
    if (cgroup is None) == (pid is None):
        raise UsageError('give exactly one of "cgroup" and "pid"')
    root = Path(os.path.realpath(cgroup_root))
    if pid is not None:
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            raise UsageError('"pid" must be a positive integer')
        try:
            text = (proc_root / str(pid) / "cgroup").read_text()
        except FileNotFoundError:
            raise UsageError(f"no process {pid}") from None
        except OSError as e:
            raise UsageError(f"cannot read the cgroup of process {pid}: {e.strerror}") from None
        rel = k8s.parse_proc_cgroup(text)
        if rel is None:
            raise UsageError(f"process {pid} is not in a cgroup v2 hierarchy")
        candidate = Path(os.path.normpath(f"{root}/{ns_base.strip('/')}/{rel.lstrip('/')}"))
    else:
        if not isinstance(cgroup, str) or not cgroup or "\x00" in cgroup:
            raise UsageError('"cgroup" must be a non-empty path')
        given = Path(cgroup)
        real = Path(os.path.realpath(given)) if given.is_absolute() else None
        if real is not None and (real == root or root in real.parents):
            candidate = real
        else:
            candidate = Path(os.path.normpath(f"{root}/{cgroup.lstrip('/')}"))
    candidate = Path(os.path.realpath(candidate))
    if candidate != root and root not in candidate.parents:
        raise UsageError(f"{cgroup if cgroup is not None else candidate} is outside the cgroup mount {root}")
    if not (candidate / "cgroup.procs").is_file():
        raise UsageError(f"{candidate} is not a cgroup (no cgroup.procs)")
    return candidate


def _proc_status(pid: int, proc_root: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in (proc_root / str(pid) / "status").read_text(errors="replace").splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key] = value.split()
    return out


def _child_in_namespace(parent: int, nspid: int, depth: int, proc_root: Path) -> int | None:
    """The child of `parent` whose pid in its own (depth-th) pid namespace is nspid."""
    try:
        tasks = list((proc_root / str(parent) / "task").iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for c in children:
            try:
                ns = _proc_status(int(c), proc_root).get("NSpid", [])
            except (OSError, ValueError):
                continue
            if len(ns) == depth and ns[-1] == str(nspid):
                return int(c)
    return None


def claim_pid(pid: Any, peer: Peer, proc_root: Path = Path("/proc"), agent_pid: int | None = None) -> int:
    """The pid, as the agent sees it, of the process a peer asks to isolate, checked to be the peer's.

    A peer in a child pid namespace (its NSpid line has more than one entry) names the pid as it
    sees it: the process is looked for among the peer's own children. The process must belong to
    the peer: root may name any, anyone else only one whose real, effective, saved and filesystem
    uids are all the peer's (the rule ptrace uses). Raises Forbidden (403) otherwise."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise UsageError('"isolate_pid" must be a positive integer')
    if peer.pid <= 0:
        raise Forbidden(
            "the agent cannot see your processes (they are in a pid namespace it does not share)",
            hint="share the process namespace with the agent (shareProcessNamespace, or hostPID)",
        )
    try:
        depth = len(_proc_status(peer.pid, proc_root).get("NSpid", ["-"]))
    except OSError:
        raise Forbidden(f"the agent cannot read your process {peer.pid} in /proc") from None
    target = pid
    if depth > 1:
        found = _child_in_namespace(peer.pid, pid, depth, proc_root)
        if found is None:
            raise Forbidden(f"process {pid} is not a child of yours", hint="isolate a process you forked")
        target = found
    try:
        uids = _proc_status(target, proc_root).get("Uid", [])
    except FileNotFoundError:
        raise UsageError(f"no process {pid}") from None
    except OSError as e:
        raise UsageError(f"cannot read process {pid}: {e.strerror}") from None
    refuse_protected(target, proc_root, agent_pid, as_named=pid)
    if peer.uid != 0 and not _owned(uids, peer.uid):
        raise Forbidden(
            f"process {pid} is not yours: uid {peer.uid} may only isolate its own processes",
            hint="run the command as the user that talks to the agent",
        )
    return target


def _owned(uids: Sequence[str], uid: int) -> bool:
    """Whether a process with these Uid: fields (real, effective, saved, filesystem) is uid's."""
    return len(uids) == 4 and all(u == str(uid) for u in uids)


def _ppid(pid: int, proc_root: Path) -> int:
    try:
        return int(_proc_status(pid, proc_root).get("PPid", ["0"])[0])
    except (OSError, ValueError, IndexError):
        return 0


def protected_pids(proc_root: Path = Path("/proc"), agent_pid: int | None = None) -> frozenset[int]:
    """PID 1, the agent and its ancestors: no peer, root included, may have them isolated or
    recorded (moving or killing them would take the system or the agent down)."""
    pids = {1}
    pid = agent_pid if agent_pid is not None else os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        pid = _ppid(pid, proc_root)
    return frozenset(pids)


def refuse_protected(
    pid: int, proc_root: Path = Path("/proc"), agent_pid: int | None = None, as_named: int | None = None
) -> None:
    """Forbidden when pid is PID 1, the agent, or one of the agent's ancestors."""
    if pid in protected_pids(proc_root, agent_pid):
        raise Forbidden(
            f"process {as_named if as_named is not None else pid} is PID 1, the agent or an ancestor "
            "of the agent: the agent does not take it into a run",
            hint="name a process of the job",
        )


def check_start(
    cgroup: Path,
    pid: int | None,
    named_cgroup: bool,
    peer: Peer,
    cgroup_root: Path,
    proc_root: Path = Path("/proc"),
    ns_base: str = "",
    agent_pid: int | None = None,
) -> None:
    """Whether `peer` may have `cgroup` recorded (POST /runs with "cgroup" or "pid"); Forbidden if not.

    For every peer: not a cgroup that holds PID 1, the agent or an ancestor of the agent (nor the
    process named by "pid" being one). For a peer other than root, the same rule as isolate_pid:
    the process it names must be its own (all four uids), a cgroup it names by path must be
    delegated to it (the directory is owned by its uid), and every process in the cgroup and the
    cgroups below must be its own: the inventory taken at attach lists their argv and files."""
    if pid is not None:
        refuse_protected(pid, proc_root, agent_pid)
    for p in sorted(protected_pids(proc_root, agent_pid)):
        try:
            theirs = resolve_cgroup(None, p, cgroup_root, proc_root, ns_base)
        except UsageError:
            continue
        if theirs == cgroup or cgroup in theirs.parents:
            raise Forbidden(
                f"{cgroup} holds PID 1, the agent or an ancestor of the agent: it is not recorded",
                hint="record a cgroup of the job's own",
            )
    if peer.uid == 0:
        return
    if pid is not None:
        try:
            uids = _proc_status(pid, proc_root).get("Uid", [])
        except OSError:
            raise UsageError(f"no process {pid}") from None
        if not _owned(uids, peer.uid):
            raise Forbidden(
                f"process {pid} is not yours: uid {peer.uid} may only record its own processes",
                hint="run the job as the user that talks to the agent",
            )
    if named_cgroup:
        try:
            owner = os.stat(cgroup).st_uid
        except OSError as e:
            raise UsageError(f"cannot read {cgroup}: {e.strerror}") from None
        if owner != peer.uid:
            raise Forbidden(
                f"{cgroup} is not delegated to uid {peer.uid} (its owner is uid {owner})",
                hint="name a cgroup delegated to you, or a process of yours",
            )
    for p in _pids_below(cgroup):
        try:
            uids = _proc_status(p, proc_root).get("Uid", [])
        except OSError:
            continue  # gone meanwhile
        if not _owned(uids, peer.uid):
            raise Forbidden(
                f"{cgroup} holds processes of other users (process {p}): uid {peer.uid} may only "
                "record cgroups that hold only its own processes",
                hint="record the job in a cgroup of its own: evidence run --agent",
            )


def _pids_below(cgroup: Path) -> list[int]:
    pids: list[int] = []
    for d, _dirs, files in os.walk(cgroup):
        if "cgroup.procs" not in files:
            continue
        try:
            with open(os.path.join(d, "cgroup.procs")) as f:
                pids.extend(int(x) for x in f.read().split())
        except (OSError, ValueError):
            continue
    return pids


def find_cgroup_by_inode(root: Path, inode: int, max_depth: int = 8) -> Path | None:
    """The directory under root whose inode (the cgroup id) is `inode`: how an agent in a cgroup
    namespace finds its namespace root on the host's cgroup mount (stat its own /sys/fs/cgroup)."""
    stack = [(root, 0)]
    while stack:
        d, depth = stack.pop()
        try:
            if os.stat(d).st_ino == inode:
                return d
            if depth < max_depth:
                with os.scandir(d) as it:
                    stack.extend((Path(e.path), depth + 1) for e in it if e.is_dir(follow_symlinks=False))
        except OSError:
            continue
    return None


def bundle_target(bundle: Any, session_id: str, bundle_dir: Path, peer_uid: int) -> Path:
    """Where a finished run's bundle is written: a plain name in bundle_dir, or (root only) a path."""
    if bundle is None:
        name = f"{session_id}.tar.gz"
        if not BUNDLE_NAME.fullmatch(name):
            raise UsageError(f'session id {session_id!r} does not make a bundle name; give "bundle"')
        return bundle_dir / name
    if not isinstance(bundle, str) or not bundle:
        raise UsageError('"bundle" must be a file name')
    if os.path.isabs(bundle):
        if peer_uid != 0:
            raise UsageError(
                "only root may have the agent write a bundle outside its bundle directory",
                hint="give a file name, then download it: evidence finish --bundle",
            )
        return Path(os.path.normpath(bundle))
    if not BUNDLE_NAME.fullmatch(bundle):
        raise UsageError(f"bundle name {bundle!r} must be a plain file name ending in .tar.gz")
    return bundle_dir / bundle
