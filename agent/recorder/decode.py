"""Decode the probes' raw ring-buffer records (bytes) into dicts. Pure: no BCC, no root.

The layouts are probes/abi.py's (the one definition the BPF C includes too); tests/unit/test_decode.py
checks them against saved raw records. Each kind's decoded dict has a type here (a TypedDict, `kind` its Literal
discriminator: `RawEvent` is their union), checked by tests/unit/test_record_types.py against what
the saved raw records decode to; the correlator turns them into the spool's records
(bundle/record_types.py).

(Over 600 lines on purpose: one decoder per record kind, each beside its TypedDict, read and changed
with the layout it unpacks; split by kind they would import each other's flag tables.)
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Literal, NotRequired, TypedDict, cast

from evidence.probes import abi
from evidence.probes.abi import ACCESS_BITS as ACCESS_BITS
from evidence.probes.abi import CHANGE_OPS as CHANGE_OPS
from evidence.probes.abi import DNS_DELIVERED as DNS_DELIVERED
from evidence.probes.abi import DNS_RECEIVED as DNS_RECEIVED
from evidence.probes.abi import DNS_SENT as DNS_SENT
from evidence.probes.abi import EV_CHANGE as EV_CHANGE
from evidence.probes.abi import EV_CHDIR as EV_CHDIR
from evidence.probes.abi import EV_CONNECT as EV_CONNECT
from evidence.probes.abi import EV_DNS as EV_DNS
from evidence.probes.abi import EV_DUP as EV_DUP
from evidence.probes.abi import EV_EXEC as EV_EXEC
from evidence.probes.abi import EV_EXEC_OK as EV_EXEC_OK
from evidence.probes.abi import EV_EXEC_VIOLATION as EV_EXEC_VIOLATION
from evidence.probes.abi import EV_EXIT as EV_EXIT
from evidence.probes.abi import EV_FCHDIR as EV_FCHDIR
from evidence.probes.abi import EV_FORK as EV_FORK
from evidence.probes.abi import EV_KINDS as EV_KINDS
from evidence.probes.abi import EV_NS as EV_NS
from evidence.probes.abi import EV_OPEN as EV_OPEN
from evidence.probes.abi import EV_RET as EV_RET
from evidence.probes.abi import EV_SIGSYS as EV_SIGSYS
from evidence.probes.abi import F_ARGS_FAULT as F_ARGS_FAULT
from evidence.probes.abi import F_ARGS_TRUNC as F_ARGS_TRUNC
from evidence.probes.abi import F_FIRST as F_FIRST
from evidence.probes.abi import F_FNAME_FAULT as F_FNAME_FAULT
from evidence.probes.abi import F_IN_ROOT as F_IN_ROOT
from evidence.probes.abi import F_KNAME as F_KNAME
from evidence.probes.abi import F_OTHER_NS as F_OTHER_NS
from evidence.probes.abi import F_PATH2_FAULT as F_PATH2_FAULT
from evidence.probes.abi import F_PATH2_TRUNC as F_PATH2_TRUNC
from evidence.probes.abi import F_PATH_TRUNC as F_PATH_TRUNC
from evidence.probes.abi import F_SEND as F_SEND
from evidence.probes.abi import F_STATE as F_STATE
from evidence.probes.abi import NO_RESULT as NO_RESULT
from evidence.probes.abi import NS_OPS as NS_OPS
from evidence.probes.abi import SC_EXEC as SC_EXEC

# The record kinds, flags, operations and layouts are probes/abi.py's (their one definition, which
# record.bpf.c includes as a generated header); the names above are re-exported for the recorder.
KIND_NAMES = abi.RECORD_NAMES
HDR = abi.HDR.struct  # ts, cgid, run, tgid, tid, kind, flags
# Calls paired in the kernel (open, chdir, fchdir, connect, dup): one record each, the result first.
# exe_tok and tok: the kernel's aggregation key (with cgid, kind, access and result) when F_FIRST.
# dino, dino2: what a dirfd named at entry, rino: what the descriptor a call returned names, each
# the address of the file's struct inode in the kernel (0: not read): identities, compared with
# what the descriptor table learnt, never written to a bundle
# nlink: a write open's file's link count (0: not read), a change's when a descriptor names its file
_OPEN = abi.OPEN_EV.struct  # ret, exe_tok, tok, dfd, flags, mode, nlink, sc, path_len, dino, rino
_CONNECT = abi.CONNECT_EV.struct  # ret, exe_tok, tok, fd, addrlen, dino
_DUP = abi.DUP_EV.struct  # ret, oldfd, newfd, rino
# a file change: ret, mino, mino2, dfd, dfd2, dino, dino2, mode, nlink, uid, gid, at_flags, op, len1, len2
# (mino, mino2: what the descriptor a path names through a magic link named, bpf/changes.bpf.c magic_fd)
_CHANGE = abi.CHANGE_EV.struct
# a namespace call: ret, flags, target, dfd, dfd2, dino, dino2, fstype, op, len1, len2 (the paths as a change's)
_NS = abi.NS_EV.struct
# dfd, at_flags, old_tid, fname_len, args_len, argc, then (exec_ok) the file that was mapped: dev
# (kernel encoding), ino, size, ctime (s, ns); then (exec) dino
_EXEC = abi.EXEC_EV.struct
_FORK = abi.FORK_EV.struct  # child
_EXIT = abi.EXIT_EV.struct  # status
_RET = abi.RET_EV.struct  # sc, ret
_SIGSYS = abi.SIGSYS_EV.struct  # nr, arch, ip
# old_tid, reason, then what was loaded (ino, dev, args_len, argv_hash) and what was decided
# (want_ino, want_hash, want_dev, want_args_len, want_flags), kill
_VIOLATION = abi.EXEC_VIOLATION_EV.struct
OPEN_PATH_OFF = abi.OPEN_EV.size  # where the path starts (chdir's and fchdir's too)
EXEC_BUF_OFF = abi.EXEC_EV.size
# i_ctime_nsec's top bits are flags on kernels with multigrain timestamps (6.13: I_CTIME_QUERIED)
_NSEC_MASK = (1 << 30) - 1
CONNECT_ADDR_OFF = abi.CONNECT_EV.size
CONNECT_ADDR_MAX = abi.CONNECT_ADDR_MAX
CHANGE_BUF_OFF = abi.CHANGE_EV.size
# ret, fd, dir, len, the server's (delivered: the source's) sockaddr, seq, sock, cookie, proto, tcp flags
_DNS = abi.DNS_EV.struct
DNS_DATA_OFF = abi.DNS_EV.size
NS_BUF_OFF = abi.NS_EV.size


class _Header(TypedDict):
    """struct hdr: every record's first fields."""

    ts: int  # monotonic ns
    cgid: int  # the task's own cgroup id
    run: int  # the run's slot
    tgid: int
    tid: int
    flags: int  # F_*


