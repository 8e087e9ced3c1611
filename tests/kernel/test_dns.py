"""DNS over loopback, for real: a small DNS server in a network namespace the test makes, and
`evidence run` itself in that namespace, in a mount namespace of its own where /etc/resolv.conf
names the server (the run's configured resolver). A job resolves through it with glibc's resolver
(`getent`) and then connects to the answered address. The bundle has the queries with their
answers, the connect carries the name, and a hostile answer (garbage bytes) is recorded as
malformed without breaking anything."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kernel.util import of_type, read_bundle

SERVER = r"""
import os, socket, sys, threading
import dns.message, dns.rrset

def listen(addr):
    lst = socket.socket(); lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lst.bind(addr); lst.listen(16)
    def accept():
        while True:
            c, _ = lst.accept(); c.close()
    threading.Thread(target=accept, daemon=True).start()
listen(("127.0.0.2", 8080))
listen(("0.0.0.0", 443))  # github.com's address (on lo here) and any loopback one

def answer(data):
    try:
        q = dns.message.from_wire(data)
    except Exception:
        return None
    name = q.question[0].name.to_text()
    if name.startswith("garbage."):
        return data[:2] + b"\x81\x80\xff\xff\x00\x07 not dns at all \x00\xc0\x0c\xc0\x0c"
    r = dns.message.make_response(q)
    if name == "svc.evidence.test." and q.question[0].rdtype == 1:
        r.answer.append(dns.rrset.from_text(name, 60, "IN", "CNAME", "edge.evidence.test."))
        r.answer.append(dns.rrset.from_text("edge.evidence.test.", 60, "IN", "A", "127.0.0.2"))
    elif name.startswith("by-"):  # by-write., by-tcp., by-msg.: one address each
        r.answer.append(dns.rrset.from_text(name, 60, "IN", "A", "127.0.0.3"))
    elif name == "github.com." and q.question[0].rdtype == 1:  # 127.0.0.77 while the file MOVED is there
        r.answer.append(dns.rrset.from_text(name, 60, "IN", "A", "127.0.0.77" if os.path.exists(MOVED) else GITHUB))
    elif name not in ("svc.evidence.test.", "github.com."):
        r.set_rcode(3)  # NXDOMAIN
    return r.to_wire()

def tcp():
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 53)); srv.listen(8)
    while True:
        c, _ = srv.accept()
        n = int.from_bytes(c.recv(2), "big")
        data = b""
        while len(data) < n:
            data += c.recv(n - len(data))
        out = answer(data)
        c.sendall(len(out).to_bytes(2, "big") + out)
        c.close()
threading.Thread(target=tcp, daemon=True).start()
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
udp.bind(("127.0.0.1", 53))
print("ready", flush=True)
while True:
    data, peer = udp.recvfrom(4096)
    out = answer(data)
    if out is not None:
        udp.sendto(out, peer)
