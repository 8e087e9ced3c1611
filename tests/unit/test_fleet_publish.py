"""The agent's fleet publisher against a real nats-server (no BPF, no root): events exactly once,
bundles stored and indexed, the outbox kept while the server is away and sent when it is back."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from evidence.agent.daemon import metrics as m
from evidence.agent.daemon.delivery import Backoff
from evidence.agent.daemon.fleet import FleetPublisher
from evidence.agent.daemon.settings import NatsSink
from evidence.bundle.fleet import binding, client, names
from tests.fleet.servers import Server, free_port
from tests.fleet.wait import until
from tests.unit import conftest_bundles as cb


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path)
    yield s
    s.kill()


def publisher(
    tmp: Path, url: str, node: str = "node-a", inbox_prefix: str | None = None, **over: Any
) -> tuple[FleetPublisher, m.Registry]:
    reg = m.Registry()
    sink = NatsSink(**{"servers": [url], "node": node, "batch_interval": 0.05, "ack_timeout": 2.0, **over})
    pub = FleetPublisher(
        sink, over.get("outbox_dir") or tmp / f"outbox-{node}", registry=reg, backoff=Backoff(0.1, 0.5),
        inbox_prefix=inbox_prefix,
    )  # fmt: skip
    return pub, reg


def event(session: str, seq: int) -> dict[str, Any]:
    return {
        "specversion": "1.0",
        "id": f"{session}:{seq}",
        "source": f"urn:evidence:session:{session}",
        "type": "dev.evidence.file.open",
        "subject": f"/w/file-{seq}\r\nX-Injected: 1",
        "time": "2026-11-27T20:00:00.000000001Z",
        "datacontenttype": "application/json",
        "sessionid": session,
        "seq": seq,
        "data": {"path": f"/w/file-{seq}", "n": seq},
    }


async def _stream_events(url: str) -> list[dict[str, Any]]:
    nc = await client.connect([url])
    try:
        js = nc.jetstream()
        info = await js.stream_info(names.EVENTS_STREAM)
        out = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await js.get_msg(names.EVENTS_STREAM, seq)
            ev = binding.from_message(msg.headers, msg.data or b"")
            ev["_subject"] = msg.subject
            out.append(ev)
        return out
    finally:
        await nc.close()


def stream_events(url: str) -> list[dict[str, Any]]:
    return asyncio.run(_stream_events(url))


async def _entries_and_bundle(url: str, key: str | None) -> tuple[list[Any], bytes | None]:
    nc = await client.connect([url])
    try:
        js = nc.jetstream()
        entries = await client.index_entries(js)
        data = None
        if key is not None:
            (entry,) = [e for e in entries if e.key == key]
            buf = io.BytesIO()
            await client.fetch_bundle(js, entry, buf)
            data = buf.getvalue()
        return entries, data
    finally:
        await nc.close()


def test_events_exactly_once_bundle_stored_and_indexed(tmp_path: Path, server: Server) -> None:
    pub, reg = publisher(tmp_path, server.url)
    pub.start()
    try:
        for i in range(1200):
            pub.submit(event("s1", i))
        bundle = cb.write(tmp_path / "b.tar.gz", session_id="s2", labels={"job": "build"})
        pub.bundle_written(bundle)
        until(lambda: reg.value("evidence_fleet_events_published_total") >= 1200, what="events acked")
        until(lambda: reg.value("evidence_fleet_bundles_stored_total") == 1, what="bundle stored")
    finally:
        pub.close()
    got = stream_events(server.url)
    assert [e["id"] for e in got] == [f"s1:{i}" for i in range(1200)]
    assert {e["_subject"] for e in got} == {"evidence.events.node-a.s1"}
    first = got[0]
    assert first["subject"] == "/w/file-0\r\nX-Injected: 1" and first["seq"] == 0
    assert first["data"] == {"path": "/w/file-0", "n": 0}
    entries, data = asyncio.run(_entries_and_bundle(server.url, "node-a.s2"))
    assert data == bundle.read_bytes()
    (entry,) = entries
    assert entry.node == "node-a" and entry.written_by == "node-a" and entry.session_id == "s2"
    assert entry.bundle_sha256 == hashlib.sha256(data).hexdigest() and entry.labels == {"job": "build"}
    assert entry.lint is not None and entry.exit_code == 0 and not entry.failed
    assert reg.value("evidence_fleet_backlog_items", kind="bundle") == 0
    assert not list(pub.outbox.bundle_dir.iterdir()) and not pub.outbox.segments()


def test_server_away_then_back_nothing_lost_nothing_duplicated(tmp_path: Path, server: Server) -> None:
    server.stop()
    pub, reg = publisher(tmp_path, server.url)
    pub.start()
    try:
        for i in range(300):
            pub.submit(event("s3", i))
        bundle = cb.write(tmp_path / "b.tar.gz", session_id="s4")
        pub.bundle_written(bundle)
        until(lambda: pub.outbox.backlog().events == 300, what="events in the outbox")
        pub.update_backlog()
        assert reg.value("evidence_fleet_backlog_items", kind="bundle") == 1
        assert reg.value("evidence_fleet_backlog_items", kind="event") == 300
        assert reg.value("evidence_fleet_backlog_bytes", kind="bundle") == bundle.stat().st_size
        server.start()
        until(lambda: reg.value("evidence_fleet_bundles_stored_total") == 1, what="bundle stored")
        until(lambda: reg.value("evidence_fleet_events_published_total") >= 300, what="events acked")
    finally:
        pub.close()
    got = stream_events(server.url)
    ids = [e["id"] for e in got]
    assert len(ids) == len(set(ids)) and sorted(ids) == sorted(f"s3:{i}" for i in range(300))
    entries, data = asyncio.run(_entries_and_bundle(server.url, "node-a.s4"))
    assert data == bundle.read_bytes() and len(entries) == 1


def test_restarted_publisher_sends_its_backlog(tmp_path: Path, server: Server) -> None:
    server.stop()
    pub, _ = publisher(tmp_path, server.url)
    pub.start()
    for i in range(50):
        pub.submit(event("s5", i))
    pub.bundle_written(cb.write(tmp_path / "b.tar.gz", session_id="s6"))
    pub.close()  # the agent stops with its outbox full
    assert pub.outbox.backlog().events == 50 and pub.outbox.backlog().bundles == 1
    server.start()
    again, reg = publisher(tmp_path, server.url)
    again.start()
    try:
        until(lambda: reg.value("evidence_fleet_bundles_stored_total") == 1, what="bundle stored")
        until(lambda: reg.value("evidence_fleet_events_published_total") >= 50, what="events acked")
    finally:
        again.close()
    ids = [e["id"] for e in stream_events(server.url)]
    assert len(ids) == len(set(ids)) and sorted(ids) == sorted(f"s5:{i}" for i in range(50))


def test_a_window_smaller_than_a_batch_still_sends_each_event_once(tmp_path: Path, server: Server) -> None:
    pub, reg = publisher(tmp_path, server.url, batch_size=100, ack_window=7)
    pub.start()
    try:
        for i in range(1000):
            pub.submit(event("w1", i))
        until(lambda: reg.value("evidence_fleet_events_published_total") >= 1000, what="events acked")
    finally:
        pub.close()
    assert [e["id"] for e in stream_events(server.url)] == [f"w1:{i}" for i in range(1000)]
    assert reg.value("evidence_fleet_events_duplicate_total") == 0
    assert not pub.outbox.segments()


def test_events_whose_acks_came_too_late_are_sent_again_and_stored_once(
    tmp_path: Path, server: Server
) -> None:
    """The server frozen (SIGSTOP) holds the publishes unanswered past ack_timeout: the publisher
    gives up on them and keeps them in the outbox; thawed, the server stores the first copies and
    answers replies no one waits for; the copies sent again are dropped by their Nats-Msg-Id."""
    assert server.proc is not None
    pub, reg = publisher(tmp_path, server.url, ack_timeout=0.5)
    pub.start()
    try:
        for i in range(10):
            pub.submit(event("l1", i))
        until(lambda: reg.value("evidence_fleet_events_published_total") >= 10, what="first events")
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            for i in range(10, 400):
                pub.submit(event("l1", i))
            until(lambda: reg.value("evidence_fleet_errors_total", what="publish") >= 1, what="a timeout")
            assert pub.outbox.backlog().events > 0  # kept, not lost
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)

        def all_answered() -> bool:
            return (
                reg.value("evidence_fleet_events_published_total")
                + reg.value("evidence_fleet_events_duplicate_total")
                >= 400
            )

        until(all_answered, what="every event answered")
        until(lambda: not pub.outbox.segments(), what="the outbox emptied")
    finally:
        pub.close()
    ids = [e["id"] for e in stream_events(server.url)]
    assert sorted(ids) == sorted(f"l1:{i}" for i in range(400)) and len(ids) == 400
    assert reg.value("evidence_fleet_events_duplicate_total") > 0
    assert reg.value("evidence_fleet_events_published_total") == 400 - reg.value(
        "evidence_fleet_events_duplicate_total"
    )


async def _object(url: str, node: str, key: str) -> tuple[Any, bytes] | None:
    """The bucket's info and bytes (read by nats-py, which checks the digest) of `key`, or None."""
    from nats.js.errors import ObjectNotFoundError

    nc = await client.connect([url])
    try:
        store = await nc.jetstream().object_store(names.bundle_bucket(node))
        try:
            got = await store.get(key)
        except ObjectNotFoundError:
            return None
        return got.info, got.data or b""
    finally:
        await nc.close()


