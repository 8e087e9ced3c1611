"""Writing files so that a reader sees the old content or the new, never a part, and hashing them.

`atomic_write` is the one temp-file-and-rename in the code base: the temp file is made beside the
target (same file system), written, flushed and (by default) fsynced with its directory, given its
mode, then renamed over the target. On any error the temp file is removed and the target is
untouched, so data already written is never lost or half replaced.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

_CHUNK = 1 << 20


@contextlib.contextmanager
def atomic_write(
    path: str | os.PathLike[str], *, mode: int = 0o644, fsync: bool = True
) -> Iterator[BinaryIO]:
    """`with atomic_write(p) as f: f.write(...)`: p appears whole when the block ends without error.
    `fsync` (bundles, keys, run metadata) makes the content and the rename durable before returning."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=".evidence-", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if fsync:
        _fsync_dir(target.parent)


def write_atomic(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o644, fsync: bool = True) -> None:
    with atomic_write(path, mode=mode, fsync=fsync) as f:
        f.write(data)


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # some file systems refuse to open or sync a directory
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def file_sha256(path: str | os.PathLike[str]) -> tuple[str, int]:
    """The sha256 (hex) and size of a file, read in chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size