class _ExecFields(_Header):
    dfd: int
    at_flags: int
    old_tid: int
    argc: int
    filename: str
    argv: list[str]
    dino: int  # exec: what dfd named at entry (its inode's address), 0: not read
    # (st_dev, st_ino, st_size, st_ctime_ns) of the file mapped (exec_ok, when the kernel read it)
    file: NotRequired[tuple[int, int, int, int]]


class ExecEvent(_ExecFields):
    kind: Literal["exec"]  # an attempt, with its argv (its result follows as a RetEvent)


class ExecOkEvent(_ExecFields):
    kind: Literal["exec_ok"]  # a success (sched_process_exec), argv read from the new image


class ForkEvent(_Header):
    kind: Literal["fork"]
    child: int


class ExitEvent(_Header):
    kind: Literal["exit"]
    status: int  # a wait status


class OpenEvent(_Header):
    kind: Literal["open"]
    ret: int
    exe_tok: int
    tok: int
    dfd: int
    oflags: int
    mode: int
    nlink: int  # a write open's file's link count, 0: not read
    sc: int
    path: str
    dino: int  # what dfd named at entry (its inode's address), 0: not read
    rino: int  # what the descriptor returned names, 0: none
    kname: str | None  # the kernel's name of the file opened (F_KNAME), else None


