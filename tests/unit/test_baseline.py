"""evidence baseline build + diff --baseline FILE [--min-runs N]: a baseline from three bundles, only
what it has not seen (often enough) is reported; bad input is one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from evidence.bundle import baseline
from evidence.cli import main
from tests.unit.conftest_bundles import WS, connect, denial, open_, records, write


@pytest.fixture
def runs(tmp_path: Path) -> list[Path]:
    """Three runs of one job: the third also talks to 203.0.113.5; the tmp names differ."""
    return [
        write(tmp_path / "r1.tar.gz", [*records(), open_(8100, "/tmp/tmpab12cd34/x", ["write"])]),
        write(tmp_path / "r2.tar.gz", [*records(), open_(8100, "/tmp/tmpzz99yy88/x", ["write"])]),
        write(
            tmp_path / "r3.tar.gz",
            [*records(), open_(8100, "/tmp/tmpqq11ww22/x", ["write"]), connect(9000, "203.0.113.5")],
            session_id="sess-3",
        ),
    ]


def _build(runs: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> Path:
    assert main(["baseline", "build", *extra, *map(str, runs)]) == 0
    out = tmp_path / "baseline.json"
    out.write_text(capsys.readouterr().out)
    return out


def test_build(runs: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _build(runs, tmp_path, capsys)
    doc = json.loads(path.read_text())
    assert doc["format"] == "evidence-baseline" and doc["format_version"] == 1 and doc["runs"] == 3
    assert [b["run_id"][:4] for b in doc["bundles"]] == ["run-"] * 3
    files = {(f["path"], f["access"]): f["runs"] for f in doc["file"]}
    assert files[("${WORKSPACE}/Makefile", "read")] == 3
    assert files[("/tmp/tmp<rand>/x", "write")] == 3  # normalised as diff does
    assert doc["network"] == [
        {"address": "127.0.0.1", "family": "AF_INET", "port": 8080, "runs": 3},
        {"address": "203.0.113.5", "family": "AF_INET", "port": 443, "runs": 1},
    ]
    assert doc["exit"] == [{"exit": "0", "runs": 3}]
    assert {"program": "/usr/bin/make", "argv": ["make", "test"], "runs": 3} in doc["exec"]
    # deterministic: the same bundles give the same bytes
    assert main(["baseline", "build", *map(str, runs)]) == 0
    assert capsys.readouterr().out == path.read_text()
    assert baseline.load(path).runs == 3


def test_diff_against_baseline(runs: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bl = _build(runs, tmp_path, capsys)
    same = write(tmp_path / "same.tar.gz", [*records(), open_(8100, "/tmp/tmp00000000/x", ["write"])])
    assert main(["diff", "--baseline", str(bl), str(same)]) == 0
    assert "No behaviour differences observed." in capsys.readouterr().out
    # fewer things than usual is not news: a baseline says what is usual, not what must happen
    assert main(["diff", "--baseline", str(bl), str(write(tmp_path / "less.tar.gz", records()[:3]))]) == 0
    capsys.readouterr()

    new = write(
        tmp_path / "new.tar.gz",
        [*records(), connect(9000, "203.0.113.5"), open_(9100, "/etc/passwd", ["read"]),
         open_(9200, WS + "/Makefile", ["write"]), denial(9300, "/etc/shadow")],
        exit_code=3,
    )  # fmt: skip
    assert main(["diff", "--baseline", str(bl), "--format", "json", str(new)]) == 1
    doc = json.loads(capsys.readouterr().out)
    added = {(c["kind"], c["key"]): c["detail"] for c in doc["added"]}
    assert doc["removed"] == [] and doc["changed"] == []
    assert added == {
        ("file", "${WORKSPACE}/Makefile"): "write x1, never seen",
        ("file", "/etc/passwd"): "read x1, never seen",
        ("denial", "write /etc/shadow (rule workspace-only, enforced)"): "x1; never seen",
        ("exit", "exit code"): "3; never seen (baseline: 0 in 3)",
    }
    # --min-runs 2: what one run in three did is not known yet
    assert main(["diff", "--baseline", str(bl), "--min-runs", "2", str(new)]) == 1
    out = capsys.readouterr().out
    assert "+ 203.0.113.5:443  (x1; seen in 1 of 3 baseline runs)" in out
    assert main(["diff", "--baseline", str(bl), "--fail-on", "removed", str(new)]) == 0
    capsys.readouterr()


def test_ignore_is_kept(runs: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bl = _build(runs, tmp_path, capsys, "--ignore", r"203\.0\.113\.\d+")
    assert json.loads(bl.read_text())["ignore"] == [r"203\.0\.113\.\d+"]
    new = write(tmp_path / "new.tar.gz", [*records(), connect(9000, "203.0.113.77")])
    assert main(["diff", "--baseline", str(bl), str(new)]) == 0  # <ignored>:443, seen once
    capsys.readouterr()


def _one_line_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str], says: str) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("evidence: ") and says in err, err


def test_bad_input(runs: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bl = _build(runs, tmp_path, capsys)
    new = str(runs[0])
    _one_line_exit_2(["diff", "--baseline", new, new], capsys, "is not a baseline: not JSON")
    other = tmp_path / "other.json"
    other.write_text('{"format": "evidence-bundle"}')
    _one_line_exit_2(["diff", "--baseline", str(other), new], capsys, "is not a baseline")
    doc = json.loads(bl.read_text())
    (tmp_path / "v2.json").write_text(json.dumps({**doc, "format_version": 2}))
    _one_line_exit_2(
        ["diff", "--baseline", str(tmp_path / "v2.json"), new], capsys, "format_version 2 is not supported"
    )
    (tmp_path / "bad.json").write_text(json.dumps({**doc, "runs": 2}))
    _one_line_exit_2(
        ["diff", "--baseline", str(tmp_path / "bad.json"), new], capsys, "runs is 2 but 3 bundles"
    )
    (tmp_path / "neg.json").write_text(json.dumps({**doc, "exit": [{"exit": "0", "runs": "3"}]}))
    _one_line_exit_2(["diff", "--baseline", str(tmp_path / "neg.json"), new], capsys, "exit.0.runs")
    _one_line_exit_2(
        ["diff", "--baseline", str(tmp_path / "missing.json"), new], capsys, "cannot read baseline"
    )
    _one_line_exit_2(["diff", "--baseline", str(bl), "--min-runs", "4", new], capsys, "has 3 runs")
    _one_line_exit_2(["diff", "--min-runs", "2", new, new], capsys, "--min-runs needs --baseline FILE")
    _one_line_exit_2(["baseline", "build", str(bl)], capsys, "verification failed")
    not_bundle = tmp_path / "x.tar.gz"
    not_bundle.write_bytes(b"\x1f\x8b garbage")
    _one_line_exit_2(["diff", "--baseline", str(bl), str(not_bundle)], capsys, "verification failed")


def test_baseline_dir_still_works(
    runs: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "store"
    assert main(["diff", "--baseline", str(store), str(runs[0])]) == 0
    assert (store / "default.bundle.tar.gz").exists()
    assert main(["diff", "--baseline", str(store), str(runs[2])]) == 1  # a new destination
    capsys.readouterr()


def test_the_file_is_written_an_item_at_a_time_as_json_dumps_would(
    runs: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """baseline.chunks writes what json.dumps(indent=2, sort_keys=True) writes of the document, an
    item at a time (the whole document as one dict and one string took 250 MB more at the cap)."""
    bl = baseline.build(map(str, runs), ["x+y"])
    doc = bl.model_dump(mode="json", exclude_defaults=True)
    assert baseline.dumps(bl) == json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def test_a_baseline_keeps_at_most_the_cap_of_keys(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Over all its runs a baseline keeps at most diff_keys.MAX_KEYS keys; the rest are not counted, a
    warning says so, and a diff against it reports them as never seen. A new run past its own cap is
    a difference (added) of its own."""
    from evidence.bundle import diff, diff_keys
    from tests.unit.conftest_bundles import exec_

    monkeypatch.setattr(diff_keys, "MAX_KEYS", 30)
    r1 = write(
        tmp_path / "r1.tar.gz",
        [*records(), *(exec_(9000 + i, 300 + i, 101, "/bin/a", [str(i)]) for i in range(20))],
    )
    r2 = write(
        tmp_path / "r2.tar.gz",
        [*records(), *(exec_(9000 + i, 300 + i, 101, "/bin/b", [str(i)]) for i in range(20))],
    )
    bl = baseline.build([str(r1), str(r2)], [])
    assert len(bl.exec) + len(bl.file) + len(bl.network) + len(bl.denial) <= 30
    assert any("past the 30 distinct keys a baseline keeps" in r.message for r in caplog.records)
    path = tmp_path / "bl.json"
    path.write_text(baseline.dumps(bl))
    assert main(["diff", "--format", "json", "--baseline", str(path), str(r2)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert any(c["key"] == "/bin/b -- 19" and "never seen" in c["detail"] for c in doc["added"])
    monkeypatch.setattr(diff_keys, "MAX_KEYS", 10)
    assert main(["diff", "--format", "json", "--baseline", str(path), str(r2)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [c["kind"] for c in doc["added"] if c["key"] == diff.PAST_CAP] == ["exec"]


def test_a_known_name_at_an_address_in_a_new_local_range_is_added(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Keyed by name, github.com is known; at a loopback address no baseline run used, it is news."""

    def named(address: str) -> dict[str, Any]:
        return dict(connect(9100, address), names=["github.com"])

    built = [
        write(tmp_path / f"r{i}.tar.gz", [*records(), named(a)])
        for i, a in enumerate(("140.82.112.3", "140.82.112.4", "10.0.0.5"))
    ]
    bl = _build(built, tmp_path, capsys)
    (item,) = [n for n in json.loads(bl.read_text())["network"] if n["family"] == "NAME"]
    assert item == {
        "address": "github.com",
        "family": "NAME",
        "port": 443,
        "runs": 3,
        "scopes": {"private": 1, "public": 2},
    }
    assert (
        main(
            [
                "diff",
                "--baseline",
                str(bl),
                str(write(tmp_path / "ok.tar.gz", [*records(), named("140.82.112.9")])),
            ]
        )
        == 0
    )
    capsys.readouterr()
    moved = write(tmp_path / "moved.tar.gz", [*records(), named("127.0.0.77")])
    assert main(["diff", "--baseline", str(bl), "--format", "json", str(moved)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [(c["kind"], c["key"], c["detail"]) for c in doc["added"]] == [
        (
            "network",
            "github.com:443 at a loopback address",
            "127.0.0.77; never seen for this name (its ranges: private in 1, public in 2)",
        )
    ]
    # a private address, seen in one run of three: known at --min-runs 1, news at --min-runs 2
    private = write(tmp_path / "private.tar.gz", [*records(), named("10.0.0.6")])
    assert main(["diff", "--baseline", str(bl), str(private)]) == 0
    assert main(["diff", "--baseline", str(bl), "--min-runs", "2", str(private)]) == 1
    capsys.readouterr()
    # a baseline whose ranges say more runs than the item's: not a baseline
    doc = json.loads(bl.read_text())
    next(n for n in doc["network"] if n["family"] == "NAME")["scopes"]["public"] = 4
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    _one_line_exit_2(["diff", "--baseline", str(bad), str(moved)], capsys, "not a valid baseline")