"""

# A job without a resolver library: queries by hand through write/read on a connected UDP socket,
# writev/read over TCP (length, then message), and sendmsg/recvmsg.
BY_HAND = r"""
import os, socket, struct
def query(name, qid):
    wire = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    return struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + wire + struct.pack(">HH", 1, 1)
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.connect(("127.0.0.1", 53))
os.write(u.fileno(), query("by-write.evidence.test", 1))
os.read(u.fileno(), 512)
u.sendmsg([query("by-msg.evidence.test", 2)])
u.recvmsg(512)
u.close()
t = socket.create_connection(("127.0.0.1", 53))
q = query("by-tcp.evidence.test", 3)
os.writev(t.fileno(), [struct.pack(">H", len(q)), q])
n = struct.unpack(">H", os.read(t.fileno(), 2))[0]
os.read(t.fileno(), n)
t.close()
"""

JOB = (
    "getent ahosts svc.evidence.test > /dev/null; "
    "getent hosts garbage.evidence.test; "
    "getent hosts nothing.evidence.test; "
    '/usr/bin/python3 -c "import socket; socket.create_connection((\\"127.0.0.2\\", 8080)).close()"'
)


GITHUB = "140.82.112.3"  # what the test's server answers for github.com (an address on its lo)
NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--")
# `evidence run` in the test's network namespace, in a mount namespace of its own where the test's
# resolv.conf is /etc/resolv.conf: the run's (and the job's) configured resolver is the test's server
_INSIDE = 'r=$1 n=$2; shift 2; mount --bind "$r" /etc/resolv.conf && exec nsenter --net="$n" -- "$@"'


@dataclasses.dataclass(frozen=True)
class DnsNet:
    name: str  # the network namespace (/run/netns/NAME)
    resolv: Path  # its resolv.conf: nameserver 127.0.0.1, the test's server
    moved: Path  # while this file exists, the server answers github.com with 127.0.0.77

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """`argv` in the namespace, with the namespace's resolv.conf."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        inside = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", _INSIDE, "sh"]
        return subprocess.run(
            [*inside, str(self.resolv), f"/run/netns/{self.name}", *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )

    def evidence(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run(sys.executable, "-m", "evidence", *args)

    def record(
        self, tmp_path: Path, *command: str, extra: tuple[str, ...] = (), name: str = "run.tar.gz"
    ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], list[dict[str, Any]]]:
        bundle = tmp_path / name
        proc = self.evidence("run", "--bundle", str(bundle), *extra, "--", *command)
        assert bundle.exists(), f"no bundle; stderr: {proc.stderr}"
        manifest, events = read_bundle(bundle)
        return proc, manifest, events


@pytest.fixture
def dns_netns(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DnsNet]:
    if os.geteuid() != 0:
        pytest.skip("needs root for a network namespace")
    name = f"evidence-test-dns-{os.getpid()}"
    resolv = tmp_path_factory.mktemp("dns") / "resolv.conf"
    moved = resolv.with_name("moved")
    resolv.write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
    subprocess.run(["ip", "netns", "add", name], check=True)
    server = None
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "-n", name, "addr", "add", f"{GITHUB}/32", "dev", "lo"], check=True)
        # an IPv6 address beside it: glibc's AI_ADDRCONFIG then asks AAAA as well as A (with
        # loopback addresses only it asks both; with a non-loopback IPv4 address only, only A)
        subprocess.run(["ip", "-n", name, "addr", "add", "2001:db8::53/128", "dev", "lo"], check=True)
        server = subprocess.Popen(
            [
                *("ip", "netns", "exec", name, sys.executable, "-c"),
                SERVER.replace("GITHUB", repr(GITHUB)).replace("MOVED", repr(str(moved))),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        yield DnsNet(name, resolv, moved)
    finally:
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "netns", "delete", name], check=False)


def test_dns_queries_answers_and_names_on_connects(tmp_path: Path, dns_netns: DnsNet) -> None:
    proc, manifest, events = dns_netns.record(tmp_path, *NOBODY, "sh", "-c", JOB, extra=("--detail", "full"))
    assert proc.returncode == 0, proc.stderr
    assert manifest["resolvers"] == ["127.0.0.1"]  # /etc/resolv.conf as the run saw it
    dns_events = [e["data"] for e in of_type(events, "network.dns")]

    a = [d for d in dns_events if d["name"] == "svc.evidence.test" and d["type"] == "A"]
    assert a, dns_events
    assert a[0]["server"] == "127.0.0.1" and a[0]["port"] == 53
    assert (a[0]["source"], a[0]["source_port"], a[0]["configured_resolver"]) == ("127.0.0.1", 53, True)
    assert a[0]["result"] == "NOERROR" and "unsolicited" not in a[0]
    assert a[0]["addresses"] == ["127.0.0.2"]
    assert "svc.evidence.test CNAME edge.evidence.test" in a[0]["answers"]
    assert a[0]["exe"] == "/usr/bin/getent"
    aaaa = [d for d in dns_events if d["name"] == "svc.evidence.test" and d["type"] == "AAAA"]
    assert aaaa and aaaa[0]["result"] == "NOERROR" and aaaa[0]["addresses"] == []

    nx = [d for d in dns_events if d["name"] == "nothing.evidence.test"]
    assert nx and all(d["result"] == "NXDOMAIN" for d in nx)

    # the hostile server's garbage: recorded as malformed; its query stays unanswered
    bad = [d for d in dns_events if d.get("malformed")]
    assert bad and bad[0]["received"] is True and bad[0]["size"] > 0
    asked = [d for d in dns_events if d["name"] == "garbage.evidence.test"]
    assert asked and all(d["result"] == "no answer" for d in asked)

    connects = [
        e["data"]
        for e in of_type(events, "network.connect")
        if e["data"]["address"] == "127.0.0.2" and e["data"]["port"] == 8080
    ]
    assert connects and connects[0]["names"] == ["edge.evidence.test", "svc.evidence.test"]
    # the connects to the server itself have no names (no answer named it)
    to_server = [e["data"] for e in of_type(events, "network.connect") if e["data"]["port"] == 53]
    assert to_server and all("names" not in c for c in to_server)


