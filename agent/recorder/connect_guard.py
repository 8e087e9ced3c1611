"""The connect guard of a policy's `net` section: policy/connect.py's tables and record meanings joined
with probes/guard.py's programs (probes/ knows no policy; policy/ knows no probes).

`ConnectGuard(net)` renders and loads connect_guard with the tries `build_tables(net)` makes, and
turns each record its programs write into a denial named after the rule that refused the call
(`to_denial`). `python -m evidence.agent.recorder.connect_guard --ebpf POLICY` prints the final C.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from evidence.policy.connect import GuardRecord, build_tables, decode_record, to_denial
from evidence.policy.model import NetPolicy, load_policy
from evidence.probes.guard import GuardProgram, GuardRules
from evidence.probes.render import GuardConfig

logger = logging.getLogger(__name__)


class ConnectGuard:
    """connect4/connect6/sendmsg4/sendmsg6 programs on a cgroup, enforcing `net` (or reporting only)."""

    def __init__(self, net: NetPolicy | None, dry_run: bool = False, *, max_entries: int = 16) -> None:
        self.net = net if net is not None else NetPolicy(default="allow")
        self.dry_run = dry_run
        self.labels = self.net.labels()
        v4, v6 = build_tables(self.net, max_entries)
        self.program = GuardProgram(
            GuardRules(v4=v4, v6=v6, default_allow=self.net.default == "allow"),
            dry_run,
            max_entries=max_entries,
        )
        self._raw: list[GuardRecord] = []
        self._mono_offset = time.time_ns() - time.monotonic_ns()

    @property
    def config(self) -> GuardConfig:
        return self.program.config

    @property
    def text(self) -> str:
        """The rendered C."""
        return self.program.text

    def load(self) -> None:
        self.program.load()

    def attach(self, cgroup_path: str) -> None:
        """Attach the four programs to a cgroup (v2 directory); its descendants are covered too."""
        self.program.attach(cgroup_path)
        logger.info("connect_guard enforces %d rules of net (default %s)", len(self.labels), self.net.default)

    def poll(self, timeout_ms: int = 0) -> list[dict[str, Any]]:
        """Denial records since the last poll (waits up to timeout_ms for the first one), as
        policy/connect.py's to_denial makes them."""
        out = []
        for data in self.program.read(timeout_ms):
            rec = decode_record(data)
            self._raw.append(rec)
            out.append(to_denial(rec, self.labels, self.net.default, self._mono_offset))
        return out

    def poll_raw(self) -> list[GuardRecord]:
        """Every decoded record so far with its cgroup id, protocol and thread id (for tests and audits)."""
        return list(self._raw)

    @property
    def lost(self) -> int:
        """Records the kernel could not put in the ring buffer (it was full)."""
        return self.program.lost

    def detach(self) -> None:
        """Detach from the cgroup. Records still in the ring buffer can be read with poll() until close()."""
        self.program.detach()

    def close(self) -> None:
        self.program.close()

    def __enter__(self) -> ConnectGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m evidence.agent.recorder.connect_guard",
        description="print connect_guard's C for a policy",
    )
    parser.add_argument("policy", nargs="?", help="policy file (default: an empty default-allow policy)")
    parser.add_argument("--ebpf", action="store_true", help="print the rendered C")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    net = None
    if args.policy:
        net = load_policy(args.policy, workspace=os.getcwd(), tmpdir=os.environ.get("TMPDIR", "/tmp")).net
    print(ConnectGuard(net, args.dry_run).text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
