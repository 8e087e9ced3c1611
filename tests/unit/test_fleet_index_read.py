"""`fleet ls` reads the whole index from a real nats-server: every live entry once, deleted keys
left out, one node's when asked, and every entry written before a listing began in that listing,
however many and while others are being written (nats-py's KV watch may end its initial values
early, nats.py #842: a listing must never drop a run without a word)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from evidence.bundle.fleet import client, names
from evidence.bundle.fleet.models import IndexEntry
from tests.fleet.servers import Server


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path)
    yield s
    s.kill()


def entry(node: str, i: int) -> IndexEntry:
    return IndexEntry(
        node=node,
        session_id=f"s{i:05d}",
        run_id=f"run-{i:032x}",
        command=["true"],
        started_at="2026-11-28T02:00:00.000000000Z",
        finished_at="2026-11-28T02:00:01.000000000Z",
        exit_code=0,
        events=i,
        lost=0,
        lint=None,
        bundle_sha256="0" * 64,
        bundle_size=1,
    )


def listed(url: str, node: str | None = None) -> list[IndexEntry]:
    async def go() -> list[IndexEntry]:
        nc = await client.connect([url])
        try:
            return await client.index_entries(nc.jetstream(), node)
        finally:
            await nc.close()

    return asyncio.run(go())


def test_no_index_lists_nothing(server: Server) -> None:
    assert listed(server.url) == []


def test_every_live_entry_once_deleted_ones_left_out_one_nodes_when_asked(server: Server) -> None:
    async def write() -> None:
        nc = await client.connect([server.url])
        try:
            js = nc.jetstream()
            await client.ensure_layout(js)
            kv = await js.key_value(names.INDEX_BUCKET)
            for node, n in (("node-a", 700), ("node-b", 600)):  # more than one fetch's batch
                for i in range(n):
                    await kv.put(names.run_key(node, f"s{i:05d}"), entry(node, i).to_json())
            await kv.put(names.run_key("node-a", "s00001"), entry("node-a", 1).to_json())  # rewritten
            await kv.delete(names.run_key("node-b", "s00002"))
            await kv.put(names.run_key("node-b", "junk"), b"not an entry")  # logged, left out
        finally:
            await nc.close()

    asyncio.run(write())
    every = listed(server.url)
    keys = [e.key for e in every]
    assert len(keys) == len(set(keys)) == 700 + 600 - 1
    assert names.run_key("node-b", "s00002") not in keys
    assert all(e.written_by == e.node for e in every)
    only_a = listed(server.url, "node-a")
    assert sorted(e.key for e in only_a) == sorted(k for k in keys if k.startswith("node-a."))


def test_a_listing_has_every_entry_written_before_it_while_more_are_written(server: Server) -> None:
    async def go() -> None:
        nc = await client.connect([server.url])
        try:
            js = nc.jetstream()
            await client.ensure_layout(js)
            kv = await js.key_value(names.INDEX_BUCKET)
            acked: list[str] = []

            async def writer() -> None:
                for i in range(1500):
                    key = names.run_key("node-w", f"s{i:05d}")
                    await kv.put(key, entry("node-w", i).to_json())
                    acked.append(key)

            task = asyncio.create_task(writer())
            while len(acked) < 100:
                await asyncio.sleep(0.01)
            assert not task.done()
            while not task.done():  # a listing at least once while entries are being written
                before = set(acked)
                got = {e.key for e in await client.index_entries(js)}
                assert before <= got, sorted(before - got)[:5]
            await task
            assert {e.key for e in await client.index_entries(js)} == set(acked)
        finally:
            await nc.close()

    asyncio.run(go())
