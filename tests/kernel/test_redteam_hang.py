"""Red team: hang the recorder. A job (as nobody) runs a program from a directory it owns and, while
the recorder is still to read it, renames a FIFO over its path. The recorder reads the program's
first bytes by path (is it a script? a 32-bit ELF?) as root: a plain open of a FIFO waits for a
writer, for ever. `evidence run` wrote its bundle and then hung at exit (its hash worker never
returned; SIGTERM is forwarded to the job, which is gone); through an agent, its two hash workers
would hang for good and every later exec wait 10 s for its hash. docs/threat-model.md, row 31."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kernel.util import as_user, of_type, read_bundle

NOBODY = 65534

_JOB = """
cd "$1"
for i in 1 2 3; do
  cp /usr/bin/sleep prog$i
  ./prog$i 0.5 &
  mkfifo f$i && mv -f f$i prog$i
done
wait
"""


@pytest.fixture
def place() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="evidence-test-rt-", dir="/tmp"))
    d.chmod(0o777)
    yield d
    shutil.rmtree(d)


def _unblock(place: Path) -> None:
    """Open each FIFO for writing: a reader waiting in open() gets its writer, then EOF."""
    for fifo in place.glob("prog*"):
        with contextlib.suppress(OSError):  # ENXIO: no reader waiting
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_a_fifo_renamed_over_a_program_that_ran_does_not_hang_the_recorder(
    tmp_path: Path, place: Path
) -> None:
    bundle = tmp_path / "run.tar.gz"
    proc = subprocess.Popen(
        [sys.executable, "-m", "evidence", "run", "--bundle", str(bundle), "--",
         *as_user(NOBODY, "/bin/sh", "-c", _JOB, "sh", str(place))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 90  # a hash given up takes 10 s; the run itself ~1 s
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    hung = proc.poll() is None
    if hung:
        _unblock(place)  # let it finish (and clean up after itself) before failing
    _, stderr = proc.communicate(timeout=120)
    assert not hung, f"evidence run hung (bundle written: {bundle.exists()})"
    assert proc.returncode == 0, stderr
    _, events = read_bundle(bundle)
    progs = [
        e["data"] for e in of_type(events, "process.exec") if e["data"]["filename"].startswith(str(place))
    ]
    assert len(progs) == 3 and all(p["result"] == 0 for p in progs)
    assert all(p["argv"][1] == "0.5" for p in progs)
