"""deploy/github/action.yml recording for real: its steps run here (tests/unit/action_runner.py) with
a fake $GITHUB_STEP_SUMMARY/$GITHUB_OUTPUT and this checkout's `evidence`, as root (the action's
sudo path is for a runner's unprivileged user)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from evidence.bundle import reader
from tests.kernel.util import read_bundle
from tests.unit.action_runner import run_action
from tests.unit.test_workflow import parse

EVIDENCE = str(Path(sys.executable).parent / "evidence")


def test_action_records_a_real_run(tmp_path: Path) -> None:
    script = "cat /etc/hostname > /dev/null\necho built > artifact.txt\necho x > /dev/udp/192.0.2.1/9\n"
    res = run_action(
        {"run": script, "evidence": EVIDENCE, "fail-on": "warn", "labels": "suite=kernel"},
        tmp_path,
        dict(os.environ),
    )
    assert (tmp_path / "artifact.txt").read_text() == "built\n"
    out = res.outputs["record"]
    assert out["exit-code"] == "0", res.stdout
    reader.open_bundle(out["bundle"]).verify()
    manifest, events = read_bundle(out["bundle"])
    assert manifest["labels"]["suite"] == "kernel" and manifest["labels"]["github/job"] == "test"
    opened = {e["data"]["path"] for e in events if e["type"] == "dev.evidence.file.open"}
    assert "/etc/hostname" in opened and str(tmp_path / "artifact.txt") in opened
    # the summary and the annotations: the UDP "connect" to 192.0.2.1 is EV005, a warning
    assert res.summary.startswith("### evidence: `bash -eo pipefail -c") and "192.0.2.1:9" in res.summary
    annotations = [parse(x) for x in res.stdout["Report"].splitlines() if x.startswith("::")]
    assert ("warning", "evidence EV005 egress-unenforced") in [
        (a[0], a[1]["title"]) for a in annotations if a
    ]
    # fail-on warn: the step fails, after the summary was written and the upload was asked for
    assert res.failed == "Verdict" and res.codes["Verdict"] == 1
    assert res.uses and res.uses[0][1]["path"] == out["bundle"]


def test_action_passes_a_clean_run(tmp_path: Path) -> None:
    res = run_action({"run": "true", "evidence": EVIDENCE, "upload": "false"}, tmp_path, dict(os.environ))
    assert res.failed is None, res.stdout
    assert res.outputs["report"]["lint-exit-code"] == "0" and "exit 0" in res.summary.splitlines()[0]


def test_action_installs_itself(tmp_path: Path) -> None:
    """With no `evidence` input, the install step makes a venv under $RUNNER_TEMP that sees the
    system's bcc and pip-installs this repository (from the action's path) with its agent extra:
    the run is then recorded with that install (package registries only; bcc is here already, so
    apt is not called)."""
    res = run_action({"run": "echo installed > proof.txt", "upload": "false"}, tmp_path, dict(os.environ))
    assert res.failed is None, (res.stdout, res.codes)
    assert res.ran[0] == "Install evidence"
    installed = res.outputs["install"]["evidence"]
    assert installed == str(tmp_path / "runner-temp" / "evidence-venv" / "bin" / "evidence")
    assert (tmp_path / "proof.txt").read_text() == "installed\n"
    reader.open_bundle(res.outputs["record"]["bundle"]).verify()
