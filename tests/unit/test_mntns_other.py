"""Events with mntns: "other" (a process that left the run's mount namespace) in diff, baseline and
profile: their paths are names in that namespace, so diff and baseline keep them apart from the
run's own and say so, and profile makes no host rule of them and says so. Bundles by the writer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from evidence.bundle import baseline
from evidence.cli import main
from evidence.policy.profile import build_profile
from tests.unit.conftest_bundles import T0, exec_, namespace, open_, records, write

OTHER = {"mntns": "other"}


def _plain() -> list[dict[str, Any]]:
    """A job that reads /etc/hostname and runs /usr/bin/true in the run's own namespace."""
    return [
        *records(),
        open_(9300, "/etc/hostname", ["read"], pid=201, exe="/usr/bin/cat"),
        exec_(9400, 202, 101, "/usr/bin/true", ["true"]),
    ]


def _escaped() -> list[dict[str, Any]]:
    """Row 2a of docs/threat-model.md: the same names, after an unshare and a bind mount over them
    (each later event of those processes carries mntns: "other")."""
    return [
        *records(),
        namespace(9100, "unshare", ["CLONE_NEWNS", "CLONE_NEWUSER"], pid=200),
        namespace(9200, "mount", ["MS_BIND"], ["/home/ci/work/x", "/etc/hostname"], pid=200, **OTHER),
        {**open_(9300, "/etc/hostname", ["read"], pid=201, exe="/usr/bin/cat"), **OTHER},
        {**exec_(9400, 202, 200, "/usr/bin/true", ["true"]), **OTHER},
    ]


def _diff(a: Path, b: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict[str, Any]]:
    code = main(["diff", "--format", "json", *extra, str(a), str(b)])
    return code, orjson.loads(capsys.readouterr().out)


def _keys(doc: dict[str, Any], what: str) -> set[tuple[str, str, str]]:
    return {(c["kind"], c["key"], c.get("mntns", "run")) for c in doc[what]}


def test_diff_shows_the_same_names_in_another_namespace_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = write(tmp_path / "a.tar.gz", _plain())
    b = write(tmp_path / "b.tar.gz", _escaped())
    code, doc = _diff(a, b, capsys)
    assert code == 1  # something was added: the reads and runs in the other namespace
    assert _keys(doc, "added") == {
        ("file", "/etc/hostname", "other"),
        ("exec", "/usr/bin/true -- true", "other"),
    }
    # the run's own /etc/hostname and /usr/bin/true are gone from B, not merged with B's others
    assert _keys(doc, "removed") == {
        ("file", "/etc/hostname", "run"),
        ("exec", "/usr/bin/true -- true", "run"),
    }
    assert doc["changed"] == []
    assert doc["a"]["events_other_mntns"] == 0 and doc["b"]["events_other_mntns"] == 2
    assert "another mount namespace" in doc["note"] and "A: 0, B: 2" in doc["note"]

    assert main(["diff", str(a), str(b)]) == 1
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert any(line.startswith("Note: events of processes in another mount namespace") for line in lines)
    own = lines.index("file:")
    other = lines.index("file, in another mount namespace (paths as named there):")
    assert lines[own + 1].startswith("  - /etc/hostname") and lines[other + 1].startswith("  + /etc/hostname")

    assert main(["diff", "--format", "markdown", str(a), str(b)]) == 1
    md = capsys.readouterr().out
    assert "### exec, in another mount namespace (paths as named there)" in md
    assert "> **Warning:** events of processes in another mount namespace" in md


