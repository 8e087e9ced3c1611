"""Decode the probes' raw ring-buffer records (bytes) into dicts. Pure: no BCC, no root.

The layouts mirror the structs in probes/record.bpf.c; tests/unit/test_decode.py checks them against
saved raw records.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

(
    EV_EXEC,
    EV_EXEC_OK,
    EV_FORK,
    EV_EXIT,
    EV_OPEN,
    EV_CONNECT,
    EV_CHDIR,
    EV_FCHDIR,
    EV_DUP,
    EV_RET,
    EV_PATHFIX,
) = range(1, 12)
KIND_NAMES = {
    EV_EXEC: "exec",
    EV_EXEC_OK: "exec_ok",
    EV_FORK: "fork",
    EV_EXIT: "exit",
    EV_OPEN: "open",
    EV_CONNECT: "connect",
    EV_CHDIR: "chdir",
    EV_FCHDIR: "fchdir",
    EV_DUP: "dup",
    EV_RET: "ret",
    EV_PATHFIX: "pathfix",
}
EV_KINDS = 12
SC_OPEN, SC_EXEC, SC_CONNECT, SC_CHDIR, SC_FCHDIR, SC_DUP = range(1, 7)

F_PATH_TRUNC = 0x1
F_ARGS_TRUNC = 0x2
F_ARGS_FAULT = 0x4
F_FNAME_FAULT = 0x8
F_SEND = 0x10  # a connect record that is a send to an explicit address (sendto/sendmsg/sendmmsg)

HDR = struct.Struct("<QQIIIHH")  # ts, cgid, run, tgid, tid, kind, flags
_OPEN = struct.Struct("<iIIHH")  # dfd, flags, mode, sc, path_len
_EXEC = struct.Struct("<iIIHHI")  # dfd, at_flags, old_tid, fname_len, args_len, argc
_FORK = struct.Struct("<II")
_EXIT = struct.Struct("<iI")
_CONNECT = struct.Struct("<iI")
_CHDIR = struct.Struct("<iHH")
_DUP = struct.Struct("<ii")
_RET = struct.Struct("<IIq")
OPEN_PATH_OFF = HDR.size + _OPEN.size  # 48
EXEC_BUF_OFF = HDR.size + _EXEC.size  # 52
CONNECT_ADDR_OFF = HDR.size + _CONNECT.size  # 40
CHDIR_PATH_OFF = HDR.size + _CHDIR.size  # 40


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
        dfd, oflags, mode, sc, plen = _OPEN.unpack_from(raw, o)
        ev.update(
            dfd=dfd, oflags=oflags, mode=mode, sc=sc, path=_cstr(raw[OPEN_PATH_OFF : OPEN_PATH_OFF + plen])
        )
    elif kind in (EV_EXEC, EV_EXEC_OK):
        dfd, at_flags, old_tid, flen, alen, argc = _EXEC.unpack_from(raw, o)
        buf = raw[EXEC_BUF_OFF:]
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
        fd, addrlen = _CONNECT.unpack_from(raw, o)
        family, address, port = decode_sockaddr(raw[CONNECT_ADDR_OFF : CONNECT_ADDR_OFF + 128], addrlen)
        ev.update(fd=fd, family=family, address=address, port=port)
    elif kind in (EV_CHDIR, EV_FCHDIR, EV_PATHFIX):
        fd, plen, _ = _CHDIR.unpack_from(raw, o)
        ev.update(fd=fd, path=_cstr(raw[CHDIR_PATH_OFF : CHDIR_PATH_OFF + plen]) if plen else None)
    elif kind == EV_DUP:
        ev["oldfd"], ev["newfd"] = _DUP.unpack_from(raw, o)
    elif kind == EV_RET:
        sc, _, ret = _RET.unpack_from(raw, o)
        ev.update(sc=sc, ret=ret)
    else:
        raise DecodeError(f"unknown record kind {kind}")
    return ev
