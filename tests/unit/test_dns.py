"""DNS messages from the job's buffers: parsed defensively, paired, and naming later connects."""

from __future__ import annotations

import random
import struct

import dns.message
import dns.rrset
from hypothesis import given, settings
from hypothesis import strategies as st

from evidence.agent.recorder import decode as d
from evidence.agent.recorder.correlate import Correlator
from evidence.agent.recorder.dns import Resolutions, owner_names, parse

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


def _ev(payload: bytes, received: bool, tgid: int = 7, address: str = SERVER) -> dict[str, object]:
    return {
        "kind": "dns",
        "ts": 1000,
        "cgid": 1,
        "run": 1,
        "tgid": tgid,
        "tid": tgid,
        "flags": 0,
        "ret": len(payload),
        "fd": 3,
        "received": received,
        "family": "AF_INET",
        "address": address,
        "port": 53,
        "payload": payload,
    }


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


def test_query_and_answer_pair_into_one_record_and_name_later_connects() -> None:
    c = Correlator(0)
    q = _query("api.example.org")
    assert c.feed(_ev(bytes(q.to_wire()), received=False)) == []
    raw = _answer(q, ("api.example.org.", "A", "192.0.2.9"))
    (rec,) = c.feed(_ev(raw, received=True))
    assert rec["k"] == "dns" and rec["name"] == "api.example.org" and rec["result"] == "NOERROR"
    assert rec["addresses"] == ["192.0.2.9"] and rec["answers"] == ["api.example.org A 192.0.2.9"]
    assert "_cgid" not in rec
    sa = struct.pack("<H", 2) + struct.pack(">H", 443) + bytes([192, 0, 2, 9]) + b"\0" * 8
    family, address, port = d.decode_sockaddr(sa, len(sa))
    connect = {
        "kind": "connect",
        "ts": 2000,
        "cgid": 1,
        "run": 1,
        "tgid": 7,
        "tid": 7,
        "flags": 0,
        "ret": 0,
        "exe_tok": 0,
        "tok": 0,
        "fd": 4,
        "family": family,
        "address": address,
        "port": port,
    }
    (conn,) = c.feed(connect)
    assert conn["names"] == ["api.example.org"]
    (other,) = c.feed(dict(connect, address="198.51.100.1"))
    assert "names" not in other


def test_an_answer_from_another_server_or_id_does_not_complete_a_query() -> None:
    r = Resolutions()
    base = (1, 7, 1, None)  # t, pid, ppid, exe
    q = _query("a.example", qid=1)
    assert r.feed(_ev(bytes(q.to_wire()), received=False), *base) == []
    spoofed = _answer(_query("a.example", qid=2), ("a.example.", "A", "203.0.113.5"))
    (rec,) = r.feed(_ev(spoofed, received=True), *base)
    assert rec.get("unasked") is True
    (elsewhere,) = r.feed(
        _ev(_answer(q, ("a.example.", "A", "203.0.113.6")), True, address="10.0.0.1"), *base
    )
    assert elsewhere.get("unasked") is True
    (left,) = r.flush()
    assert left["name"] == "a.example" and left["result"] == "no answer"


def test_malformed_messages_are_records_and_the_tables_stay_bounded() -> None:
    r = Resolutions()
    base = (1, 7, 1, None)  # t, pid, ppid, exe
    (bad,) = r.feed(_ev(b"\x12\x34garbage", received=True), *base)
    assert bad["malformed"] is True and bad["result"] == "malformed" and bad["size"] == 9
    out = []
    for i in range(5000):
        out += r.feed(_ev(bytes(_query(f"n{i}.example", qid=i % 65536).to_wire()), False), *base)
    assert len(r.pending) <= 4096 and len(out) == 5000 - len(r.pending)


def test_decode_a_dns_record() -> None:
    wire = bytes(_query("example.org").to_wire())
    sa = struct.pack("<H", 2) + struct.pack(">H", 53) + bytes([127, 0, 0, 53]) + b"\0" * 20
    body = struct.pack("<qiHH28s4x", len(wire), 5, d.DNS_RECEIVED, len(wire), sa) + wire
    raw = d.HDR.pack(1, 2, 3, 4, 5, d.EV_DNS, 0) + body
    ev = d.decode(raw)
    assert ev["kind"] == "dns" and ev["received"] is True and ev["payload"] == wire
    assert (ev["address"], ev["port"], ev["fd"]) == ("127.0.0.53", 53, 5)
