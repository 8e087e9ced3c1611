"""`evidence recover` never takes the spool of a run that is still alive, even in the moments when
that run's spool has no locked run record: from the spool's creation until its record is written
and held, and while the record is replaced by a new file (agent/recorder/recovery.py
spool_dir_lock). A run in those moments holds the spool directory's lock shared; `leftovers` takes
it exclusive."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from evidence.agent.recorder.recovery import RUN_META_SUFFIX, SPOOL_SUFFIX, hold, leftovers, spool_dir_lock


def test_a_spool_without_its_record_yet_is_not_a_leftover_while_its_run_holds_the_directory(
    tmp_path: Path,
) -> None:
    spool = tmp_path / f"live{SPOOL_SUFFIX}"
    got: list[list[Path]] = []
    with spool_dir_lock(tmp_path, exclusive=False):  # a run between its spool and its record
        spool.write_bytes(b"")
        looking = threading.Thread(target=lambda: got.append(leftovers(tmp_path)))
        looking.start()
        time.sleep(0.3)
        assert not got, "leftovers were chosen while a run was between its spool and its record"
        record = tmp_path / f"live{RUN_META_SUFFIX}"
        record.write_text("{}")
        fd = hold(record)  # its record, held: alive from now on
    looking.join(timeout=10)
    assert got == [[]]
    os.close(fd)
    assert leftovers(tmp_path) == [spool]  # its holder gone: a dead run's


def test_the_lock_is_shared_between_runs(tmp_path: Path) -> None:
    with spool_dir_lock(tmp_path, exclusive=False):
        done = threading.Event()

        def other_run() -> None:
            with spool_dir_lock(tmp_path, exclusive=False):
                done.set()

        threading.Thread(target=other_run).start()
        assert done.wait(10)


def test_no_directory_locks_nothing(tmp_path: Path) -> None:
    with spool_dir_lock(tmp_path / "missing", exclusive=True):
        pass
    assert leftovers(tmp_path / "missing") == []
