"""Resource limits on a real cgroup (agent/recorder/limits.py), with the job run as nobody: a memory
hog is OOM-killed at limits.memory and the kill is read back and named; a fork bomb is stopped at
limits.pids and its refused forks are counted; the cpu quota is written where the host keeps it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from evidence.agent.recorder.cgroups import RunCgroup
from evidence.agent.recorder.limits import AppliedLimits, LimitWatcher, apply, detect, name_victims
from evidence.policy.governance import LimitsPolicy
from tests.kernel.util import PY, as_user

NOBODY = 65534


@pytest.fixture
def run_cgroup() -> Iterator[RunCgroup]:
    cg = RunCgroup.create(f"limits-test-{uuid.uuid4().hex[:12]}")
    yield cg
    cg.kill()
    cg.wait_empty()
    cg.remove()


def _applied(limits: dict[str, object], cg: RunCgroup) -> Iterator[AppliedLimits]:
    applied = apply(LimitsPolicy.model_validate(limits), cg.path)
    try:
        yield applied
    finally:
        applied.remove()


def _in_all(applied: AppliedLimits, cg: RunCgroup, *argv: str) -> list[str]:
    """`argv` started in the run's v2 cgroup and its v1 ones: a shell moves itself in, then execs."""
    procs = [cg.procs_file(), *(str(d / "cgroup.procs") for d in applied.v1_dirs())]
    script = (
        'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 99; shift; n=$((n-1)); done; exec "$@"'
    )
    return ["/bin/sh", "-c", script, "sh", str(len(procs)), *procs, *argv]


HOG = """\
import sys
chunks = []
for _ in range(256):                     # up to 4 GiB, 16 MiB at a time, every page touched
    chunks.append(bytearray(16 << 20))
print("not killed", flush=True)
"""


def test_memory_hog_is_oom_killed_and_the_kill_is_read_and_named(run_cgroup: RunCgroup) -> None:
    hier = detect()
    assert "memory" in hier, "this host has no memory controller"
    for applied in _applied({"memory": "64MiB"}, run_cgroup):
        assert applied.degradations == []
        place = applied.placements["memory"]
        if place.version == 1:  # this VM: memory is a v1 hierarchy, the run got a cgroup there
            assert place.made and (place.path / "memory.limit_in_bytes").read_text().strip() == str(64 << 20)
        watcher = LimitWatcher(applied)
        assert watcher.poll() == []
        since = time.time_ns()
        proc = subprocess.run(
            _in_all(applied, run_cgroup, *as_user(NOBODY, PY, "-c", HOG)),
            capture_output=True,
            text=True,
            timeout=120,
        )
        died = time.time_ns()
        assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)
        assert "not killed" not in proc.stdout
        events = {e.kind: e for e in watcher.poll()}
        assert events["oom_kill"].count == 1 and events["oom_kill"].limit == "memory"
        if place.version == 2:
            assert events["memory_max"].count >= 1
        assert watcher.poll() == []  # counted once
        # the recorder's exit records name the victim: here the one process of the job, whose
        # exit (SIGKILL) the test saw as the recorder would
        exits = [{"pid": 4242, "signal": "SIGKILL", "t": died}, {"pid": 7, "signal": None, "t": died}]
        named = name_victims(events["oom_kill"], exits, since)
        assert named.pids == (4242,) and named.certain


BOMB = """\
import os, sys, time
sys.stdin.readline()                     # wait until the test has put this process in the cgroups
kids, refused = [], 0
for _ in range(200):
    try:
        pid = os.fork()
    except BlockingIOError:              # EAGAIN: pids.max reached
        refused += 1
        continue
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    kids.append(pid)
for pid in kids:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
print(len(kids), refused, flush=True)
"""


def test_fork_bomb_stops_at_pids_max_and_is_counted(run_cgroup: RunCgroup) -> None:
    assert "pids" in detect(), "this host has no pids controller"
    for applied in _applied({"pids": 20}, run_cgroup):
        assert applied.degradations == []
        watcher = LimitWatcher(applied)
        proc = subprocess.Popen(
            as_user(NOBODY, PY, "-c", BOMB), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            Path(run_cgroup.procs_file()).write_text(f"{proc.pid}\n")
            applied.enter(proc.pid)  # the v1 cgroups, where this host has them
            out, _ = proc.communicate("go\n", timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
        forked, refused = map(int, out.split())
        assert forked == 19 and refused == 200 - 19  # the bomb itself is one of the 20
        events = {e.kind: e for e in watcher.poll()}
        assert events["fork_refused"].count == refused and events["fork_refused"].limit == "pids"


def test_cpu_quota_and_the_manifest_summary(run_cgroup: RunCgroup) -> None:
    assert "cpu" in detect(), "this host has no cpu controller"
    for applied in _applied({"cpu": 0.25, "pids": 64, "wall": "30m"}, run_cgroup):
        assert applied.degradations == []
        place = applied.placements["cpu"]
        if place.version == 1:
            assert (place.path / "cpu.cfs_quota_us").read_text().strip() == "25000"
            assert (place.path / "cpu.cfs_period_us").read_text().strip() == "100000"
        else:
            assert (place.path / "cpu.max").read_text().split() == ["25000", "100000"]
        v = f"cgroup v{place.version}"
        assert applied.in_force() == {
            "cpu_millis": {"value": 250, "by": v},
            "pids": {"value": 64, "by": f"cgroup v{applied.placements['pids'].version}"},
            "wall_ms": {"value": 1_800_000, "by": "watcher"},
        }
        # a process put in the v1 cgroups cannot leave them as nobody
        proc = subprocess.run(
            _in_all(
                applied,
                run_cgroup,
                *as_user(
                    NOBODY, "/bin/sh", "-c", 'echo $$ > "$0"; echo $?', "/sys/fs/cgroup/cpu/cgroup.procs"
                ),
            ),
            capture_output=True,
            text=True,
            timeout=30,
        )
        if place.version == 1:
            assert "Permission denied" in proc.stderr and proc.stdout.strip() != "0"
    # removed afterwards
    assert all(not d.exists() for d in applied.v1_dirs())


def test_v1_cgroups_are_removed_even_with_a_process_left(run_cgroup: RunCgroup) -> None:
    applied = apply(LimitsPolicy.model_validate({"memory": "256MiB", "pids": 50}), run_cgroup.path)
    dirs = applied.v1_dirs()
    if not dirs:  # a unified host: nothing of the run's outside its v2 cgroup
        assert {p.version for p in applied.placements.values()} == {2}
        applied.remove()
        return
    proc = subprocess.Popen(_in_all(applied, run_cgroup, *as_user(NOBODY, "/bin/sleep", "60")))
    try:
        deadline = time.monotonic() + 10
        while str(proc.pid) not in (dirs[0] / "cgroup.procs").read_text() and time.monotonic() < deadline:
            time.sleep(0.01)
        applied.remove()
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert all(not d.exists() for d in dirs)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