def test_dns_summary_mode_and_show(tmp_path: Path, dns_netns: DnsNet) -> None:
    proc, _, events = dns_netns.record(tmp_path, "sh", "-c", JOB)
    assert proc.returncode == 0, proc.stderr
    dns_events = [e["data"] for e in of_type(events, "network.dns")]
    assert any(d["name"] == "svc.evidence.test" and d["addresses"] == ["127.0.0.2"] for d in dns_events)
    connects = [e["data"] for e in of_type(events, "network.connect") if e["data"]["address"] == "127.0.0.2"]
    assert connects and connects[0]["names"] == ["edge.evidence.test", "svc.evidence.test"]
    shown = dns_netns.evidence("show", str(tmp_path / "run.tar.gz"))
    assert shown.returncode == 0, shown.stderr
    assert "  svc.evidence.test A -> 127.0.0.2 via 127.0.0.1" in shown.stdout
    assert "127.0.0.2:8080 [edge.evidence.test svc.evidence.test]" in shown.stdout
    assert "malformed message received" in shown.stdout
    profile = dns_netns.evidence("profile", str(tmp_path / "run.tar.gz"))
    assert profile.returncode == 0, profile.stderr
    assert '"svc.evidence.test:8080"' in profile.stdout and "127.0.0.2" not in profile.stdout


def test_dns_by_write_read_tcp_and_msghdr(tmp_path: Path, dns_netns: DnsNet) -> None:
    command = [*NOBODY, "/usr/bin/python3", "-S", "-c", BY_HAND]
    proc, _, events = dns_netns.record(tmp_path, *command, extra=("--detail", "full"))
    assert proc.returncode == 0, proc.stderr
    got = {d["name"]: d for d in (e["data"] for e in of_type(events, "network.dns"))}
    for name in ("by-write.evidence.test", "by-msg.evidence.test", "by-tcp.evidence.test"):
        assert got[name]["result"] == "NOERROR" and got[name]["addresses"] == ["127.0.0.3"], got
        assert got[name]["server"] == "127.0.0.1" and not got[name].get("unsolicited"), got
        assert got[name]["source"] == "127.0.0.1" and got[name]["configured_resolver"] is True, got


# A job that reuses a DNS socket's descriptor number for a file, two ways: the socket closed and the
# number given to the next open (close is not traced), and a file put over a live socket's number
# by dup2 (no close call at all). What it then writes and reads there is file I/O, never DNS.
REUSED = r"""
import os, socket, struct
def query(name, qid):
    wire = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    return struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + wire + struct.pack(">HH", 1, 1)
def dns(name, qid):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect(("127.0.0.1", 53))
    os.write(s.fileno(), query(name, qid))
    os.read(s.fileno(), 512)
    return s
def file_io(fd, name, qid):
    os.write(fd, query(name, qid))
    os.lseek(fd, 0, os.SEEK_SET)
    os.read(fd, 512)
s = dns("by-write.evidence.test", 1)
n = s.fileno()
s.close()
f = os.open("/tmp", os.O_TMPFILE | os.O_RDWR, 0o600)
assert f == n, (f, n)
file_io(f, "closed-reused.evidence.test", 2)
s = dns("by-msg.evidence.test", 3)
g = os.open("/tmp", os.O_TMPFILE | os.O_RDWR, 0o600)
os.dup2(g, s.fileno())
file_io(s.fileno(), "dup2-over.evidence.test", 4)
"""


