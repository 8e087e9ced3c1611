"""Helpers for kernel tests: run the real CLI as a subprocess and read the bundle it wrote."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

PY = "/usr/bin/python3"  # Debian's python: no pyenv shims in the recorded process tree

# The exec supervisor's tests' launchers: the job's own process installs the seccomp filter that
# sends its execs to a supervisor and hands the listener over the socket whose descriptor is argv[1]
EXEC_FILTER_PROLOGUE = """\
import os, socket, sys
from evidence.agent.recorder.exec_filter import send_listener
from evidence.agent.recorder.exec_supervisor import install_exec_filter
sock = socket.socket(fileno=int(sys.argv[1]))
send_listener(sock, install_exec_filter())
sock.close()
"""
# ... then runs argv[2:] under the filter
EXEC_LAUNCHER = EXEC_FILTER_PROLOGUE + "os.execv(sys.argv[2], sys.argv[2:])\n"


def evidence(
    *args: str, cwd: str | Path | None = None, timeout: float = 120, **kw: Any
) -> subprocess.CompletedProcess[str]:
    env = dict(kw.pop("env", None) or os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return subprocess.run(
        [sys.executable, "-m", "evidence", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        **kw,
    )


def in_cgroup(procs: str | Path, *argv: str) -> list[str]:
    """`argv` started inside a cgroup (its `cgroup.procs` file): a shell moves itself in and execs it,
    so the process is in the cgroup from its first instruction. Not a preexec_fn: a test process may
    run threads (an in-process Recorder, an HTTP receiver), and Python code between fork and exec can
    then deadlock."""
    return ["/bin/sh", "-c", 'echo $$ > "$1" && shift && exec "$@"', "sh", str(procs), *argv]


def as_user(uid: int, *argv: str) -> list[str]:
    """`argv` run as `uid` (its group too, no supplementary groups): setpriv sets all four ids and
    execs it. Put it after `in_cgroup` when the cgroup is root's: root joins it, then drops."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv]


def in_netns(path: str | Path, *argv: str) -> list[str]:
    """`argv` started inside the network namespace at `path` (/run/netns/NAME): nsenter enters it and
    execs it."""
    return ["nsenter", f"--net={path}", "--", *argv]


_LANDLOCKED = """\
import os, pickle, sys
from evidence.policy import landlock
landlock.apply(pickle.loads(bytes.fromhex(sys.argv[1])))
os.execv(sys.argv[2], sys.argv[2:])
"""


def landlocked(plan: Any, *argv: str) -> list[str]:
    """`argv` started in the Landlock domain of `plan` (a policy.landlock.LandlockPlan): a Python of
    the test's venv applies it to itself with `landlock.apply`, as a preexec_fn did, then execs
    `argv` (a path: no PATH search), which inherits the domain. The plan travels pickled (the test
    made it)."""
    return [sys.executable, "-c", _LANDLOCKED, pickle.dumps(plan).hex(), *argv]


def read_bundle(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    with tarfile.open(path, "r:gz") as tar:
        names = tar.getnames()
        assert names == ["manifest.json", "events.ndjson"], names
        manifest = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
        raw = tar.extractfile("events.ndjson").read()  # type: ignore[union-attr]
    events = [json.loads(line) for line in io.BytesIO(raw).read().splitlines()]
    return manifest, events


def of_type(events: list[dict[str, Any]], suffix: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == f"dev.evidence.{suffix}"]


def record(
    tmp_path: Path, *command: str, extra: tuple[str, ...] = (), name: str = "run.tar.gz", **kw: Any
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], list[dict[str, Any]]]:
    bundle = tmp_path / name
    proc = evidence("run", "--bundle", str(bundle), *extra, "--", *command, **kw)
    assert bundle.exists(), f"no bundle; stderr: {proc.stderr}"
    manifest, events = read_bundle(bundle)
    return proc, manifest, events


# Python source for a child process: one io_uring request (openat or connect) without liburing;
# the kernel tests prove the controls hold for io_uring too.
IO_URING = r'''
import ctypes, mmap, socket, struct
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
def uring_op(opcode, fd, addr, length, off, op_flags):
    """Run one io_uring request and return its result (negative errno), or None when io_uring is refused."""
    params = ctypes.create_string_buffer(120)
    ring = _libc.syscall(425, 4, params)
    if ring < 0:
        return None
    sq_entries, cq_entries, _, _, _, features = struct.unpack_from("6I", params, 0)
    sq_head, sq_tail, sq_mask, _, _, _, sq_array = struct.unpack_from("7I", params, 40)
    cq_head, cq_tail, cq_mask, _, _, cq_cqes = struct.unpack_from("6I", params, 80)
    size = max(sq_array + sq_entries * 4, cq_cqes + cq_entries * 16)
    rings = mmap.mmap(ring, size, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
    sqes = mmap.mmap(ring, sq_entries * 64, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ | mmap.PROT_WRITE, offset=0x10000000)
    # opcode, flags, ioprio, fd, off/addr2, addr, len, op flags, user_data
    struct.pack_into("BBHiQQIIQ", sqes, 0, opcode, 0, 0, fd, off, addr, length, op_flags, 7)
    tail = struct.unpack_from("I", rings, sq_tail)[0]
    struct.pack_into("I", rings, sq_array + (tail & struct.unpack_from("I", rings, sq_mask)[0]) * 4, 0)
    struct.pack_into("I", rings, sq_tail, tail + 1)
    if _libc.syscall(426, ring, 1, 1, 1, None, 0) < 0:
        return None
    head = struct.unpack_from("I", rings, cq_head)[0]
    _, res, _ = struct.unpack_from("QiI", rings, cq_cqes + (head & struct.unpack_from("I", rings, cq_mask)[0]) * 16)
    struct.pack_into("I", rings, cq_head, head + 1)
    return res
def uring_openat(path):
    buf = ctypes.create_string_buffer(path.encode())
    return uring_op(18, -100, ctypes.addressof(buf), 0, 0, 0)  # IORING_OP_OPENAT, AT_FDCWD, O_RDONLY
def uring_connect(sock, host, port):
    if sock.family == socket.AF_INET:
        sa = struct.pack("!HH4s8x", socket.AF_INET, port, socket.inet_pton(socket.AF_INET, host))
        sa = struct.pack("H", socket.AF_INET) + sa[2:]
    else:
        sa = struct.pack("H", socket.AF_INET6) + struct.pack("!HI16sI", port, 0, socket.inet_pton(socket.AF_INET6, host), 0)
    buf = ctypes.create_string_buffer(sa, len(sa))
    return uring_op(16, sock.fileno(), ctypes.addressof(buf), 0, len(sa), 0)  # IORING_OP_CONNECT, addr2 = addrlen
'''
