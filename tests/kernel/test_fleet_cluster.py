"""Two real `evidence agent`s publishing to a real 3-node JetStream cluster (issue 25): deploy/nats's
configuration and users, each agent with its own node credentials, socket, bundle directory and
outbox; 8 concurrent `evidence run --agent` runs, 4 on each, and one server killed while they run.
Every bundle and every recorded event arrives, once; `fleet ls` (as the reader) lists all 8, and
`fleet get` returns the very bundle the client got."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from evidence.bundle.fleet import binding, client, names
from evidence.bundle.reader import read_manifest
from tests.fleet.wait import until
from tests.kernel.test_daemon import Agent
from tests.kernel.test_fleet_agent import recorded_events, wait_metric
from tests.kernel.util import PY, evidence
from tests.unit.test_fleet_cluster import deploy_cluster

pytestmark = pytest.mark.kernel

# a job that runs for a few seconds, so that the server is killed while the runs record
JOB = (
    "import time\n"
    "for i in range(20):\n"
    "    try: open(f'/tmp/evidence-fleet-cluster-{i}')\n"
    "    except OSError: pass\n"
    "    time.sleep(0.15)\n"
)


def agent_env(urls: list[str], node: str, seed: Path) -> dict[str, str]:
    sink = {"nats": {"servers": urls, "node": node, "nkey_seed": str(seed), "batch_interval": 0.05,
                     "ack_timeout": 3}}  # fmt: skip
    return {"EVIDENCE_SINK": json.dumps(sink), "EVIDENCE_RETRY_INITIAL": "0.2", "EVIDENCE_RETRY_MAX": "1"}


def answered(metrics: dict[str, float]) -> float:
    """Events JetStream answered for: stored, or had already (tests/unit/test_fleet_cluster.py)."""
    return metrics.get("evidence_fleet_events_published_total", 0.0) + metrics.get(
        "evidence_fleet_events_duplicate_total", 0.0
    )


def stream_events(urls: list[str], seed: Path) -> list[dict[str, Any]]:
    async def read() -> list[dict[str, Any]]:
        nc = await client.connect(urls, nkey_seed=seed)
        try:
            js = nc.jetstream(timeout=10)
            info = await js.stream_info(names.EVENTS_STREAM)
            out = []
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                msg = await js.get_msg(names.EVENTS_STREAM, seq)
                out.append({**binding.from_message(msg.headers, msg.data or b""), "_subject": msg.subject})
            return out
        finally:
            await nc.close()

    return asyncio.run(read())


def test_two_agents_one_server_killed_mid_way(tmp_path: Path) -> None:
    servers, seeds = deploy_cluster(tmp_path)
    urls = [s.url for s in servers]
    agents: list[Agent] = []
    runs: list[tuple[str, Path, subprocess.Popen[str]]] = []
    try:
        op = ["fleet", *[a for u in urls for a in ("--server", u)], "--nkey", str(seeds["operator"])]
        until(
            lambda: evidence(*op, "init", "--replicas", "3").returncode == 0, 60, "the layout at R3", pace=0.5
        )
        for node in ("node-a", "node-b"):
            home = tmp_path / node
            home.mkdir()
            agents.append(Agent(home, env=agent_env(urls, node, seeds[node])))
        for k in range(8):
            agent = agents[k % 2]
            bundle = tmp_path / f"run-{k}.tar.gz"
            proc = subprocess.Popen(
                [sys.executable, "-m", "evidence", "run", "--agent", str(agent.socket), "--bundle", str(bundle),
                 "--label", "job=cluster2", "--label", f"k={k}", "--", PY, "-c", JOB],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            runs.append((("node-a", "node-b")[k % 2], bundle, proc))
        time.sleep(1.5)  # the runs are recording, their first events published
        killed = servers[1]
        killed.kill()
        for _node, _bundle, proc in runs:
            _out, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err + "".join(a.output() for a in agents)
        manifests = {bundle: read_manifest(bundle) for _node, bundle, _proc in runs}
        recorded = {}
        for node, agent in zip(("node-a", "node-b"), agents, strict=True):
            metrics = wait_metric(agent, "evidence_fleet_bundles_stored_total", 4, timeout=180)
            n = recorded_events(metrics)
            # answered: stored, or had already (a batch stored by the killed server, its acks lost)
            until(
                lambda agent=agent, n=n: answered(agent.metrics()) >= n,
                180,
                lambda agent=agent: f"{agent.metrics()}\n{agent.output()}",
                pace=0.2,
            )
            assert answered(agent.metrics()) == n
            recorded[node] = n
            assert agent.proc.poll() is None
        live = [u for s, u in zip(servers, urls, strict=True) if s is not killed]
        events = until(lambda: stream_events(live, seeds["reader"]), 60, "the stream readable", pace=0.5)
        sessions = {
            m["session_id"]: node for (node, bundle, _p), m in zip(runs, manifests.values(), strict=True)
        }
        for node in ("node-a", "node-b"):
            mine = [e for e in events if sessions.get(e["sessionid"]) == node]
            ids = [e["id"] for e in mine]
            assert len(ids) == len(set(ids)) == recorded[node], (
                node,
                len(ids),
                len(set(ids)),
                recorded[node],
            )
            assert {e["_subject"].split(".")[2] for e in mine} == {node}
            for sid in {e["sessionid"] for e in mine}:
                seqs = sorted(e["seq"] for e in mine if e["sessionid"] == sid)
                assert seqs == list(range(len(seqs)))
        assert set(sessions) == {e["sessionid"] for e in events if e["sessionid"] in sessions}
        reader = ["fleet", *[a for u in live for a in ("--server", u)], "--nkey", str(seeds["reader"])]

        def listed() -> list[dict[str, Any]] | None:
            ls = evidence(*reader, "ls", "--label", "job=cluster2", "--format", "json")
            return json.loads(ls.stdout) if ls.returncode == 0 else None

        rows = until(listed, 60, "fleet ls", pace=0.5)
        assert sorted(r["session_id"] for r in rows) == sorted(sessions)
        for r in rows:
            assert r["node"] == r["written_by"] == sessions[r["session_id"]]
        node, bundle, _proc = runs[5]
        got = tmp_path / "got.tar.gz"
        sid = manifests[bundle]["session_id"]
        # the object store's stream elects its own leader after a kill: a get may time out meanwhile (exit 70)
        until(
            lambda: evidence(*reader, "get", f"{node}.{sid}", "-o", str(got)).returncode == 0,
            60,
            "fleet get",
            pace=0.5,
        )
        assert got.read_bytes() == bundle.read_bytes()
    finally:
        for _node, _bundle, proc in runs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for agent in agents:
            agent.stop()  # a leaked agent would go on recording
        for s in servers:
            s.kill()