class ConnectEvent(_Header):
    kind: Literal["connect"]
    ret: int
    exe_tok: int
    tok: int
    fd: int
    family: str
    address: str
    port: int | None
    dino: int  # a relative AF_UNIX path: the cwd at entry (its inode's address), else 0


class _DirEvent(_Header):
    ret: int
    fd: int
    path: str | None
    dino: int  # fchdir: what fd named at entry; chdir: the cwd a relative path is resolved against
    rino: int  # the directory it changed to (the cwd read at exit), 0: not read
    kname: str | None  # the kernel's name of the new cwd (F_KNAME), else None


class ChdirEvent(_DirEvent):
    kind: Literal["chdir"]


class FchdirEvent(_DirEvent):
    kind: Literal["fchdir"]


class ChangeEvent(_Header):
    kind: Literal["change"]
    ret: int
    op: str  # CHANGE_OPS
    dfd: int
    dfd2: int
    dino: int  # what dfd and dfd2 named at entry (their inodes' addresses), 0: not read
    dino2: int
    # path (path2) through a magic link of the process's descriptors (/proc/self/fd/N/...): what
    # descriptor N (names.magic_fd) named at entry and exit, 0: none, or not the same file
    mino: int
    mino2: int
    mode: int
    nlink: int  # the file's link count when a descriptor names it (fchmod, a magic link), 0: not read
    uid: int
    gid: int
    at_flags: int
    path: str | None
    path2: str | None


class NamespaceEvent(_Header):
    kind: Literal["namespace"]
    ret: int
    op: str  # NS_OPS
    ns_flags: int
    target: int
    dfd: int
    dfd2: int
    dino: int  # what dfd and dfd2 named at entry (their inodes' addresses), 0: not read
    dino2: int
    fstype: str | None
    path: str | None
    path2: str | None


class DupEvent(_Header):
    kind: Literal["dup"]
    ret: int
    oldfd: int
    newfd: int
    rino: int  # what the descriptor returned names (its inode's address), 0: none


class DnsEvent(_Header):
    kind: Literal["dns"]
    ret: int
    fd: int
    received: bool  # a message the job received (read from its buffer), else sent ...
    delivered: bool  # ... or, by neither: what the kernel delivered to a socket of the run (no process)
    family: str
    address: str  # sent, received: the server the socket's queries go to; delivered: the source
    port: int | None
    sock: int  # sent, received: the socket's identity (its inode's address)
    cookie: int  # received: the socket's cookie (0: not known); delivered: the receiving socket's
    proto: int  # delivered: 17 (UDP) or 6 (TCP)
    seq: int  # delivered over TCP: the segment's sequence number ...
    tcp_flags: int  # ... and flags
    payload: bytes


class RetEvent(_Header):
    kind: Literal["ret"]
    sc: int
    ret: int


class SigsysEvent(_Header):
    """A system call through a 32-bit entry, refused by the run's seccomp filter (SIGSYS)."""

    kind: Literal["sigsys"]
    nr: int  # its number in its architecture's table
    arch: int  # AUDIT_ARCH_*
    ip: int  # the address after the calling instruction


class ExecViolationEvent(_Header):
    """An exec of a run whose command rules are enforced that loaded another file or copied other
    arguments than its supervisor decided, or that it never decided: killed before its first
    instruction (bpf/exec_check.bpf.c)."""

    kind: Literal["exec_violation"]
    old_tid: int  # the thread that called exec
    reasons: list[str]  # what differed: probes/abi.py VIOLATIONS' names (no_pin, file, args, ...)
    file: tuple[int, int]  # (st_dev, st_ino) of what the kernel loaded (0, 0: not read)
    args_len: int  # the arg area the kernel copied: its length and hash (0: not hashed)
    argv_hash: int
    # the decision (the pin), None when there was none
    decided: tuple[int, int] | None  # (st_dev, st_ino)
    decided_args_len: int
    decided_hash: int
    decided_flags: int  # PIN_SCRIPT
    killed: bool  # bpf_send_signal(SIGKILL) succeeded
    kill_error: int  # its result when it did not (-errno)


