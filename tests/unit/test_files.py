"""evidence.files: the one atomic write (old content or new, never a part) and the one file hash."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from evidence.files import atomic_write, file_sha256, write_atomic


def test_a_failed_write_leaves_the_old_content_and_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "bundle.tar.gz"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_write(target) as f:
        f.write(b"half of the new")
        raise RuntimeError("disk gone")
    assert target.read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["bundle.tar.gz"]


def test_the_new_content_appears_whole_with_its_mode(tmp_path: Path) -> None:
    target = tmp_path / "key"
    write_atomic(target, b"secret", mode=0o600)
    assert target.read_bytes() == b"secret"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    write_atomic(target, b"public", mode=0o644, fsync=False)
    assert target.read_bytes() == b"public" and stat.S_IMODE(target.stat().st_mode) == 0o644


def test_file_sha256_reads_in_chunks(tmp_path: Path) -> None:
    data = os.urandom(3 * (1 << 20) + 17)
    (tmp_path / "f").write_bytes(data)
    assert file_sha256(tmp_path / "f") == (hashlib.sha256(data).hexdigest(), len(data))