def test_diff_compares_other_namespace_keys_with_each_other(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = write(tmp_path / "a.tar.gz", _escaped())
    b = write(
        tmp_path / "b.tar.gz", [*_escaped(), {**open_(9500, "/etc/hostname", ["read"], pid=201), **OTHER}]
    )
    code, doc = _diff(a, b, capsys, "--fail-on", "any")
    assert code == 1 and doc["added"] == [] and doc["removed"] == []
    assert doc["changed"] == [
        {
            "kind": "file",
            "what": "changed",
            "key": "/etc/hostname",
            "detail": "read count 1 -> 2",
            "mntns": "other",
        }
    ]
    same = write(tmp_path / "c.tar.gz", _escaped(), session_id="again")
    code, doc = _diff(a, same, capsys, "--fail-on", "any")
    assert code == 0 and doc["differences"] == 0 and "A: 2, B: 2" in doc["note"]
    assert main(["diff", str(a), str(same)]) == 0
    out = capsys.readouterr().out
    assert "No behaviour differences observed." in out and "another mount namespace" in out


def test_diff_of_runs_without_other_namespace_events_is_unchanged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = write(tmp_path / "a.tar.gz", _plain())
    b = write(tmp_path / "b.tar.gz", [*_plain(), open_(9500, "/etc/passwd", ["read"])])
    code, doc = _diff(a, b, capsys)
    assert code == 1 and doc["added"] == [
        {"kind": "file", "what": "added", "key": "/etc/passwd", "detail": "read x1"}
    ]
    assert "mount namespace" not in doc["note"]
    assert main(["diff", str(a), str(b)]) == 1
    assert "mount namespace" not in capsys.readouterr().out


def _denial(t: int, pid: int, target: str) -> dict[str, Any]:
    return dict(
        k="denial", t=T0 + t, pid=pid, exe="/usr/bin/cat", operation="read", target=target,
        rule="fs.read: not allowed", enforced=False, result=0,
    )  # fmt: skip


def test_a_denial_of_an_open_in_another_namespace_is_keyed_with_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    own, other = _plain(), _escaped()
    a = write(tmp_path / "a.tar.gz", [*own, _denial(9300, 201, "/etc/hostname")])
    b = write(tmp_path / "b.tar.gz", [*other, _denial(9300, 201, "/etc/hostname")])
    _, doc = _diff(a, b, capsys)
    deny = "read /etc/hostname (rule fs.read: not allowed, would deny)"
    assert ("denial", deny, "other") in _keys(doc, "added")
    assert ("denial", deny, "run") in _keys(doc, "removed")


def test_baseline_keeps_other_namespace_items_distinct(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = [write(tmp_path / f"p{i}.tar.gz", _plain(), session_id=f"p{i}") for i in range(2)]
    escaped = write(tmp_path / "e.tar.gz", _escaped())

    # a baseline of runs that never left the namespace: nothing about mntns in the file
    assert main(["baseline", "build", *map(str, plain)]) == 0
    text = capsys.readouterr().out
    assert "mntns" not in text
    (tmp_path / "plain.json").write_text(text)

    # the same names in another namespace are not known from the run's own: added, never seen
    code, doc = _diff(tmp_path / "plain.json", escaped, capsys, "--baseline")
    assert code == 1
    assert _keys(doc, "added") == {
        ("file", "/etc/hostname", "other"),
        ("exec", "/usr/bin/true -- true", "other"),
    }
    assert all("never seen" in c["detail"] for c in doc["added"])
    assert doc["b"]["events_other_mntns"] == 2

    # a baseline with them: distinct items, each marked, and the bundle's count of such events
    assert main(["baseline", "build", str(plain[0]), str(escaped)]) == 0
    text = capsys.readouterr().out
    raw = json.loads(text)
    hostname = [i for i in raw["file"] if i["path"] == "/etc/hostname"]
    assert hostname == [
        {"access": "read", "path": "/etc/hostname", "runs": 1},
        {"access": "read", "mntns": "other", "path": "/etc/hostname", "runs": 1},
    ]
    assert {"argv": ["true"], "mntns": "other", "program": "/usr/bin/true", "runs": 1} in raw["exec"]
    assert "events_other_mntns" not in raw["bundles"][0] and raw["bundles"][1]["events_other_mntns"] == 2
    path = tmp_path / "mixed.json"
    path.write_text(text)
    assert baseline.dumps(baseline.load(path)) == text  # read back as written

    # a run that did it again is known; at --min-runs 2 it is not (seen in 1 of 2)
    again = write(tmp_path / "again.tar.gz", _escaped(), session_id="again")
    code, doc = _diff(path, again, capsys, "--baseline")
    assert code == 0 and doc["added"] == [] and "A: 2, B: 2" in doc["note"]
    code = main(["diff", "--format", "json", "--baseline", str(path), "--min-runs", "2", str(again)])
    doc = orjson.loads(capsys.readouterr().out)
    assert code == 1
    assert {c["mntns"] for c in doc["added"] if c["kind"] != "exit"} == {"other"}
    assert all("seen in 1 of 2" in c["detail"] for c in doc["added"] if c["kind"] != "exit")


def test_profile_makes_no_host_rule_of_other_namespace_paths(tmp_path: Path) -> None:
    from evidence.bundle.reader import read_events, read_manifest

    other = {**OTHER, "pid": 301}
    recs = [
        *records(),
        namespace(9100, "unshare", ["CLONE_NEWNS", "CLONE_NEWUSER"], pid=301),
        {**open_(9300, "/srv/secret/data", ["read"], exe="/usr/bin/cat"), **other},
        {**open_(9350, "/var/lib/app/state", ["write", "create"], exe="/usr/bin/cat"), **other},
        {**exec_(9400, 301, 101, "/opt/evil/tool", ["tool"]), **OTHER},
        _denial(9450, 301, "/srv/secret/other"),
        {**open_(9450, "/srv/secret/other", ["read"], exe="/usr/bin/cat"), **other},
        {
            **dict(k="connect", t=T0 + 9500, pid=301, ppid=101, exe="/usr/bin/curl", family="AF_INET"),
            **dict(address="203.0.113.7", port=443, result=0, **OTHER),
        },
    ]
    bundle = write(tmp_path / "run.tar.gz", recs)
    text, policy = build_profile(read_manifest(bundle), read_events(bundle), home="/home/ci")
    for path, access in (
        ("/srv/secret/data", "read"),
        ("/srv/secret/other", "read"),
        ("/var/lib/app/state", "write"),
        ("/opt/evil/tool", "exec"),
    ):
        assert policy.check_file(path, access) is not None, (path, access)
    assert '"/srv' not in text and '"/var/lib' not in text and '"/opt' not in text
    # an address is not a path: the connect is allowed
    assert policy.check_connect("AF_INET", "203.0.113.7", 443) is None
    # the run's own accesses are allowed as before, and the header says what was left out
    assert policy.check_file("/home/ci/work/Makefile", "read") is None
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert header[1] == "# It allows what that run did in its own mount namespace. See docs/policy-format.md."
    assert header[2].startswith("# 5 file and exec events of processes in another mount namespace")

    plain, _ = build_profile(read_manifest(write(tmp_path / "p.tar.gz")), read_events(tmp_path / "p.tar.gz"))
    assert "mount namespace" not in plain