def test_the_outbox_lets_a_bundle_go_only_when_the_bucket_holds_it_with_its_digest(
    tmp_path: Path, server: Server
) -> None:
    """put without nats-py's look-up and read back: a bundle stored is nats-py's object (its meta,
    its digest checked as it reads); a name the bucket holds with another digest is not overwritten
    and the bundle stays; a bundle that changed in the outbox after it was queued is not stored
    under its name at all (its digest is the job's or nothing is written) and stays too."""
    pub, reg = publisher(tmp_path, server.url)
    pub.start()
    try:
        ours = cb.write(tmp_path / "ours.tar.gz", session_id="o1")
        pub.bundle_written(ours)
        until(lambda: reg.value("evidence_fleet_bundles_stored_total") == 1, what="o1 stored")
        got = asyncio.run(_object(server.url, "node-a", "node-a.o1"))
        assert got is not None
        info, data = got
        assert data == ours.read_bytes() and info.size == len(data) and info.chunks == 1
        assert info.digest == client.object_digest(hashlib.sha256(data).hexdigest())
        # a name the bucket holds with another digest: never overwritten, the bundle kept
        other = cb.write(tmp_path / "other.tar.gz", session_id="o1", exit_code=3)
        pub.bundle_written(other)
        until(lambda: reg.value("evidence_fleet_errors_total", what="bundle") >= 1, what="refused")
        assert asyncio.run(_object(server.url, "node-a", "node-a.o1")) == got
        assert pub.outbox.backlog().bundles == 1 and reg.value("evidence_fleet_bundles_stored_total") == 1
    finally:
        pub.close()
    # a bundle changed in the outbox after it was queued (its job names other bytes): nothing is
    # stored under its name, and it stays
    late, reg = publisher(tmp_path, server.url, outbox_dir=tmp_path / "late")
    job = late.outbox.add_bundle("node-a.c1", cb.write(tmp_path / "c1.tar.gz", session_id="c1"))
    swapped = tmp_path / "c2.tar.gz"
    swapped.write_bytes(cb.write(tmp_path / "c9.tar.gz", session_id="c1", exit_code=9).read_bytes())
    os.replace(swapped, job.path)  # (the outbox's copy is a hard link: a new file in its place)
    late.start()
    try:
        until(lambda: reg.value("evidence_fleet_errors_total", what="bundle") >= 2, what="refused twice")
        assert asyncio.run(_object(server.url, "node-a", "node-a.c1")) is None
        assert [j.key for j in late.outbox.bundle_jobs()] == ["node-a.c1"]
        assert reg.value("evidence_fleet_bundles_stored_total") == 0
    finally:
        late.close()


