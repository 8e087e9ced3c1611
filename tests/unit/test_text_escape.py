"""Hostile names cannot forge lines in human output: a newline, a carriage return, an ANSI escape or
a right-to-left override in a path, argv or label is shown escaped by show, lint and diff (text and
markdown); JSON keeps the exact string."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evidence.bundle.text import join_lines, printable
from evidence.cli import main
from tests.unit import conftest_bundles as cb

FORGED = "x\n0 findings: 0 errors, 0 warnings, 0 notes\r\x1b[2Jdone\u202etxt.exe"


def test_printable_escapes_what_could_spoof_a_line() -> None:
    assert printable("a\nb\rc\td\x1be\u202ef\u2028g\x7f") == "a\\nb\\rc\\td\\x1be\\u202ef\\u2028g\\x7f"
    assert printable("ordinary /päth (x2) ✓") == "ordinary /päth (x2) ✓"
    assert join_lines(["one", "two\nthree"]) == "one\ntwo\\nthree\n"


@pytest.fixture
def hostile(tmp_path: Path) -> tuple[Path, Path]:
    recs = cb.records() + [
        cb.open_(8500, "/etc/" + FORGED, ["write", "create"]),  # outside the workspace: a lint finding
        cb.exec_(8600, 104, 101, "/bin/echo", ["echo", FORGED], depth=1),
    ]
    a = cb.write(tmp_path / "a.tar.gz", recs, labels={"job": FORGED})
    b = cb.write(tmp_path / "b.tar.gz", session_id="sess-2")
    return a, b


def _check(out: str) -> None:
    assert "\x1b" not in out and "\r" not in out and "\u202e" not in out
    assert not any(line.startswith("0 findings") for line in out.splitlines()), out
    assert "\\n0 findings" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["show", "{a}", "--limit", "0"],
        ["lint", "{a}", "--fail-on", "none"],
        ["diff", "{b}", "{a}"],
        ["diff", "{b}", "{a}", "--format", "markdown"],
    ],
)
def test_human_outputs_escape_hostile_names(
    hostile: tuple[Path, Path], argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = hostile
    main([arg.format(a=a, b=b) for arg in argv])
    _check(capsys.readouterr().out)


def test_json_keeps_the_exact_name(hostile: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    a, b = hostile
    main(["diff", str(b), str(a), "--format", "json"])

    def strings(obj: object) -> list[str]:
        if isinstance(obj, str):
            return [obj]
        if isinstance(obj, dict):
            return [s for v in obj.values() for s in strings(v)]
        if isinstance(obj, list):
            return [s for v in obj for s in strings(v)]
        return []

    assert any(FORGED in s for s in strings(json.loads(capsys.readouterr().out)))
