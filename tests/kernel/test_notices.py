"""The job is told, on its own stderr, why an exec failed: a job run as nobody under the exec
supervisor, the recorder writing through its dup of the job's stderr taken before the launch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from evidence.agent.recorder.exec_supervisor import ExecSupervisor, receive_listener
from evidence.agent.recorder.notices import NoticeWriter
from evidence.policy.governance import CommandsPolicy
from tests.kernel.test_exec_supervisor import NOBODY
from tests.kernel.util import EXEC_LAUNCHER, as_user


def _job(script: str, cwd: Path, *, quiet: bool) -> tuple[str, str]:
    commands = CommandsPolicy.model_validate(
        {"rules": [{"name": "no-id", "program": ["id"], "decision": "deny", "message": "ask the admin"}]},
        context={"variables": {}},
    )
    err_r, err_w = os.pipe()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen(
        as_user(NOBODY, sys.executable, "-c", EXEC_LAUNCHER, str(theirs.fileno()), "/bin/sh", "-c", script),
        pass_fds=[theirs.fileno()],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=err_w,
        text=True,
        cwd=cwd,
    )
    theirs.close()
    writer = NoticeWriter(err_w, quiet=quiet)  # the recorder's copy of the job's stderr
    writer.start()
    try:
        ours.settimeout(30)
        sup = ExecSupervisor(receive_listener(ours), commands, proc.pid, tell=writer.tell)
        sup.start()
        out, _ = proc.communicate(timeout=60)
        sup.stop()
        writer.close()
        with os.fdopen(err_r, "rb") as f:
            err = f.read().decode()
    finally:
        ours.close()
        if proc.poll() is None:
            proc.kill()
    return out, err


def test_a_refused_exec_is_explained_on_the_jobs_stderr_unless_quiet(place: Path) -> None:
    out, err = _job("/usr/bin/id; echo rc=$?", place, quiet=False)
    assert out.splitlines() == ["rc=126"]
    told = "evidence: exec of /usr/bin/id refused by commands.rules[0] (no-id): ask the admin\n"
    # one write of a whole line; the shell writes its own complaint in pieces ("/bin/sh: 1: ", then
    # the rest) once its exec failed, and the notice, written by a thread of the recorder's own
    # (a job cannot stall the supervisor with a full stderr), may land between them (seen in CI)
    assert err.count(told) == 1 and "Permission denied" in err, err
    out, err = _job("/usr/bin/id; echo rc=$?", place, quiet=True)
    assert out.splitlines() == ["rc=126"] and "evidence:" not in err
