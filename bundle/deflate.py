"""The bundle's tar.gz, with its big member deflated on both cores while the events are made.

A bundle is one gzip member holding a tar: the manifest, the events, maybe the attestation. The
manifest comes first and holds the events' hash and size, so it is known only once every event is;
the events, which are nearly all of the bytes, are known long before. `Deflater` cuts the events
into chunks of exactly CHUNK bytes (where the feeds fall does not matter: the same events, the same
chunks) and deflates them on a pool of threads, each chunk with the 32 KiB before it as its preset
dictionary and sync-flushed, as pigz does (zlib and hashlib let go of the GIL on big buffers); the
sha256 of the events is taken on a thread of its own, in order, and their CRC-32 is combined from
the chunks' (`crc32_combine`, zlib's own method). `write_tar_gz` then puts one gzip stream together
around them: the manifest's part deflated and sync-flushed (which ends it on a byte boundary), the
events' chunks, and the closing part deflated to the end. The bytes depend on the content only, so
a bundle stays deterministic (for one deflate: its level-1 output is what the bytes are).

The events' chunks are deflated by ISA-L (python-isal, the agent extra's) when it is installed: its
level 1 deflates event lines about 4 times as fast as zlib's level 1 into as many bytes (a full
detail run's 600 MB of events in about 0.4 s of CPU instead of 1.4, at the run's end); else by zlib.
LEVEL is 1: zlib's fastest, 3 to 4 times level 6's speed on event lines for 20 to 30 % more bytes
(event lines repeat their keys and the run's constants: level 6 finds little more).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import queue
import struct
import tarfile
import threading
import types
import zlib
from collections import deque
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from concurrent.futures import Future

_zlib: types.ModuleType
try:  # ISA-L's deflate (the agent extra's `isal`): level 1 at about 4 times zlib's level 1, as small
    from isal import isal_zlib as _zlib
except ImportError:  # pragma: no cover - a plain install writes no bundle of a recording
    _zlib = zlib

LEVEL = 1
CHUNK = 1 << 20  # the events are deflated in chunks of exactly this many bytes (the last: what is left)
WINDOW = 32 * 1024  # the preset dictionary of a chunk: the end of the chunk before it
WORKERS = 2  # deflating threads (the machine's cores, for a recorder: the job is done by then)
IN_FLIGHT = 6  # chunks handed over and not written yet, at most (memory: this many CHUNKs)
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


def _zeros_operator(length: int) -> list[int]:
    """The GF(2) matrix that appends `length` zero bytes to a CRC-32 (zlib's crc32_combine, whose
    loop this is, kept as one matrix so that it can be applied again and again)."""
    odd = [0xEDB88320] + [1 << n for n in range(31)]  # the operator for one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four
    op = [1 << n for n in range(32)]  # the identity
    while length:
        even = _gf2_square(odd)
        if length & 1:
            op = [_gf2_times(even, v) for v in op]
        length >>= 1
        if not length:
            break
        odd = _gf2_square(even)
        if length & 1:
            op = [_gf2_times(odd, v) for v in op]
        length >>= 1
    return op


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from crc32(A), crc32(B) and len(B) (zlib's crc32_combine)."""
    if len2 <= 0:
        return crc1
    return _gf2_times(_zeros_operator(len2), crc1) ^ crc2


@functools.cache
def _chunk_zeros() -> list[int]:
    """A whole chunk's zeros operator: one matrix product per chunk combined (made once, when the
    first bundle is written: not at import, which every `evidence run` pays)."""
    return _zeros_operator(CHUNK)


def _deflate(chunk: bytes | memoryview, zdict: bytes | None, level: int) -> tuple[bytes, int]:
    """A chunk deflated (its preset dictionary `zdict`) and sync-flushed, and its CRC-32."""
    z = (
        _zlib.compressobj(level, zlib.DEFLATED, _RAW)
        if zdict is None
        else _zlib.compressobj(level, zlib.DEFLATED, _RAW, zdict=zdict)
    )
    return z.compress(chunk) + z.flush(zlib.Z_SYNC_FLUSH), _zlib.crc32(chunk)