def test_a_dns_sockets_number_reused_for_a_file_is_not_dns(tmp_path: Path, dns_netns: DnsNet) -> None:
    command = [*NOBODY, "/usr/bin/python3", "-S", "-c", REUSED]
    for detail in ("full", "summary"):
        proc, _, events = dns_netns.record(
            tmp_path, *command, extra=("--detail", detail), name=f"{detail}.tar.gz"
        )
        assert proc.returncode == 0, proc.stderr
        got = {d["name"]: d for d in (e["data"] for e in of_type(events, "network.dns"))}
        assert sorted(got) == ["by-msg.evidence.test", "by-write.evidence.test"], got
        for d in got.values():
            assert d["result"] == "NOERROR" and d["addresses"] == ["127.0.0.3"], got


# ---- issue 22, item 2: a job that forges the DNS answer naming its connect (threat-model row 41)

# What every forging job below shares: a query for github.com, and an answer to it that says
# github.com -> 127.0.0.77, sent from a UDP port of the job's own (the run's resolver, the test's
# server on 127.0.0.1:53, answers github.com with GITHUB).
FORGE = r"""
import os, socket, struct, sys
RESOLVER = ("127.0.0.1", 53)
def query(name, qid):
    wire = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    return struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + wire + struct.pack(">HH", 1, 1)
def answer(q, address):
    head = q[:2] + struct.pack(">HHHHH", 0x8180, 1, 1, 0, 0)
    return head + q[12:] + b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 60, 4) + socket.inet_aton(address)
def address_in(message):
    return socket.inet_ntoa(message[-4:])
def forger():
    f = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    f.bind(("127.0.0.1", 0))  # a port of the job's own (unprivileged: not 53)
    return f
def connect(address):
    socket.create_connection((address, 443)).close()
"""

# The red team's attack: the forged answer is queued on the job's socket before its query even
# leaves, so recvfrom returns it first (from the forger's port; the resolver's answer comes later,
# unread). The job then connects where its answer said.
FORGED_RECVFROM = (
    FORGE
    + r"""
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("127.0.0.1", 0))
q = query("github.com", 0x4747)
forger().sendto(answer(q, "127.0.0.77"), s.getsockname())
s.sendto(q, RESOLVER)
got, source = s.recvfrom(512)
assert source[1] != 53 and address_in(got) == "127.0.0.77", source
connect(address_in(got))
"""
)

HONEST = (
    "import socket; "
    "a = socket.getaddrinfo('github.com', 443, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]; "
    "socket.create_connection((a, 443)).close()"
)


def _connects(events: list[dict[str, Any]], address: str) -> list[dict[str, Any]]:
    return [e["data"] for e in of_type(events, "network.connect") if e["data"]["address"] == address]


def _github(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e["data"] for e in of_type(events, "network.dns") if e["data"]["name"] == "github.com"]


def test_a_job_answering_its_own_query_names_nothing_and_diff_sees_the_destination(
    tmp_path: Path, dns_netns: DnsNet
) -> None:
    proc, manifest, honest = dns_netns.record(
        tmp_path, *NOBODY, "/usr/bin/python3", "-S", "-c", HONEST, name="honest.tar.gz"
    )
    assert proc.returncode == 0, proc.stderr
    assert manifest["resolvers"] == ["127.0.0.1"]
    (real,) = _connects(honest, GITHUB)
    assert real["names"] == ["github.com"] and real["result"] == 0

    proc, _, forged = dns_netns.record(
        tmp_path, *NOBODY, "/usr/bin/python3", "-S", "-c", FORGED_RECVFROM, name="forged.tar.gz"
    )
    assert proc.returncode == 0, proc.stderr
    (answer,) = [d for d in _github(forged) if d["addresses"] == ["127.0.0.77"]]
    assert answer["unsolicited"] == "other source" and answer["configured_resolver"] is False
    assert answer["source"] == "127.0.0.1" and answer["source_port"] not in (None, 53)
    (fake,) = _connects(forged, "127.0.0.77")
    assert fake["result"] == 0 and "names" not in fake and "other_names" not in fake

    lint = dns_netns.evidence(
        "lint", "--format", "json", "--fail-on", "warn", str(tmp_path / "forged.tar.gz")
    )
    assert lint.returncode == 1, lint.stderr
    found = [f for f in json.loads(lint.stdout)["findings"] if f["rule"] == "EV015"]
    assert found and "github.com A -> 127.0.0.77 from 127.0.0.1:" in found[0]["message"], found

    # the CI gate: the destination is new (by address), github.com is gone
    diff = dns_netns.evidence("diff", str(tmp_path / "honest.tar.gz"), str(tmp_path / "forged.tar.gz"))
    assert diff.returncode == 1, diff.stdout + diff.stderr
    assert "+ 127.0.0.77:443" in diff.stdout and "- github.com:443" in diff.stdout, diff.stdout
    assert "No behaviour differences observed" not in diff.stdout


