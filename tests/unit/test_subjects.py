"""bundle/subjects.py: the files `--subject` patterns match become subjects (name, sha256, size), in
name order, within caps; what leads out of the workspace, is not a regular file, has other names
or comes past the caps is refused and listed with the reason."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

import pytest

from evidence.bundle import subjects


def _ws(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    (ws / "dist").mkdir(parents=True)
    (ws / "dist" / "b.whl").write_bytes(b"bee")
    (ws / "dist" / "a.whl").write_bytes(b"ay")
    (ws / "dist" / "sub").mkdir()
    (ws / "dist" / "sub" / "c.whl").write_bytes(b"sea")
    return ws


def test_matches_become_subjects_in_name_order_with_their_digests(tmp_path: Path) -> None:
    ws = _ws(tmp_path)
    got = subjects.collect(ws, ["dist/**/*.whl", "dist/a.whl"], now_ns=0)
    assert [(f.name, f.size) for f in got.files] == [
        ("dist/a.whl", 2),
        ("dist/b.whl", 3),
        ("dist/sub/c.whl", 3),
    ]
    assert got.files[0].sha256 == hashlib.sha256(b"ay").hexdigest()
    assert got.files[0].path == str(ws.resolve() / "dist" / "a.whl")
    assert got.refused == [] and got.workspace == str(ws.resolve())
    assert got.max_files == subjects.MAX_FILES and got.max_bytes == subjects.MAX_BYTES
    # the same tree, the same record
    assert subjects.collect(ws, ["dist/**/*.whl", "dist/a.whl"], now_ns=0) == got


def test_what_is_refused_is_listed_with_the_reason(tmp_path: Path) -> None:
    ws = _ws(tmp_path)
    outside = tmp_path / "secret"
    outside.write_bytes(b"root only")
    (ws / "dist" / "out.whl").symlink_to(outside)
    (ws / "dist" / "in.whl").symlink_to(ws / "dist" / "a.whl")  # inside: followed
    os.mkfifo(ws / "dist" / "fifo.whl")
    os.link(ws / "dist" / "b.whl", ws / "dist" / "hard.whl")
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(ws / "dist" / "sock.whl"))
    try:
        got = subjects.collect(ws, ["dist/*.whl", "nothing/*"], now_ns=0)
    finally:
        s.close()
    refused = {r.name: r.reason for r in got.refused}
    assert refused["dist/out.whl"] == f"leads out of the workspace (a symlink to {outside})"
    assert refused["dist/fifo.whl"] == "a FIFO"  # never opened: a FIFO cannot block the recorder
    assert refused["dist/sock.whl"] == "a socket"
    assert "hard link" in refused["dist/b.whl"] and "hard link" in refused["dist/hard.whl"]
    assert refused["nothing/*"] == "the pattern matched nothing"
    assert [f.name for f in got.files] == ["dist/a.whl", "dist/in.whl"]
    assert got.files[1].path == got.files[0].path  # a symlink inside is its target


def test_the_caps_refuse_what_comes_past_them_in_name_order(tmp_path: Path) -> None:
    ws = _ws(tmp_path)
    got = subjects.collect(ws, ["dist/**/*.whl"], max_files=2, now_ns=0)
    assert [f.name for f in got.files] == ["dist/a.whl", "dist/b.whl"]
    assert [(r.name, r.reason) for r in got.refused] == [("dist/sub/c.whl", "past the cap of 2 subjects")]
    got = subjects.collect(ws, ["dist/**/*.whl"], max_bytes=5, now_ns=0)
    assert [f.name for f in got.files] == ["dist/a.whl", "dist/b.whl"]
    assert "past the cap of 5 bytes" in got.refused[0].reason


def test_the_refusals_listed_are_bounded(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    for i in range(subjects.MAX_REFUSED + 7):
        (ws / f"f{i:04d}").write_bytes(b"x")
    got = subjects.collect(ws, ["f*"], max_files=0, now_ns=0)
    assert len(got.refused) == subjects.MAX_REFUSED and got.refused_more == 7


@pytest.mark.parametrize("pattern", ["/etc/*", "../x", "dist/../../x", ""])
def test_a_pattern_that_leaves_the_workspace_is_a_usage_error(tmp_path: Path, pattern: str) -> None:
    with pytest.raises(subjects.SubjectError):
        subjects.collect(_ws(tmp_path), [pattern])


def test_names_beyond_a_symlink_out_of_the_workspace_are_never_listed(tmp_path: Path) -> None:
    """root may read directories the job cannot: a symlink to one is refused by its own name."""
    ws = _ws(tmp_path)
    private = tmp_path / "private" / "project"
    private.mkdir(parents=True)
    (private / "plans.whl").write_bytes(b"x")
    (ws / "dist" / "elsewhere").symlink_to(tmp_path / "private")
    got = subjects.collect(ws, ["dist/*/*/*.whl", "dist/**/*.whl"], now_ns=0)
    assert [(r.name, r.reason) for r in got.refused] == [
        ("dist/elsewhere", f"leads out of the workspace (a symlink to {tmp_path / 'private'})")
    ]
    assert "plans" not in repr(got)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--subject", "/etc/*"], "patterns are relative to the workspace"),
        (["--subject", "../out"], "may not leave the workspace"),
        (["--subject-must-be-written"], "--subject-must-be-written needs --subject"),
    ],
)
def test_run_refuses_a_bad_subject_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    from evidence.cli import main

    marker = tmp_path / "ran"
    code = main(["run", *argv, "--", "/bin/touch", str(marker)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not marker.exists()


def test_collect_as_reads_with_the_clients_rights(tmp_path: Path) -> None:
    """As nobody, a file only root can read is refused (not hashed by root on the client's behalf)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another uid")
    import tempfile

    top = Path(tempfile.mkdtemp(dir="/tmp"))  # (pytest's tmp_path is root's alone)
    top.chmod(0o755)
    ws = _ws(top)
    ws.chmod(0o755)
    for d in (ws / "dist", ws / "dist" / "sub"):
        d.chmod(0o755)
    (ws / "dist" / "a.whl").chmod(0o644)
    (ws / "dist" / "b.whl").chmod(0o600)  # root's alone
    got = subjects.collect_as(65534, 65534, ws, ["dist/*.whl"])
    assert [f.name for f in got.files] == ["dist/a.whl"]
    assert [(r.name, r.reason) for r in got.refused] == [
        ("dist/b.whl", "cannot be opened: Permission denied")
    ]
    hidden = subjects.collect_as(65534, 65534, tmp_path, ["*"])  # a directory nobody cannot enter
    assert hidden.files == [] and hidden.refused[0].name == "*"
    assert hidden.refused[0].reason.startswith("not collected: ")
    import shutil

    shutil.rmtree(top)


def test_the_agents_isolate_request_takes_subjects_as_run_does() -> None:
    from evidence.agent.daemon import models
    from evidence.errors import UsageError

    req = models.parse_run_request({"isolate_pid": 5, "subjects": ["dist/*.whl"]})
    assert isinstance(req, models.IsolateRequest) and req.subjects == ("dist/*.whl",)
    for bad in (["/etc/*"], ["../x"], "dist/*", [1], ["x"] * (subjects.MAX_PATTERNS + 1)):
        with pytest.raises(UsageError):
            models.parse_run_request({"isolate_pid": 5, "subjects": bad})
