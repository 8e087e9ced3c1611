"""agent.delivery against a loopback HTTP endpoint that is down at first and comes up later:
nothing is lost, bundles stay on disk until a 2xx, and a restart resumes what was pending."""

from __future__ import annotations

import hashlib
import http.server
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cloudevents.core.bindings import http as ce_http
from prometheus_client.parser import text_string_to_metric_families

from evidence.agent.daemon import delivery
from evidence.agent.daemon import metrics as m
from evidence.agent.daemon.delivery import Backoff, BundleUploader, EventStreamer, live_event

FAST = Backoff(initial=0.05, maximum=0.2, jitter=0.0)


class Sink:
    """A loopback HTTP endpoint that can be started late, fail on purpose, and records bodies."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        self.fail_next = 0  # answer 503 to this many requests first
        self.lock = threading.Lock()
        self.server: http.server.ThreadingHTTPServer | None = None

    def start(self) -> None:
        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with sink.lock:
                    if sink.fail_next > 0:
                        sink.fail_next -= 1
                        code = 503
                    else:
                        code = 201
                        sink.requests.append((self.command, self.path, dict(self.headers.items()), body))
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_PUT = do_POST = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/in"


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


@pytest.fixture
def sink() -> Iterator[Sink]:
    s = Sink(_free_port())
    yield s
    s.stop()


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def _events(n: int, session: str = "sess1") -> list[dict[str, Any]]:
    t0 = 1_763_776_000_123_456_789
    recs = [
        {
            "k": "exec",
            "t": t0 + i,
            "pid": 100 + i,
            "ppid": 1,
            "depth": 1,
            "filename": "/bin/true",
            "argv": ["true", str(i)],
            "cwd": "/",
            "result": 0,
        }
        for i in range(n)
    ]
    return [live_event(session, i, r, {"poduid": "abc", "containerid": "c0ffee"}) for i, r in enumerate(recs)]


def _received_ids(s: Sink) -> list[str]:
    ids = []
    for _method, _path, headers, body in s.requests:
        ctype = {k.lower(): v for k, v in headers.items()}["content-type"]
        if ctype.startswith("application/cloudevents-batch+json"):
            ids += [e["id"] for e in json.loads(body)]
        else:
            ce = ce_http.from_structured_event(ce_http.HTTPMessage({"content-type": ctype}, body))
            ids.append(ce.get_id())
    return ids


# --- encoding ---------------------------------------------------------------------------------------


def test_live_event_shape_and_sdk_round_trip() -> None:
    ev = _events(1)[0]
    assert ev["id"] == "sess1:0" and ev["source"] == "urn:evidence:session:sess1"
    assert ev["type"] == "dev.evidence.process.exec" and ev["subject"] == "/bin/true"
    assert ev["time"] == "2025-11-22T01:46:40.123456789Z"
    assert ev["poduid"] == "abc" and ev["data"]["argv"] == ["true", "0"]
    (msg,) = delivery.encode([ev], "structured")
    assert msg.headers["content-type"].startswith("application/cloudevents+json")
    back = ce_http.from_structured_event(msg)
    assert back.get_id() == "sess1:0" and back.get_extension("containerid") == "c0ffee"
    assert back.get_data() == ev["data"]
    assert back.get_time().isoformat() == "2025-11-22T01:46:40.123456+00:00"  # the SDK keeps microseconds
    (batch,) = delivery.encode(_events(3), "batch")
    assert [e["id"] for e in json.loads(batch.body)] == ["sess1:0", "sess1:1", "sess1:2"]
    with pytest.raises(ValueError):
        live_event(
            "s",
            0,
            {
                "k": "exec",
                "t": 1,
                "pid": 1,
                "ppid": 0,
                "depth": 0,
                "filename": "/x",
                "argv": [],
                "cwd": None,
                "result": 0,
            },
            {"Pod-UID": "x"},
        )


def test_backoff_grows_and_is_capped() -> None:
    b = Backoff(initial=1, maximum=10, jitter=0.0)
    assert [b.delay(n) for n in (1, 2, 3, 4, 5, 9)] == [1, 2, 4, 8, 10, 10]
    jittered = Backoff(initial=10, maximum=10, jitter=0.5)
    assert jittered.delay(1, rand=lambda: 0.0) == 5 and jittered.delay(1, rand=lambda: 1.0) == 15


# --- bundles ----------------------------------------------------------------------------------------


def _bundle(d: Path, name: str, payload: bytes) -> Path:
    p = d / name
    p.write_bytes(payload)
    return p


def test_bundles_wait_on_disk_until_the_endpoint_comes_up(tmp_path: Path, sink: Sink) -> None:
    reg = m.Registry()
    a = _bundle(tmp_path, "a.tar.gz", b"bundle a")
    b = _bundle(tmp_path, "b.tar.gz", b"bundle b" * 1000)
    (tmp_path / ".evidence-x.tmp").write_bytes(b"half-written")  # the writer's temp files are not bundles
    up = BundleUploader(tmp_path, sink.url, backoff=FAST, registry=reg, headers={"Authorization": "Bearer t"})
    up.start()
    try:
        assert wait_until(lambda: reg.value("evidence_bundle_uploads_total", result="error") >= 4)
        assert up.pending() == [a, b]  # down: still there, no marker
        sink.start()
        assert wait_until(lambda: up.pending() == [])
        c = _bundle(tmp_path, "c.tar.gz", b"late")
        up.enqueue(c)
        assert wait_until(lambda: up.pending() == [])
    finally:
        up.stop()
    got = {path: (method, headers, body) for method, path, headers, body in sink.requests}
    assert set(got) == {"/in/a.tar.gz", "/in/b.tar.gz", "/in/c.tar.gz"}
    method, headers, body = got["/in/b.tar.gz"]
    assert method == "PUT" and body == b"bundle b" * 1000
    assert headers["X-Evidence-Sha256"] == hashlib.sha256(body).hexdigest()
    assert headers["Authorization"] == "Bearer t"
    for p in (a, b):
        assert p.exists()  # delivered bundles stay; the marker says so
        marker = json.loads((tmp_path / (p.name + ".delivered")).read_text())
        assert marker["status"] == 201 and marker["sha256"] == hashlib.sha256(p.read_bytes()).hexdigest()
    assert reg.value("evidence_bundles_pending") == 0


def test_non_2xx_is_a_failure_and_restart_resumes(tmp_path: Path, sink: Sink) -> None:
    _bundle(tmp_path, "a.tar.gz", b"A")
    sink.start()
    sink.fail_next = 2
    first = BundleUploader(tmp_path, sink.url, method="POST", backoff=FAST)
    assert first.run_once() == 0  # 503
    assert first.run_once() == 0  # still in backoff: not even tried
    assert first.pending() == [tmp_path / "a.tar.gz"]
    # "restart": a new uploader on the same directory finds the bundle and delivers it
    second = BundleUploader(tmp_path, sink.url, method="POST", backoff=FAST)
    assert second.run_once() == 0  # the second 503
    assert wait_until(lambda: second.run_once() == 1 or second.pending() == [])
    assert [(mth, p, body) for mth, p, _h, body in sink.requests] == [("POST", "/in", b"A")]
    assert second.pending() == []


# --- live events ------------------------------------------------------------------------------------


def sent(st: EventStreamer) -> float:
    return st.registry.value("evidence_stream_sent_events_total")


def spilled(st: EventStreamer) -> float:
    return st.registry.value("evidence_stream_spilled_events_total")


def dropped(st: EventStreamer) -> float:
    return st.registry.value("evidence_stream_dropped_events_total")


@pytest.mark.parametrize("mode", ["batch", "structured"])
def test_stream_loses_nothing_while_the_endpoint_is_down(tmp_path: Path, sink: Sink, mode: str) -> None:
    reg = m.Registry()
    st = EventStreamer(
        sink.url,
        tmp_path / "spill",
        mode=mode,  # type: ignore[arg-type]
        batch_size=10,
        batch_interval=0.05,
        queue_size=25,
        backoff=FAST,
        registry=reg,
        headers={"Authorization": "Bearer t"},
    )
    st.start()
    events = _events(120)
    try:
        st.submit_many(events[:60])  # queue of 25: most of these overflow straight to the spill dir
        assert wait_until(lambda: spilled(st) >= 60)
        assert sink.requests == []
        sink.start()
        st.submit_many(events[60:])
        assert wait_until(lambda: sent(st) >= 120)
    finally:
        st.close()
    assert all(h["Authorization"] == "Bearer t" for _m, _p, h, _b in sink.requests)
    ids = _received_ids(sink)
    assert sorted(set(ids), key=lambda i: int(i.split(":")[1])) == [e["id"] for e in events]
    assert dropped(st) == 0
    assert list((tmp_path / "spill").glob("seg-*")) == []


def test_stream_spill_survives_a_restart(tmp_path: Path, sink: Sink) -> None:
    events = _events(30)
    down = EventStreamer(sink.url, tmp_path / "spill", batch_size=8, batch_interval=0.05, backoff=FAST)
    down.start()
    down.submit_many(events)
    down.close(timeout=2)
    assert sent(down) == 0 and spilled(down) == 30
    assert len(list((tmp_path / "spill").glob("seg-*.ndjson"))) >= 4

    sink.start()
    up = EventStreamer(sink.url, tmp_path / "spill", batch_size=8, batch_interval=0.05, backoff=FAST)
    up.start()
    try:
        assert wait_until(lambda: sent(up) >= 30)
    finally:
        up.close()
    assert sorted(_received_ids(sink), key=lambda i: int(i.split(":")[1])) == [e["id"] for e in events]
    assert list((tmp_path / "spill").glob("seg-*")) == []


def test_full_spill_drops_are_counted_not_silent(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    events = _events(50)
    one_batch = len(json.dumps(events[0], sort_keys=True, separators=(",", ":"))) * 10 + 100
    reg = m.Registry()
    st = EventStreamer(
        "http://127.0.0.1:9/in",
        tmp_path / "spill",
        batch_size=10,
        queue_size=10,
        spill_max_bytes=one_batch * 2,
        backoff=FAST,
        registry=reg,
    )
    st.submit_many(events)  # no sender thread: 10 queued, 40 overflow in batches of 10
    assert spilled(st) + dropped(st) == 40
    assert dropped(st) >= 20
    st.close(timeout=1)
    assert sent(st) + spilled(st) + dropped(st) == 50  # every event accounted for
    assert "dropped" in caplog.text
    scraped = {
        s.name: s.value for fam in text_string_to_metric_families(reg.render().decode()) for s in fam.samples
    }
    assert scraped["evidence_stream_dropped_events_total"] == dropped(st) >= 20
