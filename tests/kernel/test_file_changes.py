"""Hole 3 of the escape review: file changes that are not opens left no trace (a root-owned
world-writable file was truncated; a hardlink hid which file was written). Each is now a
dev.evidence.file.change event with absolute paths (both for rename and link), its result, and in
summary mode counted like opens. Performed by an unprivileged job (nobody)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kernel.util import PY, evidence, of_type, record

NOBODY = 65534
AS_NOBODY = ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--")

JOB = r"""
import os, sys
d = sys.argv[1]
victim = d + "/victim"          # root's, world-writable, in a directory only root can write
os.chdir(d + "/w")              # nobody's directory: relative names resolve against it
os.link(victim, "alias")        # a hardlink to root's file ...
with open("alias", "w") as f:   # ... and a write through it
    f.write("through the link")
os.truncate(victim, 0)          # a truncate of the world-writable file
for name in ("new", "old"):
    with open(name, "w") as f:
        f.write(name)
w = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
os.rename("new", "old", src_dir_fd=w, dst_dir_fd=w)  # renameat over a file, through a dirfd
os.unlink("old")
for attempt in (lambda: os.chmod(victim, 0o777), lambda: os.chown(victim, NOBODY, NOBODY)):
    try:
        attempt()
    except PermissionError:
        pass
open("mine", "w").close()
os.chmod("mine", 0o600)         # one's own file: allowed
os.mkdir("sub")
os.rmdir("sub")
os.symlink("../victim", "sl")
""".replace("NOBODY", str(NOBODY))


@pytest.fixture
def place() -> Iterator[Path]:
    """A directory nobody can enter but not write, holding root's world-writable `victim`, and
    nobody's own directory `w`."""
    d = Path(tempfile.mkdtemp(prefix="evidence-changes-"))
    try:
        d.chmod(0o755)
        victim = d / "victim"
        victim.write_text("root's data")
        victim.chmod(0o666)
        (d / "w").mkdir()
        os.chown(d / "w", NOBODY, NOBODY)
        yield d
    finally:
        shutil.rmtree(d)


def _changes(events: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(e["data"]["operation"], e["data"]["path"]): e["data"] for e in of_type(events, "file.change")}


@pytest.mark.parametrize("detail", ["summary", "full"])
def test_file_changes_by_an_unprivileged_job_are_recorded(tmp_path: Path, place: Path, detail: str) -> None:
    proc, manifest, events = record(
        tmp_path, *AS_NOBODY, PY, "-S", "-c", JOB, str(place), extra=("--detail", detail)
    )
    assert proc.returncode == 0, proc.stderr
    d, w = str(place), str(place / "w")
    ch = _changes(events)
    link = ch[("link", f"{d}/victim")]
    assert (link["target"], link["raw_path"], link["result"]) == (f"{w}/alias", f"{d}/victim", 0)
    writes = [e["data"] for e in of_type(events, "file.open") if e["data"]["path"] == f"{w}/alias"]
    assert any("write" in o["access"] and o["result"] == 0 for o in writes)
    assert ch[("truncate", f"{d}/victim")]["result"] == 0
    rename = ch[("rename", f"{w}/new")]
    assert (rename["target"], rename["raw_path"], rename["result"]) == (f"{w}/old", "new", 0)
    assert ch[("unlink", f"{w}/old")]["result"] == 0
    assert ch[("chmod", f"{d}/victim")]["result"] == "EPERM"
    assert ch[("chmod", f"{d}/victim")]["mode"] == 0o777
    chown = ch[("chown", f"{d}/victim")]
    assert (chown["uid"], chown["gid"], chown["result"]) == (NOBODY, NOBODY, "EPERM")
    assert ch[("chmod", f"{w}/mine")]["result"] == 0
    assert ch[("mkdir", f"{w}/sub")]["result"] == 0 and ch[("rmdir", f"{w}/sub")]["result"] == 0
    sl = ch[("symlink", f"{w}/sl")]
    assert (sl["target"], sl["result"]) == ("../victim", 0)
    assert all(e["data"]["count"] == 1 for e in of_type(events, "file.change"))


def test_repeated_changes_are_counted_in_summary(tmp_path: Path, place: Path) -> None:
    job = "import os\nfor _ in range(50):\n    os.close(os.open('f', os.O_CREAT | os.O_WRONLY, 0o644)); os.unlink('f')"
    proc, _, events = record(tmp_path, *AS_NOBODY, PY, "-S", "-c", job, cwd=place / "w")
    assert proc.returncode == 0, proc.stderr
    unlinks = [e["data"] for e in of_type(events, "file.change") if e["data"]["operation"] == "unlink"]
    assert [(u["path"], u["count"]) for u in unlinks] == [(str(place / "w" / "f"), 50)]


def test_profile_of_changes_allows_their_directory(tmp_path: Path, place: Path) -> None:
    job = "import os\nopen('a', 'w').close()\nos.rename('a', 'b')\nos.unlink('b')"
    proc, _, _ = record(tmp_path, *AS_NOBODY, PY, "-S", "-c", job, cwd=place / "w")
    assert proc.returncode == 0, proc.stderr
    prof = evidence("profile", str(tmp_path / "run.tar.gz"), "--workspace", "/nonexistent-ws")
    assert prof.returncode == 0, prof.stderr
    assert str(place / "w") in prof.stdout


def test_distinct_changes_past_the_cap_are_counted_not_kept(tmp_path: Path, place: Path) -> None:
    job = "import os\nfor i in range(40):\n    for _ in range(2):\n        try: os.unlink(f'gone{i}')\n        except OSError: pass"
    env = {**os.environ, "EVIDENCE_MAX_DISTINCT": "1000"}
    proc, manifest, events = record(tmp_path, *AS_NOBODY, PY, "-S", "-c", job, cwd=place / "w", env=env)
    assert proc.returncode == 0, proc.stderr
    kept = [e["data"] for e in of_type(events, "file.change") if "/gone" in e["data"]["path"]]
    assert len(kept) == 40 and {k["count"] for k in kept} == {2}
    env["EVIDENCE_MAX_DISTINCT"] = "10"
    proc, manifest, events = record(
        tmp_path, *AS_NOBODY, PY, "-S", "-c", job, cwd=place / "w", env=env, name="cap.tar.gz"
    )
    kept = [e["data"] for e in of_type(events, "file.change") if "/gone" in e["data"]["path"]]
    past = manifest["lost"]["by_kind"].get("change_past_cap", 0)
    assert sum(k["count"] for k in kept) + past == 80 and len(kept) <= 10 and past >= 60
