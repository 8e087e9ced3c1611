"""Node credentials on a real nats-server (issue 25): each node's NKey user may publish only under
its own subjects and into its own bundle bucket, the reader only reads. A node that says it is
another (a compromised runner) is refused by the server: errors in its log and metrics, no crash,
and the other node's runs are untouched."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import nkeys
import pytest

from evidence.agent.daemon.settings import NatsSink
from evidence.bundle.fleet import client, names, permissions
from evidence.cli import main
from tests.fleet.servers import Server
from tests.fleet.wait import until
from tests.unit import conftest_bundles as cb
from tests.unit.test_fleet_publish import event, publisher, stream_events


def user(tmp: Path, name: str) -> tuple[Path, str]:
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    path = tmp / f"{name}.nk"
    path.write_bytes(seed + b"\n")
    path.chmod(0o600)
    return path, nkeys.from_seed(seed).public_key.decode()


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[Server, dict[str, Path]]]:
    seeds, users = {}, []
    for name, perms in (
        ("admin", None),
        ("reader", permissions.reader()),
        ("node-a", permissions.node("node-a")),
        ("node-b", permissions.node("node-b")),
    ):
        seeds[name], pub = user(tmp_path, name)
        users.append((pub, perms))
    server = Server(tmp_path, config=permissions.server_users(users))
    assert main(["fleet", "--server", server.url, "--nkey", str(seeds["admin"]), "init"]) == 0
    yield server, seeds
    server.kill()


def test_a_node_writes_only_its_own(
    secured: tuple[Server, dict[str, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server, seeds = secured
    # node-b records a run
    pub_b, reg_b = publisher(tmp_path, server.url, "node-b", nkey_seed=seeds["node-b"])
    pub_b.start()
    b_bundle = cb.write(tmp_path / "b1.tar.gz", session_id="b1")
    try:
        for i in range(10):
            pub_b.submit(event("b1", i))
        pub_b.bundle_written(b_bundle)
        until(lambda: reg_b.value("evidence_fleet_bundles_stored_total") == 1, what="b1 stored")
        until(lambda: reg_b.value("evidence_fleet_events_published_total") == 10, what="b1 events")
    finally:
        pub_b.close()
    # node-a's credentials, claiming to be node-b: events, a bundle and an index entry for b1
    said: list[str] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: said.append(record.getMessage().lower())  # type: ignore[method-assign]
    logging.getLogger("evidence.agent.daemon.fleet").addHandler(handler)
    liar, reg_l = publisher(
        tmp_path,
        server.url,
        "node-b",
        "_INBOX_node-a",
        nkey_seed=seeds["node-a"],
        outbox_dir=tmp_path / "liar",
    )
    liar.start()
    fake = cb.write(tmp_path / "fake.tar.gz", session_id="b1", exit_code=0, labels={"forged": "yes"})
    try:
        for i in range(10):
            liar.submit(event("b1", 100 + i))
        liar.bundle_written(fake)
        # it gets no reply on node-b's inbox, nor may publish there: refusals, in the log and metrics
        until(
            lambda: (
                any('violation for publish to "evidence.events.node-b.b1"' in m for m in said)
                and any(
                    'violation for publish to "$js.api.stream.info.obj_evidence-bundles-node-b"' in m
                    for m in said
                )
            ),
            timeout=60,
            what="the refusals logged",
        )
        assert reg_l.value("evidence_fleet_errors_total", what="nats") >= 2
        assert liar._thread is not None and liar._thread.is_alive()
        assert reg_l.value("evidence_fleet_events_published_total") == 0
        assert reg_l.value("evidence_fleet_bundles_stored_total") == 0
        assert liar.outbox.backlog().bundles == 1  # kept: never dropped over a refusal
    finally:
        liar.close()
        logging.getLogger("evidence.agent.daemon.fleet").removeHandler(handler)
    # what node-b wrote is untouched, and nothing of the liar's is in the stream
    assert [e["id"] for e in stream_events_as(server, seeds["reader"])] == [f"b1:{i}" for i in range(10)]
    got = tmp_path / "got.tar.gz"
    args = ["fleet", "--server", server.url, "--nkey", str(seeds["reader"])]
    assert main([*args, "get", "node-b.b1", "-o", str(got)]) == 0
    assert got.read_bytes() == b_bundle.read_bytes()
    assert main([*args, "ls", "--format", "json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["written_by"] == "node-b" and row["labels"] == {}
    # the honest node-a writes its own
    pub_a, reg_a = publisher(tmp_path, server.url, "node-a", nkey_seed=seeds["node-a"])
    pub_a.start()
    try:
        pub_a.bundle_written(cb.write(tmp_path / "a1.tar.gz", session_id="a1"))
        until(lambda: reg_a.value("evidence_fleet_bundles_stored_total") == 1, what="a1 stored")
    finally:
        pub_a.close()


def stream_events_as(server: Server, seed: Path) -> list[dict[str, object]]:
    async def read() -> list[dict[str, object]]:
        nc = await client.connect([server.url], nkey_seed=seed)
        try:
            js = nc.jetstream()
            info = await js.stream_info(names.EVENTS_STREAM)
            out = []
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                msg = await js.get_msg(names.EVENTS_STREAM, seq)
                from evidence.bundle.fleet import binding

                out.append(binding.from_message(msg.headers, msg.data or b""))
            return out
        finally:
            await nc.close()

    return asyncio.run(read())


def test_the_reader_cannot_write(secured: tuple[Server, dict[str, Path]], tmp_path: Path) -> None:
    server, seeds = secured

    async def attempt() -> str:
        nc = await client.connect([server.url], nkey_seed=seeds["reader"])
        try:
            kv = await nc.jetstream(timeout=2).key_value(names.INDEX_BUCKET)
            try:
                await kv.put("node-a.forged", b"{}")
            except Exception as e:
                return type(e).__name__
            return "accepted"
        finally:
            await nc.close()

    assert asyncio.run(attempt()) != "accepted"


def test_sink_settings_take_a_seed(tmp_path: Path) -> None:
    seed, _ = user(tmp_path, "x")
    assert NatsSink(servers=["nats://127.0.0.1:1"], node="x", nkey_seed=seed).nkey_seed == seed


_ = stream_events  # the unprotected reader the other tests use
