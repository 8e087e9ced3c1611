"""The bundle container: gzip, tar and JSON parsing within the size, line and depth limits."""

from __future__ import annotations

import dataclasses
import json
import queue
import re
import threading
import zlib
from collections.abc import Callable, Generator, Iterator
from typing import IO, Any

import orjson

from evidence.bundle import canonical
from evidence.bundle import format as fmt

MAX_MANIFEST = fmt.MAX_LINE  # manifest.json is one canonical JSON document, held in memory
BLOCK = 512
_READ = 1 << 18  # compressed bytes read at a time
CHUNK = 1 << 20  # decompressed bytes produced at a time (and about the size of a piece of events)
_TRAILER_ZEROS = 64 * 1024  # zero bytes allowed after the tar end-of-archive marker (record padding)

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(rb"[\[\]{}]")
_TAR_TYPES = {
    b"1": "a hard link",
    b"2": "a symbolic link",
    b"3": "a character device",
    b"4": "a block device",
    b"5": "a directory",
    b"6": "a FIFO",
    b"7": "a contiguous file",
    b"x": "a pax extended header",
    b"g": "a pax global header",
    b"L": "a GNU long name",
    b"K": "a GNU long link name",
    b"S": "a GNU sparse file",
}


@dataclasses.dataclass(frozen=True)
class Limits:
    compressed: int = fmt.MAX_COMPRESSED
    decompressed: int = fmt.MAX_DECOMPRESSED
    events: int = fmt.MAX_EVENTS
    line: int = fmt.MAX_LINE
    depth: int = fmt.MAX_DEPTH
    manifest: int = MAX_MANIFEST
    attestation: int = fmt.MAX_ATTESTATION


class Fatal(Exception):
    """A problem after which nothing further can be read."""


# --- gzip and tar ------------------------------------------------------------------------------


def inflate(f: IO[bytes], limits: Limits, chunk_size: int | None = None) -> Generator[bytes, None, None]:
    """Decompressed chunks of one gzip member (of at most `chunk_size` bytes, default CHUNK),
    counting both sides against the limits."""
    most = CHUNK if chunk_size is None else chunk_size
    d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    read = 0
    produced = 0
    while not d.eof:
        chunk = f.read(_READ)
        if not chunk:
            raise Fatal("truncated gzip stream (the file ends before the gzip trailer)")
        read += len(chunk)
        if read > limits.compressed:
            raise Fatal(f"compressed size exceeds the limit of {limits.compressed} bytes")
        while chunk and not d.eof:
            try:
                out = d.decompress(chunk, most)
            except zlib.error as e:
                raise Fatal(f"corrupt gzip stream: {e}") from None
            chunk = d.unconsumed_tail
            produced += len(out)
            if produced > limits.decompressed:
                raise Fatal(
                    f"decompressed size exceeds the limit of {limits.decompressed} bytes (gzip bomb?)"
                )
            if out:
                yield out
    if d.unused_data or f.read(1):
        raise Fatal("unexpected data after the end of the gzip stream")