def test_events_handed_over_in_batches_arrive_once_each_past_the_queue_too(
    tmp_path: Path, server: Server
) -> None:
    """submit_many (the agent's backend hands each run's records over that way): within the queue's
    room in one call, past it event by event into the outbox; every event once, in order."""
    reg = m.Registry()
    sink = NatsSink(servers=[server.url], node="node-a", batch_interval=0.05, batch_size=50, ack_timeout=2.0)
    pub = FleetPublisher(sink, tmp_path / "outbox", registry=reg, backoff=Backoff(0.1, 0.5), queue_size=100)
    pub.submit_many([event("h1", i) for i in range(40)])  # room: queued at once
    assert len(pub._pending) == 40
    pub.submit_many([event("h1", i) for i in range(40, 400)])  # past the room: the rest to the outbox
    pub.start()
    try:
        until(lambda: reg.value("evidence_fleet_events_published_total") >= 400, what="events acked")
    finally:
        pub.close()
    ids = [e["id"] for e in stream_events(server.url)]
    assert (
        sorted(ids, key=lambda i: int(i.split(":")[1])) == [f"h1:{i}" for i in range(400)] and len(ids) == 400
    )


def test_a_bundle_handed_over_after_close_waits_in_the_outbox(tmp_path: Path) -> None:
    """The publisher's loop has ended (closed: its loop closed): a bundle the recorder finishes
    later goes into the outbox for the next start, and a second close is harmless; neither raises
    into the caller (the recorder's finishing thread)."""
    pub, reg = publisher(tmp_path, f"nats://127.0.0.1:{free_port()}")  # nothing listens there
    pub.start()
    pub.close()
    assert pub._thread is not None and not pub._thread.is_alive()
    pub.bundle_written(cb.write(tmp_path / "late.tar.gz", session_id="late"))
    pub.close()
    assert [job.key for job in pub.outbox.bundle_jobs()] == ["node-a.late"]
    assert reg.value("evidence_fleet_errors_total", what="outbox") == 0
