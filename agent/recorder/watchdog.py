"""The run's watchdog: if `evidence run` dies (kill -9, OOM), its job dies with it.

    python -I -m evidence.agent.recorder.watchdog PIPE_FD [PARENT_PID]

`evidence run` (and `evidence agent`, for its isolated runs) starts this early, in a session of its
own (a terminal's Ctrl-C does not reach it) and outside the runs' cgroups, and keeps the write end of
a pipe. It writes one line of JSON when a run's cgroup exists (`{"cgroup": PATH, "session": ID}`),
one when a run is over and its cgroup gone (`{"unwatch": PATH}`; the agent watches many runs over
its life), and `done` when the recorder stops on purpose. If the pipe reaches EOF without `done`,
the recorder is gone: its BPF programs went with it, so nothing the jobs do any more is recorded.
The watchdog then kills everything in each cgroup still watched with `cgroup.kill`, waits until it
is empty, removes it, and says so on stderr: no job runs on unrecorded. What was recorded until
then waits in the spools for `evidence recover` (the agent recovers its own when it starts again).

With PARENT_PID (`evidence run`, `evidence agent`), the watchdog also looks at that process every
few milliseconds and acts as soon as it is exiting (PF_EXITING, or gone): the pipe's EOF comes only
when the recorder has released all its files, and a recorder with a hundred tracepoints takes
seconds for that (each perf event released waits for an RCU grace period), long enough for the job
to act unrecorded. PR_SET_PDEATHSIG is no better: it fires when the thread that started the watchdog
has exited, and that thread may be the one releasing the files. What the pipe still holds is read
first, so a `done` written before a normal exit is never missed.

A job without root cannot kill this process (it is root's, in another session and cgroup), and
cannot close the recorder's end of the pipe. Standard library only: it starts in a few tens of ms
and holds little memory for the length of the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import sys
import time
from typing import Any


def _kill_cgroup(path: str) -> int:
    """Kill every process in the cgroup and its descendants, wait until it is empty, remove it.
    Returns how many processes were in it."""
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            count = len(f.read().split())
    except OSError:
        return 0  # already gone: the recorder finished it
    try:
        with open(os.path.join(path, "cgroup.kill"), "w") as f:
            f.write("1")
    except OSError:
        pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(os.path.join(path, "cgroup.events")) as f:
                if "populated 0" in f.read():
                    break
        except OSError:
            break
        time.sleep(0.02)
    for root, dirs, _ in os.walk(path, topdown=False):
        for d in dirs:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(root, d))
    with contextlib.suppress(OSError):
        os.rmdir(path)
    return count


_PF_EXITING = 0x4  # include/linux/sched.h: set first thing in do_exit()
_POLL_MS = 10


def _exiting(pid: int) -> bool:
    """Whether the process is dying or gone. Its main thread's flags say so from the first moment of
    a kill -9 on, while the process is still seconds away from releasing its files."""
    if os.getppid() != pid:  # gone: this process has another parent now
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    fields = stat[stat.rindex(b")") + 2 :].split()  # after the command name, which may hold anything
    return fields[0] in (b"Z", b"X") or bool(int(fields[6]) & _PF_EXITING)


def _read_until_gone(fd: int, parent: int) -> bytes:
    """Wait for the pipe, looking at the parent between reads; once it is exiting, what the pipe
    holds and no more. b"" means the end."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    while not poller.poll(_POLL_MS):
        if _exiting(parent):
            os.set_blocking(fd, False)
            try:
                return os.read(fd, 65536)
            except BlockingIOError:
                return b""
    return os.read(fd, 65536)


def main(fd: int, parent: int | None = None) -> int:
    watched: dict[str, str] = {}  # cgroup -> session
    done = False
    pending = b""
    while not done:
        chunk = os.read(fd, 65536) if parent is None else _read_until_gone(fd, parent)
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            text = line.strip()
            if text == b"done":
                done = True
                break
            try:
                msg: dict[str, Any] = json.loads(text)
            except ValueError:
                continue
            if not isinstance(msg, dict):
                continue
            if msg.get("unwatch"):
                watched.pop(str(msg["unwatch"]), None)
            elif msg.get("cgroup"):
                watched[str(msg["cgroup"])] = str(msg.get("session") or "?")
    if done:
        return 0
    for cgroup, session in watched.items():
        killed = _kill_cgroup(cgroup)
        print(
            f"evidence: the recorder of run {session} died; its {killed} process(es) were killed "
            "so that nothing runs unrecorded; `evidence recover` turns what was recorded into a "
            "cut-short bundle",
            file=sys.stderr,
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None))
