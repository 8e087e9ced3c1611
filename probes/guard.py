"""Load connect_guard's cgroup/sock_addr programs with BCC, fill their rule tries, attach and poll them."""

# ConnectGuard renders probes/connect_guard.bpf.c (probes/render.py), fills its two LPM tries with the
# tables policy/connect.py builds from the policy's `net` section, and attaches connect4, connect6,
# sendmsg4 and sendmsg6 to a cgroup with BPF_F_ALLOW_MULTI. Programs attached to a cgroup apply to
# every descendant cgroup, so containers and sub-cgroups a run creates are covered too. Nothing here
# needs BCC until `load()`. `python -m evidence.probes.guard --ebpf POLICY` prints the final C.

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from evidence.errors import SetupError
from evidence.policy.connect import Entry, GuardRecord, build_tables, decode_record, to_denial
from evidence.policy.model import NetPolicy, load_policy
from evidence.probes.headers import ensure_headers
from evidence.probes.render import GuardConfig, render_guard

logger = logging.getLogger(__name__)

PROGRAMS = ("guard_connect4", "guard_connect6", "guard_sendmsg4", "guard_sendmsg6")
BPF_F_ALLOW_MULTI = 1 << 1


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
        self.text = render_guard(self.config)
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

        ensure_headers()
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
        prog="python -m evidence.probes.guard", description="print connect_guard's C for a policy"
    )
    parser.add_argument("policy", nargs="?", help="policy file (default: an empty default-allow policy)")
    parser.add_argument("--ebpf", action="store_true", help="print the rendered C")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    net = None
    if args.policy:
        net = load_policy(args.policy, workspace=os.getcwd(), tmpdir=os.environ.get("TMPDIR", "/tmp")).net
    guard = ConnectGuard(net, args.dry_run)
    print(guard.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
