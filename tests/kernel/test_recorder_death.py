"""`kill -9` of `evidence run`: the job must not run on unrecorded. The run's watchdog kills every
process of the run (and removes its cgroup) as soon as the recorder is gone, and says so."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from evidence.agent.recorder.cgroups import find_cgroup2_mount
from tests.kernel.util import evidence, of_type, read_bundle

AS_NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--")


def test_the_job_dies_with_its_recorder(tmp_path: Path) -> None:
    shared = Path(tempfile.mkdtemp(dir="/tmp"))  # not tmp_path: its parents are 0700, the job is nobody
    shared.chmod(0o777)
    started, after = shared / "started", shared / "after"
    script = f"touch {started}; sleep 3; touch {after}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "evidence",
            "run",
            "--bundle",
            str(tmp_path / "run.tar.gz"),
            "--",
            *AS_NOBODY,
            "sh",
            "-c",
            script,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not started.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=30)
    time.sleep(4)  # longer than the job would have needed to write `after`
    assert not after.exists(), f"the job ran on after its recorder died: {stderr}"
    assert "died" in stderr and "evidence recover" in stderr, stderr
    # nothing of the run is left: no process of it, no cgroup
    m = re.search(r"run ([0-9a-f]{32})", stderr)
    assert m, stderr
    assert not (find_cgroup2_mount() / "evidence" / m.group(1)).exists()
    leftovers = subprocess.run(["pgrep", "-u", "65534", "-f", "sleep 3"], capture_output=True, text=True)
    assert leftovers.stdout.strip() == ""
    for f in (started, after):
        f.unlink(missing_ok=True)
    shared.rmdir()

    # what was recorded until then becomes a cut-short bundle with `evidence recover`
    out = tmp_path / "recovered"
    rec = evidence("recover", "--bundle-dir", str(out))
    assert rec.returncode == 0, rec.stderr
    written = {read_bundle(p)[0]["session_id"]: Path(p) for p in rec.stdout.split()}
    if m.group(1) not in written:  # another `evidence recover` on this machine was first
        from evidence.agent.commands.run import RUN_SPOOL_DIR

        assert not list(RUN_SPOOL_DIR.glob(f"{m.group(1)}*")), (
            "the run's records were neither kept nor recovered"
        )
        return
    bundle = written[m.group(1)]  # and any other run that died earlier
    manifest, events = read_bundle(bundle)
    assert manifest["cut_short"] is True and manifest["exit_code"] is None
    (d,) = [e["data"] for e in of_type(events, "degradation") if e["data"]["component"] == "evidence run"]
    assert "stopped without finishing" in d["reason"]
    assert evidence("lint", str(bundle)).returncode in (0, 1)  # it verifies
