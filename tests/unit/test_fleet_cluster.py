"""deploy/nats/: the 3-node configuration, its users and the agent's settings, run for real: a
cluster made from those files (ports and directories moved to the test's), the layout at R3 by the
operator, two nodes publishing eight runs and their events while one server (the events stream's
leader) is killed part way: every bundle and event arrives, once, and `fleet ls` lists all eight."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from evidence.agent.daemon.fleet import FleetPublisher
from evidence.agent.daemon.metrics import Registry
from evidence.agent.daemon.settings import AgentSettings
from evidence.bundle.fleet import client, names
from evidence.cli import main
from tests.fleet import explain
from tests.fleet.servers import Server, free_port
from tests.fleet.wait import until
from tests.unit import conftest_bundles as cb
from tests.unit.test_fleet_publish import event, publisher

REPO = Path(__file__).resolve().parents[2]
NATS = REPO / "deploy" / "nats"


def deploy_cluster(tmp: Path) -> tuple[list[Server], dict[str, Path]]:
    users = tmp / "users"
    subprocess.run([sys.executable, str(NATS / "make-users.py"), str(users), "node-a", "node-b"], check=True,
                   capture_output=True)  # fmt: skip
    client_ports = [free_port() for _ in range(3)]
    route_ports = [free_port() for _ in range(3)]
    servers = []
    for i in range(3):
        text = (NATS / f"nats-{i}.conf").read_text()
        text = text.replace(f"127.0.0.1:422{2 + i}", f"127.0.0.1:{client_ports[i]}")
        text = re.sub(r'http: "[^"]*"', f'http: "127.0.0.1:{free_port()}"', text)
        for j in range(3):
            text = text.replace(f"127.0.0.1:622{2 + j}", f"127.0.0.1:{route_ports[j]}")
        text = text.replace(f"/var/lib/nats/evidence-{i}", str(tmp / f"store-{i}"))
        d = tmp / f"nats-n{i}"
        d.mkdir()
        (d / "users.conf").write_text((users / "users.conf").read_text())  # includes are relative
        (d / "server.conf").write_text(text)
        servers.append(Server.from_config(tmp, f"n{i}", d / "server.conf", client_ports[i]))
    return servers, {p.stem: p for p in users.glob("*.nk")}


def test_agent_sink_settings_are_valid() -> None:
    data = yaml.safe_load((NATS / "agent.yaml").read_text())
    s = AgentSettings(**data)
    assert s.sink.nats is not None and len(s.sink.nats.servers) == 3


def test_r3_cluster_one_server_killed_mid_way(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The server killed is the events stream's leader: every run of the test has the stream elect
    another while the publishers send (and may lose the acknowledgements of a batch stored)."""
    servers, seeds = deploy_cluster(tmp_path)
    urls = [s.url for s in servers]
    pubs: list[tuple[FleetPublisher, Registry]] = []
    with explain.agent_log(tmp_path / "agent.log") as log:
        _r3_run(tmp_path, capsys, servers, seeds, urls, pubs, log)


