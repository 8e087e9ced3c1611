"""show (text, markdown, html) and lint over a run governed by `commands` rules: execs refused by
rule, approvals answered, timed out, withdrawn or left open, execs an `audit` rule matched; lint's
EV019 (an approval decided by the timeout), EV020 (an exec refused by a rule) and EV022 (an exec
audited), with --explain; audited execs past the run's cap counted as lost (EV001)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from evidence.bundle import format as fmt
from evidence.bundle.lint_rules import RULES
from evidence.cli import main
from tests.unit.conftest_bundles import T0, approval, audit, denial, records, write


def exec_denial(t: int, target: str, rule: str, enforced: bool = True) -> dict[str, Any]:
    d = denial(t, target, "exec")
    return {**d, "exe": None, "rule": rule, "enforced": enforced, "result": "EACCES" if enforced else 0}


def governed(tmp_path: Path) -> Path:
    at = fmt.format_time(T0 + 1000)
    recs = [
        *records(),
        exec_denial(9100, "/usr/bin/curl", "commands.rules[2] (no-network-tools)"),
        exec_denial(9200, "/usr/bin/curl", "commands.rules[2] (no-network-tools)"),
        exec_denial(9300, "/usr/bin/nc", "commands.default", enforced=False),
        approval(9400),
        approval(9500, "allowed", via="api", by_uid=1000, reason="reviewed \x1b[2J the branch"),
        {**approval(9600), "id": "a2", "requested_at": at},
        {**approval(9700, "denied", via="timeout", by_uid=None, reason="no answer in 60s"), "id": "a2"},
        {**approval(9800), "id": "a3", "requested_at": at},
        {**approval(9850, "denied", via="withdrawn", by_uid=None, reason="the run ended"), "id": "a3"},
        {**approval(9900), "id": "a4", "requested_at": at},
        audit(9950),
        audit(9960, argv=["git", "push", "--tags"]),
    ]
    return write(tmp_path / "cmds.tar.gz", recs)


def test_show_text_lists_refused_execs_by_rule_and_each_approval(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["show", str(governed(tmp_path))]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines.index("Commands (2 refused execs by rule, 4 approvals, 1 audited by rule):")
    section = lines[start + 1 : start + 8]
    assert section[:2] == [
        "  commands.default: would refuse /usr/bin/nc",
        "  commands.rules[2] (no-network-tools): refused /usr/bin/curl (x2)",
    ]
    what = "exec of /usr/bin/git (git push --force) by commands.rules[0] (no-force-push)"
    t = fmt.format_time
    assert section[2:] == [
        f"  approval a1 {what}: allowed by uid 1000 via api at {t(T0 + 9500)}: reviewed \\x1b[2J the branch",
        f"  approval a2 {what}: timed out at {t(T0 + 9700)}, denied (approvals.on_timeout)",
        f"  approval a3 {what}: withdrawn at {t(T0 + 9850)} (the run ended): it did not run",
        f"  approval a4 {what}: requested {t(T0 + 1000)}, no answer recorded",
        "  audit commands.rules[1] (note-pushes): ran /usr/bin/git (x2)",
    ]


def test_show_markdown_and_html_carry_the_same_section(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(governed(tmp_path))
    assert main(["show", "--format", "markdown", path]) == 0
    md = capsys.readouterr().out
    assert "Commands (2 refused, 4 approvals, 1 audited)" in md
    assert "| audit | `commands.rules[1] (note-pushes): ran /usr/bin/git` | 2 |" in md
    assert "commands.rules[2] (no-network-tools): refused /usr/bin/curl" in md and "| 2 |" in md
    assert "allowed by uid 1000 via api" in md and "\x1b" not in md
    assert main(["show", "--format", "html", path]) == 0
    page = capsys.readouterr().out
    assert "<h2>Commands (2 refused, 4 approvals, 1 audited)</h2>" in page
    assert "commands.rules[1] (note-pushes): ran /usr/bin/git" in page
    assert "timed out at" in page and "commands.default: would refuse /usr/bin/nc" in page
    # a run without command rules shows no such section
    plain = str(write(tmp_path / "plain.tar.gz"))
    for f in ("text", "markdown", "html"):
        assert main(["show", "--format", f, plain]) == 0
        assert "Commands (" not in capsys.readouterr().out


def test_lint_reports_a_timed_out_approval_and_refused_execs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(governed(tmp_path))
    assert main(["lint", "--format", "json", "--fail-on", "warn", path]) == 1
    found = [
        f for f in json.loads(capsys.readouterr().out)["findings"] if f["rule"] in ("EV019", "EV020", "EV022")
    ]
    by = sorted((f["rule"], f["message"], f["count"]) for f in found)
    assert by == [
        (
            "EV019",
            "exec of /usr/bin/git waited for approval by commands.rules[0] (no-force-push): nobody "
            "answered, denied by the timeout",
            1,
        ),
        # the two refusals are one summary event (count 2): lint counts events
        ("EV020", "exec of /usr/bin/curl refused by commands.rules[2] (no-network-tools)", 1),
        ("EV020", "exec of /usr/bin/nc would be refused (dry run) by commands.default", 1),
        # each audited exec is an event of its own: counted by rule and program
        ("EV022", "exec of /usr/bin/git audited by commands.rules[1] (note-pushes)", 2),
    ]
    for code, name in (("EV019", "approval-timed-out"), ("EV020", "exec-refused"), ("EV022", "exec-audited")):
        assert RULES[code].name == name and RULES[code].severity == ("note" if code == "EV022" else "warning")
        for ask in (code, name):
            assert main(["lint", "--explain", ask]) == 0
            assert RULES[code].explain in capsys.readouterr().out
    # answered, withdrawn or open approvals are no finding; a run without them has neither rule
    assert main(["lint", "--format", "json", str(write(tmp_path / "plain.tar.gz"))]) == 0
    rules = {f["rule"] for f in json.loads(capsys.readouterr().out)["findings"]}
    assert not rules & {"EV019", "EV020", "EV022"}


def test_audited_execs_past_the_cap_are_counted_and_lint_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The recorder keeps the first AUDIT_RECORDS_MAX audit records of a run and counts the rest as
    lost (agent/recorder/command_rules.py): the bundle says how many, and lint's EV001 says so."""
    path = write(tmp_path / "capped.tar.gz", [*records(), audit(9950)], lost={"audit_past_cap": 99_000})
    assert main(["lint", "--format", "json", str(path)]) == 0
    found = {f["rule"]: f for f in json.loads(capsys.readouterr().out)["findings"]}
    assert "audit_past_cap: 99000" in found["EV001"]["message"] and found["EV022"]["count"] == 1
