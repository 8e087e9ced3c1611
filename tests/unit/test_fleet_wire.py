"""The events' own NATS connection and its segments (agent/daemon/fleet_wire.py): frames made once
and read back whole, the template encoding equal to the general one, an older agent's outbox sent,
and a message larger than the server takes dropped without losing the connection (real servers)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from evidence.agent.daemon import fleet_wire as w
from evidence.bundle.fleet import binding
from tests.fleet.servers import Server
from tests.fleet.wait import until
from tests.unit.test_fleet_publish import event, publisher, stream_events

_text = st.text(max_size=30)


@given(
    subjects=st.lists(_text, min_size=1, max_size=6),
    extra=st.dictionaries(
        st.sampled_from(["poduid", "containerid", "x1"]), _text | st.integers() | st.booleans() | st.none()
    ),
)
def test_template_encoding_is_the_general_one(subjects: list[str], extra: dict[str, Any]) -> None:
    """A batch of events (some needing percent-encoding, a bool, a None to leave out): each header
    block says what `to_message` says, and the payload is the same."""
    events = [{**event("s1", i), "subject": s, **extra} for i, s in enumerate(subjects)]
    for e, (block, payload) in zip(events, binding.encode_many(events), strict=True):
        headers, want = binding.to_message(e)
        assert binding.parse_header_block(block) == headers
        assert payload == want
        assert block.endswith(b"\r\n\r\n") and block.count(b"\r\n") == len(headers) + 2


def messages(n: int, session: str = "s1") -> list[tuple[bytes, bytes, bytes]]:
    subject = f"evidence.events.n.{session}".encode()
    return [(subject, *binding.encode(event(session, i))) for i in range(n)]


def test_a_segment_is_its_frames_and_reads_back() -> None:
    seg = w.build(42, "_INBOX_n.abc", messages(5))
    assert seg.data.count(b"HPUB evidence.events.n.s1 _INBOX_n.abc.42.") == 5
    back, problem = w.parse(seg.data, 42, "_INBOX_n.abc")
    assert problem == "" and back.data == seg.data and back.offsets == seg.offsets
    assert [back.token(k) for k in range(5)] == [0, 1, 2, 3, 4]
    # what is left after a partial acknowledgement keeps its replies, so late answers still count
    left = seg.only([1, 3])
    again, _ = w.parse(left.data, 42, "_INBOX_n.abc")
    assert [again.token(k) for k in range(2)] == [1, 3] and again.sizes == [seg.sizes[1], seg.sizes[3]]
    # a segment cut short (what a torn write would leave) keeps its whole frames
    cut, problem = w.parse(seg.data[: seg.offsets[3] + 10], 42, "_INBOX_n.abc")
    assert len(cut) == 3 and "at byte" in problem
    # replies under another inbox (the node renamed): framed again under this one
    moved, _ = w.parse(seg.data, 42, "_INBOX_m.def")
    assert moved.data.count(b" _INBOX_m.def.42.") == 5 and b"_INBOX_n" not in moved.data


def test_an_older_agents_segment_is_sent(tmp_path: Path) -> None:
    """An outbox an older agent left (events as JSON lines) is sent by this one, exactly once."""
    server = Server(tmp_path)
    try:
        outbox = tmp_path / "outbox-node-a"
        (outbox / "events").mkdir(parents=True)
        lines = b"".join(orjson.dumps(event("old1", i)) + b"\n" for i in range(30))
        (outbox / "events" / "seg-0000000000000003.ndjson").write_bytes(lines)
        pub, reg = publisher(tmp_path, server.url)
        assert pub.outbox.backlog().events == 30
        pub.start()
        try:
            for i in range(30, 40):
                pub.submit(event("old1", i))
            until(lambda: reg.value("evidence_fleet_events_published_total") >= 40, what="events")
        finally:
            pub.close()
        assert sorted(e["id"] for e in stream_events(server.url)) == sorted(f"old1:{i}" for i in range(40))
        assert not pub.outbox.segments()
    finally:
        server.kill()


def test_a_message_too_large_is_dropped_not_the_connection(tmp_path: Path) -> None:
    """An event larger than the server's max_payload would make the server close the connection
    (and the publisher send it again, for ever): it is dropped and counted, the others arrive."""
    server = Server(tmp_path, config="max_payload: 4096\n")
    try:
        pub, reg = publisher(tmp_path, server.url)
        pub.start()
        try:
            for i in range(20):
                e = event("big1", i)
                if i == 7:
                    e["data"] = {"blob": "x" * 10_000}
                pub.submit(e)
            until(lambda: reg.value("evidence_fleet_events_published_total") >= 19, what="events")
            until(lambda: reg.value("evidence_fleet_events_dropped_total") == 1, what="dropped")
            time.sleep(0.5)
        finally:
            pub.close()
        ids = [e["id"] for e in stream_events(server.url)]
        assert sorted(ids) == sorted(f"big1:{i}" for i in range(20) if i != 7)
        assert reg.value("evidence_fleet_errors_total", what="publish") >= 1
        assert not pub.outbox.segments()
    finally:
        server.kill()


def test_an_outbox_that_cannot_be_written_is_said_and_the_publisher_goes_on(tmp_path: Path) -> None:
    """The events directory gone (a disk full, a broken mount, an operator): the batch is dropped
    and counted, the error said; once it is back, events flow again."""
    import shutil

    server = Server(tmp_path)
    try:
        pub, reg = publisher(tmp_path, server.url)
        pub.start()
        try:
            shutil.rmtree(pub.outbox.event_dir)
            pub.outbox.event_dir.write_text("not a directory")
            for i in range(10):
                pub.submit(event("d1", i))
            until(lambda: reg.value("evidence_fleet_errors_total", what="outbox") >= 1, what="the error")
            assert reg.value("evidence_fleet_events_dropped_total") == 10
            assert pub._thread is not None and pub._thread.is_alive()
            pub.outbox.event_dir.unlink()
            pub.outbox.event_dir.mkdir(mode=0o700)
            for i in range(10, 20):
                pub.submit(event("d1", i))
            until(lambda: reg.value("evidence_fleet_events_published_total") >= 10, what="events again")
        finally:
            pub.close()
        assert sorted(e["id"] for e in stream_events(server.url)) == sorted(f"d1:{i}" for i in range(10, 20))
    finally:
        server.kill()
