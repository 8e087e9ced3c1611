"""Hashes of what ran (agent/recorder/exe_hash.py), recorded for real from an unprivileged job: a
program replaced at the same path between two runs of it, a `#!` script, a program from /tmp (lint's
EV009 note), and `diff` between two runs whose program changed."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kernel.util import evidence, of_type, record

AS_NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--")


def sha(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture
def jobdir() -> Iterator[Path]:
    """A directory under /tmp the unprivileged job can write (pytest's tmp_path is root's 0700)."""
    d = Path(tempfile.mkdtemp(prefix="exe-hash-", dir="/tmp"))
    d.chmod(0o777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_replaced_program_script_and_temp_note(tmp_path: Path, jobdir: Path) -> None:
    sleep, cat = shutil.which("sleep"), shutil.which("cat")
    assert sleep and cat
    sh = os.path.realpath("/bin/sh")
    prog, script = jobdir / "prog", jobdir / "build.sh"
    # the second program is `sleep` with a byte more at its end: another file, another hash; each
    # lives long enough to be read through /proc/<pid>/exe (one gone already is read by its path)
    job = (
        f"cp {sleep} {prog} && {prog} 0.3 && (cat {sleep}; echo) > {prog}.new && chmod +x {prog}.new && "
        f"mv {prog}.new {prog} && {prog} 0.3; "
        f"printf '#!/bin/sh\\necho from-script\\n' > {script} && chmod +x {script} && {script}; "
        f"{cat} /dev/null"
    )
    proc, _, events = record(tmp_path, *AS_NOBODY, "/bin/sh", "-c", job)
    assert proc.returncode == 0, proc.stderr
    assert "from-script" in proc.stdout
    execs = [e["data"] for e in of_type(events, "process.exec") if e["data"]["result"] == 0]
    ran = [d for d in execs if d["filename"] == str(prog)]
    second = hashlib.sha256(Path(sleep).read_bytes() + b"\n").hexdigest()
    assert [d["sha256"] for d in ran] == [sha(sleep), second], ran
    assert [d["hash_source"] for d in ran] == ["exe", "exe"]
    assert [d["size"] for d in ran] == [os.path.getsize(sleep), os.path.getsize(sleep) + 1]
    cats = [d for d in execs if d["filename"] == cat]
    assert cats and all(d["sha256"] == sha(cat) and d["size"] == os.path.getsize(cat) for d in cats)
    (s,) = [d for d in execs if d["filename"] == str(script)]
    assert s["sha256"] == sha(script) and s["hash_source"] == "path"
    assert s["interpreter"] == "/bin/sh" and s["interpreter_sha256"] == sha(sh)
    assert all("sha256" in d or "not_hashed" in d for d in execs)

    lint = evidence("lint", "--format", "json", "--fail-on", "none", str(tmp_path / "run.tar.gz"))
    assert lint.returncode == 0, lint.stderr
    notes = [f for f in json.loads(lint.stdout)["findings"] if f["rule"] == "EV009"]
    text = " ".join(f["message"] for f in notes)
    for digest in (sha(sleep), second, sha(script)):
        assert digest in text, text
    assert str(prog) in text and cat not in text


def test_diff_reports_a_changed_program(tmp_path: Path, jobdir: Path) -> None:
    prog = jobdir / "tool"
    bundles = []
    for i, src in enumerate(("true", "false")):
        shutil.copy(shutil.which(src) or "", prog)
        prog.chmod(0o755)
        proc, _, _ = record(tmp_path, *AS_NOBODY, "/bin/sh", "-c", f"{prog}; exit 0", name=f"r{i}.tar.gz")
        assert proc.returncode == 0, proc.stderr
        bundles.append(str(tmp_path / f"r{i}.tar.gz"))
    out = evidence("diff", "--format", "json", "--fail-on", "changed", *bundles)
    assert out.returncode == 1, out.stdout + out.stderr
    changed = json.loads(out.stdout)["changed"]
    (hit,) = [c for c in changed if c["kind"] == "exec" and c["key"].endswith("/tool")]
    assert "content changed" in hit["detail"], changed


def test_a_bind_mount_in_the_jobs_own_namespace_cannot_lie(tmp_path: Path, jobdir: Path) -> None:
    """The job binds another program over a path in a mount namespace of its own (unshare -rm: no
    privileges needed), where the recorder cannot see the mount: the path, read from outside, still
    names the harmless file, but the hash (read through /proc/<pid>/exe) is of what really ran."""
    sleep = shutil.which("sleep")
    assert sleep
    tool, other = jobdir / "tool", jobdir / "other"
    shutil.copy(sleep, tool)
    other.write_bytes(Path(sleep).read_bytes() + b"not what the path says\n")
    tool.chmod(0o755)
    other.chmod(0o755)
    job = f"mount --bind {other} {tool} && {tool} 0.3"
    proc, _, events = record(tmp_path, *AS_NOBODY, "unshare", "-rm", "/bin/sh", "-c", job)
    assert proc.returncode == 0, proc.stderr
    (ran,) = [e["data"] for e in of_type(events, "process.exec") if e["data"]["filename"] == str(tool)]
    assert ran["sha256"] == sha(other) != sha(tool) and ran["hash_source"] == "exe", ran


def test_a_program_gone_at_once_is_hashed_as_the_file_that_ran_or_said_to_be_unproven(
    tmp_path: Path, jobdir: Path
) -> None:
    """A program that exits within a millisecond is gone before /proc/<pid>/exe can be read. The exec
    record carries the device, inode, size and ctime of the file the kernel mapped, so a hash read by
    path is "inode" only when the path still names that very file: a job that runs a program and
    replaces it at once (even keeping its mtime) cannot get the innocent file's hash recorded as
    what ran."""
    true = shutil.which("true")
    assert true
    prog = jobdir / "tool"
    job = (
        f"for i in 1 2 3 4 5 6 7 8; do {true}; done; "
        f"cp {true} {prog} && {prog} && printf 'innocent' > {prog}.new && touch -r {prog} {prog}.new && "
        f"mv {prog}.new {prog}"
    )
    proc, _, events = record(tmp_path, *AS_NOBODY, "/bin/sh", "-c", job)
    assert proc.returncode == 0, proc.stderr
    execs = [e["data"] for e in of_type(events, "process.exec") if e["data"]["result"] == 0]
    trues = [d for d in execs if d["filename"] == true]
    assert trues and all(d["sha256"] == sha(true) for d in trues), trues
    assert {d["hash_source"] for d in trues} <= {"exe", "inode"}, trues  # never an unproven "path"
    (tool,) = [d for d in execs if d["filename"] == str(prog)]
    innocent = hashlib.sha256(b"innocent").hexdigest()
    if tool.get("sha256") == innocent:  # read after the swap: by path, and said to be unproven
        assert tool["hash_source"] == "path", tool
    else:  # read before the swap: the program that ran, proven unless the rename (which changes the
        # replaced file's ctime) came between the read and the identity check: then unproven
        assert tool["sha256"] == sha(true) and tool["hash_source"] in ("exe", "inode", "path"), tool
