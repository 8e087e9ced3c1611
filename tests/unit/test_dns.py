"""DNS messages from the job's buffers: parsed defensively, paired, and naming later connects."""

from __future__ import annotations

import random
import struct

import dns.message
import dns.rrset
from hypothesis import given, settings
from hypothesis import strategies as st

from evidence.agent.recorder import decode as d
from evidence.agent.recorder import dns as dnsmod
from evidence.agent.recorder.correlate import Correlator
from evidence.agent.recorder.dns import Resolutions, owner_names, parse
from evidence.bundle.record_types import DnsRecord

SERVER = "127.0.0.53"


def _query(name: str, rdtype: str = "A", qid: int = 4242) -> dns.message.Message:
    q = dns.message.make_query(name, rdtype)
    q.id = qid
    return q


def _answer(q: dns.message.Message, *rrsets: tuple[str, str, str]) -> bytes:
    r = dns.message.make_response(q)
    for owner, rtype, value in rrsets:
        r.answer.append(dns.rrset.from_text(owner, 60, "IN", rtype, value))
    return bytes(r.to_wire())


def _ev(
    payload: bytes,
    received: bool,
    tgid: int = 7,
    address: str = SERVER,
    *,
    port: int = 53,
    sock: int = 11,
    cookie: int = 21,
    flags: int = 0,
    ret: int | None = None,
) -> dict[str, object]:
    """A message the job sent or received (sock: the socket's identity, cookie: a receive's)."""
    return {
        "kind": "dns",
        "ts": 1000,
        "cgid": 1,
        "run": 1,
        "tgid": tgid,
        "tid": tgid,
        "flags": flags,
        "ret": len(payload) if ret is None else ret,
        "fd": 3,
        "received": received,
        "delivered": False,
        "family": "AF_INET",
        "address": address,
        "port": port,
        "sock": sock,
        "cookie": cookie if received else 0,
        "proto": 0,
        "seq": 0,
        "tcp_flags": 0,
        "payload": payload,
    }


def _delivered(
    payload: bytes,
    source: str = SERVER,
    port: int = 53,
    *,
    cookie: int = 21,
    proto: int = 17,
    seq: int = 0,
    tcp_flags: int = 0,
) -> dict[str, object]:
    """What the kernel delivered to the socket with `cookie` (on_dns_ingress): by no process."""
    ev = _ev(payload, False, 0, source, port=port, sock=0)
    ev.update(delivered=True, fd=-1, cookie=cookie, proto=proto, seq=seq, tcp_flags=tcp_flags)
    return ev


def _answered(r: Resolutions, raw: bytes, **kw: object) -> list[DnsRecord]:
    """`raw` delivered by the server to the socket, then read there."""
    r.deliver(_delivered(raw))
    return r.feed(_ev(raw, True, **kw), *BASE)


BASE = (1, 7, 1, None)  # t, pid, ppid, exe


def test_parse_a_query_and_an_answer_with_a_cname_chain() -> None:
    q = _query("WWW.Example.ORG")
    msg = parse(bytes(q.to_wire()))
    assert msg is not None and not msg.response
    assert (msg.name, msg.type, msg.answers) == ("www.example.org", "A", ())
    raw = _answer(
        q,
        ("www.example.org.", "CNAME", "edge.cdn.example."),
        ("edge.cdn.example.", "A", "192.0.2.7"),
        ("edge.cdn.example.", "A", "192.0.2.8"),
    )
    ans = parse(raw)
    assert ans is not None and ans.response and ans.rcode == "NOERROR"
    assert owner_names(ans, "192.0.2.8") == ["edge.cdn.example", "www.example.org"]
    assert owner_names(ans, "198.51.100.1") == []


def test_parse_a_tcp_message_with_its_length_prefix() -> None:
    wire = bytes(_query("example.org").to_wire())
    msg = parse(struct.pack(">H", len(wire)) + wire)
    assert msg is not None and msg.name == "example.org"


