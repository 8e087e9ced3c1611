"""A fleet on this machine (issue 25): publishers replaying runs into NATS JetStream, figures side by side.

    .venv/bin/python bench/fleet.py [--publishers 50] [--runs 1000] [--events 200000] [--quick]

For an R1 server and a 3-node R3 cluster (all on this machine, loopback), each with the agent's own
publisher (agent/daemon/fleet.py: outbox on disk, pipelined publishes, object store + index):
- events/s acknowledged: `--events` live events from `--publishers` publishers at once, the old way
  (nats-py's `publish_async`: a future and a PubAck object a message) and the new way (core publishes
  with a reply inbox of ours, a window of unanswered ones, one subscription for the acks), one after
  the other on the same servers;
- the floor on this machine: a plain batched loop of the same messages (encoded beforehand) with
  nats-py's public `publish` and one ack subscription, no outbox, no queue; and, for scale, the same
  messages written as raw HPUB lines through nats-py's private `_send_command` (not used by the agent);
- runs/min stored and indexed: `--runs` bundles (a small recorded-run bundle, made by the writer)
  spread over the publishers; p50/p99 from a bundle handed to its publisher to its entry seen by an
  index watcher (what `fleet ls` reads);
- the servers' disk per 1,000 runs (store directories, before and after);
- the publisher's CPU: process CPU seconds per run and per 1,000 events, and what 100 runs/min
  (each with `--events-per-run` events) would cost of one core.
Targets (issue 25): 1,000 runs/min and 20,000 events/s into R1; run to listed p99 <= 2 s; <= 5% of a
core at 100 runs/min. A missed target is printed, not failed; the exit code is about correctness
(every event and bundle acknowledged, the index complete).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evidence.agent.daemon import metrics as m  # noqa: E402
from evidence.agent.daemon.delivery import Backoff  # noqa: E402
from evidence.agent.daemon.fleet import FleetPublisher  # noqa: E402
from evidence.agent.daemon.settings import NatsSink  # noqa: E402
from evidence.bundle.fleet import binding, client, names  # noqa: E402
from tests.fleet.servers import Server, cluster  # noqa: E402
from tests.unit import conftest_bundles as cb  # noqa: E402


def du(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


def event(session: str, seq: int) -> dict[str, Any]:
    return {
        "specversion": "1.0",
        "id": f"{session}:{seq}",
        "source": f"urn:evidence:session:{session}",
        "type": "dev.evidence.file.open",
        "subject": f"/home/ci/work/src/module_{seq % 97}/file_{seq}.py",
        "time": "2026-11-27T20:00:00.000000001Z",
        "datacontenttype": "application/json",
        "sessionid": session,
        "seq": seq,
        "data": {
            "pid": 4242, "ppid": 4200, "exe": "/usr/bin/python3.11",
            "path": f"/home/ci/work/src/module_{seq % 97}/file_{seq}.py", "raw_path": f"file_{seq}.py",
            "flags": ["O_RDONLY", "O_CLOEXEC"], "access": ["read"], "result": 0, "count": 1,
            "first_time": "2026-11-27T20:00:00.000000001Z", "last_time": "2026-11-27T20:00:00.000000001Z",
        },
    }  # fmt: skip


def publishers(
    urls: list[str], n: int, tmp: Path, replicas: int, mode: str = "inbox"
) -> list[tuple[FleetPublisher, m.Registry]]:
    out = []
    for i in range(n):
        reg = m.Registry()
        sink = NatsSink(
            servers=urls, node=f"node-{i:03d}", batch_interval=0.05, batch_size=1000, ack_timeout=20
        )
        pub = FleetPublisher(
            sink,
            tmp / f"outbox-{mode}-{i}",
            registry=reg,
            backoff=Backoff(0.2, 2.0),
            replicas=replicas,
            publish_mode=mode,
        )
        out.append((pub, reg))
    return out


def wait(regs: list[m.Registry], metric: str, want: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(r.value(metric) >= w for r, w in zip(regs, want, strict=True)):
            return True
        time.sleep(0.02)
    return False


class IndexWatcher:
    """Sees index entries as they are written (a thread with its own loop): key -> monotonic time."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.seen: dict[str, float] = {}
        self.ready = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.thread.start()
        self.ready.wait(30)

    async def _main(self) -> None:
        nc = await client.connect(self.urls)
        js = nc.jetstream()
        await client.ensure_layout(js, 1)
        kv = await js.key_value(names.INDEX_BUCKET)
        w = await kv.watchall()
        self.ready.set()
        while not self.stop.is_set():
            try:
                e = await w.updates(timeout=0.5)
            except Exception:
                continue
            if e is not None and e.key not in self.seen:
                self.seen[e.key] = time.monotonic()
        await nc.close()