def test_a_name_the_runs_own_resolver_moves_to_a_loopback_address_is_a_new_destination(
    tmp_path: Path, dns_netns: DnsNet
) -> None:
    """The run's configured resolver itself answers github.com with 127.0.0.77 (a name the job got
    registered with it): credited, so compared by name, and still the gate sees it."""
    command = [*NOBODY, "/usr/bin/python3", "-S", "-c", HONEST]
    proc, _, _ = dns_netns.record(tmp_path, *command, name="honest.tar.gz")
    assert proc.returncode == 0, proc.stderr
    dns_netns.moved.touch()
    try:
        proc, _, events = dns_netns.record(tmp_path, *command, name="moved.tar.gz")
    finally:
        dns_netns.moved.unlink()
    assert proc.returncode == 0, proc.stderr
    (local,) = _connects(events, "127.0.0.77")
    assert local["names"] == ["github.com"]
    diff = dns_netns.evidence("diff", str(tmp_path / "honest.tar.gz"), str(tmp_path / "moved.tar.gz"))
    assert diff.returncode == 1, diff.stdout + diff.stderr
    assert (
        "+ github.com:443 at a loopback address  (127.0.0.77; the name's addresses in A: public)"
        in diff.stdout
    )
    built = dns_netns.evidence("baseline", "build", str(tmp_path / "honest.tar.gz"))
    assert built.returncode == 0, built.stderr
    (tmp_path / "baseline.json").write_text(built.stdout)
    against = dns_netns.evidence(
        "diff", "--baseline", str(tmp_path / "baseline.json"), str(tmp_path / "moved.tar.gz")
    )
    assert against.returncode == 1 and "github.com:443 at a loopback address" in against.stdout, (
        against.stdout
    )


# The same answer read without a source buffer: read() on a socket that is not connected, and
# recv() on one connected to the resolver after the forged answer was queued on it (a connected
# UDP socket receives only from its peer, but what came before the connect stays queued).
FORGED_UNSEEN_SOURCE = (
    FORGE
    + r"""
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("127.0.0.1", 0))
q = query("github.com", 0x4748)
forger().sendto(answer(q, "127.0.0.77"), s.getsockname())
s.sendto(q, RESOLVER)
got = os.read(s.fileno(), 512)
assert address_in(got) == "127.0.0.77"
connect(address_in(got))
c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
c.bind(("127.0.0.1", 0))
q = query("github.com", 0x4749)
forger().sendto(answer(q, "127.0.0.78"), c.getsockname())
c.connect(RESOLVER)
c.send(q)
got = c.recv(512)
assert address_in(got) == "127.0.0.78"
connect(address_in(got))
"""
)


def test_a_forged_answer_read_without_its_source_is_not_credited(tmp_path: Path, dns_netns: DnsNet) -> None:
    command = [*NOBODY, "/usr/bin/python3", "-S", "-c", FORGED_UNSEEN_SOURCE]
    proc, _, events = dns_netns.record(tmp_path, *command)
    assert proc.returncode == 0, proc.stderr
    for address in ("127.0.0.77", "127.0.0.78"):
        (answer,) = [d for d in _github(events) if d["addresses"] == [address]]
        assert answer["unsolicited"] == "other source", answer
        assert answer["source"] == "127.0.0.1" and answer["source_port"] not in (None, 53)
        (fake,) = _connects(events, address)
        assert "names" not in fake and "other_names" not in fake


