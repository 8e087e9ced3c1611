"""ConnectGuard on the real kernel, against a peer in a network namespace of its own.

The test builds (and removes) a network namespace with a veth pair carrying IPv4 and IPv6
addresses, a server inside it (TCP on 8080 and 9090 over both families, UDP echo on 5353 and 5354),
and a cgroup of its own under the cgroup2 mount. A client process placed in that cgroup tries to
break the policy: IPv4, IPv6, IPv4-mapped IPv6, UDP sendto, and a sub-cgroup it creates itself.
No traffic leaves the machine: every address is on the test's veth pair.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kernel.util import IO_URING, in_cgroup, in_netns

pytestmark = pytest.mark.kernel


def _cgroup2_mount() -> str | None:
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 2 and parts[2] == "cgroup2":
                return parts[1]
    return None


def _require() -> str:
    if os.geteuid() != 0:
        pytest.skip("needs root (CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN) for cgroup BPF programs and netns")
    mount = _cgroup2_mount()
    if mount is None:
        pytest.skip("needs a cgroup2 mount (none in /proc/self/mounts)")
    try:
        import bcc  # noqa: F401
    except ImportError:
        pytest.skip("needs BCC (python3-bpfcc)")
    return mount


@pytest.fixture(scope="module")
def peer() -> Iterator[dict[str, str]]:
    """A netns with the far end of a veth pair (IPv4 + IPv6) and servers listening in it."""
    _require()
    from pyroute2 import IPRoute, NetNS, netns
    from pyroute2.netlink.rtnl.ifaddrmsg import IFA_F_NODAD

    tag = secrets.token_hex(3)
    subnet = 20 + os.getpid() % 200
    ns_name, host_if, peer_if = f"evt-peer-{tag}", f"evh{tag}", f"evp{tag}"
    v4_host, v4_peer = f"10.{subnet}.77.1", f"10.{subnet}.77.2"
    v6_host, v6_peer = f"fd00:{subnet:x}:77::1", f"fd00:{subnet:x}:77::2"
    netns.create(ns_name)
    server = None
    try:
        with IPRoute() as ipr:
            ipr.link("add", ifname=host_if, kind="veth", peer=peer_if)
            pidx = ipr.link_lookup(ifname=peer_if)[0]
            ipr.link("set", index=pidx, net_ns_fd=ns_name)
            hidx = ipr.link_lookup(ifname=host_if)[0]
            ipr.addr("add", index=hidx, address=v4_host, prefixlen=24)
            ipr.addr("add", index=hidx, address=v6_host, prefixlen=64, flags=IFA_F_NODAD)
            ipr.link("set", index=hidx, state="up")
        with NetNS(ns_name) as ns:
            pidx = ns.link_lookup(ifname=peer_if)[0]
            ns.addr("add", index=pidx, address=v4_peer, prefixlen=24)
            ns.addr("add", index=pidx, address=v6_peer, prefixlen=64, flags=IFA_F_NODAD)
            ns.link("set", index=pidx, state="up")
            ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
        server = subprocess.Popen(
            in_netns(f"/run/netns/{ns_name}", sys.executable, "-c", SERVER, v4_peer, v6_peer),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "ready"
        yield {"v4": v4_peer, "v6": v6_peer, "v4_host": v4_host, "ns": ns_name}
    finally:
        if server is not None:
            server.kill()
            server.wait()
        with IPRoute() as ipr:
            for idx in ipr.link_lookup(ifname=host_if):
                ipr.link("del", index=idx)
        netns.remove(ns_name)


SERVER = r"""
import socket, sys, threading
v4, v6 = sys.argv[1], sys.argv[2]
def tcp(fam, addr, port):
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port)); s.listen(64)
    def loop():
        while True:
            c, _ = s.accept(); c.sendall(b"hi"); c.close()
    threading.Thread(target=loop, daemon=True).start()
def udp(fam, addr, port):
    s = socket.socket(fam, socket.SOCK_DGRAM); s.bind((addr, port))
    def loop():
        while True:
            data, peer = s.recvfrom(100); s.sendto(b"echo:" + data, peer)
    threading.Thread(target=loop, daemon=True).start()
for port in (8080, 9090):
    tcp(socket.AF_INET, v4, port); tcp(socket.AF_INET6, v6, port)
