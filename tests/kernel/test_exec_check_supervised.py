"""The exec check's two halves together (issue 24): the real exec supervisor pins each exec it lets
go on through a run's `ExecCheck` (agent/recorder/exec_check.py, RecorderProbes.publish), and the
BPF program at sched_process_exec finds every one as pinned: a program, a `#!` script called by a
relative name, an arg area past the recorder probe's 8191 bytes, and an empty argv all run, and
nothing is killed or recorded as a violation. A job as nobody, in a tracked cgroup."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from evidence.agent.recorder.cgroups import RunCgroup
from evidence.agent.recorder.decode import decode
from evidence.agent.recorder.exec_check import ExecCheck
from evidence.agent.recorder.exec_supervisor import ExecDecision, ExecSupervisor, receive_listener
from evidence.agent.recorder.kernel import mount_tracefs
from evidence.policy.model import CommandsPolicy
from evidence.probes.headers import ensure_headers
from evidence.probes.loader import RecorderProbes
from tests.kernel.util import EXEC_LAUNCHER, as_user, in_cgroup

pytestmark = pytest.mark.kernel

SLOT = 2
NOBODY = 65534
ROOT = Path(__file__).resolve().parents[2]

# an exec with an empty argv (the kernel gives the program one empty argument)
EMPTY_ARGV = "import ctypes, sys; ctypes.CDLL(None).execv(sys.argv[1].encode(), None)"


def test_what_the_supervisor_pins_is_what_the_kernel_loads_every_exec_runs(place: Path) -> None:
    mount_tracefs()
    ensure_headers()
    probes = RecorderProbes()
    cg = RunCgroup.create(f"exec-check-supervised-{os.getpid()}")
    probes.reset_lost(SLOT)
    probes.track(cg.id, SLOT)
    check = ExecCheck(probes, SLOT)
    script = place / "s.sh"
    script.write_text(f'#!/bin/sh\necho script "$@" > {place}/script\n')
    script.chmod(0o755)
    long = "x" * 20_000
    job = (
        f"/usr/bin/touch {place}/program"
        f" && ./s.sh one two"
        f" && /usr/bin/printf %s {long} > {place}/long"
        f" && /usr/bin/python3 -S -c '{EMPTY_ARGV}' /usr/bin/true && echo ran > {place}/empty"
    )
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = as_user(NOBODY, sys.executable, "-c", EXEC_LAUNCHER, str(theirs.fileno()), "/bin/sh", "-c", job)
    proc = subprocess.Popen(
        in_cgroup(cg.procs_file(), *argv),
        pass_fds=[theirs.fileno()],
        cwd=place,
        env=env,
        stderr=subprocess.PIPE,
    )
    theirs.close()
    decisions: list[ExecDecision] = []
    sup = None
    try:
        ours.settimeout(30)
        listener = receive_listener(ours)
        probes.ring().read()  # the job's start (sh, setpriv, python): before the check
        check.enforce()  # before the first supervised exec is answered
        sup = ExecSupervisor(
            listener,
            CommandsPolicy.model_validate({"default": "allow", "rules": []}, context={"variables": {}}),
            proc.pid,
            on_decision=decisions.append,
            publish=check.publish,
            check_key=check.key,
        )
        sup.start()
        _, err = proc.communicate(timeout=60)
        records = [decode(r) for r in probes.ring().read()]
    finally:
        with contextlib.suppress(OSError):
            proc.kill()
        if sup is not None:
            sup.stop()
        ours.close()
        check.release()
        probes.untrack(cg.id)
        cg.wait_empty()
        cg.remove()
        probes.close()
    assert [r for r in records if r["kind"] == "exec_violation"] == []
    assert proc.returncode == 0, err
    assert all(d.allowed for d in decisions) and len(decisions) >= 6, decisions
    assert (place / "program").exists()
    assert (place / "script").read_text() == "script one two\n"
    assert (place / "long").read_text() == long
    assert (place / "empty").read_text() == "ran\n"
