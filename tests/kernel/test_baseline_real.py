"""A baseline from three real recordings of the same job; a fourth run that reads one more file and
talks to one more address is reported for exactly those (the temp names and pids that differ
between runs are normalised away)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.kernel.util import evidence, record

JOB = 'd=$(mktemp -d); echo x > "$d/out"; cat /etc/hostname > /dev/null; rm -r "$d"'


def test_baseline_of_three_real_runs(tmp_path: Path) -> None:
    bundles = []
    for i in range(3):
        proc, _, _ = record(tmp_path, "/bin/bash", "-c", JOB, name=f"r{i}.tar.gz", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        bundles.append(str(tmp_path / f"r{i}.tar.gz"))
    built = evidence("baseline", "build", *bundles)
    assert built.returncode == 0, built.stderr
    doc = json.loads(built.stdout)
    assert doc["runs"] == 3
    assert {"access": "read", "path": "/etc/hostname", "runs": 3} in doc["file"]
    baseline = tmp_path / "baseline.json"
    baseline.write_text(built.stdout)

    proc, _, _ = record(tmp_path, "/bin/bash", "-c", JOB, name="same.tar.gz", cwd=tmp_path)
    same = evidence("diff", "--baseline", str(baseline), str(tmp_path / "same.tar.gz"))
    assert same.returncode == 0, same.stdout + same.stderr

    # (/etc/os-release is a symlink: the bundle names the file read, the kernel's name of it)
    os_release = os.path.realpath("/etc/os-release")
    new_job = JOB + "; cat /etc/os-release > /dev/null; echo x > /dev/udp/192.0.2.7/9"
    proc, _, _ = record(tmp_path, "/bin/bash", "-c", new_job, name="new.tar.gz", cwd=tmp_path)
    new = evidence("diff", "--baseline", str(baseline), "--format", "json", str(tmp_path / "new.tar.gz"))
    assert new.returncode == 1, new.stderr
    added = {(c["kind"], c["key"]) for c in json.loads(new.stdout)["added"]}
    assert ("file", os_release) in added and ("network", "192.0.2.7:9") in added
    # besides those: the job's own command line (it changed) and the cat that read the file; the
    # temp directory (mktemp's tmp.XXXXXXXXXX, another each run) is not news
    assert {key for kind, key in added if kind == "file"} == {os_release}, added
    assert {kind for kind, _ in added} == {"file", "network", "exec"}, added


def test_a_flood_of_distinct_execs_is_bounded_and_still_a_difference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 22, item 7. A job (as nobody) runs 400 distinct command lines, then one more program:
    a bundle of 1.5M such execs took `diff` 3 GB and `baseline build` 3.4 GB. With the cap on keys a
    side keeps made small (diff_keys.MAX_KEYS 100, in process: the same code as 200,000), both keep at most
    that many keys; the execs past it are a difference of their own (added), so the default gate
    fails and the program after the flood cannot hide in it."""
    from evidence.bundle import baseline, diff, diff_keys
    from evidence.cli import main
    from tests.kernel.util import PY, as_user

    quiet = tmp_path / "quiet.tar.gz"
    proc, _, _ = record(tmp_path, *as_user(65534, "/bin/true"), name="quiet.tar.gz", cwd="/tmp")
    assert proc.returncode == 0, proc.stderr
    flood = "import subprocess\nfor i in range(400):\n    subprocess.run(['/bin/true', str(i)])\nsubprocess.run(['/bin/echo', 'after'])\n"
    proc, _, _ = record(tmp_path, *as_user(65534, PY, "-c", flood), name="flood.tar.gz", cwd="/tmp")
    assert proc.returncode == 0, proc.stderr
    monkeypatch.setattr(diff_keys, "MAX_KEYS", 100)
    b = diff_keys.behaviour(str(tmp_path / "flood.tar.gz"))
    assert sum(map(len, (b.execs, b.files, b.network, b.denials))) <= 100 and b.budget.past["exec"] > 200
    bl = baseline.build([str(quiet), str(tmp_path / "flood.tar.gz")], [])
    assert len(bl.exec) + len(bl.file) + len(bl.network) + len(bl.denial) <= 100
    assert main(["diff", "--format", "json", str(quiet), str(tmp_path / "flood.tar.gz")]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [c["kind"] for c in doc["added"] if c["key"] == diff.PAST_CAP] == ["exec"]
