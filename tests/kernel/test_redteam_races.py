"""Red team: races between the threads of a hostile job (as nobody) that make the bundle name the
wrong file, made deterministic (an open held in flight by a FIFO). docs/threat-model.md, row 28."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.kernel.util import PY, as_user, of_type, record

NOBODY = 65534


def test_a_cwd_changed_while_an_open_is_in_flight_does_not_rename_what_was_opened(
    tmp_path: Path, place: Path
) -> None:
    """A thread opens "fifo" in REAL (the lookup is done, the open waits for a writer); another
    thread then changes the cwd to DECOY and opens REAL/fifo for writing, which completes the first
    open. The bundle named DECOY/fifo (no such file), result 0, in summary and full detail alike.
    The same race without a FIFO (a thread flipping the cwd between /etc and DECOY while another
    opens "passwd" 50,000 times, in C) recorded every successful read of /etc/passwd as
    DECOY/passwd in 2 runs of 3 (16,815 and 10,590 opens), none in the third: a job can retry until
    it wins. Correct: REAL/fifo, or a name that says the cwd is not known."""
    real, decoy = place / "real", place / "decoy"
    real.mkdir()
    real.chmod(0o777)
    decoy.mkdir()
    decoy.chmod(0o755)
    script = textwrap.dedent(
        f"""
        import os, threading, time
        os.chdir({str(real)!r})
        os.mkfifo('fifo')
        got = []
        def reader():
            fd = os.open('fifo', os.O_RDONLY)
            got.append(os.read(fd, 16))
        t = threading.Thread(target=reader)
        t.start()
        wchan = f'/proc/self/task/{{t.native_id}}/wchan'
        for _ in range(3000):  # the lookup is done: it waits for a writer
            if open(wchan).read() == 'wait_for_partner':
                break
            time.sleep(0.01)
        else:
            raise SystemExit('the reader never waited in the open')
        os.chdir({str(decoy)!r})
        w = os.open({str(real / "fifo")!r}, os.O_WRONLY)
        os.write(w, b'through the fifo')
        t.join()
        assert got == [b'through the fifo'], got
        """
    )
    for detail in ("summary", "full"):
        proc, _, events = record(
            tmp_path, *as_user(NOBODY, PY, "-c", script), extra=("--detail", detail), name=f"{detail}.tar.gz"
        )
        assert proc.returncode == 0, proc.stderr
        (rec,) = [e["data"] for e in of_type(events, "file.open") if e["data"]["raw_path"] == "fifo"]
        assert rec["result"] == 0
        assert rec["path"] == str(real / "fifo"), detail  # the directory a chdir of the run entered
        (real / "fifo").unlink()
