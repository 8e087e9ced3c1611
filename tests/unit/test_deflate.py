"""The bundle's gzip stream put together from parts deflated apart (bundle/deflate.py)."""

from __future__ import annotations

import gzip
import io
import random
import subprocess
import tarfile
import zlib
from pathlib import Path

import pytest

from evidence.bundle import deflate


@pytest.mark.parametrize("split", [0, 1, 7, 4096, 99_999, 100_000])
def test_crc32_combine_is_zlibs(split: int) -> None:
    data = random.Random(split).randbytes(100_000)
    a, b = data[:split], data[split:]
    assert deflate.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(data)


def _tinfo(name: str, size: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size = size
    return ti


def _bundle(tmp: Path, events: list[bytes], tail: bytes | None = None) -> bytes:
    with open(tmp / "deflated", "w+b") as deflated:
        d = deflate.Deflater(deflated)
        for line in events:
            d.feed(line)
        d.finish()
        out = io.BytesIO()
        deflate.write_tar_gz(
            out,
            [(_tinfo("manifest.json", 5), b"hello")],
            _tinfo("events.ndjson", d.size),
            deflated,
            d,
            [(_tinfo("attestation.json", len(tail)), tail)] if tail is not None else [],
        )
    return out.getvalue()


@pytest.mark.parametrize("n", [0, 1, 30_000])
def test_one_gzip_stream_that_every_reader_takes(tmp_path: Path, n: int) -> None:
    rng = random.Random(n)
    # text that compresses and bytes that do not, past several chunks
    events = [f'{{"seq":{i},"path":"/w/{rng.randbytes(20).hex()}"}}\n'.encode() for i in range(n)]
    raw = _bundle(tmp_path, events, tail=b"signed")
    assert raw == _bundle(tmp_path, events, tail=b"signed")  # the same content, the same bytes
    plain = gzip.decompress(raw)
    d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)  # one member: the bundle reader's way
    assert d.decompress(raw) == plain and d.eof and not d.unused_data
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:gz") as tar:
        assert tar.getnames() == ["manifest.json", "events.ndjson", "attestation.json"]
        assert tar.extractfile("events.ndjson").read() == b"".join(events)  # type: ignore[union-attr]
        assert tar.extractfile("attestation.json").read() == b"signed"  # type: ignore[union-attr]
    assert len(plain) % tarfile.RECORDSIZE == 0  # ended as tarfile ends an archive
    (tmp_path / "b.tar.gz").write_bytes(raw)
    subprocess.run(["gzip", "-t", str(tmp_path / "b.tar.gz")], check=True)
    listed = subprocess.run(
        ["tar", "-tzf", str(tmp_path / "b.tar.gz")], check=True, capture_output=True, text=True
    )
    assert listed.stdout.split() == ["manifest.json", "events.ndjson", "attestation.json"]


def test_a_failing_write_is_raised_not_hidden(tmp_path: Path) -> None:
    class Full(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, b: object) -> int:
            raise OSError(28, "No space left on device")

    d = deflate.Deflater(Full())  # type: ignore[arg-type]
    with pytest.raises(OSError, match="No space"):
        for _ in range(64):
            d.feed(b"x" * deflate.CHUNK)
        d.finish()
    d.abort()
