"""The bundle cannot be written (disk full): the job's outcome is not lost. `run` says how the command
exited, exits 70, and keeps the records (spool and run record) for `evidence recover`."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from evidence.agent.commands.run import RUN_SPOOL_DIR
from evidence.agent.recorder.recovery import RUN_META_SUFFIX as RUN_RECORD_SUFFIX
from tests.kernel.util import evidence, of_type, read_bundle


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "full"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        # a process that outlives `evidence run` for a moment (the recorder's detaching child) may
        # still hold it: retry, then detach it lazily rather than leave a mount behind
        for _ in range(50):
            if subprocess.run(["umount", str(mnt)], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        else:
            subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_disk_full_keeps_the_exit_code_and_the_records(full_disk: Path, tmp_path: Path) -> None:
    proc = evidence(
        "run",
        "--bundle",
        str(full_disk / "run.tar.gz"),
        "--",
        "sh",
        "-c",
        "ls -R /etc > /dev/null 2>&1; exit 7",
    )
    assert proc.returncode == 70, proc.stderr
    # (other runs on this machine may have left records: `run` then says so on a line of its own)
    lines = [line for line in proc.stderr.strip().splitlines() if "earlier run(s) left records" not in line]
    assert len(lines) == 1 and "the command exited 7" in lines[0] and "evidence recover" in lines[0], (
        proc.stderr
    )
    assert not list(full_disk.glob("*"))  # no partial bundle
    records = [json.loads(p.read_text()) for p in RUN_SPOOL_DIR.glob(f"*{RUN_RECORD_SUFFIX}")]
    mine = [r for r in records if r.get("bundle_path") == str(full_disk / "run.tar.gz")]
    assert len(mine) == 1 and mine[0]["exit_code"] == 7
    spool = RUN_SPOOL_DIR / f"{mine[0]['session_id']}.spool.zst"
    assert spool.stat().st_size > 0

    # once there is room, `evidence recover` writes the complete bundle, with the exit code
    room = tmp_path / "room"
    room.mkdir()
    rec = evidence("recover", "--bundle-dir", str(room))
    assert rec.returncode == 0, rec.stderr
    written = {read_bundle(p)[0]["session_id"]: p for p in rec.stdout.split()}
    manifest, events = read_bundle(written[mine[0]["session_id"]])
    assert manifest["exit_code"] == 7 and manifest["cut_short"] is False
    assert manifest["command"] == ["sh", "-c", "ls -R /etc > /dev/null 2>&1; exit 7"]
    assert of_type(events, "file.open")  # the records are all there
    assert not spool.exists()
