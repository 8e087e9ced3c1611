"""Counts the recorder's kernel kept (a record standing for `n` more occurrences up to time `tl`)
reach the bundle's summary exactly, and the live stream shows such a record with its count."""

from __future__ import annotations

from pathlib import Path

from evidence.bundle import format as fmt
from evidence.bundle.writer import RunMeta, write_bundle
from tests.kernel.util import read_bundle

META = RunMeta(
    session_id="s1",
    command=["cat"],
    cwd="/",
    pid=7,
    cgroup="/cg",
    started_ns=50,
    finished_ns=900,
    exit_code=0,
    detail="summary",
    host={},
    capabilities={},
    headers={},
)
FIRST = {"k": "open", "t": 100, "pid": 8, "ppid": 7, "exe": "/bin/cat", "path": "/etc/x", "raw_path": "x",
         "dirfd": None, "flags": ["O_RDONLY"], "access": ["read"], "mode": None, "result": 0}  # fmt: skip
# what the recorder writes when the run ends for a key the kernel counted 5000 times
REPEATS = {k: FIRST[k] for k in ("k", "exe", "path", "access", "result", "pid")} | {
    "t": 100,
    "tl": 700,
    "n": 4999,
}


def test_kernel_counts_are_added_to_the_first_record(tmp_path: Path) -> None:
    write_bundle(tmp_path / "b.tar.gz", META, lambda: [FIRST, REPEATS])
    _, events = read_bundle(tmp_path / "b.tar.gz")
    (ev,) = [e for e in events if e["type"] == fmt.FILE_OPEN]
    assert ev["data"]["count"] == 5000 and ev["data"]["raw_path"] == "x"
    assert ev["data"]["first_time"] == fmt.format_time(100)
    assert ev["data"]["last_time"] == fmt.format_time(700)
    assert "n" not in ev["data"] and "tl" not in ev["data"]


def test_the_live_stream_shows_the_repeats_with_their_count() -> None:
    from evidence.agent.daemon.delivery import live_event

    ev = live_event("s1", 3, REPEATS)
    assert ev["data"]["count"] == 4999 and ev["data"]["last_time"] == fmt.format_time(700)
    assert "n" not in ev["data"] and "tl" not in ev["data"]