class Deflater:
    """Deflates what is fed to it into `out` on threads of their own, with its sha256, CRC-32 and
    size. `feed` hands over whole chunks and blocks when the threads are behind (IN_FLIGHT chunks
    at most wait in memory); `compressed_bound` is an upper bound on the deflated size so far."""

    def __init__(self, out: IO[bytes], level: int = LEVEL) -> None:
        self.out = out
        self.level = level
        self.sha = hashlib.sha256()
        self.crc = 0
        self.size = 0
        self.compressed = 0
        self._pending = 0  # fed, not yet deflated and written
        self._buf: list[bytes] = []
        self._buffered = 0
        self._zdict: bytes | None = None  # the end of the last chunk handed over
        self._flight: deque[tuple[int, Future[tuple[bytes, int]]]] = deque()
        from concurrent.futures import ThreadPoolExecutor  # (imported when a bundle is written)

        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="evidence-deflate")
        self._hashing: queue.Queue[bytes | memoryview | None] = queue.Queue(maxsize=IN_FLIGHT)
        self._error: BaseException | None = None
        self._hasher = threading.Thread(target=self._hash, name="evidence-sha256", daemon=True)
        self._hasher.start()
        self._done = False

    def feed(self, data: bytes) -> None:
        """Hand `data` over after what was fed before, in whole chunks (CHUNK bytes of the stream,
        wherever its feeds were cut): a chunk begun before is filled from `data`'s start, the whole
        chunks after it handed over as views of `data` (never copied: the premade lines, 4 MiB a
        feed after the head events' few hundred bytes, were joined to what was buffered, 1.3 GB
        copied for a 2 x 1M flood), and what is left is kept for the next."""
        self._pending += len(data)
        at = 0
        if self._buffered:
            need = CHUNK - self._buffered
            if len(data) < need:
                self._buf.append(data)
                self._buffered += len(data)
                return
            self._buf.append(data[:need])
            self._hand_over(b"".join(self._buf))
            self._buf = []
            self._buffered = 0
            at = need
        view = memoryview(data)
        whole = at + (len(data) - at) // CHUNK * CHUNK
        for i in range(at, whole, CHUNK):
            self._hand_over(view[i : i + CHUNK])
        if whole < len(data):
            self._buf.append(data[whole:])
            self._buffered = len(data) - whole

    def compressed_bound(self) -> int:
        """The deflated size of everything fed so far, at most (what is not deflated yet counts at
        its own size: deflate never grows text by more than a few bytes a block)."""
        return self.compressed + self._pending + self._pending // 64 + 64 * (len(self._flight) + 1)

    def finish(self) -> str:
        """Deflate what is left and end the stream on a byte boundary; the events' sha256 (hex)."""
        if self._buffered:
            self._hand_over(b"".join(self._buf))
            self._buf.clear()
            self._buffered = 0
        while self._flight:
            self._write_oldest()
        if self.size == 0:  # nothing fed: the stream is one empty block, sync-flushed
            empty = zlib.compressobj(self.level, zlib.DEFLATED, _RAW).flush(zlib.Z_SYNC_FLUSH)
            self.out.write(empty)
            self.compressed += len(empty)
        self._put_hash(None)
        self._hasher.join()
        self._pool.shutdown()
        self._done = True
        if self._error is not None:
            raise self._error
        return self.sha.hexdigest()

    def abort(self) -> None:
        """Stop the threads without finishing (the bundle is not written)."""
        self._buf.clear()
        for _, fut in self._flight:
            fut.cancel()
        self._flight.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._hasher.is_alive():
            with contextlib.suppress(BaseException):  # its own error is raised by finish, or not wanted
                self._put_hash(None)
            self._hasher.join(timeout=5)

    def _hand_over(self, chunk: bytes | memoryview) -> None:
        if self._error is not None:
            raise self._error
        while len(self._flight) >= IN_FLIGHT:
            self._write_oldest()
        self._flight.append((len(chunk), self._pool.submit(_deflate, chunk, self._zdict, self.level)))
        self._zdict = bytes(chunk[-WINDOW:])
        self._put_hash(chunk)

    def _write_oldest(self) -> None:
        n, fut = self._flight.popleft()
        packed, crc = fut.result()
        self.out.write(packed)
        # a whole chunk's CRC is combined by one precomputed matrix (the last may be shorter)
        self.crc = (
            (_gf2_times(_chunk_zeros(), self.crc) ^ crc) if n == CHUNK else crc32_combine(self.crc, crc, n)
        )
        self.size += n
        self.compressed += len(packed)
        self._pending -= n

    def _put_hash(self, item: bytes | memoryview | None) -> None:
        while True:
            if self._error is not None:
                raise self._error
            try:
                self._hashing.put(item, timeout=0.2)
                return
            except queue.Full:
                if not self._hasher.is_alive():
                    raise self._error or RuntimeError("the hashing thread stopped") from None

    def _hash(self) -> None:
        try:
            while (chunk := self._hashing.get()) is not None:
                self.sha.update(chunk)
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
