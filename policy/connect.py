"""Network rules for connect_guard: the policy's `net` section as LPM trie contents, and its records.

Pure (no BCC, no root): `build_tables(net)` turns the policy's rules into the contents of the two LPM
tries (IPv4 and IPv6) of probes/connect_guard.bpf.c, `decode_record(raw)` decodes one record of its
ring buffer and `to_denial` makes it a bundle denial record named after the rule that refused it.
probes/guard.py (`ConnectGuard`) loads the programs with BCC, fills the tries with these tables and
attaches them to a cgroup; probes/render.py renders their C.

A denied call fails with EPERM in the process; each deny (or would-block in dry-run) is a record.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import struct
from collections.abc import Sequence
from typing import Any

from evidence.errors import PolicyError
from evidence.policy.model import NetPolicy

RULE_DEFAULT = 0xFFFFFFFF
ACTION_ALLOW, ACTION_DENY = 1, 2
OP_NAMES = {1: "connect", 2: "sendmsg"}
PROTO_NAMES = {6: "tcp", 17: "udp"}

# struct denial in connect_guard.bpf.c (56 bytes, native byte order)
RECORD = struct.Struct("=QQIIIHBBBBBB16sI")


Entry = tuple[int, int, int, int]  # (port or 0, protocol number or 0, action, rule id)


def build_tables(
    net: NetPolicy, max_entries: int = 16
) -> tuple[dict[tuple[bytes, int], list[Entry]], dict[tuple[bytes, int], list[Entry]]]:
    """LPM contents: {(network bytes, prefix length): entries}, for IPv4 and for IPv6.

    Each prefix carries every rule whose CIDR contains it, most specific first, so that the single
    longest-prefix match the kernel returns still sees the broader rules (a /32 with a port must fall
    back to a covering /8 for other ports)."""
    flat = net.entries()
    tables: tuple[dict[tuple[bytes, int], list[Entry]], dict[tuple[bytes, int], list[Entry]]] = ({}, {})
    prefixes = sorted(
        {(n.version, n) for n, *_ in flat},
        key=lambda vn: (vn[0], vn[1].network_address.packed, vn[1].prefixlen),
    )
    for version, prefix in prefixes:
        covering = []
        for n, port, proto, deny, rid in flat:
            if n.version != version or not prefix.subnet_of(n):  # type: ignore[arg-type]
                continue
            covering.append(
                (
                    (n.prefixlen, port is not None, proto is not None, deny),
                    (port or 0, proto or 0, ACTION_DENY if deny else ACTION_ALLOW, rid),
                )
            )
        covering.sort(key=lambda c: (c[0], -c[1][3]), reverse=True)
        entries = [e for _, e in covering]
        if len(entries) > max_entries:
            raise PolicyError(
                f"net: {len(entries)} rules apply to {prefix}; at most {max_entries} are supported"
            )
        tables[0 if version == 4 else 1][(prefix.network_address.packed, prefix.prefixlen)] = entries
    return tables


def format_target(family: int, addr: bytes, port: int, mapped: bool = False) -> str:
    if family == 4:
        text = str(ipaddress.IPv4Address(addr[:4]))
        return f"{text}:{port}" if port else text
    text = str(ipaddress.IPv6Address(addr[:16]))
    if mapped:
        text = "::ffff:" + str(ipaddress.IPv4Address(addr[12:16]))
    return f"[{text}]:{port}" if port else text


@dataclasses.dataclass(frozen=True)
class GuardRecord:
    ts_ns: int  # CLOCK_MONOTONIC
    cgroup_id: int
    tgid: int
    tid: int
    rule_id: int
    port: int
    family: int
    protocol: int
    op: int
    enforced: bool
    mapped: bool
    addr: bytes

    @property
    def target(self) -> str:
        return format_target(self.family, self.addr, self.port, self.mapped)


def decode_record(raw: bytes) -> GuardRecord:
    if len(raw) < RECORD.size:
        raise ValueError(f"connect_guard record of {len(raw)} bytes, expected {RECORD.size}")
    ts, cg, tgid, tid, rule, port, family, proto, op, enforced, mapped, _, addr, _ = RECORD.unpack_from(raw)
    return GuardRecord(ts, cg, tgid, tid, rule, port, family, proto, op, bool(enforced), bool(mapped), addr)


def to_denial(rec: GuardRecord, labels: Sequence[str], default: str, mono_offset_ns: int) -> dict[str, Any]:
    """The bundle record of a guard record (shape of bundle.format.PolicyDenial, plus k and t)."""
    if rec.rule_id == RULE_DEFAULT:
        rule = f"net.default: {default}"
    elif rec.rule_id < len(labels):
        rule = labels[rec.rule_id]
    else:
        rule = f"net: rule {rec.rule_id}"
    return {
        "k": "denial",
        "t": rec.ts_ns + mono_offset_ns,
        "pid": rec.tgid,
        "exe": None,
        "operation": OP_NAMES.get(rec.op, "connect"),
        "target": rec.target,
        "rule": rule,
        "enforced": rec.enforced,
        "result": "EPERM" if rec.enforced else 0,
    }