def floor(url: str, n: int, raw: bool) -> tuple[float, float]:
    """(events/s, CPU s per 1,000) of a plain loop: `n` messages encoded beforehand, published with a
    reply inbox in windows of 2,000, acks counted by one subscription. `raw`: written as HPUB lines
    through nats-py's private `_send_command` (what the public `publish` costs above the wire)."""

    async def run() -> tuple[float, float]:
        nc = await client.connect([url])
        session = "floorraw" if raw else "floor"
        msgs = [binding.to_message(event(session, i)) for i in range(n)]
        subject = names.event_subject("floor", session)
        inbox = nc.new_inbox()
        got = 0
        room = asyncio.Event()

        async def on_ack(msg: Any) -> None:
            nonlocal got
            got += 1
            room.set()

        await nc.subscribe(inbox + ".*", cb=on_ack, pending_msgs_limit=-1)
        cpu0, t0 = time.process_time(), time.monotonic()
        chunk: list[bytes] = []
        for i, (headers, payload) in enumerate(msgs):
            while i - got >= 2000:
                room.clear()
                await room.wait()
            if raw:
                hdr = (
                    "NATS/1.0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
                ).encode()
                chunk.append(
                    f"HPUB {subject} {inbox}.{i} {len(hdr)} {len(hdr) + len(payload)}\r\n".encode()
                    + hdr
                    + payload
                    + b"\r\n"
                )
                if len(chunk) == 500 or i == n - 1:
                    await nc._send_command(b"".join(chunk))
                    await nc._flush_pending()
                    chunk = []
            else:
                await nc.publish(subject, payload, reply=f"{inbox}.{i}", headers=headers)
        while got < n:
            room.clear()
            await room.wait()
        wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
        await nc.close()
        return n / wall, cpu / n * 1000

    return asyncio.run(run())


def one_agent(url: str, n: int, tmp: Path) -> float:
    """CPU s per 1,000 events of one publisher alone in this process (an agent has one): `n` events
    handed over at once, until all are acknowledged. The 50 publishers' figure above includes their
    threads' contention for one interpreter."""
    ((pub, reg),) = publishers([url], 1, tmp, 1, "inbox")
    pub.start()
    time.sleep(1.0)
    cpu0 = time.process_time()
    for i in range(n):
        pub.submit(event("oneagent", i))
    wait([reg], "evidence_fleet_events_published_total", [n], 600)
    cpu = time.process_time() - cpu0
    pub.close()
    return cpu / n * 1000


