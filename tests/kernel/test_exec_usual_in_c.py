"""The usual allowed exec answered wholly in C (exec_supervisor.ExecSupervisor._serve_usual,
src/fast/_exec.c next_usual: read, resolved, checked, pinned and let go on without Python) against
the kernel's own exec check: a job as nobody, in a tracked cgroup, execs plain programs again and
again with every kind of argv (none, empty arguments, bytes that are not UTF-8, a long one), by
their names and through a link; C answers the repeats, the BPF program at sched_process_exec finds
each pin as the kernel loads the exec (nothing killed, no violation), and every exec runs. Then the
job puts a `#!` script (its interpreter denied) and a link to a denied program where an allowed
program was: C leaves both to the whole path, which refuses them; neither runs."""

from __future__ import annotations

import contextlib
import os
import shutil
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
from tests.kernel.util import EXEC_FILTER_PROLOGUE, EXEC_LAUNCHER, as_user, in_cgroup

pytestmark = pytest.mark.kernel

SLOT = 3
NOBODY = 65534
ROOT = Path(__file__).resolve().parents[2]

# `run(path, argv)`: a child execs `path` with `argv` (None: a NULL argv) and says how it ended:
# ("exit", code), 100 + errno when the exec failed, or ("signal", n)
JOB = """\
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)

def run(path, argv):
    pid = os.fork()
    if pid == 0:
        if argv is None:
            libc.execv(path, None)
        else:
            arr = (ctypes.c_char_p * (len(argv) + 1))(*argv, None)
            libc.execv(path, arr)
        os._exit(100 + ctypes.get_errno())
    st = os.waitpid(pid, 0)[1]
    return ("exit", os.WEXITSTATUS(st)) if os.WIFEXITED(st) else ("signal", os.WTERMSIG(st))

P = sys.argv[1].encode()
ARGVS = [None, [], [b""], [b"true"], [b"true", b"", b""], [b"\\xff\\xfe", b"na\\xefve"], [b"x" * 20000, b"y"]]
for i in range(4):
    for argv in ARGVS:
        for path in (b"/usr/bin/true", b"/bin/true", P + b"/ok/link", P + b"/ok/prog"):
            print("plain", *run(path, argv), flush=True)
# an allowed program's name taken by a script whose interpreter is denied, then by a link to a denied one
os.rename(P + b"/script", P + b"/ok/prog")
print("script", *run(P + b"/ok/prog", [b"prog"]), flush=True)
os.rename(P + b"/ok/other", P + b"/ok/prog")
print("other", *run(P + b"/ok/prog", [b"prog"]), flush=True)
"""