# The resolver's real answer, rewritten in the job's buffer after the kernel copied it there and
# before the probe reads it: recvmmsg for two messages returns (and its exit is traced) only when
# the second comes, so a second thread sees the answer land in the first buffer, writes the forged
# one (the same length) over it, and only then sends the second message, from a port of its own.
FORGED_IN_BUFFER = (
    FORGE
    + r"""
import ctypes, threading, time
libc = ctypes.CDLL(None, use_errno=True)
NR_RECVMMSG = {"x86_64": 299, "aarch64": 243}[os.uname().machine]
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
class msghdr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_void_p), ("namelen", ctypes.c_uint32), ("iov", ctypes.POINTER(iovec)),
                ("iovlen", ctypes.c_size_t), ("control", ctypes.c_void_p), ("controllen", ctypes.c_size_t),
                ("flags", ctypes.c_int)]
class mmsghdr(ctypes.Structure):
    _fields_ = [("hdr", msghdr), ("len", ctypes.c_uint32)]
bufs = [ctypes.create_string_buffer(512) for _ in range(2)]
iovs = (iovec * 2)(*(iovec(ctypes.addressof(b), 512) for b in bufs))
msgs = (mmsghdr * 2)()
for i in range(2):
    msgs[i].hdr.iov = ctypes.pointer(iovs[i])
    msgs[i].hdr.iovlen = 1
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
q = query("github.com", 0x5001)
forged = answer(q, "127.0.0.77")
def rewrite():
    while bufs[0].raw[:2] != q[:2]:  # the resolver's answer is in the first buffer
        time.sleep(0.001)
    ctypes.memmove(bufs[0], forged, len(forged))
    forger().sendto(b"the second message", s.getsockname())
s.sendto(q, RESOLVER)
t = threading.Thread(target=rewrite)
t.start()
n = libc.syscall(NR_RECVMMSG, s.fileno(), msgs, 2, 0, None)
t.join()
assert n == 2, ctypes.get_errno()
got = bufs[0].raw[: msgs[0].len]
assert address_in(got) == "127.0.0.77"
connect(address_in(got))
"""
)


def test_an_answer_rewritten_in_the_jobs_buffer_is_not_credited(tmp_path: Path, dns_netns: DnsNet) -> None:
    command = [*NOBODY, "/usr/bin/python3", "-S", "-c", FORGED_IN_BUFFER]
    proc, _, events = dns_netns.record(tmp_path, *command)
    assert proc.returncode == 0, proc.stderr
    # what the probe read is no message the kernel delivered: the resolver's was another
    (rewritten,) = [d for d in _github(events) if d["addresses"] == ["127.0.0.77"]]
    assert rewritten["unsolicited"] == "unverified" and rewritten["source"] is None, rewritten
    assert rewritten["configured_resolver"] is False
    (asked,) = [d for d in _github(events) if "unsolicited" not in d]
    assert asked["result"] == "no answer" and asked["configured_resolver"] is True  # its answer never read
    (fake,) = _connects(events, "127.0.0.77")
    assert "names" not in fake and "other_names" not in fake


# A resolver of the job's own at the run's resolver's very address: in a user and network namespace
# of its own the job is root, serves 127.0.0.1:53 itself and answers github.com -> 127.0.0.77.
OWN_NETWORK = (
    FORGE
    + r"""
import subprocess
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
srv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
srv.bind(RESOLVER)
site = socket.socket()
site.bind(("127.0.0.77", 443))
site.listen(1)
c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
c.sendto(query("github.com", 0x4750), RESOLVER)
q, peer = srv.recvfrom(512)
srv.sendto(answer(q, "127.0.0.77"), peer)
got, source = c.recvfrom(512)
assert source == RESOLVER, source
connect(address_in(got))
"""
)


def test_a_resolver_of_the_jobs_own_network_is_not_the_runs(tmp_path: Path, dns_netns: DnsNet) -> None:
    command = [*NOBODY, "unshare", "-Urn", "--", "/usr/bin/python3", "-S", "-c", OWN_NETWORK]
    proc, manifest, events = dns_netns.record(tmp_path, *command)
    assert proc.returncode == 0, proc.stderr
    assert manifest["resolvers"] == ["127.0.0.1"]
    (answer,) = _github(events)
    # from 127.0.0.1:53 as the kernel delivered it, to the query's socket: credited, but in a
    # network the process made itself (it left the run's namespaces): not the run's resolver
    assert (answer["source"], answer["source_port"]) == ("127.0.0.1", 53) and "unsolicited" not in answer
    assert answer["configured_resolver"] is False
    (site,) = _connects(events, "127.0.0.77")
    assert site["mntns"] == "other" and "names" not in site and site["other_names"] == ["github.com"]