RawEvent = (
    ExecEvent
    | ExecOkEvent
    | ForkEvent
    | ExitEvent
    | OpenEvent
    | ConnectEvent
    | ChdirEvent
    | FchdirEvent
    | ChangeEvent
    | NamespaceEvent
    | DupEvent
    | DnsEvent
    | RetEvent
    | SigsysEvent
    | ExecViolationEvent
)
# a record kind's number -> the type of what decode() makes of it (names from probes/abi.py)
EVENT_TYPES: dict[int, type] = {
    EV_EXEC: ExecEvent,
    EV_EXEC_OK: ExecOkEvent,
    EV_FORK: ForkEvent,
    EV_EXIT: ExitEvent,
    EV_OPEN: OpenEvent,
    EV_CONNECT: ConnectEvent,
    EV_CHDIR: ChdirEvent,
    EV_FCHDIR: FchdirEvent,
    EV_CHANGE: ChangeEvent,
    EV_NS: NamespaceEvent,
    EV_DUP: DupEvent,
    EV_DNS: DnsEvent,
    EV_RET: RetEvent,
    EV_SIGSYS: SigsysEvent,
    EV_EXEC_VIOLATION: ExecViolationEvent,
}


def agg_key(ev: OpenEvent | ConnectEvent) -> tuple[int, int, int, int, int, int, int]:
    """The kernel's aggregation key of an open or connect record (as `struct akey`, without the run):
    (exe token, path or address token, cgroup id, kind, access bits, result, what an open opened)."""
    ret = ev["ret"]
    if ev["kind"] == "open":
        kind, access, ino = EV_OPEN, ev["oflags"] & ACCESS_BITS, ev["rino"] if ret >= 0 else 0
    else:
        kind, access, ino = EV_CONNECT, ev["flags"] & (F_SEND | F_FNAME_FAULT), 0
    return (ev["exe_tok"], ev["tok"], ev["cgid"], kind, access, ret if ret < 0 else 0, ino)


class DecodeError(ValueError):
    pass


def path_text(name: str) -> str:
    """A name read from the system as str (os.readlink, os.getcwd: bytes that are not UTF-8 become
    lone surrogates, which no JSON encoder takes) in the form the kernel's names get: such bytes as
    \\xNN. A job picks its cwd's name: one that is not UTF-8 crashed the recorder's consumer."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def cstr(raw: bytes) -> str:
    """A NUL-terminated name of the kernel's as str (bytes not UTF-8 as \\xNN)."""
    return raw.split(b"\0", 1)[0].decode("utf-8", "backslashreplace")


def _argv(raw: bytes) -> list[str]:
    if not raw:
        return []
    if raw.endswith(b"\0"):
        raw = raw[:-1]
    return [a.decode("utf-8", "backslashreplace") for a in raw.split(b"\0")]


def decode_sockaddr(raw: bytes, addrlen: int) -> tuple[str, str, int | None]:
    """(family, address, port) of a struct sockaddr as passed to connect()."""
    if addrlen < 2 or len(raw) < 2:
        return "OTHER", "", None
    family = struct.unpack_from("<H", raw, 0)[0]
    if family == socket.AF_INET and len(raw) >= 8:
        port = struct.unpack_from(">H", raw, 2)[0]
        return "AF_INET", socket.inet_ntop(socket.AF_INET, raw[4:8]), port
    if family == socket.AF_INET6 and len(raw) >= 24:
        port = struct.unpack_from(">H", raw, 2)[0]
        return "AF_INET6", socket.inet_ntop(socket.AF_INET6, raw[8:24]), port
    if family == socket.AF_UNIX:
        path = raw[2 : max(2, min(addrlen, len(raw)))]
        if path[:1] == b"\0":  # abstract socket
            return "AF_UNIX", "@" + path[1:].rstrip(b"\0").decode("utf-8", "backslashreplace"), None
        return "AF_UNIX", cstr(path), None
    if family == socket.AF_UNSPEC:
        return "AF_UNSPEC", "", None
    return "OTHER", f"family={family}", None