class Ahead:
    """Runs a chunk generator in a thread, a few chunks ahead of the consumer: zlib releases the
    GIL, so inflating overlaps with checking events. Exceptions reach the consumer in order."""

    _END = object()

    def __init__(self, chunks: Iterator[bytes], depth: int = 8) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._ended = False
        self._thread = threading.Thread(target=self._run, args=(chunks,), name="bundle-inflate", daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, chunks: Iterator[bytes]) -> None:
        try:
            for chunk in chunks:
                if not self._put(chunk):
                    return
            self._put(self._END)
        except BaseException as e:  # handed to the consumer
            self._put(e)
        finally:
            closer = getattr(chunks, "close", None)
            if closer is not None:
                closer()

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        if self._ended:
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._ended = True
                    raise Fatal("the decompressing thread stopped without a result") from None
        if item is self._END:
            self._ended = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        chunk: bytes = item
        return chunk

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class Stream:
    """Exact reads over the decompressed chunks."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._buf = b""
        self._pos = 0

    def _fill(self) -> bool:
        for chunk in self._chunks:
            self._buf = self._buf[self._pos :] + chunk if self._pos < len(self._buf) else chunk
            self._pos = 0
            return True
        return False

    def read_some(self, n: int) -> bytes:
        """Up to n bytes (at least one unless the stream has ended)."""
        if self._pos >= len(self._buf) and not self._fill():
            return b""
        out = self._buf[self._pos : self._pos + n]
        self._pos += len(out)
        return out

    def read(self, n: int) -> bytes:
        """Exactly n bytes, fewer only at the end of the stream."""
        parts = []
        while n > 0:
            b = self.read_some(n)
            if not b:
                break
            parts.append(b)
            n -= len(b)
        return b"".join(parts)


@dataclasses.dataclass
class Member:
    name: str
    size: int


def _octal(field: bytes, what: str) -> int:
    if field[:1] and field[0] & 0x80:
        raise Fatal(f"tar header {what} uses base-256 encoding")
    text = field.split(b"\0", 1)[0].strip(b" ")
    if not text:
        return 0
    if not re.fullmatch(rb"[0-7]+", text):
        raise Fatal(f"tar header {what} is not an octal number")
    return int(text, 8)


def header(block: bytes) -> Member | None:
    """The member a 512-byte header describes, or None for an all-zero (end-of-archive) block."""
    if len(block) < BLOCK:
        raise Fatal("truncated tar archive (a header is cut short)")
    if block == bytes(BLOCK):
        return None
    stored = _octal(block[148:156], "checksum")
    if stored != sum(block[:148]) + 8 * 32 + sum(block[156:]):
        raise Fatal("tar header checksum mismatch (not a tar archive, or corrupt)")
    if block[257:262] != b"ustar":
        raise Fatal("not a ustar tar archive")
    raw_name = block[0:100].split(b"\0", 1)[0]
    prefix = block[345:500].split(b"\0", 1)[0]
    if prefix:
        raw_name = prefix + b"/" + raw_name
    try:
        name = raw_name.decode("utf-8")
    except UnicodeDecodeError:
        raise Fatal(f"member name {raw_name!r} is not valid UTF-8") from None
    shown = json.dumps(name)
    if name.startswith("/"):
        raise Fatal(f"member name {shown} is an absolute path")
    if ".." in name.replace("\\", "/").split("/"):
        raise Fatal(f"member name {shown} escapes the archive ('..')")
    kind = block[156:157]
    if kind not in (b"0", b"\0"):
        what = _TAR_TYPES.get(kind, f"of unsupported type {kind!r}")
        raise Fatal(f"member {shown} is {what}; a bundle holds only regular files")
    return Member(name, _octal(block[124:136], "size"))


# --- JSON ----------------------------------------------------------------------------------------


def _depth(line: bytes) -> int:
    depth = top = 0
    for m in _BRACKETS.finditer(_STRING.sub(b"", line)):
        depth += 1 if m.group() in (b"[", b"{") else -1
        top = max(top, depth)
    return top


def _duplicate_key(line: bytes) -> str | None:
    found: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen = set()
        for k, _ in items:
            if k in seen and not found:
                found.append(k)
            seen.add(k)
        return dict(items)

    try:
        json.loads(line, object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return None
    return found[0] if found else None


def parse(line: bytes, what: str, limits: Limits) -> Any:
    """Decode one canonical JSON document; raises Fatal with the reason."""
    if line.count(b"[") + line.count(b"{") > limits.depth and _depth(line) > limits.depth:
        raise Fatal(f"{what}: JSON nested deeper than {limits.depth} levels")
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as u:
            raise Fatal(f"{what}: invalid UTF-8 at byte {u.start}") from None
        raise Fatal(f"{what}: invalid JSON: {e}") from None
    try:
        again = canonical.dumps(value)
    except canonical.CanonicalError as e:
        raise Fatal(f"{what}: not canonical JSON: {e}") from None
    if again != line:
        dup = _duplicate_key(line)
        if dup is not None:
            raise Fatal(f"{what}: duplicate JSON key {json.dumps(dup)}")
        raise Fatal(f"{what}: not canonical JSON (sorted keys, no whitespace, minimal escapes)")
    return value


# --- the end of the archive, the events in pieces -------------------------------------------------


def unexpected(member: Member, *, attested: bool = False) -> Fatal:
    """The error for a member found where it has no place (`attested`: after the attestation)."""
    name = json.dumps(member.name)
    if member.name == fmt.ATTESTATION_NAME and not attested:
        return Fatal(f"{name} must be the last member, right after {fmt.EVENTS_NAME}")
    if member.name in (*fmt.MEMBERS, fmt.ATTESTATION_NAME):
        return Fatal(f"duplicate member {name}")
    allowed = ", ".join(fmt.MEMBERS)
    return Fatal(
        f"unexpected member {name} (a bundle holds only {allowed}, and {fmt.ATTESTATION_NAME} if signed)"
    )


def check_trailer(s: Stream, first: bytes | None = None, *, attested: bool = False) -> None:
    """What follows the last member: the end-of-archive marker and padding, nothing else. `first`:
    the block after the last member, when the caller has read it already; `attested`: the last
    member was the attestation."""
    zeros = 0
    while True:
        block = first if first is not None else s.read(BLOCK)
        first = None
        if not block:
            break
        if block != bytes(len(block)):
            if zeros < 2 * BLOCK and len(block) == BLOCK:
                member = header(block)
                if member is None:  # (an all-zero block is handled above)
                    raise Fatal("unexpected data after the end of the tar archive")
                raise unexpected(member, attested=attested)
            raise Fatal("unexpected data after the end of the tar archive")
        zeros += len(block)
        if zeros > _TRAILER_ZEROS:
            raise Fatal("unexpected data after the end of the tar archive (too much padding)")
    if zeros < 2 * BLOCK:
        raise Fatal("truncated tar archive (no end-of-archive marker)")


def whole_lines(s: Stream, size: int, limits: Limits, hashing: Callable[[bytes], None]) -> Iterator[bytes]:
    """events.ndjson (the next `size` bytes) in pieces of whole lines, handing its bytes to
    `hashing` as they pass."""
    leftover = b""
    remaining = size
    while remaining:
        chunk = s.read_some(min(remaining, CHUNK))
        if not chunk:
            raise Fatal(f"truncated tar archive (inside {fmt.EVENTS_NAME})")
        remaining -= len(chunk)
        hashing(chunk)
        cut = chunk.rfind(b"\n") + 1
        if cut:
            piece = leftover + chunk[:cut] if leftover or cut < len(chunk) else chunk
            leftover = chunk[cut:]
        else:
            piece, leftover = b"", leftover + chunk
        if len(leftover) > limits.line:
            raise Fatal(f"{fmt.EVENTS_NAME}: a line is longer than {limits.line} bytes")
        if piece:
            yield piece
    if leftover:
        raise Fatal(f"{fmt.EVENTS_NAME} does not end with a newline")
