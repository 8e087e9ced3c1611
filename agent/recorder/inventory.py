"""What was already running in a cgroup when recording started (attach to a running cgroup).

The probes only see what happens after they are attached; for a cgroup that was running before,
the bundle starts with one `inventory` record per process there: argv, cwd, exe and parent from
/proc, and its open TCP/UDP sockets (IPv4 and IPv6, listening, connected or bound) from the
kernel's sock_diag (pyroute2's DiagSocket), matched to the process by the socket inodes in
/proc/PID/fd. Processes in another network namespace (pods) are looked up in that namespace: a
helper thread enters it with setns(2) (needs CAP_SYS_ADMIN) and asks sock_diag there; without the
privilege, /proc/PID/net/{tcp,tcp6,udp,udp6}, which show the process's own namespace, are read
instead. A process that exits while it is being read is left out; a field that cannot be read
(permissions) is null, never guessed.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TypedDict

from evidence.agent.recorder.decode import path_text
from evidence.bundle.record_types import InventoryRecord

logger = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
TCP_STATES = {
    1: "established", 2: "syn-sent", 3: "syn-recv", 4: "fin-wait1", 5: "fin-wait2", 6: "time-wait",
    7: "close", 8: "close-wait", 9: "last-ack", 10: "listen", 11: "closing",
}  # fmt: skip
MAX_PROCESSES = 10_000

SocketTable = dict[int, str]  # socket inode -> description


def describe_socket(proto: str, family: int, state: int, src: str, sport: int, dst: str, dport: int) -> str:
    """'tcp listen 127.0.0.1:8080', 'tcp established [::1]:40000 -> [::1]:8080', 'udp bound 0.0.0.0:53'."""

    def ep(addr: str, port: int) -> str:
        return f"[{addr}]:{port}" if family == socket.AF_INET6 else f"{addr}:{port}"

    if proto == "udp":
        if state == 1:
            return f"udp connected {ep(src, sport)} -> {ep(dst, dport)}"
        return f"udp bound {ep(src, sport)}"
    name = TCP_STATES.get(state, f"state{state}")
    if state == 10:
        return f"tcp listen {ep(src, sport)}"
    return f"tcp {name} {ep(src, sport)} -> {ep(dst, dport)}"


# --- sock_diag --------------------------------------------------------------------------------------


def sockets_via_diag() -> SocketTable:
    """Every TCP/UDP socket of the calling thread's network namespace, by inode."""
    from pyroute2 import DiagSocket

    table: SocketTable = {}
    with DiagSocket() as ds:
        ds.bind()
        for family in (socket.AF_INET, socket.AF_INET6):
            for proto, name in ((socket.IPPROTO_TCP, "tcp"), (socket.IPPROTO_UDP, "udp")):
                for msg in ds.get_sock_stats(family=family, protocol=proto):
                    inode = int(msg["idiag_inode"])
                    if inode:
                        table[inode] = describe_socket(
                            name,
                            family,
                            int(msg["idiag_state"]),
                            str(msg["idiag_src"]),
                            int(msg["idiag_sport"]),
                            str(msg["idiag_dst"]),
                            int(msg["idiag_dport"]),
                        )
    return table


def _setns(fd: int, nstype: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, nstype) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def sockets_in_netns(ns_path: str) -> SocketTable:
    """sock_diag in another network namespace, from a short-lived thread that enters it (setns
    changes only the calling thread's namespace; the thread ends with it)."""
    result: list[SocketTable] = []
    error: list[BaseException] = []

    def work() -> None:
        try:
            fd = os.open(ns_path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                _setns(fd, CLONE_NEWNET)
            finally:
                os.close(fd)
            result.append(sockets_via_diag())
        except BaseException as e:  # reported to the caller
            error.append(e)

    t = threading.Thread(target=work, name="evidence-netns", daemon=True)
    t.start()
    t.join(10)
    if error:
        raise error[0]
    if not result:
        raise TimeoutError(f"sock_diag in {ns_path} did not answer")
    return result[0]


# --- /proc/PID/net fallback -------------------------------------------------------------------------


def _hex_addr(text: str, family: int) -> str:
    raw = bytes.fromhex(text)
    # /proc/net prints each 32-bit word in host (little-endian here) byte order
    fixed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(fixed)) if family == socket.AF_INET6 else socket.inet_ntoa(fixed)


def parse_proc_net(text: str, proto: str, family: int) -> SocketTable:
    """The socket table of /proc/PID/net/{tcp,tcp6,udp,udp6}."""
    table: SocketTable = {}
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 10:
            continue
        try:
            src, sport = f[1].split(":")
            dst, dport = f[2].split(":")
            inode = int(f[9])
            if inode:
                table[inode] = describe_socket(
                    proto, family, int(f[3], 16), _hex_addr(src, family), int(sport, 16),
                    _hex_addr(dst, family), int(dport, 16),
                )  # fmt: skip
        except ValueError:
            continue
    return table


