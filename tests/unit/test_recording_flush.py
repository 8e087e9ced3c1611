"""The recorder flushes each run's spool at least once a second, so a recorder killed outright
(SIGKILL) leaves at most about a second of records unwritten. No kernel: fake probes feed raw
records through the real poller and correlator threads."""

from __future__ import annotations

import struct
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import zstandard

from evidence.agent.recorder import decode as d
from evidence.agent.recorder import recording
from evidence.agent.recorder.correlate import Correlator
from evidence.bundle.spool import SpoolWriter, read_spool


class FakeRing:
    def __init__(self) -> None:
        self.pending: list[bytes] = []
        self.lock = threading.Lock()

    def wait(self, timeout_ms: int) -> None:
        time.sleep(timeout_ms / 1000)

    def wake(self) -> None:
        pass

    def read(self, max_records: int = 65536) -> list[bytes]:
        with self.lock:
            out, self.pending = self.pending, []
        return out


class FakeProbes:
    def __init__(self) -> None:
        self.fake_ring = FakeRing()

    def ring(self) -> FakeRing:
        return self.fake_ring

    def close(self, background: bool = False) -> None:
        pass


def _open_record(path: bytes, ts: int) -> bytes:
    body = struct.pack("<qQQiIIHHQQ", 3, 0, 0, -100, 0, 0, 0, len(path) + 1, 0, 0) + path + b"\0"
    return d.HDR.pack(ts, 1, 1, 10, 10, d.EV_OPEN, 0) + body


def _readable_lines(path: Path) -> list[dict[str, Any]]:
    """What a reader finds in the spool file as it is on disk now (an unfinished zstd frame)."""
    data = zstandard.ZstdDecompressor().decompressobj().decompress(path.read_bytes())
    return [orjson.loads(x) for x in data.splitlines() if x]


def test_records_reach_the_disk_within_about_a_second(tmp_path: Path) -> None:
    rec = recording.Recorder(tmp_path, probes=FakeProbes())  # type: ignore[arg-type]
    try:
        spool = SpoolWriter(tmp_path / "s.spool.zst")
        corr = Correlator(0)
        corr.add_root(10, 1, "/w")
        session = recording.Session(
            slot=1,
            session_id="s",
            cgroup_path=tmp_path,
            cgroup_id=1,
            command=["x"],
            cwd="/w",
            detail="full",
            labels={},
            spool=spool,
            correlator=corr,
            started_ns=0,
        )
        rec._sessions[1] = session
        with rec.probes.fake_ring.lock:  # type: ignore[attr-defined]
            rec.probes.fake_ring.pending.append(_open_record(b"/etc/hostname", 5))  # type: ignore[attr-defined]
        deadline = time.monotonic() + recording.FLUSH_SECONDS + 1.5
        while time.monotonic() < deadline and not _readable_lines(spool.path):
            time.sleep(0.1)
        assert [r["path"] for r in _readable_lines(spool.path)] == ["/etc/hostname"]
        rec._sessions.clear()
        spool.close()
    finally:
        rec.close()


def test_a_stuck_consumer_makes_drain_say_so(tmp_path: Path) -> None:
    """finish() drains the ring into the spool before it reads the loss counters; when the consumer
    is stuck (red team: a read of a FIFO put at a program's path blocked it), drain returns False and
    finish records a degradation: those records are neither spooled nor counted as lost."""
    rec = recording.Recorder(tmp_path, probes=FakeProbes())  # type: ignore[arg-type]
    release = threading.Event()

    class StuckCorrelator(Correlator):
        def open_record(self, *args: Any, **kw: Any) -> Any:
            release.wait(30)
            return super().open_record(*args, **kw)

    spool = SpoolWriter(tmp_path / "s.spool.zst")
    try:
        assert rec.drain(timeout=5)  # nothing to wait for
        corr = StuckCorrelator(0)
        corr.add_root(10, 1, "/w")
        rec._sessions[1] = recording.Session(
            slot=1, session_id="s", cgroup_path=tmp_path, cgroup_id=1, command=["x"], cwd="/w",
            detail="full", labels={}, spool=spool, correlator=corr, started_ns=0,
        )  # fmt: skip
        with rec.probes.fake_ring.lock:  # type: ignore[attr-defined]
            rec.probes.fake_ring.pending.append(_open_record(b"/etc/hostname", 5))  # type: ignore[attr-defined]
        time.sleep(0.5)  # the consumer takes the batch and sticks in it
        assert not rec.drain(timeout=1)
        release.set()
        assert rec.drain(timeout=10)
    finally:
        release.set()
        rec._sessions.clear()
        spool.close()
        rec.close()


def test_a_batch_the_correlator_fails_on_is_counted_and_the_run_still_ends(tmp_path: Path) -> None:
    """A bug in correlation (an exception on a batch) killed the correlator thread: the ring's
    records then filled its queue, and `evidence run` hung for ever at its end (seen in a bench
    run). Now the batch is logged, counted as lost (`not_correlated`) with a degradation, later
    batches are recorded, and close() returns."""
    rec = recording.Recorder(tmp_path, probes=FakeProbes())  # type: ignore[arg-type]
    calls = 0

    class BrokenOnce(Correlator):
        def open_record(self, *args: Any, **kw: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("a bug")
            return super().open_record(*args, **kw)

    spool = SpoolWriter(tmp_path / "s.spool.zst")
    try:
        corr = BrokenOnce(0)
        corr.add_root(10, 1, "/w")
        session = recording.Session(
            slot=1, session_id="s", cgroup_path=tmp_path, cgroup_id=1, command=["x"], cwd="/w",
            detail="full", labels={}, spool=spool, correlator=corr, started_ns=0,
        )  # fmt: skip
        rec._sessions[1] = session
        for path in (b"/etc/hostname", b"/etc/passwd"):
            with rec.probes.fake_ring.lock:  # type: ignore[attr-defined]
                rec.probes.fake_ring.pending.append(_open_record(path, 5))  # type: ignore[attr-defined]
            assert rec.drain(timeout=10)
        assert rec.stats["failed_batches"] == 1 and session.failed == 1
        spool.flush()
        assert [r["path"] for r in read_spool(tmp_path / "s.spool.zst")] == ["/etc/passwd"]
    finally:
        rec._sessions.clear()
        spool.close()
        rec.close()