def measure(
    label: str, urls: list[str], store_dirs: list[Path], args: argparse.Namespace, replicas: int
) -> dict[str, Any]:
    ok = True
    with tempfile.TemporaryDirectory(prefix="evidence-bench-fleet-") as t:
        tmp = Path(t)

        # the layout first, with the right replicas
        async def init() -> None:
            nc = await client.connect(urls)
            await client.ensure_layout(nc.jetstream(timeout=30), replicas)
            await nc.close()

        asyncio.run(init())
        events: dict[str, tuple[float, float]] = {}
        per = args.events // args.publishers
        for mode in ("publish_async", "inbox"):
            pubs = publishers(urls, args.publishers, tmp, replicas, mode)
            for p, _ in pubs:
                p.start()
            regs = [r for _, r in pubs]
            time.sleep(1.0)  # connected, buckets made
            cpu0 = time.process_time()
            t0 = time.monotonic()
            for k, (p, _) in enumerate(pubs):
                for i in range(per):
                    p.submit(event(f"ev{mode.replace('_', '')}{k}", i))
            ok &= wait(regs, "evidence_fleet_events_published_total", [per] * len(pubs), 600)
            wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
            events[mode] = (per * len(pubs) / wall, cpu / (per * len(pubs)) * 1000)
            if mode != "inbox":
                for p, _ in pubs:
                    p.close()
        watcher = IndexWatcher(urls)
        # runs
        disk0 = sum(du(d) for d in store_dirs)
        runs_per = max(1, args.runs // len(pubs))
        todo = []
        for j in range(runs_per):
            for k, (p, _) in enumerate(pubs):
                sid = f"r{j:05d}x{k:03d}"
                todo.append((p, names.run_key(p.node, sid), cb.write(tmp / f"{sid}.tar.gz", session_id=sid)))
        handed: dict[str, float] = {}
        t0 = time.monotonic()
        cpu0 = time.process_time()
        for p, key, path in todo:
            handed[key] = time.monotonic()
            p.bundle_written(path)
        ok &= wait(regs, "evidence_fleet_bundles_stored_total", [runs_per] * len(pubs), 900)
        run_wall = time.monotonic() - t0
        run_cpu = time.process_time() - cpu0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(set(handed) & set(watcher.seen)) < len(handed):
            time.sleep(0.05)
        lat = sorted(watcher.seen[k] - handed[k] for k in handed if k in watcher.seen)
        ok &= len(lat) == len(handed)
        for p, _ in pubs:
            p.close()
        watcher.stop.set()
        disk1 = sum(du(d) for d in store_dirs)
    floors = [floor(urls[0], args.events, raw) for raw in (False, True)]
    with tempfile.TemporaryDirectory(prefix="evidence-bench-fleet-") as t:
        alone = one_agent(urls[0], min(args.events, 50_000), Path(t))
    n_runs = runs_per * len(pubs)
    return {
        "label": label,
        "ok": ok,
        "events": per * len(pubs),
        "events_per_s_old": events["publish_async"][0],
        "cpu_per_1k_events_old": events["publish_async"][1],
        "events_per_s": events["inbox"][0],
        "cpu_per_1k_events": events["inbox"][1],
        "cpu_per_1k_events_alone": alone,
        "events_per_s_floor": floors[0][0],
        "cpu_per_1k_events_floor": floors[0][1],
        "events_per_s_raw": floors[1][0],
        "cpu_per_1k_events_raw": floors[1][1],
        "runs": n_runs,
        "runs_per_min": n_runs / run_wall * 60,
        "cpu_per_run": run_cpu / n_runs,
        "p50": statistics.median(lat) if lat else float("nan"),
        "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else float("nan"),
        "disk_per_1k_runs": (disk1 - disk0) / n_runs * 1000 / replicas,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--publishers", type=int, default=50)
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--events-per-run", type=int, default=2_000)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.publishers, args.runs, args.events = 5, 50, 10_000
    results = []
    with tempfile.TemporaryDirectory(prefix="evidence-bench-nats-") as t:
        tmp = Path(t)
        one = Server(tmp / "r1", "r1")
        try:
            results.append(measure("R1, 1 server", [one.url], [one.dir], args, 1))
        finally:
            one.kill()
        three = cluster(tmp / "r3", 3)
        try:
            time.sleep(2.0)  # a meta leader
            results.append(measure("R3, 3 servers", [s.url for s in three], [s.dir for s in three], args, 3))
        finally:
            for s in three:
                s.kill()
    rows = [
        ("events/s acked, old (publish_async)", "events_per_s_old", "{:,.0f}", ""),
        ("events/s acked, new (inbox, window)", "events_per_s", "{:,.0f}", "R1 >= 20,000"),
        ("events/s, floor: plain nats-py loop", "events_per_s_floor", "{:,.0f}", ""),
        ("events/s, raw HPUB (private API)", "events_per_s_raw", "{:,.0f}", ""),
        ("runs/min stored + indexed", "runs_per_min", "{:,.0f}", "R1 >= 1,000"),
        ("run to listed p50 (s)", "p50", "{:.3f}", ""),
        ("run to listed p99 (s)", "p99", "{:.3f}", "<= 2"),
        ("disk per 1,000 runs, one copy (MB)", "disk_per_1k_runs", "{:.2f}", ""),
        ("CPU per 1,000 events, old (s)", "cpu_per_1k_events_old", "{:.3f}", ""),
        ("CPU per 1,000 events, new (s)", "cpu_per_1k_events", "{:.3f}", ""),
        ("CPU per 1,000 events, new, 1 alone (s)", "cpu_per_1k_events_alone", "{:.3f}", ""),
        ("CPU per 1,000 events, floor (s)", "cpu_per_1k_events_floor", "{:.3f}", ""),
        ("CPU per 1,000 events, raw HPUB (s)", "cpu_per_1k_events_raw", "{:.3f}", ""),
        ("publisher CPU per run (s)", "cpu_per_run", "{:.4f}", ""),
    ]
    print(
        f"{args.publishers} publishers, {args.events:,} events, {args.runs:,} runs (one process: the publishers share its CPU)"
    )
    print(f"{'':38} " + "  ".join(f"{r['label']:>14}" for r in results) + "  target")
    for name, key, f, target in rows:
        vals = [r[key] / (1e6 if key == "disk_per_1k_runs" else 1) for r in results]
        print(f"{name:38} " + "  ".join(f"{f.format(v):>14}" for v in vals) + f"  {target}")
    r1 = results[0]
    for way, key in (("old", "_old"), ("new", ""), ("new, 1 alone", "_alone"), ("floor", "_floor")):
        per_event = r1["cpu_per_1k_events" + key] / 1000
        core = (r1["cpu_per_run"] * 100 + per_event * args.events_per_run * 100) / 60
        print(
            f"{f'100 runs/min x {args.events_per_run} events, {way}':38} {core * 100:>13.1f}%  of a core (<= 5%)"
        )
    ok = all(r["ok"] for r in results)
    print("correctness:", "ok" if ok else "FAILED (events or bundles not acknowledged, or index incomplete)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
