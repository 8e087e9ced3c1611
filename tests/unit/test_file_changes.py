"""File changes that are not opens (rename, unlink, link, symlink, truncate, chmod, chown, mkdir,
mknod): correlation, the writer's summary, diff, profile, lint and show."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from evidence.agent.recorder.correlate import Correlator
from evidence.bundle import lint
from evidence.cli import main
from evidence.policy.profile import collect
from tests.unit.conftest_bundles import WS, change, members, records, write


def ev(tgid: int = 10, **kw: Any) -> dict[str, Any]:  # a decoded change record
    base = {"kind": "change", "ts": 1, "run": 1, "tgid": tgid, "tid": tgid, "flags": 0, "ret": 0}
    base.update(dfd=-100, dfd2=0, dino=0, dino2=0, mode=0, uid=0, gid=0, at_flags=0, path=None, path2=None)
    base.update(kw)
    return base


SRV = 0xFFFF0001000  # what descriptor 4 names (its inode's address, decode.py's rino)


def test_paths_are_resolved_like_opens_both_paths_and_descriptors() -> None:
    c = Correlator(wall_offset_ns=0)
    c.add_root(10, 1, "/home/u")
    c.feed(
        {"kind": "open", "ts": 1, "run": 1, "tgid": 10, "tid": 10, "flags": 0, "path": "/srv", "dfd": -100}
        | {"oflags": 0o200000, "mode": 0, "sc": 0, "ret": 4, "dino": 0, "rino": SRV, "kname": None}
    )
    out = []
    out += c.feed(ev(op="rename", path="a", dfd=4, dino=SRV, path2="../b", dfd2=-100, at_flags=1))
    out += c.feed(ev(op="link", path="/etc/x", path2="y", dfd2=-100, ret=-1))
    out += c.feed(ev(op="symlink", path="../t", path2="s", dfd2=4, dino2=SRV))
    out += c.feed(ev(op="chmod", path=None, dfd=4, dino=SRV, mode=0o100755))
    out += c.feed(ev(op="chown", path="f", uid=0xFFFFFFFF, gid=0))
    out += c.feed(ev(op="unlink", path="g", dfd=7, ret=-13))
    rename, link, symlink, fchmod, chown, unlink = out
    assert (rename["path"], rename["target"], rename["raw_path"], rename["at_flags"]) == (
        "/srv/a",
        "/home/b",
        "a",
        1,
    )
    assert rename["access"] == ("write", "create") and rename["result"] == 0
    assert (link["path"], link["target"], link["result"]) == ("/etc/x", "/home/u/y", "EPERM")
    assert (symlink["path"], symlink["target"], symlink["raw_path"]) == ("/srv/s", "../t", "s")
    assert (fchmod["path"], fchmod["raw_path"], fchmod["mode"]) == ("/srv", None, 0o755)
    assert (chown["path"], chown["uid"], chown["gid"]) == ("/home/u/f", None, 0)
    assert (unlink["path"], unlink["result"]) == ("<unknown fd 7>/g", "EACCES")
    assert {r["operation"] for r in out} == {"rename", "link", "symlink", "chmod", "chown", "unlink"}


def _events(path: Path, type_: str) -> list[dict[str, Any]]:
    _, lines = members(path)
    return [e["data"] for e in map(orjson.loads, lines) if e["type"] == type_]


def test_summary_counts_equal_changes_once(tmp_path: Path) -> None:
    recs = [*records(), *(change(8000 + i, "unlink", WS + "/tmp.o") for i in range(3))]
    recs.append(change(8100, "unlink", WS + "/tmp.o", result="ENOENT"))
    summary = _events(write(tmp_path / "s.tar.gz", recs), "dev.evidence.file.change")
    assert [(d["result"], d["count"]) for d in summary] == [(0, 3), ("ENOENT", 1)]
    full = _events(write(tmp_path / "f.tar.gz", recs, detail="full"), "dev.evidence.file.change")
    assert len(full) == 4


def test_diff_shows_a_new_change(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = write(tmp_path / "a.tar.gz")
    b = write(tmp_path / "b.tar.gz", [*records(), change(8000, "rename", WS + "/app", "/etc/passwd")])
    main(["diff", "--format", "json", str(a), str(b)])
    doc = orjson.loads(capsys.readouterr().out)
    added = {(c["key"], c["detail"]) for c in doc["added"] if c["kind"] == "file"}
    assert ("/etc/passwd", "rename to x1") in added
    changed = {(c["key"], c["detail"]) for c in doc["changed"] if c["kind"] == "file"}
    assert ("${WORKSPACE}/app", "new access rename") in changed


def test_profile_allows_the_directory_for_names_and_the_file_for_attributes() -> None:
    act = collect(
        [
            {
                "type": "dev.evidence.file.change",
                "data": {"operation": "rename", "path": "/w/a", "target": "/w/b", "result": 0},
            },
            {"type": "dev.evidence.file.change", "data": {"operation": "chmod", "path": "/w/c", "result": 0}},
            {
                "type": "dev.evidence.file.change",
                "data": {"operation": "unlink", "path": "/w/d", "result": "EACCES"},
            },
        ]
    )
    assert act.write == {("/w/a", True), ("/w/b", True), ("/w/c", False)}


def test_lint_flags_a_change_outside_the_workspace(tmp_path: Path) -> None:
    path = write(tmp_path / "a.tar.gz", [*records(), change(8000, "truncate", "/etc/motd")])
    _, findings, _ = lint.lint(str(path))
    assert any(f.rule.code == "EV004" and "/etc/motd" in f.message for f in findings)


def test_show_lists_changes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "a.tar.gz", [*records(), change(8000, "rename", WS + "/a", WS + "/b")])
    assert main(["show", str(path)]) == 0
    assert f"{WS}/a -> {WS}/b" in capsys.readouterr().out
