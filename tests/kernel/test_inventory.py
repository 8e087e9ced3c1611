"""agent.inventory on real processes in a real cgroup, with real sockets (loopback only)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from evidence.agent.recorder import inventory
from evidence.agent.recorder.cgroups import find_cgroup2_mount
from evidence.bundle.format import Inventory
from evidence.errors import SetupError

pytestmark = pytest.mark.kernel

# Listens on 127.0.0.1, connects to itself, binds a UDP socket on ::1, prints the ports, then waits.
SERVER = r"""
import os, socket, sys
os.chdir(sys.argv[1])
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen()
cli = socket.create_connection(srv.getsockname()); acc, _ = srv.accept()
udp = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); udp.bind(("::1", 0))
print(srv.getsockname()[1], cli.getsockname()[1], udp.getsockname()[1], flush=True)
sys.stdin.read()
"""


def _cgroup2_mount() -> Path | None:
    try:
        return find_cgroup2_mount()
    except SetupError:
        return None


@pytest.fixture
def cgroup() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("needs root to create a cgroup and move a process into it")
    mount = _cgroup2_mount()
    if mount is None:
        pytest.skip("no cgroup2 mount")
    root = mount / f"evidence-test-inv-{uuid.uuid4().hex[:8]}"
    (root / "child").mkdir(parents=True)
    yield root
    for d in (root / "child", root):
        for pid in (d / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), 9)
    for d in (root / "child", root):
        for _ in range(100):
            try:
                d.rmdir()
                break
            except OSError:
                time.sleep(0.05)


def _spawn(cmd: list[str], cgroup: Path) -> tuple[subprocess.Popen[str], list[int]]:
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    ports = [int(p) for p in proc.stdout.readline().split()]
    (cgroup / "cgroup.procs").write_text(str(proc.pid))
    return proc, ports


def _stop(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=10)


def test_inventory_of_a_process_with_real_sockets(cgroup: Path, tmp_path: Path) -> None:
    proc, (lport, cport, uport) = _spawn([sys.executable, "-c", SERVER, str(tmp_path)], cgroup / "child")
    try:
        assert inventory.cgroup_pids(cgroup) == [proc.pid]  # found in the child cgroup, recursively
        records = inventory.take_inventory(cgroup, now_ns=123)
    finally:
        _stop(proc)
    assert len(records) == 1
    rec = records[0]
    assert rec["k"] == "inventory" and rec["t"] == 123
    assert rec["pid"] == proc.pid and rec["ppid"] == os.getpid()
    assert rec["argv"] == [sys.executable, "-c", SERVER, str(tmp_path)]
    assert rec["cwd"] == str(tmp_path)
    assert rec["exe"] == os.path.realpath(sys.executable)
    assert rec["sockets"] == sorted(
        [
            f"tcp listen 127.0.0.1:{lport}",
            f"tcp established 127.0.0.1:{cport} -> 127.0.0.1:{lport}",
            f"tcp established 127.0.0.1:{lport} -> 127.0.0.1:{cport}",
            f"udp bound [::1]:{uport}",
        ]
    )
    # the record is exactly the bundle's inventory event data
    Inventory(**{k: v for k, v in rec.items() if k not in ("k", "t")})


def test_inventory_in_another_network_namespace(cgroup: Path, tmp_path: Path) -> None:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs unshare(1) and ip(8) to make a throwaway network namespace")
    script = f"ip link set lo up && exec {sys.executable} -c '{SERVER}' {tmp_path}"
    proc, (lport, cport, _uport) = _spawn(["unshare", "--net", "sh", "-c", script], cgroup)
    try:
        ns = os.stat(f"/proc/{proc.pid}/ns/net").st_ino
        assert ns != os.stat("/proc/self/ns/net").st_ino
        via_diag = inventory.sockets_in_netns(f"/proc/{proc.pid}/ns/net")
        via_proc = inventory.sockets_via_proc(proc.pid)
        records = inventory.take_inventory(cgroup)
    finally:
        _stop(proc)
    (rec,) = records
    assert f"tcp listen 127.0.0.1:{lport}" in rec["sockets"]
    assert f"tcp established 127.0.0.1:{cport} -> 127.0.0.1:{lport}" in rec["sockets"]
    # socket inodes are unique across namespaces: none of these is in the agent's own namespace,
    # so they were really looked up in the other one
    assert via_diag and not set(via_diag) & set(inventory.sockets_via_diag())
    # sock_diag and the /proc/PID/net fallback agree on what they both see
    assert {v for v in via_diag.values() if "tcp" in v} == {v for v in via_proc.values() if "tcp" in v}


def test_parse_proc_net_and_describe() -> None:
    text = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1\n"
        "   1: 0100007F:C350 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 4243 1\n"
        "   2: 0100007F:C351 0100007F:1F90 06 00000000:00000000 00:00000000 00000000     0        0 0 1\n"
    )
    assert inventory.parse_proc_net(text, "tcp", socket.AF_INET) == {
        4242: "tcp listen 127.0.0.1:8080",
        4243: "tcp established 127.0.0.1:50000 -> 127.0.0.1:8080",
    }
    v6 = (
        "  sl  local_address                         remote_address                        st ...\n"
        "   0: 00000000000000000000000001000000:0035 00000000000000000000000000000000:0000 07 "
        "00000000:00000000 00:00000000 00000000     0        0 77 2\n"
    )
    assert inventory.parse_proc_net(v6, "udp", socket.AF_INET6) == {77: "udp bound [::1]:53"}


def test_processes_that_vanish_are_left_out(tmp_path: Path) -> None:
    assert inventory.read_process(2**22 + 12345) is None
    me = inventory.read_process(os.getpid())
    assert me is not None and me["ppid"] == os.getppid() and me["argv"][0]
    fake = tmp_path / "cg"
    (fake / "a").mkdir(parents=True)
    (fake / "cgroup.procs").write_text(f"{2**22 + 12345}\n")
    (fake / "a" / "cgroup.procs").write_text(f"{os.getpid()}\n")
    recs = inventory.take_inventory(fake, now_ns=1)
    assert [r["pid"] for r in recs] == [os.getpid()]
