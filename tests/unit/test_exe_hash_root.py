"""Program hashes read names as the run's processes see them (exe_hash.open_in, RunHashes.in_root_of):
from the run's root, not the recorder's. A directory stands in for the run's root here (no
privilege): a name in it is that directory's file, never the file of the same name outside it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from evidence.agent.recorder import exe_hash


@pytest.fixture
def two_roots(tmp_path: Path) -> tuple[Path, int]:
    """`tmp_path/run` as the run's root, holding /prog (a binary-looking file) and a symlink
    /abs -> /prog; the same name at the recorder's side (`tmp_path/prog`) is a script."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "prog").write_bytes(b"\x7fELF the run's own program")
    (run / "abs").symlink_to("/prog")  # absolute: stays in the run's root
    (tmp_path / "prog").write_text("#!/bin/sh\necho the host's\n")
    return tmp_path, os.open(run, os.O_PATH | os.O_DIRECTORY)


def test_a_name_is_read_in_the_runs_root(two_roots: tuple[Path, int]) -> None:
    outside, root = two_roots
    try:
        got = exe_hash.read_head("/prog", 64, root)
        assert got is not None and got[0].startswith(b"\x7fELF")
        via_link = exe_hash.read_head("/abs", 64, root)
        assert via_link is not None and via_link[0] == got[0]
        up = exe_hash.read_head("/../../prog", 64, root)  # `..` stays in the root
        assert up is not None and up[0] == got[0]
        assert exe_hash.read_head(str(outside / "prog"), 64) is not None  # no root: read here
    finally:
        os.close(root)


def test_a_gone_process_is_hashed_by_its_name_in_the_runs_root(two_roots: tuple[Path, int]) -> None:
    _, root = two_roots
    try:
        h = exe_hash.ExeHasher(proc_root="/nonexistent")  # the process is gone: by its name
        fields = h.hash_exec(1, "/prog", None, root)
    finally:
        os.close(root)
    assert fields.get("sha256") == hashlib.sha256(b"\x7fELF the run's own program").hexdigest()
    assert "interpreter" not in fields  # the run's file is no script, whatever is outside


def test_a_name_through_proc_is_read_here(tmp_path: Path) -> None:
    """The correlator names the program of a process in a namespace of its own through its
    /proc/PID/root, a magic link: read here, as before."""
    (tmp_path / "x").write_bytes(b"here")
    root = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    try:
        name = f"/proc/self/root{tmp_path}/x"
        got = exe_hash.read_head(name, 16, root)
    finally:
        os.close(root)
    assert got is not None and got[0] == b"here"


def test_run_hashes_read_names_in_the_root_of_the_runs_first_process(tmp_path: Path) -> None:
    """`in_root_of` takes a process's root (ours here: "/"); a pid that names nothing keeps what was."""
    prog = tmp_path / "p"
    prog.write_bytes(b"\x7fELF ours")
    hasher = exe_hash.Hasher(exe_hash.ExeHasher(proc_root=str(tmp_path / "no-proc")), workers=1)
    run = hasher.run("r")
    try:
        run.in_root_of(os.getpid())
        run.in_root_of(-1)  # unreadable: the root taken before stays
        got = run(7, str(prog))
        fields = got.future.result(30) if isinstance(got, exe_hash.Pending) else got
    finally:
        run.close()
        hasher.close()
    assert fields.get("sha256") == hashlib.sha256(b"\x7fELF ours").hexdigest(), fields
