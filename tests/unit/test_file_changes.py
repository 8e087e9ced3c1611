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
    base.update(dfd=-100, dfd2=0, dino=0, dino2=0, mino=0, mino2=0, mode=0, nlink=0, uid=0, gid=0, at_flags=0)
    base.update(path=None, path2=None)
    base.update(kw)
    return base


SRV = 0xFFFF0001000  # what descriptor 4 names (its inode's address, decode.py's rino)


def test_paths_are_resolved_like_opens_both_paths_and_descriptors() -> None:
    c = Correlator(wall_offset_ns=0)
    c.add_root(10, 1, "/home/u")
    c.feed(
        {"kind": "open", "ts": 1, "run": 1, "tgid": 10, "tid": 10, "flags": 0, "path": "/srv", "dfd": -100}
        | {
            "oflags": 0o200000,
            "mode": 0,
            "nlink": 0,
            "sc": 0,
            "ret": 4,
            "dino": 0,
            "rino": SRV,
            "kname": None,
        }
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


def test_a_change_through_a_magic_link_names_what_the_descriptor_names() -> None:
    """truncate, chmod, mkdir, rename through /proc/self/fd/N (and /dev/fd/N, /proc/thread-self,
    the process's own /proc/<pid>[/task/<tid>], a relative fd/N from /proc/<pid>, N from its fd
    directory) change what descriptor N names: named after the table's entry for N when the
    kernel says N named that file then (mino, mino2); else as given."""
    c = Correlator(wall_offset_ns=0)
    c.add_root(10, 1, "/home/u")
    opn = {"kind": "open", "ts": 1, "run": 1, "tgid": 10, "tid": 10, "flags": 0, "dfd": -100, "mode": 0}
    opn |= {"sc": 0, "dino": 0, "kname": None, "nlink": 0}
    o_path = 0o10000000
    c.feed(opn | {"path": "/srv/victim", "oflags": o_path, "ret": 3, "rino": SRV})
    c.feed(opn | {"path": "/srv", "oflags": o_path, "ret": 5, "rino": SRV + 1})
    out = []
    out += c.feed(ev(op="truncate", path="/proc/self/fd/3", mino=SRV))
    out += c.feed(ev(op="chmod", path="/dev/fd/3", mino=SRV, mode=0o777))
    out += c.feed(ev(op="mkdir", path="/proc/thread-self/fd/5/sub", mino=SRV + 1))
    out += c.feed(ev(op="rename", path="/proc/10/fd/5/a", mino=SRV + 1, path2="/proc/10/task/11/fd/5/b"))
    # (path2's identity not given: named as given)
    out += c.feed(ev(op="unlink", path="/proc/self/fd/5/../x", mino=SRV + 1))
    out += c.feed(ev(op="truncate", path="/proc/self/fd/3", mino=SRV + 9))  # N names another file now
    out += c.feed(ev(op="truncate", path="/proc/self/fd/3"))  # the kernel could not say (0)
    out += c.feed(ev(op="truncate", path="/proc/11/fd/3", mino=SRV))  # another process's descriptor
    out += c.feed(ev(op="truncate", path="/proc/self/fd/7", mino=SRV))  # a descriptor never seen opened
    c.feed(
        opn | {"kind": "chdir", "path": "/proc/self", "ret": 0, "fd": -100, "rino": 77, "kname": "/proc/10"}
    )
    out += c.feed(ev(op="truncate", path="fd/3", mino=SRV))
    assert [r["path"] for r in out] == [
        "/srv/victim",
        "/srv/victim",
        "/srv/sub",
        "/srv/a",
        "/srv/../x",
        "/proc/self/fd/3",
        "/proc/self/fd/3",
        "/proc/11/fd/3",
        "/proc/self/fd/7",
        "/srv/victim",
    ]
    assert out[3]["target"] == "/proc/10/task/11/fd/5/b"
    out = c.feed(ev(op="rename", path="/proc/10/fd/5/a", mino=SRV + 1, path2="/dev/fd/3", mino2=SRV))
    assert (out[0]["path"], out[0]["target"], out[0]["raw_path"]) == (
        "/srv/a",
        "/srv/victim",
        "/proc/10/fd/5/a",
    )
    out = c.feed(ev(op="symlink", path="/proc/self/fd/3", path2="/proc/self/fd/5/l", mino=SRV, mino2=SRV + 1))
    assert (out[0]["path"], out[0]["target"]) == ("/srv/l", "/proc/self/fd/3")  # its content stays


def test_link_counts_are_kept_on_writes_and_changes_of_a_file_with_other_names() -> None:
    """The kernel's link count of a write open's file, and of a truncate, chmod or chown's file
    named by a descriptor: kept when the file has other names (> 1), never on other changes."""
    c = Correlator(wall_offset_ns=0)
    c.add_root(10, 1, "/home/u")
    opn = {"kind": "open", "ts": 1, "run": 1, "tgid": 10, "tid": 10, "flags": 0, "dfd": -100, "mode": 0}
    opn |= {"sc": 0, "dino": 0, "kname": None, "ret": 3, "rino": SRV, "oflags": 1}
    out = c.feed(opn | {"path": "/tmp/linked", "nlink": 2}) + c.feed(opn | {"path": "/tmp/alone", "nlink": 1})
    assert [(r["path"], r.get("nlink")) for r in out] == [("/tmp/linked", 2), ("/tmp/alone", None)]
    out = c.feed(ev(op="chmod", path=None, dfd=3, dino=SRV, mode=0o600, nlink=3))
    out += c.feed(ev(op="truncate", path="/proc/self/fd/3", mino=SRV, nlink=3))
    out += c.feed(ev(op="symlink", path="/proc/self/fd/3", path2="l", dfd2=-100, mino=SRV, nlink=3))
    assert [(r["operation"], r["path"], r.get("nlink")) for r in out] == [
        ("chmod", "/tmp/alone", 3),
        ("truncate", "/tmp/alone", 3),
        ("symlink", "/home/u/l", None),
    ]


def test_lint_flags_a_write_to_a_file_with_other_names(tmp_path: Path) -> None:
    """A write open, or a truncate, of a file in the workspace or /tmp with other names (a hard link,
    made in an earlier run, to a file anywhere on the same file system): EV004, the others may be
    outside the workspace (one finding a file). The same file with one name is not flagged."""
    from tests.unit.conftest_bundles import open_

    recs = [
        *records(),
        {**open_(8000, "/tmp/linked", ["write"]), "nlink": 2},
        open_(8001, "/tmp/alone", ["write"]),
    ]
    recs += [change(8002, "truncate", WS + "/obj", nlink=2), change(8003, "truncate", WS + "/one")]
    _, findings, _ = lint.lint(str(write(tmp_path / "a.tar.gz", recs)))
    got = sorted(f.message for f in findings if f.rule.code == "EV004")
    assert got == [
        f"/usr/bin/make changed {WS}/obj (truncate), a file with 2 names: the others may be outside the workspace {WS}",
        f"/usr/bin/make wrote /tmp/linked (write), a file with 2 names: the others may be outside the workspace {WS}",
    ]


def test_the_magic_descriptor_number_is_read_as_the_probe_reads_it() -> None:
    """names.magic_fd, record.bpf.c magic_fd's twin: the first component of digits that is the
    name's first or follows a component `fd`, within the first 48 characters, up to 9 digits."""
    from evidence.agent.recorder.names import magic_fd

    assert magic_fd("/proc/self/fd/3") == 3
    assert magic_fd("/dev/fd/12/sub/dir") == 12
    assert magic_fd("/proc/4194304/task/4194305/fd/7") == 7
    assert magic_fd("fd/3") == 3
    assert magic_fd("3/sub") == 3
    assert magic_fd("/home/u/afd/3") is None  # not a component `fd`
    assert magic_fd("/proc/self/fd//3") is None
    assert magic_fd("/proc/self/fd/3x") is None
    assert magic_fd("/proc/self/fd/1234567890") is None  # 10 digits
    assert magic_fd("/" + "a" * 43 + "/fd/3") is None  # its digit past the first 48 characters
    assert magic_fd("/" + "a" * 42 + "/fd/3") == 3
    assert magic_fd("/tmp/fd/2/../../proc/self/fd/3") == 2  # the first: the name then is not one


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


def test_lint_judges_a_change_through_a_descriptor_it_cannot_name_outside(tmp_path: Path) -> None:
    """A change still named through a magic link (the recorder could not name the file: a
    descriptor it never saw opened) may have changed any file: EV004, though /proc/self/fd and
    /dev/fd are scratch places for an open. One named after the file is judged by that name."""
    recs = [*records(), change(8000, "truncate", "/proc/self/fd/7"), change(8001, "chmod", "/dev/stdout")]
    recs += [change(8002, "mkdir", "/proc/123/task/124/fd/3/sub"), change(8003, "truncate", WS + "/x")]
    _, findings, _ = lint.lint(str(write(tmp_path / "a.tar.gz", recs)))
    flagged = {f.message.split(" ")[2] for f in findings if f.rule.code == "EV004"}
    assert flagged == {"/proc/self/fd/7", "/dev/stdout", "/proc/123/task/124/fd/3/sub"}
    assert all("could not name" in f.message for f in findings if f.rule.code == "EV004")


def test_show_lists_changes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "a.tar.gz", [*records(), change(8000, "rename", WS + "/a", WS + "/b")])
    assert main(["show", str(path)]) == 0
    assert f"{WS}/a -> {WS}/b" in capsys.readouterr().out
