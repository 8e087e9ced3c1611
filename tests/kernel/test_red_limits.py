"""Issue 25's red team: memory a job under `limits.memory` leaves behind in shared memory (a file
in /dev/shm, a System V segment nobody removes) is charged to the run while it runs, and stays
taken after the run ends and its cgroup is gone: run after run, each within its limit, a job
held as much of the host's memory as it liked. Fixed: the command runs with an IPC namespace and a
/dev/shm of the run's own (agent/recorder/exec_helper.py private_ipc), which die with it. The
charge during the run is asserted too (the limit holds while it runs)."""

from __future__ import annotations

import os
import subprocess
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kernel.util import PY, as_user, evidence, of_type, read_bundle

pytestmark = pytest.mark.kernel

NOBODY = 65534
MIB = 1 << 20

LEAVE = """\
import ctypes, mmap, os, sys
name = sys.argv[1]
with open(f"/dev/shm/{name}", "wb") as f:  # tmpfs: memory, charged to the writer's cgroup
    for _ in range(24):
        f.write(os.urandom(1 << 20))
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
seg = libc.shmget(0, 24 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600, never IPC_RMID
addr = libc.shmat(seg, None, 0)
ctypes.memset(addr, 1, 24 << 20)  # touched: memory
print(seg, os.readlink("/proc/self/ns/ipc"), os.readlink("/proc/self/ns/mnt"), flush=True)
"""

TOO_MUCH = """\
import os, sys
with open(f"/dev/shm/{sys.argv[1]}", "wb") as f:
    for i in range(128):
        f.write(os.urandom(1 << 20))
        print(i, flush=True)
"""


def _namespaces_in_use() -> set[str]:
    """The IPC and mount namespaces of every process on the host (as /proc/PID/ns/* read)."""
    out = set()
    for pid in Path("/proc").iterdir():
        for kind in ("ipc", "mnt"):
            try:
                out.add(os.readlink(pid / "ns" / kind))
            except OSError:
                continue
    return out


@pytest.fixture
def place() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="evidence-red-limits-"))
    d.chmod(0o777)
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


def _run(place: Path, *command: str) -> tuple[subprocess.CompletedProcess[str], list[dict]]:  # type: ignore[type-arg]
    policy = place / "policy.yaml"
    policy.write_text(textwrap.dedent("version: 1\nlimits:\n  memory: 64MiB\n"))
    bundle = place / "run.tar.gz"
    bundle.unlink(missing_ok=True)
    proc = evidence(
        "run", "--bundle", str(bundle), "--policy", str(policy), "--", *as_user(NOBODY, *command), cwd=place
    )
    assert bundle.exists(), proc.stderr
    return proc, read_bundle(bundle)[1]


def test_shared_memory_is_charged_to_the_run_while_it_runs(place: Path) -> None:
    name = f"evidence-red-{uuid.uuid4().hex}"
    try:
        proc, events = _run(place, PY, "-c", TOO_MUCH, name)
        written = [int(x) for x in proc.stdout.split()]
        assert written and max(written) < 64, proc.stdout  # stopped at the limit: tmpfs pages count
        assert [e for e in of_type(events, "policy.limit") if e["data"]["kind"] == "oom_kill"], events
    finally:
        Path(f"/dev/shm/{name}").unlink(missing_ok=True)


def test_shared_memory_a_run_leaves_does_not_outlive_it(place: Path) -> None:
    name = f"evidence-red-{uuid.uuid4().hex}"
    seg = -1
    try:
        proc, _ = _run(place, PY, "-c", LEAVE, name)
        seg = int(proc.stdout.split()[0])
        left = Path(f"/dev/shm/{name}")
        segments = Path("/proc/sysvipc/shm").read_text().split("\n")[1:]
        kept = [line.split() for line in segments if line.split() and int(line.split()[1]) == seg]
        assert not left.exists() and not kept, (left.exists(), kept)
        # and the job's own namespaces, which held them, are gone: no process is in them any more
        theirs = set(proc.stdout.split()[1:3])
        assert theirs and not theirs & _namespaces_in_use(), theirs
    finally:
        Path(f"/dev/shm/{name}").unlink(missing_ok=True)
        if seg >= 0:
            subprocess.run(["ipcrm", "-m", str(seg)], check=False, capture_output=True)