for port in (5353, 5354):
    udp(socket.AF_INET, v4, port); udp(socket.AF_INET6, v6, port)
print("ready", flush=True)
threading.Event().wait()
"""

CLIENT = r"""
import errno, json, os, socket, sys
v4, v6, sub_cgroup = sys.argv[1], sys.argv[2], sys.argv[3]
out = {}
def err(e):
    return errno.errorcode.get(e.errno, str(e.errno))
def tcp(name, fam, host, port):
    s = socket.socket(fam, socket.SOCK_STREAM); s.settimeout(3)
    try:
        s.connect((host, port)); out[name] = s.recv(10).decode()
    except OSError as e:
        out[name] = err(e)
    finally:
        s.close()
def udp(name, fam, host, port):
    s = socket.socket(fam, socket.SOCK_DGRAM); s.settimeout(3)
    try:
        s.sendto(b"x", (host, port)); out[name] = s.recv(100).decode()
    except OSError as e:
        out[name] = err(e)
    finally:
        s.close()
def udp_connected(name, fam, host, port):
    s = socket.socket(fam, socket.SOCK_DGRAM); s.settimeout(3)
    try:
        s.connect((host, port)); s.send(b"y"); out[name] = s.recv(100).decode()
    except OSError as e:
        out[name] = err(e)
    finally:
        s.close()
mapped = "::ffff:" + v4
tcp("tcp4_allowed", socket.AF_INET, v4, 8080)
tcp("tcp4_denied_rule", socket.AF_INET, v4, 9090)
tcp("tcp4_default", socket.AF_INET, v4, 7070)
tcp("tcp6_allowed", socket.AF_INET6, v6, 8080)
tcp("tcp6_default", socket.AF_INET6, v6, 9090)
tcp("mapped_allowed", socket.AF_INET6, mapped, 8080)
tcp("mapped_denied_rule", socket.AF_INET6, mapped, 9090)
udp("udp4_allowed", socket.AF_INET, v4, 5353)
udp("udp4_default", socket.AF_INET, v4, 5354)
udp("udp6_default", socket.AF_INET6, v6, 5353)
udp("udp_mapped_allowed", socket.AF_INET6, mapped, 5353)
udp("udp_mapped_default", socket.AF_INET6, mapped, 5354)
udp_connected("udp4_connect_default", socket.AF_INET, v4, 5354)
# escape attempt: a sub-cgroup of our own
os.mkdir(sub_cgroup)
with open(sub_cgroup + "/cgroup.procs", "w") as f:
    f.write(str(os.getpid()))
with open("/proc/self/cgroup") as f:
    out["moved_to"] = f.read().strip().split("::")[-1]
tcp("sub_cgroup_tcp4", socket.AF_INET, v4, 9090)
tcp("sub_cgroup_mapped", socket.AF_INET6, mapped, 9090)
tcp("sub_cgroup_allowed", socket.AF_INET, v4, 8080)
out["pid"] = os.getpid()
print(json.dumps(out))
"""


@pytest.fixture
def cgroup() -> Iterator[Path]:
    mount = _require()
    path = Path(mount) / f"evidence-test-guard-{os.getpid()}-{secrets.token_hex(3)}"
    path.mkdir()
    try:
        yield path
    finally:
        for sub in sorted(path.glob("*/"), reverse=True):
            if sub.is_dir():
                _evacuate(sub, Path(mount))
                sub.rmdir()
        _evacuate(path, Path(mount))
        path.rmdir()


def _evacuate(cg: Path, mount: Path) -> None:
    procs = (cg / "cgroup.procs").read_text().split()
    for pid in procs:
        with contextlib.suppress(OSError):
            (mount / "cgroup.procs").write_text(pid)


POLICY = """\
version: 1
net:
  default: deny
  allow:
    - "{v4}/32:8080"
    - "[{v6}]:8080"
    - "udp://{v4}:5353"
  deny:
    - "{v4net}/24:9090"
