"""A private tmp per run: a 0700 directory, TMPDIR/TMP/TEMP pointing at it, removed afterwards."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator, Mapping

logger = logging.getLogger(__name__)

TMP_VARIABLES = ("TMPDIR", "TMP", "TEMP")


def create_private_tmp(base: str | None = None, prefix: str = "evidence-run-") -> str:
    """Create the run's private tmp (mode 0700, owned by the caller) and return its canonical path."""
    path = tempfile.mkdtemp(prefix=prefix, dir=base)
    os.chmod(path, 0o700)
    return os.path.realpath(path)


def tmp_environ(environ: Mapping[str, str], path: str) -> dict[str, str]:
    """A copy of environ with TMPDIR, TMP and TEMP set to path."""
    env = dict(environ)
    for name in TMP_VARIABLES:
        env[name] = path
    return env


def chown_private_tmp(path: str, uid: int, gid: int) -> None:
    """Give the private tmp to the user the command runs as (when it is not the recorder's user)."""
    os.chown(path, uid, gid)


def _make_writable(func: object, path: str, exc: BaseException) -> None:
    # A run may leave read-only directories behind: make the parent writable and retry once.
    parent = os.path.dirname(path)
    try:
        os.chmod(parent, stat.S_IRWXU)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, stat.S_IRWXU)
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except OSError as e:
        logger.warning("cannot remove %s from the private tmp: %s", path, e)


def remove_private_tmp(path: str) -> None:
    """Remove the private tmp and everything in it (symlinks are removed, never followed)."""
    if not os.path.lexists(path):
        return
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=_make_writable)
    else:
        shutil.rmtree(path, onerror=lambda f, p, ei: _make_writable(f, p, ei[1]))


@contextlib.contextmanager
def private_tmp(base: str | None = None) -> Iterator[str]:
    path = create_private_tmp(base)
    try:
        yield path
    finally:
        remove_private_tmp(path)
