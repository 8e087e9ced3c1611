"""deploy/github/action.yml, its steps run here (tests/unit/action_runner.py) with a fake $GITHUB_*
and a stand-in for `evidence run` that writes a prepared bundle and runs the command (no root, no
BPF); show and lint are the real ones. tests/kernel/test_github_action.py records for real."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
import yaml

from evidence.bundle import reader
from tests.unit import hostile_names
from tests.unit.action_runner import ACTION, run_action
from tests.unit.conftest_bundles import connect, records, write
from tests.unit.test_show_markdown import ALLOWED, gfm
from tests.unit.test_workflow import parse

FAKE = """#!/bin/bash
# evidence, except that `run` copies $FAKE_BUNDLE to --bundle and runs the command itself
if [ "$1" = run ]; then
  shift
  while [ "$1" != -- ]; do
    [ "$1" = --bundle ] && bundle=$2
    echo "$1" >> "$FAKE_ARGS"
    shift
  done
  shift
  [ "$FAKE_BUNDLE" = none ] && exit 70
  "$@"
  code=$?
  cp "$FAKE_BUNDLE" "$bundle"
  exit $code
fi
exec {python} -m evidence "$@"
"""


@pytest.fixture
def fake(tmp_path: Path) -> dict[str, str]:
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "evidence").write_text(FAKE.format(python=sys.executable))
    for name, body in (("sudo", 'while [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"'),
                       ("setpriv", 'while [ "$1" != -- ]; do shift; done\nshift\nexec "$@"')):  # fmt: skip
        (bin_ / name).write_text(f"#!/bin/bash\n{body}\n")
    for f in bin_.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IXUSR)
    env = dict(os.environ)
    env["PATH"] = f"{bin_}:{env['PATH']}"
    env["FAKE_ARGS"] = str(tmp_path / "args")
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    return env


def test_action_file() -> None:
    spec = yaml.safe_load(ACTION.read_text())
    assert spec["runs"]["using"] == "composite" and "post" not in spec["runs"]
    for step in spec["runs"]["steps"]:
        if "run" in step:  # inputs reach scripts through env only: no ${{ }} in a script
            assert "${{" not in step["run"] and step["shell"] == "bash", step["name"]
    assert {"run", "fail-on", "upload", "evidence"} <= set(spec["inputs"])
    assert [s["uses"] for s in spec["runs"]["steps"] if "uses" in s] == ["actions/upload-artifact@v4"]


def test_action_records_reports_uploads(tmp_path: Path, fake: dict[str, str]) -> None:
    bundle = write(tmp_path / "prepared.tar.gz")
    fake["FAKE_BUNDLE"] = str(bundle)
    inputs = {"run": "echo hello from the job > out.txt\necho done", "evidence": "evidence",
              "labels": "team=build\n\nkind=test"}  # fmt: skip
    res = run_action(inputs, tmp_path, fake)
    assert res.failed is None, res.stdout
    assert res.ran == ["Record the command", "Report", "Upload the bundle", "Verdict"]
    assert (tmp_path / "out.txt").read_text() == "hello from the job\n"  # the command ran, in the workdir
    assert "done" in res.stdout["Record the command"]
    out = res.outputs["record"]
    assert out["exit-code"] == "0" and res.outputs["report"]["lint-exit-code"] == "0"
    assert Path(out["bundle"]).parent.parent == tmp_path / "runner-temp"
    reader.open_bundle(out["bundle"]).verify()
    assert res.summary.startswith("### evidence: `make test` · exit 0")
    assert res.uses == [
        ("actions/upload-artifact@v4",
         {"name": out["artifact-name"], "path": out["bundle"], "if-no-files-found": "error"})
    ]  # fmt: skip
    assert out["artifact-name"].startswith("evidence-test-")
    args = (tmp_path / "args").read_text().splitlines()
    assert args[args.index("team=build") - 1 : args.index("kind=test") + 1] == [
        "--label",
        "team=build",
        "--label",
        "kind=test",
    ]
    assert "github/repository=example/repo" in args and "github/run=7.1" in args
    assert res.action_outputs["bundle"] == out["bundle"] and res.action_outputs["exit-code"] == "0"


def test_action_fails_on_findings_at_the_level(tmp_path: Path, fake: dict[str, str]) -> None:
    bundle = write(tmp_path / "prepared.tar.gz", [*records(), connect(9000, "203.0.113.9")])  # EV005
    fake["FAKE_BUNDLE"] = str(bundle)
    res = run_action({"run": "true", "evidence": "evidence"}, tmp_path / "a", fake)
    assert res.failed is None  # a warning, and fail-on: error
    annotations = [parse(x) for x in res.stdout["Report"].splitlines() if x.startswith("::")]
    assert [(a[0], a[1]["title"]) for a in annotations if a] == [
        ("warning", "evidence EV005 egress-unenforced")
    ]

    res = run_action(
        {"run": "true", "evidence": "evidence", "fail-on": "warn", "upload": "false"}, tmp_path / "b", fake
    )
    assert res.failed == "Verdict" and res.codes["Verdict"] == 1
    assert "Upload the bundle" not in res.ran and res.summary  # the summary is written all the same
    assert "::error title=evidence::lint findings at or above 'warn'" in res.stdout["Verdict"]


def test_action_keeps_the_commands_exit_code(tmp_path: Path, fake: dict[str, str]) -> None:
    fake["FAKE_BUNDLE"] = str(write(tmp_path / "prepared.tar.gz", exit_code=3))
    res = run_action({"run": "echo before; exit 3; echo after", "evidence": "evidence"}, tmp_path, fake)
    assert res.failed == "Verdict" and res.codes["Verdict"] == 3
    assert "before" in res.stdout["Record the command"] and "after" not in res.stdout["Record the command"]
    assert "Upload the bundle" in res.ran and res.outputs["record"]["exit-code"] == "3"


def test_action_when_the_recorder_cannot_start(tmp_path: Path, fake: dict[str, str]) -> None:
    fake["FAKE_BUNDLE"] = "none"
    res = run_action({"run": "touch ran", "evidence": "evidence"}, tmp_path, fake)
    assert res.failed == "Verdict" and res.codes["Verdict"] == 70
    assert res.ran == ["Record the command", "Verdict"] and not (tmp_path / "ran").exists()
    assert (
        "::error title=evidence::the command was not recorded (evidence run exited 70)"
        in res.stdout["Record the command"]
    )


def test_action_summary_with_hostile_names(tmp_path: Path, fake: dict[str, str]) -> None:
    fake["FAKE_BUNDLE"] = str(hostile_names.bundle(tmp_path / "prepared.tar.gz"))
    res = run_action({"run": "true", "evidence": "evidence", "upload": "false"}, tmp_path, fake)
    assert res.failed is None
    page = gfm(res.summary)  # as GitHub renders the job summary
    assert set(page.tags) <= ALLOWED and hostile_names.SCRIPT in page.code
    lines = res.stdout["Report"].splitlines()
    assert all(parse(x) is not None for x in lines[:-1]) and lines[-1].startswith("evidence lint: ")
