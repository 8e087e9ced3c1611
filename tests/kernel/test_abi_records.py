"""The ABI (probes/abi.py) against what the loaded probes write: a job run as nobody gives every call
it can the largest and strangest arguments (a path past PATH_MAX, megabytes of argv, an abstract
socket name of 107 bytes, names that are not UTF-8, two long paths in one rename), and every record
it makes is at least its layout's fixed part, every length its header declares fits inside it, and
it decodes. A record whose lengths ran past its end would be read by the decoder from the next
record's bytes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from evidence.agent.recorder.cgroups import RunCgroup
from evidence.agent.recorder.decode import decode
from evidence.agent.recorder.kernel import mount_tracefs
from evidence.probes import abi
from evidence.probes.headers import ensure_headers
from evidence.probes.loader import RecorderProbes
from tests.kernel.util import as_user, in_cgroup

NOBODY = 65534

# as nobody, in a directory of its own; every call is expected to fail or succeed, never to hang
_JOB = r"""
import ctypes, os, socket, sys
os.chdir(sys.argv[1])
long = "d/" + "a" * 5000  # past PATH_MAX: truncated at entry, refused by the kernel
odd = b"\xff\xfe-\x80"  # not UTF-8
for call in (
    lambda: os.open(long, os.O_RDONLY),
    lambda: os.open(odd, os.O_CREAT | os.O_WRONLY, 0o600),
    lambda: os.rename(odd, long + "b"),
    lambda: os.rename(long, long),
    lambda: os.symlink(long, odd + b"-link"),
    lambda: os.mkdir(odd + b"-dir"),
    lambda: os.chdir(odd + b"-dir"),
    lambda: os.chdir(".."),
    lambda: os.chmod(odd, 0o7777),
    lambda: os.unlink(odd + b"-link"),
    lambda: socket.socket(socket.AF_UNIX).connect(b"\0" + b"z" * 107),
    lambda: socket.socket(socket.AF_UNIX).connect(("a" * 107).encode()),
    lambda: socket.socket(socket.AF_INET6).connect(("::1", 9, 0, 0)),
    lambda: ctypes.CDLL(None).unshare(0x10000000 | 0x00020000),  # CLONE_NEWUSER | CLONE_NEWNS
    lambda: os.execv("/nonexistent/" + "x" * 300, ["x" * 100000] * 20),
    lambda: os.execv(odd, [odd] * 3),
):
    try:
        call()
    except (OSError, ValueError):
        pass
"""


def _named(layout: abi.Layout, raw: bytes) -> dict[str, int | bytes]:
    names = [f.name for f in layout.fields if not f.name.startswith("pad")]
    return dict(zip(names, layout.struct.unpack_from(raw, abi.HDR_SIZE if layout.header else 0), strict=True))


LAYOUT_OF = {
    abi.EV_EXEC: abi.EXEC_EV,
    abi.EV_EXEC_OK: abi.EXEC_EV,
    abi.EV_FORK: abi.FORK_EV,
    abi.EV_EXIT: abi.EXIT_EV,
    abi.EV_OPEN: abi.OPEN_EV,
    abi.EV_CHDIR: abi.OPEN_EV,
    abi.EV_FCHDIR: abi.OPEN_EV,
    abi.EV_CONNECT: abi.CONNECT_EV,
    abi.EV_DUP: abi.DUP_EV,
    abi.EV_RET: abi.RET_EV,
    abi.EV_CHANGE: abi.CHANGE_EV,
    abi.EV_NS: abi.NS_EV,
    abi.EV_DNS: abi.DNS_EV,
    abi.EV_SIGSYS: abi.SIGSYS_EV,
    abi.EV_EXEC_VIOLATION: abi.EXEC_VIOLATION_EV,
}


def _check(raw: bytes) -> str:
    """The record's kind, once its lengths are checked against its size."""
    kind = abi.HDR.struct.unpack_from(raw, 0)[5]
    assert kind in abi.RECORD_NAMES, kind
    layout = LAYOUT_OF[kind]
    assert set(LAYOUT_OF) == set(abi.RECORD_NAMES)
    assert len(raw) >= layout.size, (abi.RECORD_NAMES[kind], len(raw))
    f = _named(layout, raw)
    tail = {
        abi.OPEN_EV.name: lambda: f["path_len"],
        abi.EXEC_EV.name: lambda: int(f["fname_len"]) + int(f["args_len"]),
        abi.CHANGE_EV.name: lambda: int(f["len1"]) + int(f["len2"]),
        abi.NS_EV.name: lambda: int(f["len1"]) + int(f["len2"]),
        abi.DNS_EV.name: lambda: f["len"],
    }.get(layout.name, lambda: 0)()
    assert isinstance(tail, int)
    assert layout.size + tail <= len(raw), (abi.RECORD_NAMES[kind], layout.size, tail, len(raw))
    decoded = decode(raw)
    assert decoded["kind"] == abi.RECORD_NAMES[kind]
    return decoded["kind"]


def test_a_hostile_jobs_records_fit_their_layouts(place: Path) -> None:
    mount_tracefs()
    ensure_headers()
    probes = RecorderProbes()
    cg = RunCgroup.create(f"abi-test-{os.getpid()}")
    (place / "d").mkdir()
    os.chown(place / "d", NOBODY, NOBODY)
    try:
        ring = probes.ring()
        probes.reset_lost(1)
        probes.track(cg.id, 1)
        job = as_user(NOBODY, "/usr/bin/python3", "-S", "-c", _JOB, str(place / "d"))
        subprocess.run(in_cgroup(cg.procs_file(), *job), check=True, timeout=60)
        kinds = [_check(raw) for raw in ring.read()]
        kinds += [_check(raw) for raw in probes.in_flight(1)]
        assert probes.read_lost(1) == {}
        assert {"exec", "exec_ok", "ret", "open", "chdir", "change", "connect", "namespace", "exit"} <= set(
            kinds
        )
    finally:
        probes.untrack(cg.id)
        cg.wait_empty()
        cg.remove()
        probes.close()
