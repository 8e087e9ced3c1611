"""DNS messages of the run's processes (record.bpf.c, ---- dns): parsed with dnspython, paired
query with answer, and the addresses the answers name, for the connects that follow.

The bytes come from the job's buffers: a hostile job sends to port 53 whatever it likes, and a
hostile server answers whatever it likes. Nothing here trusts them: a message dnspython cannot
parse is a record with `malformed: true`, never an exception, and every table is bounded.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from evidence.bundle.record_types import DnsRecord

if TYPE_CHECKING:
    from evidence.agent.recorder.decode import DnsEvent

logger = logging.getLogger(__name__)

MAX_PENDING = 4096  # queries waiting for their answer (past it the oldest is recorded unanswered)
MAX_ADDRESSES = 65536  # addresses with names (past it the oldest is forgotten)
MAX_NAMES = 16  # names kept per address
MAX_ANSWERS = 64  # answer records kept per message
MAX_TEXT = 255  # characters of an answer's value kept
NO_ANSWER = "no answer"  # the result of a query whose answer was not seen


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


def addresses_of(msg: Message) -> list[str]:
    """The addresses of an answer's A and AAAA records, sorted."""
    return sorted({value for _, rtype, value in msg.answers if rtype in ("A", "AAAA")})


def owner_names(msg: Message, address: str) -> list[str]:
    """The names that lead to `address` in an answer: the owners of its A or AAAA records and the
    CNAME chain back from them (the question's name when the chain starts there)."""
    names = {owner for owner, rtype, value in msg.answers if rtype in ("A", "AAAA") and value == address}
    cnames = [(owner, value) for owner, rtype, value in msg.answers if rtype == "CNAME"]
    for _ in range(len(cnames)):  # each round adds a link of the chain, or nothing
        more = {owner for owner, target in cnames if target in names} - names
        if not more:
            break
        names |= more
    return sorted(n for n in names if n)


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


class Resolutions:
    """Pairs a run's DNS messages into `dns` records and keeps address -> names for its connects."""

    def __init__(self) -> None:
        # (server, id, name) -> the query's record
        self.pending: OrderedDict[tuple[str, int, str | None], DnsRecord] = OrderedDict()
        self.names: OrderedDict[str, list[str]] = OrderedDict()

    def feed(self, ev: DnsEvent, t: int, pid: int, ppid: int, exe: str | None) -> list[DnsRecord]:
        """A decoded `dns` record, by process `pid` (its parent `ppid`, its program `exe`) at time
        `t`. Returns the records it completes, each with `_cgid` (its cgroup id) for the caller."""
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
        key = (ev["address"], msg.id, msg.name)
        if not ev["received"]:
            out = []
            if key in self.pending:  # sent again (a retry): the first one is kept
                return []
            if len(self.pending) >= MAX_PENDING:
                out.append(self.pending.popitem(last=False)[1])
            self.pending[key] = _record(ev, t, pid, ppid, exe, msg.name, msg.type, NO_ANSWER)
            return out
        query = self.pending.pop(key, None)
        if query is not None:
            rec = query  # the query's time, process and server; the answer's content
        else:  # an answer to no query seen (its result and content are set below)
            rec = _record(ev, t, pid, ppid, exe, msg.name, msg.type, "")
            rec["unasked"] = True
        addresses = addresses_of(msg)
        rec["result"] = msg.rcode
        rec["answers"] = [f"{owner} {rtype} {value}" for owner, rtype, value in msg.answers]
        rec["addresses"] = addresses
        for address in addresses:
            self._learn(address, owner_names(msg, address))
        return [rec]

    def _learn(self, address: str, names: list[str]) -> None:
        known = self.names.pop(address, [])
        merged = sorted(set(known) | set(names))[:MAX_NAMES]
        self.names[address] = merged
        if len(self.names) > MAX_ADDRESSES:
            self.names.popitem(last=False)

    def names_of(self, address: str) -> list[str] | None:
        """The names the run's DNS answers gave `address` (an IPv4-mapped IPv6 address is looked up
        as IPv4 too), None when none did."""
        found = self.names.get(address)
        if found is None and address.startswith("::ffff:") and "." in address:
            found = self.names.get(address[7:])
        return list(found) if found else None

    def flush(self) -> list[DnsRecord]:
        """The queries whose answer was not seen, recorded with the result "no answer"."""
        out = list(self.pending.values())
        self.pending.clear()
        return out
