"""Load connect_guard's cgroup/sock_addr programs (compiled by BCC once, then from the compiled-probe
cache), fill their rule tries, attach them and read their records.

`GuardProgram` renders probes/connect_guard.bpf.c (probes/render.py), fills its two LPM tries with the
tables it is given (`GuardRules`: policy/connect.py builds them from a policy's `net` section) and
attaches connect4, connect6, sendmsg4 and sendmsg6 to a cgroup with BPF_F_ALLOW_MULTI. Programs
attached to a cgroup apply to every descendant cgroup, so containers and sub-cgroups a run creates
are covered too. Its records come back as bytes: what a record means (which rule, which denial) is
the policy's (agent/recorder/connect_guard.py joins the two). Nothing here needs BCC until `load()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import mmap
import os
import struct
from collections.abc import Mapping, Sequence

from evidence.errors import SetupError
from evidence.probes.bpfsys import Function, LoadedObject, Map
from evidence.probes.headers import ensure_headers
from evidence.probes.render import GuardConfig, render_guard
from evidence.probes.ringbuf import RingBuffer

logger = logging.getLogger(__name__)

PROGRAMS = ("guard_connect4", "guard_connect6", "guard_sendmsg4", "guard_sendmsg6")
BPF_F_ALLOW_MULTI = 1 << 1
PROG_TYPE_CGROUP_SOCK_ADDR = 18
# enum bpf_attach_type: what each program is loaded and attached for
ATTACH_TYPES = {
    "guard_connect4": 10,  # BPF_CGROUP_INET4_CONNECT
    "guard_connect6": 11,  # BPF_CGROUP_INET6_CONNECT
    "guard_sendmsg4": 14,  # BPF_CGROUP_UDP4_SENDMSG
    "guard_sendmsg6": 15,  # BPF_CGROUP_UDP6_SENDMSG
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_ENTRY = struct.Struct("<HBBI")  # struct rule_entry: port, proto, action, rule

Entry = tuple[int, int, int, int]  # struct rule_entry: (port or 0, protocol number or 0, action, rule id)
Table = Mapping[tuple[bytes, int], Sequence[Entry]]  # (network bytes, prefix length) -> its rules


@dataclasses.dataclass(frozen=True)
class GuardRules:
    """What the programs enforce: the contents of their two LPM tries and what a call no rule
    matches gets."""

    v4: Table
    v6: Table
    default_allow: bool


class GuardProgram:
    """connect4/connect6/sendmsg4/sendmsg6 programs on a cgroup, enforcing `rules` (or reporting only)."""

    def __init__(self, rules: GuardRules, dry_run: bool = False, *, max_entries: int = 16) -> None:
        self.rules = rules
        self.dry_run = dry_run
        self.config = GuardConfig(
            default_allow=rules.default_allow,
            dry_run=dry_run,
            max_entries=max_entries,
            v4_capacity=max(1, len(rules.v4)),
            v6_capacity=max(1, len(rules.v6)),
        )
        self.text = render_guard(self.config)
        self._bpf: LoadedObject | None = None
        self._ring: RingBuffer | None = None
        self._fns: list[tuple[Function, int]] = []
        self._cgroup_fd: int | None = None

    # -- loading -------------------------------------------------------------------------------------
    def load(self) -> None:
        """Create the maps and load the programs: compiled by BCC once per rendered source (a policy's
        rule counts are part of it), then from the compiled-probe cache (probes/objcache.py)."""
        if self._bpf is not None:
            return
        from evidence.probes import objcache

        headers = ensure_headers()
        try:
            self._bpf = objcache.load(self.text, str(headers.path) if headers.path else None)
        except ImportError as e:
            raise SetupError("BCC is not available (python3-bpfcc)", hint="install python3-bpfcc") from e
        except Exception as e:  # BCC raises bare Exception on compile failures
            raise SetupError(f"cannot load connect_guard: {e}") from e
        try:
            self._fill(self._bpf[b"rules_v4"], self.rules.v4)
            self._fill(self._bpf[b"rules_v6"], self.rules.v6)
            for name in PROGRAMS:
                fn = self._bpf.load_func(name.encode(), PROG_TYPE_CGROUP_SOCK_ADDR, ATTACH_TYPES[name])
                self._fns.append((fn, ATTACH_TYPES[name]))
            self._ring = RingBuffer(self._bpf[b"denials"].map_fd, self.config.ringbuf_pages * mmap.PAGESIZE)
        except Exception as e:
            self.close()
            raise SetupError(f"cannot load connect_guard: {e}") from e

    def _fill(self, table: Map, entries: Table) -> None:
        """Each prefix's rules as struct rule_set (connect_guard.bpf.c): n, pad, then the entries."""
        for (packed, plen), rules in entries.items():
            key = _U32.pack(plen) + packed  # the address stays in network byte order
            leaf = bytearray(table.value_size)
            _U32.pack_into(leaf, 0, len(rules))
            for i, (port, proto, action, rid) in enumerate(rules):
                _ENTRY.pack_into(leaf, 8 + i * _ENTRY.size, port, proto, action, rid)
            table[key] = bytes(leaf)

    # -- attach / poll / detach ----------------------------------------------------------------------
    def attach(self, cgroup_path: str) -> None:
        """Attach the four programs to a cgroup (v2 directory); its descendants are covered too."""
        self.load()
        fd = os.open(cgroup_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        attached: list[tuple[Function, int]] = []
        try:
            for fn, atype in self._fns:
                LoadedObject.attach_cgroup(fn, fd, atype, BPF_F_ALLOW_MULTI)
                attached.append((fn, atype))
        except Exception as e:
            for fn, atype in attached:
                with contextlib.suppress(Exception):  # best effort while failing
                    LoadedObject.detach_cgroup(fn, fd, atype)
            os.close(fd)
            raise SetupError(f"cannot attach connect_guard to {cgroup_path}: {e}") from e
        self._cgroup_fd = fd
        logger.info(
            "connect_guard attached to %s (%s, default %s)",
            cgroup_path,
            "dry-run" if self.dry_run else "enforce",
            "allow" if self.rules.default_allow else "deny",
        )

    def read(self, timeout_ms: int = 0) -> list[bytes]:
        """Records since the last read (waits up to timeout_ms for the first one), as bytes."""
        if self._ring is None:
            return []
        raw = self._ring.read()
        if not raw and timeout_ms > 0:
            self._ring.wait(timeout_ms)
            raw = self._ring.read()
        return raw

    @property
    def lost(self) -> int:
        """Records the kernel could not put in the ring buffer (it was full)."""
        if self._bpf is None:
            return 0
        return int(_U64.unpack(self._bpf[b"lost"][_U32.pack(0)])[0])

    def detach(self) -> None:
        """Detach from the cgroup. Records still in the ring buffer can be read with poll() until close()."""
        if self._cgroup_fd is None:
            return
        for fn, atype in self._fns:
            try:
                LoadedObject.detach_cgroup(fn, self._cgroup_fd, atype)
            except Exception as e:  # noqa: BLE001 - report and go on detaching the others
                logger.warning("detaching %s: %s", fn.name.decode(), e)
        os.close(self._cgroup_fd)
        self._cgroup_fd = None

    def close(self) -> None:
        self.detach()
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        if self._bpf is not None:
            self._bpf.cleanup()
            self._bpf = None
        self._fns = []

    def __enter__(self) -> GuardProgram:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