"""


def _policy(peer: dict[str, str]):  # noqa: ANN202
    from evidence.policy.model import parse_policy

    v4net = peer["v4"].rsplit(".", 1)[0] + ".0"
    text = POLICY.format(v4=peer["v4"], v6=peer["v6"], v4net=v4net)
    return parse_policy(text, name="net.yaml", variables={}, resolve=None)


def _run_client(cgroup: Path, peer: dict[str, str]) -> dict[str, object]:
    proc = subprocess.run(
        in_cgroup(
            cgroup / "cgroup.procs",
            sys.executable,
            "-c",
            CLIENT,
            peer["v4"],
            peer["v6"],
            str(cgroup / "escape"),
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _collect(guard, want: int, deadline_s: float = 3.0) -> list[dict[str, object]]:  # noqa: ANN001
    out: list[dict[str, object]] = []
    end = time.monotonic() + deadline_s
    while len(out) < want and time.monotonic() < end:
        out.extend(guard.poll(100))
    out.extend(guard.poll(0))
    return out


def test_enforce_denies_every_way_of_reaching_a_denied_address(peer: dict[str, str], cgroup: Path) -> None:
    from evidence.agent.recorder.connect_guard import ConnectGuard

    policy = _policy(peer)
    guard = ConnectGuard(policy.net, dry_run=False)
    try:
        guard.attach(str(cgroup))
        got = _run_client(cgroup, peer)
        records = _collect(guard, 10)
        raw = guard.poll_raw()
    finally:
        guard.close()

    assert got["tcp4_allowed"] == "hi"
    assert got["tcp6_allowed"] == "hi"
    assert got["mapped_allowed"] == "hi"
    assert got["udp4_allowed"] == "echo:x"
    assert got["udp_mapped_allowed"] == "echo:x"
    for name in (
        "tcp4_denied_rule",
        "tcp4_default",
        "tcp6_default",
        "mapped_denied_rule",
        "udp4_default",
        "udp6_default",
        "udp_mapped_default",
        "udp4_connect_default",
        "sub_cgroup_tcp4",
        "sub_cgroup_mapped",
    ):
        assert got[name] == "EPERM", (name, got[name])
    assert got["sub_cgroup_allowed"] == "hi"
    assert str(got["moved_to"]).endswith("/escape")

    v4, v6, pid = peer["v4"], peer["v6"], got["pid"]
    by_target = {(r["operation"], r["target"]): r for r in records}
    deny_rule = f"net.deny[0]: {v4.rsplit('.', 1)[0]}.0/24:9090"
    assert by_target[("connect", f"{v4}:9090")]["rule"] == deny_rule
    assert by_target[("connect", f"{v4}:7070")]["rule"] == "net.default: deny"
    assert by_target[("connect", f"[{v6}]:9090")]["rule"] == "net.default: deny"
    assert by_target[("connect", f"[::ffff:{v4}]:9090")]["rule"] == deny_rule
    assert by_target[("sendmsg", f"{v4}:5354")]["rule"] == "net.default: deny"
    assert by_target[("sendmsg", f"[{v6}]:5353")]["rule"] == "net.default: deny"
    # a UDP datagram to a v4-mapped address goes through the kernel's IPv4 path (udpv6_sendmsg hands
    # it to udp_sendmsg), so the sendmsg4 program sees it as IPv4: two records for v4:5354
    assert [(r["operation"], r["target"]) for r in records].count(("sendmsg", f"{v4}:5354")) == 2
    assert ("connect", f"{v4}:5354") in by_target  # connect() on a UDP socket
    for r in records:
        assert r["k"] == "denial" and r["enforced"] is True and r["result"] == "EPERM"
        assert r["pid"] == pid and r["exe"] is None
        assert abs(int(r["t"]) - time.time_ns()) < 60 * 10**9
    assert len(records) == 10  # one record per failing call above
    # the sub-cgroup's records carry the sub-cgroup's id: the parent's programs still ran
    assert len({r.cgroup_id for r in raw}) == 2
    assert {r.protocol for r in raw} == {6, 17}


def test_dry_run_reports_would_block_but_lets_traffic_through(peer: dict[str, str], cgroup: Path) -> None:
    from evidence.agent.recorder.connect_guard import ConnectGuard

    guard = ConnectGuard(_policy(peer).net, dry_run=True)
    try:
        guard.attach(str(cgroup))
        got = _run_client(cgroup, peer)
        records = _collect(guard, 10)
    finally:
        guard.close()
    assert got["tcp4_denied_rule"] == "hi"
    assert got["mapped_denied_rule"] == "hi"
    assert got["tcp6_default"] == "hi"
    assert got["udp4_default"] == "echo:x"
    assert got["sub_cgroup_tcp4"] == "hi"
    assert got["tcp4_default"] == "ECONNREFUSED"  # nothing listens on 7070: the call really went out
    assert records and all(r["enforced"] is False and r["result"] == 0 for r in records)
    assert len(records) == 10


def test_outside_the_cgroup_nothing_is_blocked(peer: dict[str, str], cgroup: Path) -> None:
    import socket

    from evidence.agent.recorder.connect_guard import ConnectGuard

    guard = ConnectGuard(_policy(peer).net, dry_run=False)
    try:
        guard.attach(str(cgroup))
        with socket.create_connection((peer["v4"], 9090), timeout=3) as s:
            assert s.recv(10) == b"hi"
        assert guard.poll(100) == []
    finally:
        guard.close()


def test_detach_removes_the_programs(peer: dict[str, str], cgroup: Path) -> None:
    from evidence.agent.recorder.connect_guard import ConnectGuard

    guard = ConnectGuard(_policy(peer).net, dry_run=False)
    guard.attach(str(cgroup))
    guard.detach()
    got = _run_client(cgroup, peer)
    guard.close()
    assert got["tcp4_denied_rule"] == "hi"


NET_PROBE = r"""
import errno, json, socket
out = {}
with open("/proc/net/dev") as f:
    out["interfaces"] = sorted(line.split(":")[0].strip() for line in f.readlines()[2:])
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen()
c = socket.socket(); c.settimeout(2)
try:
    c.connect(srv.getsockname()); out["loopback"] = "ok"
