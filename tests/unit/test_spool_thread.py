"""The spool's compression on a thread of its own (bundle/spool.py SpoolWriter): from the first
large batch on, in order with the small ones before it, flushed to the file when flush() returns,
and a failure of the thread's raised on the writing side."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import zstandard

from evidence.bundle.spool import SpoolWriter, read_spool


def _flushed(path: Path) -> bytes:
    """What a reader of the file sees now (a recovery after the recorder was killed): the blocks
    flushed of a frame not ended."""
    return zstandard.ZstdDecompressor().decompressobj().decompress(path.read_bytes())


def test_large_batches_go_through_the_thread_in_order_and_flush_reaches_the_file(tmp_path: Path) -> None:
    path = tmp_path / "s.spool.zst"
    spool = SpoolWriter(path)
    small = [{"k": "open", "t": i, "path": "/a"} for i in range(3)]
    large = [{"k": "open", "t": 10 + i, "path": "/b/" + "x" * 100 + str(i)} for i in range(4000)]
    spool.write_many(small)
    assert spool._thread is None  # small: on the writing thread
    spool.write_many(large)
    assert spool._thread is not None
    spool.write_many([b'{"k":"open","t":99999,"path":"/b"}\n'])  # a line, after the large batch
    spool.flush()
    seen = _flushed(path).splitlines()
    assert len(seen) == 3 + 4000 + 1 and seen[-1].endswith(b'"/b"}')
    spool.close()
    assert spool._thread is None
    records = list(read_spool(path))
    assert [r["t"] for r in records] == [0, 1, 2, *range(10, 4010), 99999]


def test_an_error_of_the_thread_is_raised_by_the_next_write(tmp_path: Path) -> None:
    spool = SpoolWriter(tmp_path / "s.spool.zst")
    big = [{"k": "open", "t": i, "path": "/" + "y" * 200} for i in range(2000)]
    spool.write_many(big)
    os.close(spool._raw.fileno())  # the file's descriptor gone under it: its writes fail
    with pytest.raises(OSError):
        for _ in range(50):  # (the thread's failure comes with a write or a flush after it)
            spool.write_many(big)
            spool.flush()
    with pytest.raises(OSError):
        spool.close()