def sockets_via_proc(pid: int, proc_root: Path = Path("/proc")) -> SocketTable:
    table: SocketTable = {}
    for name, proto, family in (
        ("tcp", "tcp", socket.AF_INET), ("tcp6", "tcp", socket.AF_INET6),
        ("udp", "udp", socket.AF_INET), ("udp6", "udp", socket.AF_INET6),
    ):  # fmt: skip
        try:
            table.update(parse_proc_net((proc_root / str(pid) / "net" / name).read_text(), proto, family))
        except OSError:
            continue
    return table


# --- processes --------------------------------------------------------------------------------------


def cgroup_pids(cgroup_dir: str | Path) -> list[int]:
    """Every pid in the cgroup and its descendants, sorted."""
    pids: set[int] = set()
    for dirpath, _dirs, files in os.walk(cgroup_dir):
        if "cgroup.procs" not in files:
            continue
        try:
            text = Path(dirpath, "cgroup.procs").read_text()
        except OSError:
            continue  # removed while walking
        pids.update(int(p) for p in text.split() if p.isdigit())
        if len(pids) > MAX_PROCESSES:
            logger.warning(
                "more than %d processes in %s: the inventory is cut there", MAX_PROCESSES, cgroup_dir
            )
            break
    return sorted(pids)[:MAX_PROCESSES]


def _readlink(path: Path) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def socket_inodes(pid: int, proc_root: Path = Path("/proc")) -> set[int]:
    inodes: set[int] = set()
    fd_dir = proc_root / str(pid) / "fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return inodes
    for name in names:
        target = _readlink(fd_dir / name)
        if target and target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


class ProcessInfo(TypedDict):
    pid: int
    ppid: int
    argv: list[str]
    cwd: str | None
    exe: str | None


def read_process(pid: int, proc_root: Path = Path("/proc")) -> ProcessInfo | None:
    """pid, ppid, argv, cwd, exe of a live process; None once it has gone."""
    base = proc_root / str(pid)
    try:
        stat = (base / "stat").read_text()
        cmdline = (base / "cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # stat: "pid (comm) state ppid ...": comm may hold spaces and parentheses
    fields = stat[stat.rfind(")") + 2 :].split()
    ppid = int(fields[1]) if len(fields) > 1 else 0
    argv = [a.decode("utf-8", "surrogateescape") for a in cmdline.split(b"\0")[:-1]] if cmdline else []
    if not argv:  # kernel thread, or a zombie: the name from stat is all there is
        argv = [stat[stat.find("(") + 1 : stat.rfind(")")]]
    return {
        "pid": pid,
        "ppid": ppid,
        "argv": [a.encode("utf-8", "surrogateescape").decode("utf-8", "replace") for a in argv],
        "cwd": _text(_readlink(base / "cwd")),
        "exe": _text(_readlink(base / "exe")),
    }


def _text(name: str | None) -> str | None:
    return path_text(name) if name is not None else None


def _netns_of(pid: int, proc_root: Path) -> tuple[int, str] | None:
    path = proc_root / str(pid) / "ns" / "net"
    try:
        return os.stat(path).st_ino, str(path)
    except OSError:
        return None


class _SocketLookup:
    """Socket tables per network namespace, each read once per inventory."""

    def __init__(self, proc_root: Path) -> None:
        self.proc_root = proc_root
        self.own_ns = _netns_of(os.getpid(), proc_root) if proc_root == Path("/proc") else None
        self.tables: dict[int, SocketTable] = {}

    def table_for(self, pid: int) -> SocketTable:
        ns = _netns_of(pid, self.proc_root)
        if ns is None:
            return sockets_via_proc(pid, self.proc_root)
        ino, path = ns
        if ino not in self.tables:
            self.tables[ino] = self._read(pid, ino, path)
        return self.tables[ino]

    def _read(self, pid: int, ino: int, path: str) -> SocketTable:
        try:
            if self.own_ns is not None and ino == self.own_ns[0]:
                return sockets_via_diag()
            return sockets_in_netns(path)
        except Exception as e:
            logger.info("sock_diag for netns %d unavailable (%s); reading /proc/%d/net", ino, e, pid)
            return sockets_via_proc(pid, self.proc_root)


def take_inventory(
    cgroup_dir: str | Path, now_ns: int | None = None, proc_root: Path = Path("/proc")
) -> list[InventoryRecord]:
    """One record per process in the cgroup tree, by pid; each with its sockets, sorted."""
    t = time.time_ns() if now_ns is None else now_ns
    lookup = _SocketLookup(proc_root)
    records: list[InventoryRecord] = []
    for pid in cgroup_pids(cgroup_dir):
        info = read_process(pid, proc_root)
        if info is None:
            continue
        inodes = socket_inodes(pid, proc_root)
        sockets: list[str] = []
        if inodes:
            table = lookup.table_for(pid)
            sockets = sorted({table[i] for i in inodes if i in table})
        records.append({"k": "inventory", "t": t, **info, "sockets": sockets})
    return records


def summarize(records: Iterable[InventoryRecord]) -> str:
    recs = list(records)
    n_sock = sum(len(r["sockets"]) for r in recs)
    return f"{len(recs)} process(es), {n_sock} socket(s)"
