"""The bundle's tar.gz, with its big member deflated on a second core while the events are made.

A bundle is one gzip member holding a tar: the manifest, the events, maybe the attestation. The
manifest comes first and holds the events' hash and size, so it is known only once every event is;
the events, which are nearly all of the bytes, are known long before. `Deflater` deflates the
events in a thread as they are made (zlib and hashlib let go of the GIL on big buffers), and
`write_tar_gz` then puts one gzip stream together around them: the manifest's part deflated and
sync-flushed (which ends it on a byte boundary), the events' deflate, sync-flushed too, and the
closing part deflated to the end. This is how pigz joins deflate streams compressed apart; the
trailer's CRC-32 is combined from the parts' (`crc32_combine`, zlib's own method). The bytes depend
on the content only (chunks are cut at the same places for the same events), so a bundle stays
deterministic.
"""

from __future__ import annotations

import contextlib
import hashlib
import queue
import struct
import tarfile
import threading
import zlib
from typing import IO

LEVEL = 6
CHUNK = 1 << 20  # the events are deflated in chunks of at least this many bytes
_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"  # deflate, no name, mtime 0, OS unknown
_RAW = -zlib.MAX_WBITS  # a raw deflate stream: the gzip framing is written here


def _gf2_times(mat: list[int], vec: int) -> int:
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from crc32(A), crc32(B) and len(B) (zlib's crc32_combine)."""
    if len2 <= 0:
        return crc1
    odd = [0xEDB88320] + [1 << n for n in range(31)]  # the operator for one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four
    while True:
        even = _gf2_square(odd)  # apply len2 zero bytes to crc1, one bit of len2 at a time
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


class Deflater:
    """Deflates what is fed to it into `out` on a thread of its own, with its sha256, CRC-32 and
    size. `feed` hands over whole chunks and blocks when the thread is behind (a few chunks at most
    wait in memory); `compressed_bound` is an upper bound on the deflated size so far."""

    def __init__(self, out: IO[bytes], level: int = LEVEL) -> None:
        self.out = out
        self.sha = hashlib.sha256()
        self.crc = 0
        self.size = 0
        self.compressed = 0
        self._pending = 0  # fed, not yet deflated
        self._buf: list[bytes] = []
        self._buffered = 0
        self._z = zlib.compressobj(level, zlib.DEFLATED, _RAW)
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=4)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="evidence-deflate", daemon=True)
        self._thread.start()

    def feed(self, data: bytes) -> None:
        self._buf.append(data)
        self._buffered += len(data)
        self._pending += len(data)
        if self._buffered >= CHUNK:
            self._hand_over()

    def compressed_bound(self) -> int:
        """The deflated size of everything fed so far, at most (what is not deflated yet counts at
        its own size: deflate never grows text by more than a few bytes a block)."""
        return self.compressed + self._pending + self._pending // 64 + 64

    def finish(self) -> str:
        """Deflate what is left and end the stream on a byte boundary; the events' sha256 (hex)."""
        self._hand_over()
        self._put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.sha.hexdigest()

    def abort(self) -> None:
        """Stop the thread without finishing (the bundle is not written)."""
        self._buf.clear()
        if self._thread.is_alive():
            with contextlib.suppress(BaseException):  # its own error is raised by finish, or not wanted
                self._put(None)
            self._thread.join(timeout=5)

    def _hand_over(self) -> None:
        if self._buf:
            chunk = b"".join(self._buf)
            self._buf.clear()
            self._buffered = 0
            self._put(chunk)

    def _put(self, item: bytes | None) -> None:
        while True:
            if self._error is not None:
                raise self._error
            try:
                self._queue.put(item, timeout=0.2)
                return
            except queue.Full:
                if not self._thread.is_alive():
                    raise self._error or RuntimeError("the deflate thread stopped") from None

    def _run(self) -> None:
        try:
            while True:
                chunk = self._queue.get()
                if chunk is None:
                    tail = self._z.flush(zlib.Z_SYNC_FLUSH)
                    self.out.write(tail)
                    self.compressed += len(tail)
                    return
                self.sha.update(chunk)
                self.crc = zlib.crc32(chunk, self.crc)
                packed = self._z.compress(chunk)
                self.out.write(packed)
                self.size += len(chunk)
                self.compressed += len(packed)
                self._pending -= len(chunk)
        except BaseException as e:  # handed to the feeding thread
            self._error = e


def _part(data: bytes, final: bool) -> bytes:
    z = zlib.compressobj(LEVEL, zlib.DEFLATED, _RAW)
    return z.compress(data) + z.flush(zlib.Z_FINISH if final else zlib.Z_SYNC_FLUSH)


def _pad(size: int) -> bytes:
    return tarfile.NUL * (-size % tarfile.BLOCKSIZE)


def write_tar_gz(
    out: IO[bytes],
    head: list[tuple[tarfile.TarInfo, bytes]],
    big: tarfile.TarInfo,
    deflated: IO[bytes],
    deflater: Deflater,
    tail: list[tuple[tarfile.TarInfo, bytes]],
) -> None:
    """One gzip stream of a USTAR tar: the members of `head`, then `big` whose data `deflater`
    deflated into `deflated` (a finished Deflater), then those of `tail`; the end of the archive as
    tarfile writes it (two zero blocks, then zeros to a whole record)."""
    prefix = b"".join(ti.tobuf(tarfile.USTAR_FORMAT) + data + _pad(len(data)) for ti, data in head)
    prefix += big.tobuf(tarfile.USTAR_FORMAT)
    suffix = _pad(deflater.size)
    suffix += b"".join(ti.tobuf(tarfile.USTAR_FORMAT) + data + _pad(len(data)) for ti, data in tail)
    suffix += tarfile.NUL * (2 * tarfile.BLOCKSIZE)
    total = len(prefix) + deflater.size + len(suffix)
    suffix += tarfile.NUL * (-total % tarfile.RECORDSIZE)
    total = len(prefix) + deflater.size + len(suffix)
    out.write(_GZIP_HEADER)
    out.write(_part(prefix, final=False))
    deflated.seek(0)
    while chunk := deflated.read(CHUNK):
        out.write(chunk)
    out.write(_part(suffix, final=True))
    crc = crc32_combine(
        crc32_combine(zlib.crc32(prefix), deflater.crc, deflater.size), zlib.crc32(suffix), len(suffix)
    )
    out.write(struct.pack("<II", crc, total & 0xFFFFFFFF))