AUDIT_ARCH_I386, AUDIT_ARCH_X86_64, AUDIT_ARCH_ARM = 0x40000003, 0xC000003E, 0x40000028
X32_SYSCALL_BIT = 0x40000000
# the i386 calls a job would use to hide something (arch/x86/entry/syscalls/syscall_32.tbl), and a
# few that any 32-bit program makes first; others are named by number
I386_CALLS = {
    1: "exit", 2: "fork", 3: "read", 4: "write", 5: "open", 6: "close", 8: "creat", 9: "link",
    10: "unlink", 11: "execve", 12: "chdir", 14: "mknod", 15: "chmod", 16: "lchown", 20: "getpid",
    21: "mount", 26: "ptrace", 37: "kill", 38: "rename", 39: "mkdir", 40: "rmdir", 41: "dup", 45: "brk",
    54: "ioctl", 61: "chroot", 63: "dup2", 83: "symlink", 92: "truncate", 94: "fchmod", 95: "fchown",
    102: "socketcall", 120: "clone", 122: "uname", 133: "fchdir", 190: "vfork", 192: "mmap2",
    212: "chown32", 243: "set_thread_area", 252: "exit_group", 258: "set_tid_address", 295: "openat",
    296: "mkdirat", 297: "mknodat", 298: "fchownat", 301: "unlinkat", 302: "renameat", 303: "linkat",
    304: "symlinkat", 306: "fchmodat", 310: "unshare", 346: "setns", 347: "process_vm_readv",
    348: "process_vm_writev", 353: "renameat2", 358: "execveat", 359: "socket", 362: "connect",
    369: "sendto", 370: "sendmsg", 371: "recvfrom", 372: "recvmsg", 384: "arch_prctl",
    425: "io_uring_setup", 437: "openat2",
}  # fmt: skip


def refused_call(arch: int, nr: int) -> str:
    """A refused 32-bit call's name for a denial's target: "i386 open (5)", "x32 call 257"."""
    if arch == AUDIT_ARCH_I386:
        name = I386_CALLS.get(nr)
        return f"i386 {name} ({nr})" if name else f"i386 call {nr}"
    if arch == AUDIT_ARCH_X86_64 and nr & X32_SYSCALL_BIT:
        return f"x32 call {nr & ~X32_SYSCALL_BIT}"
    if arch == AUDIT_ARCH_ARM:
        return f"arm call {nr}"
    return f"arch {arch:#x} call {nr}"


