"""Decode the probes' raw ring-buffer records (bytes) into dicts. Pure: no BCC, no root.

The layouts mirror the structs in probes/record.bpf.c; tests/unit/test_decode.py checks them against
saved raw records.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

from evidence.probes import kinds

# the record kinds, defined once (probes/kinds.py; record.bpf.c gets them from there too)
EV_EXEC = kinds.EV_EXEC
EV_EXEC_OK = kinds.EV_EXEC_OK
EV_FORK = kinds.EV_FORK
EV_EXIT = kinds.EV_EXIT
EV_OPEN = kinds.EV_OPEN
EV_CONNECT = kinds.EV_CONNECT
EV_CHDIR = kinds.EV_CHDIR
EV_FCHDIR = kinds.EV_FCHDIR
EV_DUP = kinds.EV_DUP
EV_RET = kinds.EV_RET
EV_CHANGE = kinds.EV_CHANGE  # a file change that is not an open (op)
EV_NS = kinds.EV_NS  # a namespace, mount, chroot or ptrace call (op)
EV_DNS = kinds.EV_DNS  # ---- dns: a DNS message sent or received
EV_KINDS = kinds.EV_KINDS
KIND_NAMES = kinds.RECORD_NAMES
DNS_SENT, DNS_RECEIVED = 0, 1  # struct dns_ev's dir
SC_EXEC = 2  # ret_ev.sc: exec's result is the only result that is a record of its own

F_PATH_TRUNC = 0x1
F_ARGS_TRUNC = 0x2
F_ARGS_FAULT = 0x4
F_FNAME_FAULT = 0x8
F_SEND = 0x10  # a connect record that is a send to an explicit address (sendto/sendmsg/sendmmsg)
F_FIRST = 0x20  # the first occurrence of a key the kernel aggregates (its count is in the agg map)
F_STATE = 0x40  # already counted by the kernel: only for the cwd and descriptor tables
F_PATH2_FAULT = 0x80  # a change record's second path could not be read
F_PATH2_TRUNC = 0x100  # a change record's second path is truncated
F_OTHER_NS = 0x200  # by a process that left the run's mount or user namespace, mounted or chrooted

# struct change_ev's op: what a file change record is
CHANGE_OPS = {
    1: "rename",
    2: "unlink",
    3: "rmdir",
    4: "link",
    5: "symlink",
    6: "truncate",
    7: "chmod",
    8: "chown",
    9: "mkdir",
    10: "mknod",
}

# struct ns_ev's op: which namespace, mount, chroot or ptrace call
NS_OPS = {
    1: "unshare",
    2: "setns",
    3: "clone",
    4: "mount",
    5: "move_mount",
    6: "open_tree",
    7: "fsmount",
    8: "pivot_root",
    9: "chroot",
    10: "ptrace",
    11: "process_vm_writev",
}

HDR = struct.Struct("<QQIIIHH")  # ts, cgid, run, tgid, tid, kind, flags
# Calls paired in the kernel (open, chdir, fchdir, connect, dup): one record each, the result first.
# exe_tok and tok: the kernel's aggregation key (with cgid, kind, access and result) when F_FIRST
_OPEN = struct.Struct("<qQQiIIHH")  # ret, exe_tok, tok, dfd, flags, mode, sc, path_len (+chdir, fchdir)
_CONNECT = struct.Struct("<qQQiI8x")  # ret, exe_tok, tok, fd, addrlen
_DUP = struct.Struct("<qii")  # ret, oldfd, newfd
# a file change: ret, (exe, tok unused), dfd, dfd2, mode, uid, gid, at_flags, op, len1, len2
_CHANGE = struct.Struct("<q16xiiIIIIHHH2x")
# a namespace call: ret, flags, target, dfd, dfd2, fstype, op, len1, len2 (the paths as a change's)
_NS = struct.Struct("<qQQii16sHHH2x")
# dfd, at_flags, old_tid, fname_len, args_len, argc, then (exec_ok) the file that was mapped: dev
# (kernel encoding), ino, size, ctime (s, ns)
_EXEC = struct.Struct("<iIIHHIIQQqI")
_FORK = struct.Struct("<II")
_EXIT = struct.Struct("<iI")
_RET = struct.Struct("<IIq")
OPEN_PATH_OFF = HDR.size + _OPEN.size  # 72
EXEC_BUF_OFF = HDR.size + _EXEC.size  # 84
# i_ctime_nsec's top bits are flags on kernels with multigrain timestamps (6.13: I_CTIME_QUERIED)
_NSEC_MASK = (1 << 30) - 1
CONNECT_ADDR_OFF = HDR.size + _CONNECT.size  # 72
CHANGE_BUF_OFF = HDR.size + _CHANGE.size  # 88
_DNS = struct.Struct("<qiHH28s4x")  # ret, fd, dir, len, the server's sockaddr
DNS_DATA_OFF = HDR.size + _DNS.size  # 80
NS_BUF_OFF = HDR.size + _NS.size  # 88


ACCESS_BITS = 0o3 | 0o100 | 0o1000 | 0o10000000 | 0o20200000  # as record.bpf.c: what access depends on


def agg_key(ev: dict[str, Any]) -> tuple[int, int, int, int, int, int]:
    """The kernel's aggregation key of an open or connect record (as `struct akey`, without the run):
    (exe token, path or address token, cgroup id, kind, access bits, result)."""
    kind = EV_OPEN if ev["kind"] == "open" else EV_CONNECT
    access = ev["oflags"] & ACCESS_BITS if kind == EV_OPEN else ev["flags"] & (F_SEND | F_FNAME_FAULT)
    ret = ev["ret"]
    return (ev["exe_tok"], ev["tok"], ev["cgid"], kind, access, ret if ret < 0 else 0)


class DecodeError(ValueError):
    pass


def _cstr(raw: bytes) -> str:
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
        return "AF_UNIX", _cstr(path), None
    if family == socket.AF_UNSPEC:
        return "AF_UNSPEC", "", None
    return "OTHER", f"family={family}", None


def decode(raw: bytes) -> dict[str, Any]:
    if len(raw) < HDR.size:
        raise DecodeError(f"record of {len(raw)} bytes is shorter than its header")
    ts, cgid, run, tgid, tid, kind, flags = HDR.unpack_from(raw, 0)
    ev: dict[str, Any] = {
        "kind": KIND_NAMES.get(kind, kind),
        "ts": ts,
        "cgid": cgid,
        "run": run,
        "tgid": tgid,
        "tid": tid,
        "flags": flags,
    }
    o = HDR.size
    if kind == EV_OPEN:
        ret, exe_tok, tok, dfd, oflags, mode, sc, plen = _OPEN.unpack_from(raw, o)
        ev.update(
            ret=ret,
            exe_tok=exe_tok,
            tok=tok,
            dfd=dfd,
            oflags=oflags,
            mode=mode,
            sc=sc,
            path=_cstr(raw[OPEN_PATH_OFF : OPEN_PATH_OFF + plen]),
        )
    elif kind in (EV_EXEC, EV_EXEC_OK):
        dfd, at_flags, old_tid, flen, alen, argc, kdev, ino, size, ctime_s, ctime_ns = _EXEC.unpack_from(
            raw, o
        )
        buf = raw[EXEC_BUF_OFF:]
        if ino:  # (st_dev, st_ino, st_size, st_ctime_ns) as stat(2) would give them
            ev["file"] = (
                os.makedev(kdev >> 20, kdev & 0xFFFFF),
                ino,
                size,
                ctime_s * 1_000_000_000 + (ctime_ns & _NSEC_MASK),
            )
        ev.update(
            dfd=dfd,
            at_flags=at_flags,
            old_tid=old_tid,
            argc=argc,
            filename=_cstr(buf[:flen]),
            argv=_argv(buf[flen : flen + alen]),
        )
    elif kind == EV_FORK:
        ev["child"] = _FORK.unpack_from(raw, o)[0]
    elif kind == EV_EXIT:
        ev["status"] = _EXIT.unpack_from(raw, o)[0]
    elif kind == EV_CONNECT:
        ret, exe_tok, tok, fd, addrlen = _CONNECT.unpack_from(raw, o)
        family, address, port = decode_sockaddr(raw[CONNECT_ADDR_OFF : CONNECT_ADDR_OFF + 128], addrlen)
        ev.update(ret=ret, exe_tok=exe_tok, tok=tok, fd=fd, family=family, address=address, port=port)
    elif kind in (EV_CHDIR, EV_FCHDIR):
        ret, _, _, fd, _, _, _, plen = _OPEN.unpack_from(raw, o)
        ev.update(ret=ret, fd=fd, path=_cstr(raw[OPEN_PATH_OFF : OPEN_PATH_OFF + plen]) if plen else None)
    elif kind == EV_CHANGE:
        ret, dfd, dfd2, mode, uid, gid, at_flags, op, len1, len2 = _CHANGE.unpack_from(raw, o)
        buf = raw[CHANGE_BUF_OFF:]
        ev.update(
            ret=ret,
            op=CHANGE_OPS.get(op, f"op{op}"),
            dfd=dfd,
            dfd2=dfd2,
            mode=mode,
            uid=uid,
            gid=gid,
            at_flags=at_flags,
            path=_cstr(buf[:len1]) if len1 else None,
            path2=_cstr(buf[len1 : len1 + len2]) if len2 else None,
        )
    elif kind == EV_NS:
        ret, nflags, target, dfd, dfd2, fstype, op, len1, len2 = _NS.unpack_from(raw, o)
        buf = raw[NS_BUF_OFF:]
        ev.update(
            ret=ret,
            op=NS_OPS.get(op, f"op{op}"),
            ns_flags=nflags,
            target=target,
            dfd=dfd,
            dfd2=dfd2,
            fstype=_cstr(fstype) or None,
            path=_cstr(buf[:len1]) if len1 else None,
            path2=_cstr(buf[len1 : len1 + len2]) if len2 else None,
        )
    elif kind == EV_DUP:
        ev["ret"], ev["oldfd"], ev["newfd"] = _DUP.unpack_from(raw, o)
    elif kind == EV_DNS:
        ret, fd, direction, n, addr = _DNS.unpack_from(raw, o)
        family, address, port = decode_sockaddr(addr, len(addr))
        ev.update(
            ret=ret,
            fd=fd,
            received=direction == DNS_RECEIVED,
            family=family,
            address=address,
            port=port,
            payload=raw[DNS_DATA_OFF : DNS_DATA_OFF + n],
        )
    elif kind == EV_RET:
        sc, _, ret = _RET.unpack_from(raw, o)
        ev.update(sc=sc, ret=ret)
    else:
        raise DecodeError(f"unknown record kind {kind}")
    return ev


# An open record's header and fields in one unpack (the recorder's fast path, Recorder._process):
# ts, cgid, run, tgid, tid, kind, flags, ret, exe_tok, tok, dfd, oflags, mode, sc, path_len
OPEN_REC = struct.Struct(HDR.format + _OPEN.format.lstrip("<"))
KIND_OFF = 28  # struct hdr: kind (u16) at byte 28
OPEN_KIND = struct.pack("<H", EV_OPEN)  # those two bytes of an open record
