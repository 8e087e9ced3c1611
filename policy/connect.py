"""Network enforcement: cgroup/sock_addr BPF programs that deny connect() and sendmsg() by address.

The pure half (testable without root): `render(config)` fills the tokens of
probes/connect_guard.bpf.c, `build_tables(net)` turns the policy's rules into the contents of the
two LPM tries, `decode_record(raw, ...)` decodes one ring-buffer record. The kernel half is
`ConnectGuard`: it loads the programs with BCC, fills the maps and attaches connect4, connect6,
sendmsg4 and sendmsg6 to a cgroup with BPF_F_ALLOW_MULTI. Programs attached to a cgroup apply to
every descendant cgroup, so containers and sub-cgroups a run creates are covered too.

A denied call fails with EPERM in the process; each deny (or would-block in dry-run) is a record.
`python -m policy.connect --ebpf POLICY` prints the final C.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.resources
import ipaddress
import logging
import os
import re
import struct
import sys
import time
from collections.abc import Sequence
from typing import Any

from evidence.errors import PolicyError, SetupError
from policy.model import NetPolicy

logger = logging.getLogger(__name__)

TOKENS = (
    "__MAX_ENTRIES__",
    "__DEFAULT_ALLOW__",
    "__DRY_RUN__",
    "__V4_CAPACITY__",
    "__V6_CAPACITY__",
    "__RINGBUF_PAGES__",
)
_TOKEN_RE = re.compile(r"__[A-Z][A-Z0-9_]*__")
PROGRAMS = ("guard_connect4", "guard_connect6", "guard_sendmsg4", "guard_sendmsg6")
RULE_DEFAULT = 0xFFFFFFFF
ACTION_ALLOW, ACTION_DENY = 1, 2
OP_NAMES = {1: "connect", 2: "sendmsg"}
PROTO_NAMES = {6: "tcp", 17: "udp"}
BPF_F_ALLOW_MULTI = 1 << 1

# struct denial in connect_guard.bpf.c (56 bytes, native byte order)
RECORD = struct.Struct("=QQIIIHBBBBBB16sI")


@dataclasses.dataclass(frozen=True)
class GuardConfig:
    default_allow: bool
    dry_run: bool
    max_entries: int = 16  # rules that can apply to one prefix (after covering rules are copied in)
    v4_capacity: int = 1024
    v6_capacity: int = 1024
    ringbuf_pages: int = 64  # a power of two

    def __post_init__(self) -> None:
        if self.ringbuf_pages <= 0 or self.ringbuf_pages & (self.ringbuf_pages - 1):
            raise ValueError("ringbuf_pages must be a power of two")
        if not 1 <= self.max_entries <= 64:
            raise ValueError("max_entries must be between 1 and 64")


def source() -> str:
    return importlib.resources.files("probes").joinpath("connect_guard.bpf.c").read_text(encoding="utf-8")


def render(config: GuardConfig, text: str | None = None) -> str:
    """The C program for a configuration; fails if a token is left unfilled."""
    text = source() if text is None else text
    values = {
        "__MAX_ENTRIES__": str(config.max_entries),
        "__DEFAULT_ALLOW__": "1" if config.default_allow else "0",
        "__DRY_RUN__": "1" if config.dry_run else "0",
        "__V4_CAPACITY__": str(max(1, config.v4_capacity)),
        "__V6_CAPACITY__": str(max(1, config.v6_capacity)),
        "__RINGBUF_PAGES__": str(config.ringbuf_pages),
    }
    for token, value in values.items():
        text = text.replace(token, value)
    left = sorted(set(_TOKEN_RE.findall(text)))
    if left:
        raise ValueError(f"connect_guard.bpf.c: tokens left unfilled: {', '.join(left)}")
    return text


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


def pack_key_words(packed: bytes) -> list[int]:
    """Network-order address bytes as the native-order u32 words the BPF struct holds."""
    return [int.from_bytes(packed[i : i + 4], sys.byteorder) for i in range(0, len(packed), 4)]


class ConnectGuard:
    """connect4/connect6/sendmsg4/sendmsg6 programs on a cgroup, enforcing `net` (or reporting only)."""

    def __init__(self, net: NetPolicy | None, dry_run: bool = False, *, max_entries: int = 16) -> None:
        self.net = net if net is not None else NetPolicy(default="allow")
        self.dry_run = dry_run
        self.labels = self.net.labels()
        self.v4, self.v6 = build_tables(self.net, max_entries)
        self.config = GuardConfig(
            default_allow=self.net.default == "allow",
            dry_run=dry_run,
            max_entries=max_entries,
            v4_capacity=max(1, len(self.v4)),
            v6_capacity=max(1, len(self.v6)),
        )
        self.text = render(self.config)
        self._bpf: Any = None
        self._fns: list[tuple[Any, int]] = []
        self._cgroup_fd: int | None = None
        self._pending: list[dict[str, Any]] = []
        self._raw: list[GuardRecord] = []
        self._mono_offset = time.time_ns() - time.monotonic_ns()

    # -- loading -------------------------------------------------------------------------------------
    def load(self) -> None:
        if self._bpf is not None:
            return
        try:
            from bcc import BPF, BPFAttachType, BPFProgType
        except ImportError as e:
            raise SetupError("BCC is not available (python3-bpfcc)", hint="install python3-bpfcc") from e
        try:
            self._bpf = BPF(text=self.text.encode())
        except Exception as e:
            raise SetupError(f"cannot load connect_guard: {e}") from e
        self._fill(self._bpf[b"rules_v4"], self.v4)
        self._fill(self._bpf[b"rules_v6"], self.v6)
        types = {
            "guard_connect4": BPFAttachType.CGROUP_INET4_CONNECT,
            "guard_connect6": BPFAttachType.CGROUP_INET6_CONNECT,
            "guard_sendmsg4": BPFAttachType.CGROUP_UDP4_SENDMSG,
            "guard_sendmsg6": BPFAttachType.CGROUP_UDP6_SENDMSG,
        }
        for name in PROGRAMS:
            fn = self._bpf.load_func(name.encode(), BPFProgType.CGROUP_SOCK_ADDR, attach_type=types[name])
            self._fns.append((fn, types[name]))
        self._bpf[b"denials"].open_ring_buffer(self._on_record)

    def _fill(self, table: Any, entries: dict[tuple[bytes, int], list[Entry]]) -> None:
        for (packed, plen), rules in entries.items():
            key = table.Key()
            key.prefixlen = plen
            words = pack_key_words(packed)
            if len(words) == 1:
                key.addr = words[0]
            else:
                for i, w in enumerate(words):
                    key.addr[i] = w
            leaf = table.Leaf()
            leaf.n = len(rules)
            for i, (port, proto, action, rid) in enumerate(rules):
                leaf.e[i].port = port
                leaf.e[i].proto = proto
                leaf.e[i].action = action
                leaf.e[i].rule = rid
            table[key] = leaf

    def _on_record(self, _ctx: Any, data: Any, size: int) -> None:
        import ctypes

        rec = decode_record(ctypes.string_at(data, size))
        self._raw.append(rec)
        self._pending.append(to_denial(rec, self.labels, self.net.default, self._mono_offset))

    # -- attach / poll / detach ----------------------------------------------------------------------
    def attach(self, cgroup_path: str) -> None:
        """Attach the four programs to a cgroup (v2 directory); its descendants are covered too."""
        from bcc import BPF

        self.load()
        fd = os.open(cgroup_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        attached: list[tuple[Any, int]] = []
        try:
            for fn, atype in self._fns:
                BPF.attach_func(fn, fd, atype, BPF_F_ALLOW_MULTI)
                attached.append((fn, atype))
        except Exception as e:
            for fn, atype in attached:
                with contextlib.suppress(Exception):  # best effort while failing
                    BPF.detach_func(fn, fd, atype)
            os.close(fd)
            raise SetupError(f"cannot attach connect_guard to {cgroup_path}: {e}") from e
        self._cgroup_fd = fd
        logger.info(
            "connect_guard attached to %s (%s, default %s, %d rules)",
            cgroup_path,
            "dry-run" if self.dry_run else "enforce",
            self.net.default,
            len(self.labels),
        )

    def poll(self, timeout_ms: int = 0) -> list[dict[str, Any]]:
        """Denial records since the last poll (waits up to timeout_ms for the first one)."""
        if self._bpf is None:
            return []
        self._bpf.ring_buffer_poll(timeout_ms)
        out, self._pending = self._pending, []
        return out

    def poll_raw(self) -> list[GuardRecord]:
        """Every decoded record so far with its cgroup id, protocol and thread id (for tests and audits)."""
        return list(self._raw)

    @property
    def lost(self) -> int:
        """Records the kernel could not put in the ring buffer (it was full)."""
        if self._bpf is None:
            return 0
        return int(sum(v.value for v in self._bpf[b"lost"].values()))

    def detach(self) -> None:
        """Detach from the cgroup. Records still in the ring buffer can be read with poll() until close()."""
        if self._cgroup_fd is None:
            return
        from bcc import BPF

        for fn, atype in self._fns:
            try:
                BPF.detach_func(fn, self._cgroup_fd, atype)
            except Exception as e:  # noqa: BLE001 - report and go on detaching the others
                logger.warning("detaching %s: %s", fn.name, e)
        os.close(self._cgroup_fd)
        self._cgroup_fd = None

    def close(self) -> None:
        self.detach()
        if self._bpf is not None:
            self._bpf.cleanup()
            self._bpf = None

    def __enter__(self) -> ConnectGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m policy.connect", description="print connect_guard's C for a policy"
    )
    parser.add_argument("policy", nargs="?", help="policy file (default: an empty default-allow policy)")
    parser.add_argument("--ebpf", action="store_true", help="print the rendered C")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    net = None
    if args.policy:
        from policy.model import load_policy

        net = load_policy(args.policy, workspace=os.getcwd(), tmpdir=os.environ.get("TMPDIR", "/tmp")).net
    guard = ConnectGuard(net, args.dry_run)
    print(guard.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