def decode(raw: bytes) -> RawEvent:
    """The decoded record: `kind` (its name, probes/abi.py), its header's fields and its own."""
    if len(raw) < HDR.size:
        raise DecodeError(f"record of {len(raw)} bytes is shorter than its header")
    ts, cgid, run, tgid, tid, kind, flags = HDR.unpack_from(raw, 0)
    if kind in (EV_EXEC, EV_EXEC_OK):
        return _exec(raw, kind, ts, cgid, run, tgid, tid, flags)
    hdr: _Header = {"ts": ts, "cgid": cgid, "run": run, "tgid": tgid, "tid": tid, "flags": flags}
    o = HDR.size
    if kind == EV_OPEN:
        ret, exe_tok, tok, dfd, oflags, mode, nlink, sc, plen, dino, rino = _OPEN.unpack_from(raw, o)
        return {
            "kind": "open",
            **hdr,
            "ret": ret,
            "exe_tok": exe_tok,
            "tok": tok,
            "dfd": dfd,
            "oflags": oflags,
            "mode": mode,
            "nlink": nlink,
            "sc": sc,
            "path": cstr(raw[OPEN_PATH_OFF : OPEN_PATH_OFF + plen]),
            "dino": dino,
            "rino": rino,
            "kname": cstr(raw[OPEN_PATH_OFF + plen :]) if flags & F_KNAME else None,
        }
    if kind == EV_FORK:
        return {"kind": "fork", **hdr, "child": _FORK.unpack_from(raw, o)[0]}
    if kind == EV_EXIT:
        return {"kind": "exit", **hdr, "status": _EXIT.unpack_from(raw, o)[0]}
    if kind == EV_CONNECT:
        ret, exe_tok, tok, fd, addrlen, dino = _CONNECT.unpack_from(raw, o)
        family, address, port = decode_sockaddr(
            raw[CONNECT_ADDR_OFF : CONNECT_ADDR_OFF + CONNECT_ADDR_MAX], addrlen
        )
        return {
            "kind": "connect",
            **hdr,
            "ret": ret,
            "exe_tok": exe_tok,
            "tok": tok,
            "fd": fd,
            "family": family,
            "address": address,
            "port": port,
            "dino": dino,
        }
    if kind in (EV_CHDIR, EV_FCHDIR):
        ret, _, _, fd, _, _, _, _, plen, dino, rino = _OPEN.unpack_from(raw, o)
        path = cstr(raw[OPEN_PATH_OFF : OPEN_PATH_OFF + plen]) if plen else None
        kname = cstr(raw[OPEN_PATH_OFF + plen :]) if flags & F_KNAME else None
        # the two kinds have the same fields: one dict, typed by its kind (as _exec's)
        return cast(
            "ChdirEvent | FchdirEvent",
            {
                "kind": "chdir" if kind == EV_CHDIR else "fchdir",
                **hdr,
                "ret": ret,
                "fd": fd,
                "path": path,
                "dino": dino,
                "rino": rino,
                "kname": kname,
            },
        )
    if kind == EV_CHANGE:
        ret, mino, mino2, dfd, dfd2, dino, dino2, mode, nlink, uid, gid, at_flags, op, len1, len2 = (
            _CHANGE.unpack_from(raw, o)
        )
        buf = raw[CHANGE_BUF_OFF:]
        return {
            "kind": "change",
            **hdr,
            "ret": ret,
            "op": CHANGE_OPS.get(op, f"op{op}"),
            "dfd": dfd,
            "dfd2": dfd2,
            "dino": dino,
            "dino2": dino2,
            "mino": mino,
            "mino2": mino2,
            "mode": mode,
            "nlink": nlink,
            "uid": uid,
            "gid": gid,
            "at_flags": at_flags,
            "path": cstr(buf[:len1]) if len1 else None,
            "path2": cstr(buf[len1 : len1 + len2]) if len2 else None,
        }
    if kind == EV_NS:
        ret, nflags, target, dfd, dfd2, dino, dino2, fstype, op, len1, len2 = _NS.unpack_from(raw, o)
        buf = raw[NS_BUF_OFF:]
        return {
            "kind": "namespace",
            **hdr,
            "ret": ret,
            "op": NS_OPS.get(op, f"op{op}"),
            "ns_flags": nflags,
            "target": target,
            "dfd": dfd,
            "dfd2": dfd2,
            "dino": dino,
            "dino2": dino2,
            "fstype": cstr(fstype) or None,
            "path": cstr(buf[:len1]) if len1 else None,
            "path2": cstr(buf[len1 : len1 + len2]) if len2 else None,
        }
    if kind == EV_DUP:
        ret, oldfd, newfd, rino = _DUP.unpack_from(raw, o)
        return {"kind": "dup", **hdr, "ret": ret, "oldfd": oldfd, "newfd": newfd, "rino": rino}
    if kind == EV_DNS:
        ret, fd, direction, n, addr, seq, sock, cookie, proto, tcp_flags = _DNS.unpack_from(raw, o)
        family, address, port = decode_sockaddr(addr, len(addr))
        return {
            "kind": "dns",
            **hdr,
            "ret": ret,
            "fd": fd,
            "received": direction == DNS_RECEIVED,
            "delivered": direction == DNS_DELIVERED,
            "family": family,
            "address": address,
            "port": port,
            "sock": sock,
            "cookie": cookie,
            "proto": proto,
            "seq": seq,
            "tcp_flags": tcp_flags,
            "payload": raw[DNS_DATA_OFF : DNS_DATA_OFF + n],
        }
    if kind == EV_RET:
        sc, ret = _RET.unpack_from(raw, o)
        return {"kind": "ret", **hdr, "sc": sc, "ret": ret}
    if kind == EV_SIGSYS:
        nr, arch, ip = _SIGSYS.unpack_from(raw, o)
        return {"kind": "sigsys", **hdr, "nr": nr, "arch": arch, "ip": ip}
    if kind == EV_EXEC_VIOLATION:
        if len(raw) < abi.EXEC_VIOLATION_EV.size:
            raise DecodeError(f"exec violation record of {len(raw)} bytes")
        old_tid, reason, ino, kdev, alen, ahash, w_ino, w_hash, w_dev, w_len, w_flags, kill = (
            _VIOLATION.unpack_from(raw, o)
        )
        return {
            "kind": "exec_violation",
            **hdr,
            "old_tid": old_tid,
            "reasons": [name for bit, name in abi.VIOLATION_REASONS.items() if reason & bit],
            "file": (_stat_dev(kdev), ino) if ino else (0, 0),
            "args_len": alen,
            "argv_hash": ahash,
            "decided": None if reason & abi.VIOLATION_BIT["no_pin"] else (_stat_dev(w_dev), w_ino),
            "decided_args_len": w_len,
            "decided_hash": w_hash,
            "decided_flags": w_flags,
            "killed": kill == 0,
            "kill_error": kill,
        }
    raise DecodeError(f"unknown record kind {kind}")


