"""`evidence recover` beside live runs (an admin's cron, another CI step) never takes a live run's
spool: a run's spool is not a leftover at any moment of its life, including those when its run
record is not written yet or is being replaced (agent/recorder/recovery.py spool_dir_lock). What
recover would take is looked at as fast as it can be (`leftovers`, recover's own choice, in a tight
loop) while runs start and end; and a real `evidence recover` loop runs beside them too."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from evidence.agent.commands.run import RUN_SPOOL_DIR
from evidence.agent.recorder.recovery import SPOOL_SUFFIX, leftovers
from tests.kernel.util import evidence, read_bundle

pytestmark = pytest.mark.kernel


def test_runs_beside_a_recover_loop_keep_their_spools(tmp_path: Path) -> None:
    recovered = tmp_path / "recovered"
    stop = threading.Event()
    chosen: set[str] = set()  # sessions whose spool recover would have taken
    written: list[str] = []

    def look() -> None:
        while not stop.is_set():
            chosen.update(p.name.removesuffix(SPOOL_SUFFIX) for p in leftovers(RUN_SPOOL_DIR))

    def recover_loop() -> None:
        while not stop.is_set():
            written.extend(evidence("recover", "--bundle-dir", str(recovered)).stdout.split())

    threads = [threading.Thread(target=look), threading.Thread(target=recover_loop)]
    for t in threads:
        t.start()
    sessions = []
    try:
        for i in range(8):
            bundle = tmp_path / f"run{i}.tar.gz"
            run = evidence("run", "--bundle", str(bundle), "--", "/bin/true")
            assert run.returncode == 0 and bundle.exists(), run.stderr
            manifest, _ = read_bundle(bundle)
            assert not manifest["cut_short"] and manifest["exit_code"] == 0
            sessions.append(manifest["session_id"])
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    taken = {read_bundle(p)[0]["session_id"] for p in written} & set(sessions)
    assert not taken, f"live runs' spools recovered: {taken}"
    assert not chosen & set(sessions), f"live runs' spools taken for leftovers: {chosen & set(sessions)}"