except OSError as e:
    out["loopback"] = errno.errorcode[e.errno]
print(json.dumps(out))
"""


@pytest.mark.parametrize(("mode", "loopback"), [("none", "ENETUNREACH"), ("loopback", "ok")])
def test_private_netns(peer: dict[str, str], mode: str, loopback: str) -> None:
    from evidence.policy.netns import PrivateNetns

    with PrivateNetns(mode) as ns:  # type: ignore[arg-type]
        assert os.path.exists(ns.path)
        proc = subprocess.run(
            in_netns(ns.path, sys.executable, "-c", NET_PROBE), capture_output=True, text=True, timeout=30
        )
        assert proc.returncode == 0, proc.stderr
        got = json.loads(proc.stdout)
        # only lo: the host's interfaces (and the test's veth) are not there
        assert got["interfaces"] == ["lo"]
        assert got["loopback"] == loopback
    assert not os.path.exists(ns.path)


# A minimal io_uring client (ctypes + mmap, no liburing), run inside the client.


URING_CLIENT = (
    IO_URING
    + r"""
import errno, json, socket, sys
v4, v6 = sys.argv[1], sys.argv[2]
out = {}
for name, fam, host, port in (
    ("v4_allowed", socket.AF_INET, v4, 8080),
    ("v4_denied", socket.AF_INET, v4, 9090),
    ("v6_denied", socket.AF_INET6, v6, 9090),
    ("mapped_denied", socket.AF_INET6, "::ffff:" + v4, 9090),
):
    s = socket.socket(fam, socket.SOCK_STREAM)
    res = uring_connect(s, host, port)
    out[name] = None if res is None else ("ok" if res == 0 else errno.errorcode[-res])
    s.close()
print(json.dumps(out))
"""
)


def test_io_uring_connect_is_denied_too(peer: dict[str, str], cgroup: Path) -> None:
    from evidence.agent.recorder.connect_guard import ConnectGuard

    guard = ConnectGuard(_policy(peer).net, dry_run=False)
    try:
        guard.attach(str(cgroup))
        proc = subprocess.run(
            in_cgroup(cgroup / "cgroup.procs", sys.executable, "-c", URING_CLIENT, peer["v4"], peer["v6"]),
            capture_output=True,
            text=True,
            timeout=60,
        )
        records = _collect(guard, 3)
    finally:
        guard.close()
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    if got["v4_allowed"] is None:
        pytest.skip("io_uring is refused on this kernel (io_uring_setup failed)")
    assert got == {"v4_allowed": "ok", "v4_denied": "EPERM", "v6_denied": "EPERM", "mapped_denied": "EPERM"}
    assert len(records) == 3 and all(r["enforced"] for r in records)
