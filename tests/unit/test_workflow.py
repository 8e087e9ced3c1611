"""evidence lint --format github: one workflow command per finding, escaped by GitHub's rules, so a
hostile name can neither end its command nor start another."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from evidence.bundle import workflow
from evidence.bundle.text import printable
from evidence.cli import main
from tests.unit.conftest_bundles import connect, open_, records, write

HOSTILE = "/etc/evil\n::error title=forged::pwned,%0A:x\r::warning::y"

# GitHub's parser (actions/runner ActionCommand.TryParseV2): `::name props::message` on one line
_LINE = re.compile(r"^::(?P<name>[a-z-]+)(?: (?P<props>[^:]*))?::(?P<msg>.*)$")


def _unescape_data(s: str) -> str:
    return s.replace("%0D", "\r").replace("%0A", "\n").replace("%25", "%")


def _unescape_prop(s: str) -> str:
    return _unescape_data(s.replace("%3A", ":").replace("%2C", ","))


def parse(line: str) -> tuple[str, dict[str, str], str] | None:
    m = _LINE.match(line)
    if not m:
        return None
    props = {}
    for part in (m.group("props") or "").split(","):
        if part:
            k, _, v = part.partition("=")
            props[k] = _unescape_prop(v)
    return m.group("name"), props, _unescape_data(m.group("msg"))


def test_escaping_rules() -> None:
    assert workflow.escape_data("a%b\r\nc:d,e") == "a%25b%0D%0Ac:d,e"
    assert workflow.escape_property("a%b\r\nc:d,e") == "a%25b%0D%0Ac%3Ad%2Ce"
    assert workflow.command("warning", "m", title="t: x,y") == "::warning title=t%3A x%2Cy::m"
    assert workflow.command("notice", "m") == "::notice::m"


def test_lint_github(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recs = [*records(), open_(9000, HOSTILE, ["write", "create"]), connect(9100, "203.0.113.9", 443)]
    path = write(tmp_path / "a.tar.gz", recs, lost={"ringbuf": 2})
    assert main(["lint", "--format", "github", "--fail-on", "warn", str(path)]) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    parsed = [parse(line) for line in lines]
    commands = [p for p in parsed if p is not None]
    assert [c[0] for c in commands] == ["warning", "warning", "warning"]  # EV001, EV004, EV005
    assert all(c[1]["title"].startswith("evidence EV00") for c in commands)
    ev004 = next(c for c in commands if "EV004" in c[1]["title"])
    # the message is the finding's, control characters written out: one line, no forged command
    assert printable(HOSTILE) in ev004[2] and "\n" not in ev004[2]
    assert sum(1 for line in lines if line.startswith("::")) == 3
    assert lines[-1] == f"evidence lint: {path}: 3 findings; note: not signed"


def test_lint_github_notice_and_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recs = [*records()]
    recs.insert(3, {**recs[2], "t": recs[2]["t"] - 5_000_000_000})  # a clock step back: EV008, a note
    path = write(tmp_path / "a.tar.gz", recs)
    assert main(["lint", "--format", "github", str(path)]) == 0
    commands = [parse(x) for x in capsys.readouterr().out.splitlines() if x.startswith("::")]
    assert [(c[0], c[1]["title"]) for c in commands if c] == [("notice", "evidence EV008 clock-backwards")]


def test_lint_github_bad_bundle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"not a bundle")
    assert main(["lint", "--format", "github", str(bad)]) == 2
    out, err = capsys.readouterr()
    c = parse(out.splitlines()[0])
    assert c is not None and c[0] == "error" and c[1]["title"] == "evidence: bundle failed verification"
    assert err.count("\n") == 1