def test_the_usual_allowed_exec_is_answered_in_c_and_the_kernel_finds_its_pin(place: Path) -> None:
    from evidence.agent.recorder import exec_supervisor

    if exec_supervisor._fast is None:
        pytest.skip("the compiled module is not built (tests/unit/test_native.py fails under CI=true)")
    mount_tracefs()
    ensure_headers()
    ok = place / "ok"
    ok.mkdir()
    ok.chmod(0o777)
    shutil.copy("/usr/bin/true", ok / "prog")
    (ok / "link").symlink_to("/usr/bin/true")
    (place / "script").write_text("#!/usr/bin/id\n")
    (place / "script").chmod(0o755)
    (ok / "other").symlink_to("/usr/bin/id")  # in the workspace, but it leads to `id`
    (place / "job.py").write_text(JOB)
    commands = CommandsPolicy.model_validate(
        {
            "default": "deny",
            "rules": [
                {"name": "python", "program": ["python3*", "setpriv"], "decision": "allow"},
                {"name": "true", "program": ["/usr/bin/true"], "decision": "allow"},
                {"name": "workspace", "program": [f"{ok}/*"], "decision": "allow"},
                {"name": "no-id", "program": ["/usr/bin/id"], "decision": "deny"},
            ],
        },
        context={"variables": {}},
    )
    probes = RecorderProbes()
    cg = RunCgroup.create(f"exec-usual-in-c-{os.getpid()}")
    probes.reset_lost(SLOT)
    probes.track(cg.id, SLOT)
    check = ExecCheck(probes, SLOT)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = as_user(NOBODY, sys.executable, "-c", EXEC_LAUNCHER, str(theirs.fileno()), sys.executable, "-S")
    proc = subprocess.Popen(
        in_cgroup(cg.procs_file(), *argv, str(place / "job.py"), str(place)),
        pass_fds=[theirs.fileno()],
        cwd=place,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    theirs.close()
    decisions: list[ExecDecision] = []
    sup = None
    try:
        ours.settimeout(30)
        listener = receive_listener(ours)
        probes.ring().read()  # the job's start: before the check
        check.enforce()
        sup = ExecSupervisor(
            listener,
            commands,
            proc.pid,
            on_decision=decisions.append,
            publish=check.publish,
            pins_fd=probes.pins_fd(),
            check_key=check.key,
            record_only=True,
        )
        sup.start()
        out, err = proc.communicate(timeout=120)
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
    assert proc.returncode == 0, err
    assert [r for r in records if r["kind"] == "exec_violation"] == []
    ended = [line.split() for line in out.splitlines()]
    plain = [e for e in ended if e[0] == "plain"]
    assert len(plain) == 4 * 7 * 4 and all(e[1:] == ["exit", "0"] for e in plain), out
    # each program's first exec teaches the supervisor it is allowed outright; C answers the rest
    print("answered in C:", sup and sup.answered_in_c, "of", len(plain))
    assert sup is not None and sup.answered_in_c >= len(plain) - 4, sup.answered_in_c
    assert sup.round_trips.count >= sup.answered_in_c
    # a name C knows as allowed, now a script whose interpreter is denied, then a denied program
    assert dict((e[0], e[1:]) for e in ended if e[0] != "plain") == {
        "script": ["exit", "113"],
        "other": ["exit", "113"],
    }, out
    refused = [(d.request.program, d.decision.label) for d in decisions if not d.allowed and d.request]
    assert refused == [
        (f"{ok}/prog", "commands.rules[3] (no-id)"),  # its interpreter's rule
        ("/usr/bin/id", "commands.rules[3] (no-id)"),
    ], refused


RUNS_TRUE = (
    EXEC_FILTER_PROLOGUE
    + """\
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        try:
            os.execv("/usr/bin/true", ["true"])
        except OSError as e:
            os._exit(100 + e.errno)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""
)


def test_a_pin_the_map_does_not_take_is_refused_in_c_as_in_python(place: Path) -> None:
    """Fail closed in C's answer too: the first exec of /usr/bin/true teaches the supervisor it is
    allowed outright (the Python shortcut, whose pin the "map", a pipe, does not take: refused), the
    next two are C's, whose pin is not taken either: each is refused with EACCES and recorded as
    one that cannot be pinned; none runs."""
    from evidence.agent.recorder import exec_supervisor
    from evidence.agent.recorder.exec_check import new_key

    if exec_supervisor._fast is None:
        pytest.skip("the compiled module is not built (tests/unit/test_native.py fails under CI=true)")
    commands = CommandsPolicy.model_validate({"default": "allow", "rules": []}, context={"variables": {}})
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        as_user(NOBODY, sys.executable, "-c", RUNS_TRUE, str(theirs.fileno())),
        pass_fds=[theirs.fileno()],
        cwd=place,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    theirs.close()
    decisions: list[ExecDecision] = []
    told: list[str] = []
    r, w = os.pipe()
    sup = None
    try:
        ours.settimeout(30)
        sup = ExecSupervisor(
            receive_listener(ours),
            commands,
            proc.pid,
            on_decision=decisions.append,
            tell=told.append,
            pins_fd=r,
            check_key=new_key(),
            record_only=True,
        )
        sup.start()
        out, err = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(OSError):
            proc.kill()
        if sup is not None:
            sup.stop()
        ours.close()
        os.close(r)
        os.close(w)
    assert out.split() == ["113", "113", "113"], out + err
    assert sup is not None and os.path.realpath("/usr/bin/true").encode() in sup._outright
    assert sup.answered_in_c == 0
    assert [(d.allowed, d.error) for d in decisions] == [(False, "what would run cannot be pinned")] * 3
    assert len([line for line in told if "cannot be pinned" in line]) == 3, told


def test_a_name_c_knows_bound_over_in_a_namespace_of_the_jobs_own_is_not_c_s(place: Path) -> None:
    """Red team on the names C answers for: the job (nobody) runs /usr/bin/true until the
    supervisor answers it in C, then binds /usr/bin/id over it in a user and mount namespace of its
    own: the next exec of /usr/bin/true is not the usual request (its root mount is its own), so
    the whole path judges it (the name leads elsewhere for it: `default: deny` refuses it); chrooted
    back to evidence's root, the name is C's again and runs evidence's true. id never runs."""
    from tests.kernel.test_red_exec_fast import _ended
    from tests.kernel.test_red_exec_outright import BIND_OVER_TRUE, RACE_RULES, _job, _refused, _uid_lines

    body = (
        """\
    for i in range(5):
        show(f"taught{i}", run([b"/usr/bin/true"]))
"""
        + BIND_OVER_TRUE
    )
    proc, _, events = _job(place, RACE_RULES.replace("WS", str(place)), body)
    out = proc.stdout
    assert "job=0" in out, out + proc.stderr
    assert _uid_lines(out) == [], out
    ended = _ended(out)
    assert all(ended[f"taught{i}"] == ("exit", 0) for i in range(5)), out
    assert ended["bound"] == ("exit", 113), out
    assert ended["chrooted"] == ("exit", 0), out
    assert _refused(events).get("/usr/bin/true") == "commands.default", _refused(events)