def test_hostile_bytes_never_raise() -> None:
    wire = _answer(_query("example.org"), ("example.org.", "A", "192.0.2.1"))
    rng = random.Random(7)
    samples = [b"", b"\x00", b"\xff" * 12, wire[:5], wire[:-1], wire + b"\x00" * 3]
    # a compression pointer that points at itself, and one that loops between two names
    samples.append(wire[:12] + b"\xc0\x0c")
    samples.append(b"\x00\x01\x81\x80\x00\x01\x00\x00\x00\x00\x00\x00\xc0\x0e\xc0\x0c\x00\x01\x00\x01")
    for _ in range(2000):
        b = bytearray(wire)
        for _ in range(rng.randint(1, 6)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        samples.append(bytes(b))
    for raw in samples:
        parse(raw)  # a Message or None, nothing else
    assert parse(b"not dns at all, but long enough") is None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_any_bytes_parse_or_are_none(raw: bytes) -> None:
    msg = parse(raw)
    assert msg is None or isinstance(msg.answers, tuple)


def _connect(address: str, tgid: int = 7) -> dict[str, object]:
    sa = struct.pack("<H", 2) + struct.pack(">H", 443) + bytes(map(int, address.split("."))) + b"\0" * 8
    family, addr, port = d.decode_sockaddr(sa, len(sa))
    return {
        "kind": "connect",
        "ts": 2000,
        "cgid": 1,
        "run": 1,
        "tgid": tgid,
        "tid": tgid,
        "flags": 0,
        "ret": 0,
        "exe_tok": 0,
        "tok": 0,
        "fd": 4,
        "family": family,
        "address": addr,
        "port": port,
    }


def test_query_and_answer_pair_into_one_record_and_name_later_connects() -> None:
    c = Correlator(0)
    c.dns.configure([SERVER])
    q = _query("api.example.org")
    assert c.feed(_ev(bytes(q.to_wire()), received=False)) == []
    raw = _answer(q, ("api.example.org.", "A", "192.0.2.9"))
    assert c.feed(_delivered(raw)) == []  # what the kernel delivered: checked against, not a record
    (rec,) = c.feed(_ev(raw, received=True))
    assert rec["k"] == "dns" and rec["name"] == "api.example.org" and rec["result"] == "NOERROR"
    assert rec["addresses"] == ["192.0.2.9"] and rec["answers"] == ["api.example.org A 192.0.2.9"]
    assert (rec["source"], rec["source_port"], rec["configured_resolver"]) == (SERVER, 53, True)
    assert "unsolicited" not in rec and "_cgid" not in rec
    (conn,) = c.feed(_connect("192.0.2.9"))
    assert conn["names"] == ["api.example.org"] and "other_names" not in conn
    (other,) = c.feed(_connect("198.51.100.1"))
    assert "names" not in other


def test_an_answer_from_a_port_of_the_jobs_own_is_unsolicited_and_names_nothing() -> None:
    """The red team's forgery: the job answers its own query (same id and question) from a port of
    its own, github.com -> 127.0.0.77, before the resolver's answer arrives."""
    c = Correlator(0)
    c.dns.configure([SERVER])
    q = _query("github.com")
    c.feed(_ev(bytes(q.to_wire()), received=False))
    forged = _answer(q, ("github.com.", "A", "127.0.0.77"))
    c.feed(_delivered(forged, "127.0.0.1", 40000))
    (rec,) = c.feed(_ev(forged, received=True))
    assert rec["unsolicited"] == "other source" and rec["addresses"] == ["127.0.0.77"]
    assert (rec["source"], rec["source_port"], rec["configured_resolver"]) == ("127.0.0.1", 40000, False)
    (conn,) = c.feed(_connect("127.0.0.77"))
    assert "names" not in conn and "other_names" not in conn
    # the resolver's own answer, still awaited, is credited when it comes
    real = _answer(q, ("github.com.", "A", "140.82.112.3"))
    c.feed(_delivered(real))
    (ok,) = c.feed(_ev(real, received=True))
    assert "unsolicited" not in ok and ok["configured_resolver"] is True
    assert c.feed(_connect("140.82.112.3"))[0]["names"] == ["github.com"]


def test_an_answer_rewritten_in_the_jobs_buffer_is_unverified() -> None:
    """The resolver's answer was delivered, but another thread of the job rewrote the buffer before
    the probe read it: the bytes read are none the kernel delivered."""
    r = Resolutions([SERVER])
    q = _query("github.com")
    r.feed(_ev(bytes(q.to_wire()), received=False), *BASE)
    r.deliver(_delivered(_answer(q, ("github.com.", "A", "140.82.112.3"))))
    forged = _answer(q, ("github.com.", "A", "127.0.0.77"))
    (rec,) = r.feed(_ev(forged, True), *BASE)
    assert rec["unsolicited"] == "unverified" and rec["source"] is None
    assert rec["configured_resolver"] is False and r.names_of("127.0.0.77") is None
    # nothing delivered at all (its delivery not recorded): the same
    (none,) = Resolutions([SERVER]).feed(_ev(forged, True), *BASE)
    assert none["unsolicited"] == "unverified"


def test_an_answer_on_another_socket_or_to_another_id_or_question_is_unsolicited() -> None:
    r = Resolutions([SERVER])
    q = _query("a.example", qid=1)
    assert r.feed(_ev(bytes(q.to_wire()), received=False), *BASE) == []
    (other_id,) = _answered(r, _answer(_query("a.example", qid=2), ("a.example.", "A", "203.0.113.5")))
    assert other_id["unsolicited"] == "no query"
    (other_type,) = _answered(
        r, _answer(_query("a.example", "AAAA", qid=1), ("a.example.", "AAAA", "2001:db8::1"))
    )
    assert other_type["unsolicited"] == "no query"
    (other_socket,) = _answered(r, _answer(q, ("a.example.", "A", "203.0.113.6")), sock=12)
    assert other_socket["unsolicited"] == "no query"
    # delivered to another socket than the one it was read from
    raw = _answer(q, ("a.example.", "A", "203.0.113.7"))
    r.deliver(_delivered(raw, cookie=99))
    (elsewhere,) = r.feed(_ev(raw, True), *BASE)
    assert elsewhere["unsolicited"] == "unverified"
    assert r.names == {} and r.other_names == {}
    (left,) = r.flush()
    assert (
        left["name"] == "a.example" and left["result"] == "no answer" and left["configured_resolver"] is True
    )


def test_answers_of_a_server_that_is_not_configured_name_only_other_names() -> None:
    c = Correlator(0)
    c.dns.configure(["10.0.0.2"])
    q = _query("pkg.example")
    c.feed(_ev(bytes(q.to_wire()), received=False))  # to SERVER, which is not the run's resolver
    raw = _answer(q, ("pkg.example.", "A", "192.0.2.20"))
    c.feed(_delivered(raw))
    (rec,) = c.feed(_ev(raw, received=True))
    assert "unsolicited" not in rec and rec["configured_resolver"] is False
    (conn,) = c.feed(_connect("192.0.2.20"))
    assert "names" not in conn and conn["other_names"] == ["pkg.example"]


def test_answers_to_a_process_in_another_namespace_are_never_a_configured_resolvers() -> None:
    """A process in a user and network namespace of its own is root there: it can answer from any
    address and port it likes."""
    r = Resolutions([SERVER])
    q = _query("github.com")
    r.feed(_ev(bytes(q.to_wire()), received=False, flags=d.F_OTHER_NS), *BASE)
    (rec,) = _answered(r, _answer(q, ("github.com.", "A", "127.0.0.77")), flags=d.F_OTHER_NS)
    assert "unsolicited" not in rec and rec["configured_resolver"] is False
    assert r.names_of("127.0.0.77") is None and r.other_names_of("127.0.0.77") == ["github.com"]


def test_only_the_name_asked_for_and_its_cname_chain_are_named() -> None:
    """A hostile server (behind a resolver that passes its records on) adds a record of a name that
    was not asked for: it names nothing."""
    r = Resolutions([SERVER])
    q = _query("x.attacker.example")
    r.feed(_ev(bytes(q.to_wire()), received=False), *BASE)
    raw = _answer(
        q,
        ("x.attacker.example.", "CNAME", "y.attacker.example."),
        ("y.attacker.example.", "A", "192.0.2.50"),
        ("github.com.", "A", "192.0.2.51"),
    )
    (rec,) = _answered(r, raw)
    assert rec["addresses"] == ["192.0.2.50"] and "github.com A 192.0.2.51" in rec["answers"]
    assert r.names_of("192.0.2.50") == ["x.attacker.example", "y.attacker.example"]
    assert r.names_of("192.0.2.51") is None


def test_an_answer_to_a_query_answered_already_is_credited_too() -> None:
    r = Resolutions([SERVER])
    q = _query("dup.example")
    r.feed(_ev(bytes(q.to_wire()), received=False), *BASE)
    raw = _answer(q, ("dup.example.", "A", "192.0.2.60"))
    (first,) = _answered(r, raw)
    (again,) = _answered(r, raw)  # a retry's answer, after the first one
    assert "unsolicited" not in first and "unsolicited" not in again and again["name"] == "dup.example"


def _tcp(message: bytes) -> bytes:
    return struct.pack(">H", len(message)) + message


def test_tcp_answers_are_credited_only_as_framed_from_the_streams_start() -> None:
    """Over TCP a job cuts its reads where it likes: a message is credited only when it is one the
    stream frames from its first byte, never bytes from inside another message (a question name
    the job chose, that reads as a whole DNS answer)."""
    r = Resolutions([SERVER])
    q = _query("big.example", qid=7)
    r.feed(_ev(bytes(q.to_wire()), received=False), *BASE)
    answer = _answer(q, ("big.example.", "A", "192.0.2.70"))
    inner = _answer(_query("github.com", qid=8), ("github.com.", "A", "127.0.0.77"))
    carrier = _answer(_query("carrier.example", qid=9))
    stream = _tcp(answer) + _tcp(carrier + inner)  # the forgery inside the second message
    r.deliver(_delivered(b"", proto=6, seq=1000, tcp_flags=0x12))  # SYN-ACK
    r.deliver(_delivered(stream[:30], proto=6, seq=1001))
    r.deliver(_delivered(stream[30:], proto=6, seq=1031))
    r.feed(_ev(bytes(_query("github.com", qid=8).to_wire()), received=False), *BASE)
    (ok,) = r.feed(_ev(answer, True), *BASE)  # read after its 2-byte length
    assert "unsolicited" not in ok and ok["source"] == SERVER
    (forged,) = r.feed(_ev(inner, True), *BASE)
    assert forged["unsolicited"] == "unverified" and r.names_of("127.0.0.77") is None
    # with its length prefix, in one read: credited too (the query again, the first one answered)
    (prefixed,) = r.feed(_ev(_tcp(answer), True), *BASE)
    assert "unsolicited" not in prefixed


def test_deliveries_are_bounded() -> None:
    r = Resolutions([SERVER])
    wire = _answer(_query("flood.example"), ("flood.example.", "A", "192.0.2.1"))
    for i in range(dnsmod.MAX_DELIVERIES + 500):
        r.deliver(_delivered(wire, cookie=i % 3000 + 1))
    for i in range(50):
        r.deliver(_delivered(b"", proto=6, seq=i, tcp_flags=0x12, cookie=5000 + i))
        r.deliver(_delivered(wire, proto=6, seq=i + 1, cookie=5000 + i))
    held = sum(len(v) for v in r.deliveries.udp.values())
    held += sum(len(s.segments) + 1 for s in r.deliveries.tcp.values())
    assert held == r.deliveries.held <= dnsmod.MAX_DELIVERIES


def test_malformed_messages_are_records_and_the_tables_stay_bounded() -> None:
    r = Resolutions()
    (bad,) = r.feed(_ev(b"\x12\x34garbage", received=True), *BASE)
    assert bad["malformed"] is True and bad["result"] == "malformed" and bad["size"] == 9
    out = []
    for i in range(5000):
        out += r.feed(_ev(bytes(_query(f"n{i}.example", qid=i % 65536).to_wire()), False), *BASE)
    assert len(r.pending) <= 4096 and len(out) == 5000 - len(r.pending) and len(r.asked) <= 4096


def test_decode_a_dns_record() -> None:
    wire = bytes(_query("example.org").to_wire())
    sa = struct.pack("<H", 2) + struct.pack(">H", 53) + bytes([127, 0, 0, 53]) + b"\0" * 20
    body = struct.pack("<qiHH28sIQQBB6x", len(wire), 5, d.DNS_RECEIVED, len(wire), sa, 0, 77, 88, 0, 0) + wire
    raw = d.HDR.pack(1, 2, 3, 4, 5, d.EV_DNS, 0) + body
    ev = d.decode(raw)
    assert ev["kind"] == "dns" and ev["received"] is True and ev["payload"] == wire
    assert (ev["address"], ev["port"], ev["fd"], ev["sock"], ev["cookie"]) == ("127.0.0.53", 53, 5, 77, 88)
    assert ev["delivered"] is False
