"""The poller's overflow (agent/recorder/pipeline.py: _Spill): past HELD_RECORDS raw records
waiting in memory, batches go to a file and come back to the correlator in order. No kernel: a
fake ring hands batches to the real poller and correlator threads, with a correlator held back so
that batches pile up."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from evidence.agent.recorder import pipeline, recording


class _Ring:
    def __init__(self, batches: list[list[bytes]]) -> None:
        self.batches = batches
        self.lock = threading.Lock()

    def wait(self, timeout_ms: int) -> None:
        time.sleep(0.001)

    def wake(self) -> None:
        pass

    def read(self, max_records: int = 65536) -> list[bytes]:
        with self.lock:
            return self.batches.pop(0) if self.batches else []


class _Probes:
    def __init__(self, ring: _Ring) -> None:
        self._ring = ring

    def ring(self) -> _Ring:
        return self._ring

    def close(self, background: bool = False) -> None:
        pass


def test_batches_past_the_memory_bound_go_to_disk_and_come_back_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pipeline, "HELD_RECORDS", 50)
    # records of any bytes, lengths 0 to 300: what comes back is exactly what was read
    batches = [
        [bytes([i % 251, j % 256]) * (j % 151) for j in range(i % 40)] for i in range(200)
    ]  # (fewer than QUEUE_BATCHES)
    want = [r for b in batches for r in b]
    seen: list[bytes] = []
    gate = threading.Event()
    spilled: list[int] = []

    def process(self: recording.Recorder, batch: list[bytes]) -> None:
        gate.wait(10)  # held back until every batch was read: most of them must go to disk
        spilled.append(self._spill.end)
        seen.extend(batch)

    monkeypatch.setattr(recording.Recorder, "_process", process)
    ring = _Ring(list(batches))
    rec = recording.Recorder(tmp_path / "spool", probes=_Probes(ring))  # type: ignore[arg-type]
    try:
        deadline = time.monotonic() + 10
        while ring.batches and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rec._held <= pipeline.HELD_RECORDS + 40  # one batch over, at most
        assert rec._spill.waiting > 0  # some went to disk
        gate.set()
        assert rec.drain(10)
    finally:
        rec.close()
    assert seen == want
    assert rec._spill.waiting == 0 and rec._held == 0
    assert max(spilled) > 0


def test_a_consumer_behind_but_correlating_is_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """drain's timeout is how long the consumer may go without finishing a batch: one behind on a
    flood, finishing a batch every 0.2 s, is waited for past it (its records are the run's)."""
    monkeypatch.setattr(pipeline, "COALESCE", 1)  # one batch at a time
    seen: list[bytes] = []

    def process(self: recording.Recorder, batch: list[bytes]) -> None:
        self.stats["batches"] += 1
        time.sleep(0.2)
        seen.extend(batch)

    monkeypatch.setattr(recording.Recorder, "_process", process)
    batches = [[b"%d" % i] for i in range(15)]
    ring = _Ring(list(batches))
    rec = recording.Recorder(tmp_path / "spool", probes=_Probes(ring))  # type: ignore[arg-type]
    try:
        while ring.batches:
            time.sleep(0.01)
        assert rec.drain(timeout=1)  # about 3 s of batches, none longer than 1 s
    finally:
        rec.close()
    assert seen == [r for b in batches for r in b]


class _FloodRing(_Ring):
    """A ring of `count` records, read as the real one is: at most max_records at a time."""

    def __init__(self, count: int) -> None:
        super().__init__([])
        self.records = [b"%d" % i for i in range(count)]
        self.largest = 0

    def read(self, max_records: int = 65536) -> list[bytes]:
        with self.lock:
            out, self.records = self.records[:max_records], self.records[max_records:]
        self.largest = max(self.largest, len(out))
        return out


def test_a_flood_is_read_off_the_ring_in_small_batches_while_the_correlator_is_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The poller reads READ_RECORDS at a time (not a whole ring's worth of bytes objects at once),
    and more batches than the 256 that once bounded the queue go to disk while the correlator is
    held back: the ring is emptied (nothing waits in it to be lost) and every record comes back in
    order."""
    monkeypatch.setattr(pipeline, "HELD_RECORDS", 50)
    monkeypatch.setattr(pipeline, "READ_RECORDS", 7)
    ring = _FloodRing(7 * 1000)
    want = list(ring.records)
    seen: list[bytes] = []
    gate = threading.Event()

    def process(self: recording.Recorder, batch: list[bytes]) -> None:
        gate.wait(20)
        seen.extend(batch)

    monkeypatch.setattr(recording.Recorder, "_process", process)
    rec = recording.Recorder(tmp_path / "spool", probes=_Probes(ring))  # type: ignore[arg-type]
    try:
        deadline = time.monotonic() + 20
        while ring.records and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not ring.records  # all read while the correlator still waits
        assert rec._spill.waiting > 256
        gate.set()
        assert rec.drain(20)
    finally:
        rec.close()
    assert ring.largest == 7
    assert seen == want
