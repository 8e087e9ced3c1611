"""Writing files so that a reader sees the old content or the new, never a part, and hashing them;
directories only the recorder may enter.

`atomic_write` is the one temp-file-and-rename in the code base: the temp file is made beside the
target (same file system), written, flushed and (by default) fsynced with its directory, given its
mode, then renamed over the target. On any error the temp file is removed and the target is
untouched, so data already written is never lost or half replaced.

`private_dir` is where the recorder keeps what jobs must neither change nor read (spools, run
records, bundles, undelivered events): modes are set explicitly, never left to the umask (an agent
started with umask 0 made its bundle directory 0777).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

logger = logging.getLogger(__name__)

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


def private_dir(path: Path) -> Path:
    """`path` as a directory only this user may enter: made 0700 (missing parents 0755), whatever
    the umask. Refuses (OSError) a symlink, another user's directory, or one that group or others
    may write to (what is in it cannot be trusted). One that group or others may only read or enter
    (a bundle directory of an older agent: 0755, its bundles 0644) is made 0700, and the files in
    it that group or others may read are made 0600."""
    missing = [p for p in (path, *path.parents) if not os.path.lexists(p)]
    for p in reversed(missing):
        with contextlib.suppress(FileExistsError):
            p.mkdir(mode=0o700 if p == path else 0o755)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(errno.ENOTDIR, "not a directory", str(path))
    if st.st_uid != os.geteuid():
        raise OSError(errno.EPERM, f"belongs to uid {st.st_uid}, not to this user", str(path))
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise OSError(errno.EPERM, f"is writable by others (mode {mode:o}): make it 0700", str(path))
    if mode & 0o077:
        logger.warning("%s could be read by others (mode %o): made 0700", path, mode)
        os.chmod(path, 0o700)
    _tighten_files(path)
    return path


def _tighten_files(directory: Path) -> None:
    """Make the regular files of this user in `directory` that group or others may read 0600
    (through a descriptor: never a symlink's target)."""
    for entry in os.scandir(directory):
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or not st.st_mode & 0o077:
                continue
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o700)
        finally:
            os.close(fd)
