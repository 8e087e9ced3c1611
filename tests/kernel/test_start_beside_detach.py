"""A start beside an earlier run's teardown (issue 27): an `evidence-detach` (what `evidence run`
leaves to close its perf events, a grace period each under the kernel's event_mutex) closes none
while a start holds probes.loader's attach lock, and finishes once it is let go, closing every one."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evidence.agent.recorder.kernel import mount_tracefs
from evidence.probes.headers import ensure_headers
from evidence.probes.loader import ATTACH_LOCK, attaching

pytestmark = pytest.mark.kernel

# loads the probes, leaves them to an evidence-detach as `evidence run` does, says its pid, exits
# (the child names itself after the fork, while close() returns: looked for until it has)
RUN = """
import os
import time
from evidence.probes.loader import load_probes
p = load_probes()
p.close(background=True)
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    for pid in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        comm, _, rest = stat.partition("(")[2].rpartition(")")
        if comm == "evidence-detach" and int(rest.split()[1]) == os.getpid():
            print(pid, flush=True)
            raise SystemExit(0)
    time.sleep(0.01)
raise SystemExit("no evidence-detach child named itself within 30 s")
"""


def _perf_events(pid: int) -> int:
    n = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            n += os.readlink(fd) == "anon_inode:[perf_event]"
        except OSError:
            continue
    return n


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_a_detach_closes_nothing_while_a_start_attaches_and_everything_after() -> None:
    mount_tracefs()
    ensure_headers()
    with attaching(wait=30):  # a start, attaching
        out = subprocess.run([sys.executable, "-c", RUN], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        detach = int(out.stdout.split()[0])  # its parent gone: it wants to close its perf events now
        held = _perf_events(detach)
        assert held >= 100  # the recorder's syscall tracepoints (112 here)
        time.sleep(0.5)  # it would have closed several by now (~40 ms each)
        assert _alive(detach) and _perf_events(detach) == held
    deadline = time.monotonic() + 120
    while _alive(detach) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(detach), "the detach closed its perf events and exited once the start was done"


def test_a_detach_holds_nothing_of_the_run_but_the_probes_attachments(tmp_path: Path) -> None:
    """evidence-detach outlives `evidence run` by seconds: it must not hold what other processes
    wait on (a launcher's or the watchdog's pipe: a run refused before launching waited forever for
    its helper's exit) nor the run's files, only the perf events and its own pipe."""
    mount_tracefs()
    ensure_headers()
    key = tmp_path / "k"
    assert (
        subprocess.run([sys.executable, "-m", "evidence", "keygen", "--out", str(key)], timeout=60).returncode
        == 0
    )
    key.chmod(0o644)  # refused after the probes started loading, with the launcher started
    with attaching(wait=30):  # holds the detach before its perf events close
        run = subprocess.run(
            [sys.executable, "-m", "evidence", "run", "--sign-key", str(key), "--bundle", str(tmp_path / "b.tar.gz"),
             "--", "/bin/true"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert run.returncode == 2 and "accessible by others" in run.stderr, run.stderr
        # ours: a fork of that `evidence run`, its command line the same
        detach = [p for p in _detaches() if str(tmp_path) in Path(f"/proc/{p}/cmdline").read_text()]
        assert detach, "the refused run's probes were handed to an evidence-detach"
        for pid in detach:
            # it closes what it inherited as it starts: read its descriptors until they settle
            deadline = time.monotonic() + 10
            while True:
                kinds, pipes = _held(pid)
                if (
                    kinds <= {"anon_inode", "pipe", str(ATTACH_LOCK)} and pipes == 1
                ) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert kinds <= {"anon_inode", "pipe", str(ATTACH_LOCK)}, kinds
            assert pipes == 1, "its own pipe to evidence run, nothing else's"


def _held(pid: int) -> tuple[set[str], int]:
    """The kinds of what `pid` holds past stdio, and how many pipes (a descriptor closed while it is
    read is skipped)."""
    kinds: set[str] = set()
    pipes = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        if int(fd.name) <= 2:
            continue
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        kinds.add(target.split(":")[0] if target.startswith("anon_inode") else target.split(":[")[0])
        pipes += target.startswith("pipe:")
    return kinds, pipes


def _detaches() -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            comm, _, rest = stat.read_text().partition("(")[2].rpartition(")")
            if comm == "evidence-detach" and rest.split()[0] != "Z":
                out.append(int(stat.parent.name))
    return out
