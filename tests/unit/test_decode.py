"""Decoding: real ring-buffer records captured from the probes (tests/data/capture_raw.py), with the
decoded JSON saved beside them."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from evidence.agent.recorder import decode as d
from evidence.probes import abi


def jsonable(decoded: dict) -> dict:
    """A decoded record as raw_records.json holds it (tests/data/capture_raw.py): bytes as hex."""
    return {k: v.hex() if isinstance(v, bytes) else v for k, v in decoded.items()}


RECORDS = json.loads((Path(__file__).parent.parent / "data" / "raw_records.json").read_text())


@pytest.mark.parametrize("rec", RECORDS, ids=lambda r: f"{r['decoded']['kind']}")
def test_saved_records_decode_to_saved_json(rec: dict) -> None:
    # tuples as lists, bytes as hex (as tests/data/capture_raw.py saves them)
    assert json.loads(json.dumps(jsonable(d.decode(bytes.fromhex(rec["hex"]))))) == rec["decoded"]


def test_capture_covers_every_kind_we_rely_on() -> None:
    kinds = {r["decoded"]["kind"] for r in RECORDS}
    assert {
        "exec",
        "exec_ok",
        "open",
        "chdir",
        "fchdir",
        "dup",
        "connect",
        "exit",
        "ret",
        "change",
        "dns",
    } <= kinds
    dns = [r["decoded"] for r in RECORDS if r["decoded"]["kind"] == "dns"]
    assert [(r["received"], r["delivered"], r["address"], r["port"], r["proto"]) for r in dns] == [
        (False, False, "127.3.5.3", 53, 0),  # the query, on a socket connected to port 53
        (False, True, "127.3.5.3", 53, 17),  # the answer as the kernel delivered it (its source)
        (True, False, "127.3.5.3", 53, 0),  # ... and as the job read it (the socket's server)
        (False, False, "127.3.5.3", 53, 0),  # the query again, sent to port 53 from another socket
        (False, True, "127.3.5.3", dns[4]["port"], 17),  # an answer from a port of the job's own ...
        (True, False, "127.3.5.3", 53, 0),  # ... as read (the socket's server: where queries go)
    ]
    assert dns[4]["port"] != 53
    # a message read and the delivery it was: the same socket (cookie) and bytes; sends have none
    assert dns[1]["cookie"] == dns[2]["cookie"] != 0 and dns[1]["payload"] == dns[2]["payload"]
    assert dns[4]["cookie"] == dns[5]["cookie"] != dns[1]["cookie"] and dns[0]["cookie"] == 0
    assert dns[0]["sock"] == dns[2]["sock"] != dns[3]["sock"] == dns[5]["sock"] and dns[1]["sock"] == 0
    assert dns[1]["tgid"] == 0 and dns[1]["fd"] == -1  # delivered in the kernel, by no process
    ops = {r["decoded"]["op"] for r in RECORDS if r["decoded"]["kind"] == "change"}
    assert {"link", "rename", "truncate", "chmod", "chown", "symlink", "unlink", "mkdir", "rmdir"} <= ops


def test_short_and_unknown_records_raise_decode_error() -> None:
    with pytest.raises(d.DecodeError):
        d.decode(b"\0" * 10)
    with pytest.raises(d.DecodeError):
        d.decode(d.HDR.pack(1, 7, 1, 1, 1, 99, 0))


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            struct.pack("<H", 2) + struct.pack(">H", 443) + bytes([10, 0, 0, 1]) + b"\0" * 8,
            ("AF_INET", "10.0.0.1", 443),
        ),
        (
            struct.pack("<H", 10) + struct.pack(">H", 80) + b"\0" * 4 + bytes(15) + b"\1" + b"\0" * 4,
            ("AF_INET6", "::1", 80),
        ),
        (struct.pack("<H", 1) + b"\0abstract\0", ("AF_UNIX", "@abstract", None)),
        (struct.pack("<H", 1) + b"/run/x.sock\0", ("AF_UNIX", "/run/x.sock", None)),
        (struct.pack("<H", 0), ("AF_UNSPEC", "", None)),
        (struct.pack("<H", 17) + b"\0" * 14, ("OTHER", "family=17", None)),
    ],
)
def test_sockaddr(raw: bytes, expected: tuple) -> None:
    assert d.decode_sockaddr(raw, len(raw)) == expected


def test_non_utf8_paths_are_escaped_not_lost() -> None:
    raw = (
        d.HDR.pack(1, 7, 1, 2, 2, d.EV_OPEN, 0)
        + struct.pack("<qQQiIHHHHQQ", 3, 0, 0, -100, 0, 0, 0, 0, 5, 0, 0)
        + b"a\xffb\0\0"
    )
    assert d.decode(raw)["path"] == "a\\xffb"


def test_a_refused_32bit_call_decodes_with_its_architecture_and_name() -> None:
    """struct sigsys_ev (probes/abi.py): the header, then si_syscall, si_arch and si_call_addr."""
    raw = d.HDR.pack(5, 7, 1, 42, 43, d.EV_SIGSYS, 0) + struct.pack("<iIQ", 5, d.AUDIT_ARCH_I386, 0x4000100F)
    ev = d.decode(raw)
    assert ev == {
        "kind": "sigsys",
        "ts": 5,
        "cgid": 7,
        "run": 1,
        "tgid": 42,
        "tid": 43,
        "flags": 0,
        "nr": 5,
        "arch": d.AUDIT_ARCH_I386,
        "ip": 0x4000100F,
    }
    assert d.refused_call(d.AUDIT_ARCH_I386, 5) == "i386 open (5)"
    assert d.refused_call(d.AUDIT_ARCH_I386, 999) == "i386 call 999"
    assert d.refused_call(d.AUDIT_ARCH_X86_64, d.X32_SYSCALL_BIT | 257) == "x32 call 257"
    assert d.refused_call(d.AUDIT_ARCH_ARM, 5) == "arm call 5"


def test_an_exec_violation_decodes_what_was_loaded_and_what_was_decided() -> None:
    bits = abi.VIOLATION_BIT
    body = abi.EXEC_VIOLATION_EV.struct.pack(
        77, bits["file"] | bits["args"], 5, (254 << 20) | 0, 30, 0xAB, 6, 0xCD, (8 << 20) | 1, 31, 1, 0
    )
    ev = d.decode(d.HDR.pack(1, 2, 3, 4, 4, abi.EV_EXEC_VIOLATION, 0) + body)
    assert ev["kind"] == "exec_violation"
    assert ev["old_tid"] == 77 and ev["reasons"] == ["file", "args"]
    assert ev["file"] == (os.makedev(254, 0), 5) and ev["decided"] == (os.makedev(8, 1), 6)
    assert (ev["args_len"], ev["argv_hash"], ev["decided_args_len"], ev["decided_hash"]) == (
        30,
        0xAB,
        31,
        0xCD,
    )
    assert ev["decided_flags"] == abi.PIN_SCRIPT and ev["killed"] and ev["kill_error"] == 0
    # no pin: nothing was decided; a failed kill says why
    body = abi.EXEC_VIOLATION_EV.struct.pack(77, bits["no_pin"], 5, 1, 30, 0xAB, 0, 0, 0, 0, 0, -1)
    ev = d.decode(d.HDR.pack(1, 2, 3, 4, 4, abi.EV_EXEC_VIOLATION, 0) + body)
    assert ev["reasons"] == ["no_pin"] and ev["decided"] is None
    assert not ev["killed"] and ev["kill_error"] == -1
    with pytest.raises(d.DecodeError):
        d.decode(d.HDR.pack(1, 2, 3, 4, 4, abi.EV_EXEC_VIOLATION, 0) + body[:-4])
