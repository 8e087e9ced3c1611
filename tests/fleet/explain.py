"""What a fleet test says when it times out: each server's state (alive, the tail of its own log,
its JetStream view from the monitoring port: the meta leader, each stream's leader and replicas)
and each publisher's (its metrics, its connections, its thread, the tail of the agent's log), so
that a failure in CI explains itself instead of asking to be reproduced."""

from __future__ import annotations

import json
import logging
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.fleet.servers import Server

if TYPE_CHECKING:
    from evidence.agent.daemon import metrics as m
    from evidence.agent.daemon.fleet import FleetPublisher

TAIL = 25


def tail(path: Path, lines: int = TAIL) -> str:
    if not path.exists():
        return "(no file)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def jetstream(server: Server) -> str:
    """The server's JetStream view (its /jsz), in a few lines: who leads the meta group and each
    stream, with which replicas current."""
    if server.http_port is None or (server.proc is not None and server.proc.poll() is not None):
        return "(not asked: no monitoring port, or not running)"
    url = f"http://127.0.0.1:{server.http_port}/jsz?accounts=true&streams=true"
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            jsz = json.load(r)
    except OSError as e:
        return f"(/jsz: {e})"
    meta = jsz.get("meta_cluster") or {}
    out = [f"meta leader {meta.get('leader')!r}, peers {[p.get('name') for p in meta.get('replicas') or []]}"]
    for account in jsz.get("account_details") or []:
        for s in account.get("stream_detail") or []:
            c = s.get("cluster") or {}
            replicas = [
                f"{r.get('name')}{'' if r.get('current') else ' (behind)'}{' (offline)' if r.get('offline') else ''}"
                for r in c.get("replicas") or []
            ]
            state = s.get("state") or {}
            out.append(
                f"  {account.get('name', '')[:8]} {s.get('name')}: leader {c.get('leader')!r}, "
                f"replicas {replicas}, {state.get('messages')} msgs"
            )
    return "\n".join(out)


def servers(ss: Sequence[Server]) -> str:
    parts = []
    for s in ss:
        alive = s.proc is not None and s.proc.poll() is None
        parts.append(
            f"--- server {s.name} ({s.url}, {'running' if alive else 'not running'})\n"
            f"{jetstream(s)}\n{tail(s.log)}"
        )
    return "\n".join(parts)


def publisher(pub: FleetPublisher, reg: m.Registry) -> str:
    lines = [
        line
        for line in reg.render().decode().splitlines()
        if line.startswith("evidence_fleet_") and not line.endswith(" 0.0")
    ]
    wire = pub._wire
    conn = wire.conn if wire is not None else None
    peer: Any = conn.transport.get_extra_info("peername") if conn and conn.transport else None
    nc = pub._nc
    thread = pub._thread
    return (
        f"--- publisher {pub.node}: thread {'alive' if thread and thread.is_alive() else 'gone'}, "
        f"events' wire {'up' if wire and wire.connected else 'down'} (peer {peer}), "
        f"nats-py {'up to ' + str(nc.connected_url.netloc) if nc and nc.is_connected and nc.connected_url else 'down'}, "
        f"retry in {max(0.0, pub._event_retry_at - time.monotonic()):.1f}s "
        f"after {pub._event_failures} failure(s)\n" + "\n".join(lines)
    )


def everything(
    ss: Sequence[Server], pubs: Sequence[tuple[FleetPublisher, m.Registry]], agent_log: Path
) -> str:
    return "\n".join(
        [servers(ss), *(publisher(p, r) for p, r in pubs), f"--- agent log (tail)\n{tail(agent_log, 60)}"]
    )


@contextmanager
def agent_log(path: Path) -> Iterator[Path]:
    """The fleet's loggers at INFO, with times, into `path` while inside (and as they were after).
    The levels are set on the fleet's own loggers: the CLI's `main` sets the `evidence` logger's."""
    top = logging.getLogger("evidence")
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(levelname)s %(name)s: %(message)s"))
    fleet = [logging.getLogger(n) for n in ("evidence.agent.daemon", "evidence.bundle.fleet")]
    levels = [lg.level for lg in fleet]
    top.addHandler(handler)
    for lg in fleet:
        lg.setLevel(logging.INFO)
    try:
        yield path
    finally:
        top.removeHandler(handler)
        for lg, level in zip(fleet, levels, strict=True):
            lg.setLevel(level)
        handler.close()