def _stat_dev(kdev: int) -> int:
    """The kernel's encoding of a device number (major << 20 | minor) as stat(2) gives it."""
    return os.makedev(kdev >> 20, kdev & 0xFFFFF)


def _exec(
    raw: bytes, kind: int, ts: int, cgid: int, run: int, tgid: int, tid: int, flags: int
) -> ExecEvent | ExecOkEvent:
    """An exec's attempt (EV_EXEC) or success (EV_EXEC_OK)."""
    dfd, at_flags, old_tid, flen, alen, argc, kdev, ino, size, ctime_s, ctime_ns, dino = _EXEC.unpack_from(
        raw, HDR.size
    )
    buf = raw[EXEC_BUF_OFF:]
    filename, argv = cstr(buf[:flen]), _argv(buf[flen : flen + alen])
    # the two kinds have the same fields: one dict, typed by its kind (mypy cannot narrow a Literal
    # chosen at run time)
    ev = cast(
        "ExecEvent | ExecOkEvent",
        {
            "kind": "exec" if kind == EV_EXEC else "exec_ok",
            "ts": ts,
            "cgid": cgid,
            "run": run,
            "tgid": tgid,
            "tid": tid,
            "flags": flags,
            "dfd": dfd,
            "at_flags": at_flags,
            "old_tid": old_tid,
            "argc": argc,
            "filename": filename,
            "argv": argv,
            "dino": dino,
        },
    )
    if ino:  # (st_dev, st_ino, st_size, st_ctime_ns) as stat(2) would give them
        ev["file"] = (
            _stat_dev(kdev),
            ino,
            size,
            ctime_s * 1_000_000_000 + (ctime_ns & _NSEC_MASK),
        )
    return ev


# An open record's header and fields in one unpack (the recorder's fast path, Recorder._process):
# ts, cgid, run, tgid, tid, kind, flags, ret, exe_tok, tok, dfd, oflags, mode, nlink, sc, path_len, dino, rino
OPEN_REC = struct.Struct(HDR.format + _OPEN.format.lstrip("<"))
KIND_OFF = abi.HDR.offset("kind")
OPEN_KIND = struct.pack("<H", EV_OPEN)  # those two bytes of an open record
