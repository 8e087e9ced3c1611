"""The spool's compression on a thread of its own (bundle/spool.py SpoolWriter): in order, flushed
to the file when flush() returns, and a failure of the thread's raised on the writing side. Both
ways: the compiled module's C thread (src/fast/zfile.h ZFile) and the Python path's thread (from
the first large batch on, the small ones before it compressed on the writing thread)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import zstandard

from evidence.bundle import spool as spool_module
from evidence.bundle.spool import SpoolWriter, read_spool

WAYS = ["c", "python"]


@pytest.fixture(params=WAYS)
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "c":
        if spool_module._fast is None:
            pytest.skip("the compiled module is not built (tests/unit/test_native.py fails under CI)")
    else:
        monkeypatch.setattr(spool_module, "_fast", None)
    return str(request.param)


def _flushed(path: Path) -> bytes:
    """What a reader of the file sees now (a recovery after the recorder was killed): the blocks
    flushed of a frame not ended."""
    return zstandard.ZstdDecompressor().decompressobj().decompress(path.read_bytes())


def test_large_batches_go_through_the_thread_in_order_and_flush_reaches_the_file(
    tmp_path: Path, way: str
) -> None:
    path = tmp_path / "s.spool.zst"
    spool = SpoolWriter(path)
    small = [{"k": "open", "t": i, "path": "/a"} for i in range(3)]
    large = [{"k": "open", "t": 10 + i, "path": "/b/" + "x" * 100 + str(i)} for i in range(4000)]
    spool.write_many(small)
    spool.flush()
    assert len(_flushed(path).splitlines()) == 3  # a small batch too, flushed
    if way == "python":
        assert spool._thread is None  # small: on the writing thread
    spool.write_many(large)
    if way == "python":
        assert spool._thread is not None
    spool.write_many([b'{"k":"open","t":99999,"path":"/b"}\n'])  # a line, after the large batch
    spool.flush()
    seen = _flushed(path).splitlines()
    assert len(seen) == 3 + 4000 + 1 and seen[-1].endswith(b'"/b"}')
    spool.close()
    spool.close()  # (once is enough)
    assert spool._thread is None
    records = list(read_spool(path))
    assert [r["t"] for r in records] == [0, 1, 2, *range(10, 4010), 99999]


def test_an_error_of_the_thread_is_raised_by_the_next_write(tmp_path: Path, way: str) -> None:
    """The file's disk full under it (/dev/full in place of its descriptor): the thread's ENOSPC is
    raised by the next write or flush, and by close, never lost."""
    spool = SpoolWriter(tmp_path / "s.spool.zst")
    big = [{"k": "open", "t": i, "path": "/" + "y" * 200} for i in range(2000)]
    spool.write_many(big)
    spool.flush()
    full = os.open("/dev/full", os.O_WRONLY)
    fd = spool._c.fileno() if spool._c is not None else spool._raw.fileno()
    os.dup2(full, fd)
    os.close(full)
    with pytest.raises(OSError) as caught:  # noqa: PT012 - the failure comes with a write or a flush after it
        for _ in range(50):
            spool.write_many(big)
            spool.flush()
    assert caught.value.errno == errno.ENOSPC
    with pytest.raises(OSError):
        spool.close()