def _r3_run(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    servers: list[Server],
    seeds: dict[str, Path],
    urls: list[str],
    pubs: list[tuple[FleetPublisher, Registry]],
    log: Path,
) -> None:
    def why(what: str) -> Callable[[], str]:
        return lambda: f"{what}\n{explain.everything(servers, pubs, log)}"

    try:
        op = ["fleet", *[a for u in urls for a in ("--server", u)], "--nkey", str(seeds["operator"])]
        until(lambda: main([*op, "init", "--replicas", "3"]) == 0, timeout=60, what="init at R3")
        capsys.readouterr()
        kill = leader(urls, seeds["operator"], names.EVENTS_STREAM)
        for node in ("node-a", "node-b"):
            pub, reg = publisher(tmp_path, urls[0], node, nkey_seed=seeds[node])
            pubs.append((pub, reg))
        for pub, _ in pubs:
            pub.sink.servers[:] = urls  # every server: a client reconnects to the others
            pub.start()  # its bucket gets the stream's 3 replicas (an agent is not told the cluster's size)
        for k in range(8):
            pub, _ = pubs[k % 2]
            sid = f"c{k}"
            for i in range(200):
                pub.submit(event(sid, i))
            pub.bundle_written(
                cb.write(tmp_path / f"{sid}.tar.gz", session_id=sid, labels={"job": "cluster"})
            )
            if k == 3:
                next(s for s in servers if s.name == kill).kill()
        for _pub, reg in pubs:
            until(
                lambda reg=reg: reg.value("evidence_fleet_bundles_stored_total") == 4,
                timeout=120,
                what=why("bundles"),
            )
            until(lambda reg=reg: answered(reg) >= 800, timeout=120, what=why("events"))
            assert answered(reg) == 800  # each event answered once: stored, or had already
        for pub, _ in pubs:
            pub.close()
            assert not pub.outbox.segments()
        live = [u for s, u in zip(servers, urls, strict=True) if s.name != kill]
        reader = ["fleet", *[a for u in live for a in ("--server", u)], "--nkey", str(seeds["reader"])]
        # right after the kill the cluster elects new leaders: JetStream answers 503 meanwhile (exit 70)
        until(lambda: main([*reader, "ls", "--label", "job=cluster", "--format", "json"]) == 0, timeout=60,
              what=why("ls"))  # fmt: skip
        rows = json.loads(capsys.readouterr().out.splitlines()[-1])
        assert sorted(r["session_id"] for r in rows) == [f"c{k}" for k in range(8)]
        assert bucket_replicas(live, seeds["reader"], "node-a") == 3
        got = tmp_path / "got.tar.gz"
        # the object store's stream elects its own leader, after the index's: a get may time out meanwhile
        until(lambda: main([*reader, "get", "node-b.c7", "-o", str(got)]) == 0, timeout=60, what=why("get"))
        assert got.read_bytes() == (tmp_path / "c7.tar.gz").read_bytes()
        capsys.readouterr()

        def follow() -> bool:  # the events stream's leader too may still be in election
            capsys.readouterr()
            return main([*reader, "follow", "--since", "1h", "--count", "1600", "--format", "json"]) == 0

        until(follow, timeout=60, what=why("follow"))
        ids = [json.loads(x)["id"] for x in capsys.readouterr().out.splitlines()]
        assert len(ids) == len(set(ids)) == 1600
    finally:
        for pub, _ in pubs:
            pub.close()
        for s in servers:
            s.kill()


def answered(reg: Registry) -> float:
    """The node's events JetStream answered for: stored, or had already. A server killed after it
    stored (and replicated) a batch but before its acknowledgements reached the agent leaves that
    batch unanswered; sent again to the new leader, each of its events is answered as a duplicate
    of the copy the stream holds (its `Nats-Msg-Id`), and counted under `_duplicate_total`."""
    return reg.value("evidence_fleet_events_published_total") + reg.value(
        "evidence_fleet_events_duplicate_total"
    )


def leader(urls: list[str], seed: Path, stream: str) -> str:
    """The name (n0, n1, n2) of the server that leads `stream`."""

    async def read() -> str:
        nc = await client.connect(urls, nkey_seed=seed)
        try:
            info = await nc.jetstream(timeout=10).stream_info(stream)
            if info.cluster is None or not info.cluster.leader:
                return ""  # in election: asked again
            return "n" + info.cluster.leader.rsplit("-", 1)[1]  # evidence-nats-<i> (deploy/nats)
        finally:
            await nc.close()

    return until(lambda: asyncio.run(read()), timeout=30, what=f"a leader of {stream}")


def bucket_replicas(urls: list[str], seed: Path, node: str) -> int:
    async def read() -> int:
        nc = await client.connect(urls, nkey_seed=seed)
        try:
            info = await nc.jetstream(timeout=10).stream_info(f"OBJ_{names.bundle_bucket(node)}")
            return int(info.config.num_replicas or 1)
        finally:
            await nc.close()

    return asyncio.run(read())
