"""DNS messages of the run's processes (record.bpf.c, ---- dns): parsed with dnspython, paired
query with answer, and the addresses the answers name, for the connects that follow.

The bytes come from the job's buffers: a hostile job sends to port 53 whatever it likes, and a
hostile server answers whatever it likes. Nothing here trusts them: a message dnspython cannot
parse is a record with `malformed: true`, never an exception, and every table is bounded.

Nor does a message read from a buffer say where it came from: a job can answer its own query from
a port of its own, or rewrite its buffer after the kernel copied the real answer there. So an
answer is credited (its names given to later connects) only when:
- its bytes are those of a datagram (or a DNS-over-TCP message) the kernel delivered to the very
  socket it was read from (`Deliveries`: the probes' ingress program records each delivery with
  its source, as the kernel saw it, and the receiving socket's cookie);
- it came from the address and port a query with its ID and question was sent to, on that socket.
Otherwise it is recorded as `unsolicited`, with the reason, and names nothing. A credited answer
from one of the run's configured resolvers (its /etc/resolv.conf, `resolvers`) names the addresses
of the name asked for (`names_of`), one from any other server only as `other_names_of`: `diff`,
`baseline` and `profile` compare connects by the first only.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from evidence.agent.recorder.decode import F_OTHER_NS
from evidence.bundle.normalize import canonical_address
from evidence.bundle.record_types import DnsRecord
from evidence.probes import abi

if TYPE_CHECKING:
    from evidence.agent.recorder.decode import DnsEvent

logger = logging.getLogger(__name__)

MAX_PENDING = 4096  # queries waiting for their answer (past it the oldest is recorded unanswered)
MAX_ANSWERED = 4096  # queries answered, whose later answers (a retry's) are credited too
MAX_ADDRESSES = 65536  # addresses with names (past it the oldest is forgotten)
MAX_NAMES = 16  # names kept per address
MAX_ANSWERS = 64  # answer records kept per message
MAX_TEXT = 255  # characters of an answer's value kept
MAX_MESSAGE = abi.DNS_MAX  # bytes of a message the probes keep (DNS_MAX_)
MAX_DELIVERIES = 8192  # UDP datagrams and TCP segments kept to check receives against, all sockets
MAX_STREAM_MESSAGES = 64  # DNS-over-TCP messages framed per connection
NO_ANSWER = "no answer"  # the result of a query whose answer was not seen
_TCP_SYN = 0x02
_SEQ = 1 << 32

# why a received answer is not credited (the event's `unsolicited`)
UNVERIFIED = "unverified"  # its bytes are no message the kernel delivered to that socket
OTHER_SOURCE = "other source"  # from another address or port than its query was sent to
NO_QUERY = "no query"  # no query with its ID and question was sent on that socket


@dataclasses.dataclass(frozen=True, slots=True)
class Message:
    id: int
    response: bool
    name: str | None  # the first question's name, lower case, without the final dot
    type: str | None  # its type ("A", "AAAA", ...)
    rcode: str
    answers: tuple[tuple[str, str, str], ...]  # (owner name, type, value), in the message's order


def _text(name: Any) -> str:
    text = str(name.to_text(omit_final_dot=True)).lower()
    return text[:MAX_TEXT]


def parse(payload: bytes) -> Message | None:
    """The DNS message in `payload` (a DNS-over-TCP length prefix allowed), None when it is not one.
    Hostile bytes cannot make it raise."""
    # dnspython is imported at the first DNS message, outside the try below (an import error must not
    # pass for a malformed message); most runs send none, and the import costs ~40 ms of every start
    import dns.message  # noqa: F401 - _parse's imports then cost nothing

    candidates = [payload]
    if len(payload) > 2 and int.from_bytes(payload[:2], "big") == len(payload) - 2:
        candidates.append(payload[2:])
    for data in candidates:
        try:
            return _parse(data)
        except Exception:  # dnspython raises DNSException, ValueError, struct.error, ...: all hostile input
            continue
    return None


def _parse(data: bytes) -> Message:
    import dns.flags
    import dns.message
    import dns.rcode
    import dns.rdatatype

    msg = dns.message.from_wire(data, one_rr_per_rrset=True)
    name = qtype = None
    if msg.question:
        q = msg.question[0]
        name, qtype = _text(q.name), dns.rdatatype.to_text(q.rdtype)
    answers: list[tuple[str, str, str]] = []
    for rrset in msg.answer:
        for rd in rrset:
            if len(answers) >= MAX_ANSWERS:
                break
            value = rd.target if rd.rdtype == dns.rdatatype.CNAME else rd
            text = _text(value) if rd.rdtype == dns.rdatatype.CNAME else str(value.to_text())[:MAX_TEXT]
            answers.append((_text(rrset.name), dns.rdatatype.to_text(rd.rdtype), text))
    return Message(
        id=msg.id,
        response=bool(msg.flags & dns.flags.QR),
        name=name,
        type=qtype,
        rcode=dns.rcode.to_text(msg.rcode()),
        answers=tuple(answers),
    )


def chain(msg: Message) -> list[str]:
    """The name asked for and the CNAME chain from it, in order: the names an answer speaks for. A
    record of any other name (a hostile server's extra "github.com A ...") names nothing."""
    if msg.name is None:
        return []
    names = [msg.name]
    cnames = {owner: value for owner, rtype, value in reversed(msg.answers) if rtype == "CNAME"}
    while names[-1] in cnames and cnames[names[-1]] not in names:
        names.append(cnames[names[-1]])
    return names


def addresses_of(msg: Message) -> list[str]:
    """The addresses an answer gives the name asked for (its A and AAAA records, or those of a name
    of its CNAME chain), sorted."""
    on_chain = set(chain(msg))
    return sorted({v for owner, rtype, v in msg.answers if rtype in ("A", "AAAA") and owner in on_chain})


def owner_names(msg: Message, address: str) -> list[str]:
    """The names an answer gives `address`: the name asked for and its CNAME chain, down to the
    (last) name whose A or AAAA record is the address; [] when none is."""
    names = chain(msg)
    owners = {owner for owner, rtype, value in msg.answers if rtype in ("A", "AAAA") and value == address}
    last = max((i for i, n in enumerate(names) if n in owners), default=-1)
    return sorted(names[: last + 1])


@dataclasses.dataclass(frozen=True, slots=True)
class Delivery:
    """A UDP datagram the kernel delivered to a socket: where from, and its first bytes."""

    source: str
    port: int | None
    data: bytes
    size: int  # its whole payload


@dataclasses.dataclass(slots=True)
class _Stream:
    """A TCP connection from port 53, as delivered to a socket: its segments by their offset in
    the stream (from its SYN-ACK), at most MAX_MESSAGE * 2 bytes of each."""

    source: str
    port: int | None
    start: int  # the sequence number of the stream's first byte
    segments: dict[int, bytes] = dataclasses.field(default_factory=dict)

    def take(self, pos: int, n: int) -> bytes:
        """Up to `n` bytes of the stream from `pos`, as far as the delivered bytes kept reach."""
        out = b""
        while len(out) < n:
            piece = next(
                (d[pos - o :] for o, d in self.segments.items() if o <= pos < o + len(d)),
                None,
            )
            if not piece:
                break
            piece = piece[: n - len(out)]
            out += piece
            pos += len(piece)
        return out

    def messages(self) -> Iterable[bytes]:
        """Each DNS message of the stream as framed from its first byte (a 2-byte length, then the
        message), with its length prefix, as far as it was kept: a message read at any other
        offset is none of these, however the job cut its reads."""
        pos = 0
        for _ in range(MAX_STREAM_MESSAGES):
            head = self.take(pos, 2)
            if len(head) < 2:
                return
            size = int.from_bytes(head, "big")
            yield head + self.take(pos + 2, min(size, MAX_MESSAGE))
            pos += 2 + size


class Deliveries:
    """What the kernel delivered to the run's sockets (record.bpf.c on_dns_ingress), by socket
    cookie: the UDP datagrams shaped as DNS answers, and the TCP streams from port 53. Bounded in
    all (MAX_DELIVERIES datagrams and segments): a flood pushes out the oldest, whose receives are
    then not credited."""

    def __init__(self) -> None:
        self.udp: OrderedDict[int, deque[Delivery]] = OrderedDict()
        self.tcp: OrderedDict[int, _Stream] = OrderedDict()
        self.held = 0  # datagrams and segments kept

    def add(self, ev: DnsEvent) -> None:
        cookie = ev["cookie"]
        if not cookie:
            return
        source, port = canonical_address(ev["address"]), ev["port"]
        if ev["proto"] == 17:
            got = self.udp.pop(cookie, None) or deque()
            got.append(Delivery(source, port, ev["payload"][:MAX_MESSAGE], ev["ret"]))
            self.udp[cookie] = got
            self.held += 1
        elif ev["proto"] == 6:
            stream = self.tcp.pop(cookie, None)
            if ev["tcp_flags"] & _TCP_SYN:  # a SYN-ACK: a new stream starts after it
                if stream is not None:
                    self.held -= 1 + len(stream.segments)
                stream = _Stream(source, port, (ev["seq"] + 1) % _SEQ)
                self.held += 1
            elif stream is None or not ev["payload"]:
                return  # the stream's start was not seen: its messages cannot be framed
            else:
                at = (ev["seq"] - stream.start) % _SEQ
                self.held += at not in stream.segments  # a segment sent again takes no more room
                stream.segments[at] = ev["payload"]
            self.tcp[cookie] = stream
        while self.held > MAX_DELIVERIES:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        """Forgets the oldest datagram of the socket delivered to least recently, or when there is
        none, the TCP stream delivered to least recently."""
        if self.udp:
            cookie, got = next(iter(self.udp.items()))
            got.popleft()
            if not got:
                del self.udp[cookie]
            self.held -= 1
        elif self.tcp:
            _, stream = self.tcp.popitem(last=False)
            self.held -= 1 + len(stream.segments)
        else:  # pragma: no cover - held counts what the tables hold
            self.held = 0

    def source_of(self, ev: DnsEvent) -> tuple[str, int | None] | None:
        """Where the message a receive read came from, as the kernel delivered it to that socket:
        None when its bytes are none the kernel delivered there (rewritten in the job's buffer,
        read at an offset of a TCP stream that is no message's start, or not recorded)."""
        cookie, payload = ev["cookie"], ev["payload"]
        if not cookie or not payload:
            return None
        for got in self.udp.get(cookie, ()):
            if got.data.startswith(payload) and ev["ret"] <= got.size:
                return got.source, got.port
        stream = self.tcp.get(cookie)
        if stream is not None:
            for framed in stream.messages():
                if framed[2:].startswith(payload) or (len(payload) > 2 and framed.startswith(payload)):
                    return stream.source, stream.port
        return None


def _record(
    ev: DnsEvent,
    t: int,
    pid: int,
    ppid: int,
    exe: str | None,
    name: str | None,
    type_: str | None,
    result: str,
) -> DnsRecord:
    """A `dns` record of message `ev` by process `pid` at time `t`, with no answers yet."""
    return {
        "k": "dns",
        "t": t,
        "pid": pid,
        "ppid": ppid,
        "exe": exe,
        "_cgid": ev["cgid"],
        "server": ev["address"],
        "port": ev["port"],
        "name": name,
        "type": type_,
        "result": result,
        "answers": [],
        "addresses": [],
    }


# a query: (socket, server, port, id, name, type)
_Key = tuple[int, str, int | None, int, str | None, str | None]


class Resolutions:
    """Pairs a run's DNS messages into `dns` records and keeps address -> names for its connects.
    `resolvers`: the run's configured resolvers (canonical addresses), set before its first
    message."""

    def __init__(self, resolvers: Iterable[str] = ()) -> None:
        self.resolvers: frozenset[str] = frozenset()
        self.configure(resolvers)
        self.deliveries = Deliveries()
        self.pending: OrderedDict[_Key, DnsRecord] = OrderedDict()
        self.answered: OrderedDict[_Key, DnsRecord] = OrderedDict()
        # (socket, id, name, type) -> (server, port) its latest query went to: why an answer is not one
        self.asked: dict[tuple[int, int, str | None, str | None], tuple[str, int | None]] = {}
        self.names: OrderedDict[str, list[str]] = OrderedDict()  # by configured resolvers' answers
        self.other_names: OrderedDict[str, list[str]] = OrderedDict()  # by other servers'

    def configure(self, resolvers: Iterable[str]) -> None:
        """The run's configured resolvers (the nameservers of its /etc/resolv.conf)."""
        self.resolvers = frozenset(canonical_address(a) for a in resolvers)

    def configured(self, address: str, port: int | None) -> bool:
        """Whether `address`, `port` is one of the run's configured resolvers."""
        return port == 53 and canonical_address(address) in self.resolvers

    def feed(self, ev: DnsEvent, t: int, pid: int, ppid: int, exe: str | None) -> list[DnsRecord]:
        """A decoded `dns` record sent or received by process `pid` (its parent `ppid`, its program
        `exe`) at time `t`. Returns the records it completes, each with `_cgid` (its cgroup id) for
        the caller. (A delivery, by no process, goes to `deliver`.)"""
        payload = ev["payload"]
        msg = parse(payload)
        if msg is None:
            rec = _record(ev, t, pid, ppid, exe, None, None, "malformed")
            rec["malformed"] = True
            rec["received"] = ev["received"]
            rec["size"] = len(payload)
            if payload and len(payload) < ev["ret"]:
                rec["truncated"] = True
            return [rec]
        if not ev["received"]:
            return self._query(ev, msg, t, pid, ppid, exe)
        return [self._answer(ev, msg, t, pid, ppid, exe)]

    def deliver(self, ev: DnsEvent) -> None:
        """What the kernel delivered to a socket of the run (record.bpf.c on_dns_ingress)."""
        self.deliveries.add(ev)

    def _query(
        self, ev: DnsEvent, msg: Message, t: int, pid: int, ppid: int, exe: str | None
    ) -> list[DnsRecord]:
        server = canonical_address(ev["address"])
        key = (ev["sock"], server, ev["port"], msg.id, msg.name, msg.type)
        if key in self.pending:  # sent again (a retry): the first one is kept
            return []
        out = []
        if len(self.pending) >= MAX_PENDING:
            old, rec = self.pending.popitem(last=False)
            self.asked.pop((old[0], old[3], old[4], old[5]), None)
            out.append(rec)
        rec = _record(ev, t, pid, ppid, exe, msg.name, msg.type, NO_ANSWER)
        rec["configured_resolver"] = self.configured(server, ev["port"])
        self.pending[key] = rec
        if len(self.asked) >= MAX_PENDING:
            self.asked.pop(next(iter(self.asked)))
        self.asked[(ev["sock"], msg.id, msg.name, msg.type)] = (server, ev["port"])
        return out

    def _answer(self, ev: DnsEvent, msg: Message, t: int, pid: int, ppid: int, exe: str | None) -> DnsRecord:
        source = self.deliveries.source_of(ev)
        why = UNVERIFIED
        query = None
        if source is not None:
            key = (ev["sock"], source[0], source[1], msg.id, msg.name, msg.type)
            query = self.pending.pop(key, None)
            if query is not None:
                self.asked.pop((ev["sock"], msg.id, msg.name, msg.type), None)
                self.answered[key] = query
                if len(self.answered) > MAX_ANSWERED:
                    self.answered.popitem(last=False)
            elif key in self.answered:  # answered before (a query sent twice): credited too
                query = self.answered[key].copy()
                query["t"] = t
            else:
                why = OTHER_SOURCE if (ev["sock"], msg.id, msg.name, msg.type) in self.asked else NO_QUERY
        if query is not None:
            rec = query  # the query's time, process and server; the answer's content
        else:
            rec = _record(ev, t, pid, ppid, exe, msg.name, msg.type, "")
            rec["unsolicited"] = why
        configured = source is not None and self.configured(*source) and not ev["flags"] & F_OTHER_NS
        rec["configured_resolver"] = configured
        rec["source"] = source[0] if source else None
        rec["source_port"] = source[1] if source else None
        addresses = addresses_of(msg)
        rec["result"] = msg.rcode
        rec["answers"] = [f"{owner} {rtype} {value}" for owner, rtype, value in msg.answers]
        rec["addresses"] = addresses
        if query is not None:
            table = self.names if configured else self.other_names
            for address in addresses:
                _learn(table, address, owner_names(msg, address))
        return rec

    def names_of(self, address: str) -> list[str] | None:
        """The names the run's configured resolvers gave `address` in answers to its queries (an
        IPv4-mapped IPv6 address is looked up as IPv4), None when none did."""
        found = self.names.get(canonical_address(address))
        return list(found) if found else None

    def other_names_of(self, address: str) -> list[str] | None:
        """The names other servers gave `address` in answers to the run's queries, None when none
        did (those that a configured resolver gave it too are left out)."""
        found = self.other_names.get(canonical_address(address))
        if not found:
            return None
        mine = set(self.names.get(canonical_address(address)) or ())
        return [n for n in found if n not in mine] or None

    def flush(self) -> list[DnsRecord]:
        """The queries whose answer was not seen, recorded with the result "no answer"."""
        out = list(self.pending.values())
        self.pending.clear()
        return out


def _learn(table: OrderedDict[str, list[str]], address: str, names: list[str]) -> None:
    if not names:
        return
    known = table.pop(address, [])
    table[address] = sorted(set(known) | set(names))[:MAX_NAMES]
    if len(table) > MAX_ADDRESSES:
        table.popitem(last=False)
