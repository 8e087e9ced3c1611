"""The terminal approver driven by a person (pexpect) on a real terminal: `evidence run`'s stand-in
(the recorder's side: broker, supervisor, terminal approver) runs on a pseudo-terminal, the job as
nobody under the exec supervisor; each held exec is shown escaped and answered by typing."""

from __future__ import annotations

import sys
from pathlib import Path

import pexpect

from tests.kernel.util import EXEC_LAUNCHER

TERMINAL_OWNER = 1000

RECORDER = """\
import os, socket, subprocess, sys
from evidence.agent.recorder.approvals import ApprovalBroker
from evidence.agent.recorder.exec_supervisor import ExecSupervisor, receive_listener
from evidence.agent.recorder.tty_approver import TtyApprover
from evidence.policy.governance import ApprovalsPolicy, CommandsPolicy
launcher, job_script, owner = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.fchown(0, owner, -1)  # the terminal belongs to the user logged in on it, as login makes it
rules = [{"name": "ask-id", "program": ["/usr/bin/id"], "decision": "approve", "message": "who?"}]
commands = CommandsPolicy.model_validate({"rules": rules}, context={"variables": {}})
recs = []
broker = ApprovalBroker(record=recs.append)
ours, theirs = socket.socketpair()
job = subprocess.Popen(
    ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--",
     sys.executable, "-c", launcher, str(theirs.fileno()), "/bin/sh", "-c", job_script],
    pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT, text=True)
theirs.close()
tty = TtyApprover.open(broker, run="r")
assert tty is not None
tty.start()
if len(sys.argv) > 4:  # another process group has the terminal's foreground until a request is open
    import signal, threading
    other = subprocess.Popen(["sleep", "300"], process_group=0)
    os.tcsetpgrp(0, other.pid)
    def back(_request):
        def restore():
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTTOU])  # asking from the background
            os.tcsetpgrp(0, os.getpgrp())
            other.kill()
        threading.Timer(1.0, restore).start()
    broker.subscribe(back)
policy = ApprovalsPolicy.model_validate({"timeout": "60s"})
sup = ExecSupervisor(receive_listener(ours), commands, job.pid, approver=broker.approver("r", 0, policy))
sup.start()
out, _ = job.communicate(timeout=120)
sup.stop()
tty.stop()
print("JOB-OUTPUT-BEGIN")
print(out, end="")
print("JOB-OUTPUT-END")
for r in recs:
    print("RECORD", r["state"], r.get("via"), r.get("by_uid"), repr(r.get("reason")), r["argv"])
"""


def test_a_person_answers_held_execs_on_the_recorders_terminal(place: Path) -> None:
    job = "/usr/bin/id -u; echo rc=$?; /usr/bin/id -g \"$(printf 'a\\033[2Jb')\"; echo rc2=$?"
    child = pexpect.spawn(
        sys.executable,
        ["-c", RECORDER, EXEC_LAUNCHER, job, str(TERMINAL_OWNER)],
        encoding="utf-8",
        timeout=60,
        cwd=str(place),
    )
    try:
        child.expect(r"allow\? \[y/N")
        first = child.before
        assert "exec of /usr/bin/id" in first and "argv: /usr/bin/id -u" in first
        assert "rule: commands.rules[0] (ask-id): who?" in first and "depth 1" in first
        child.sendline("y checked it")
        child.expect(r"allow\? \[y/N")
        second = child.before
        assert "evidence: allowed" in second
        # the job's argument is shown escaped: it cannot clear the screen the person reads
        assert "a\\x1b[2Jb" in second and "\x1b[2J" not in second
        child.sendline("no not today")
        child.expect("JOB-OUTPUT-END")
        job_out = child.before.split("JOB-OUTPUT-BEGIN", 1)[1]
        child.expect(pexpect.EOF)
        recs = [line for line in child.before.splitlines() if line.startswith("RECORD")]
    finally:
        child.close(force=True)
    lines = job_out.split()
    assert "65534" in lines and "rc=0" in lines and "rc2=126" in lines, job_out
    assert recs == [
        "RECORD requested None None None ['/usr/bin/id', '-u']",
        f"RECORD allowed terminal {TERMINAL_OWNER} 'checked it' ['/usr/bin/id', '-u']",
        "RECORD requested None None None ['/usr/bin/id', '-g', 'a\\x1b[2Jb']",
        f"RECORD denied terminal {TERMINAL_OWNER} 'not today' ['/usr/bin/id', '-g', 'a\\x1b[2Jb']",
    ]


def test_keys_typed_before_the_question_answer_nothing(place: Path) -> None:
    """A `y` typed while the job ran (meant for it, or a slip) does not approve the exec asked
    later: the prompt discards type-ahead."""
    job = "while [ ! -e go ]; do /bin/sleep 0.05; done; /usr/bin/id -u; echo rc=$?"
    child = pexpect.spawn(
        sys.executable,
        ["-c", RECORDER, EXEC_LAUNCHER, job, str(TERMINAL_OWNER)],
        encoding="utf-8",
        timeout=60,
        cwd=str(place),
    )
    try:
        child.sendline("y")
        child.expect("y\r\n")  # the terminal echoed it: it sits in the input queue
        (place / "go").touch()  # now the job asks
        child.expect(r"allow\? \[y/N")
        child.sendline("n typed after the question")
        child.expect("JOB-OUTPUT-END")
        job_out = child.before.split("JOB-OUTPUT-BEGIN", 1)[1]
        child.expect(pexpect.EOF)
        recs = [line for line in child.before.splitlines() if line.startswith("RECORD")]
    finally:
        child.close(force=True)
    assert "rc=126" in job_out.split(), job_out
    assert (
        recs[-1]
        == f"RECORD denied terminal {TERMINAL_OWNER} 'typed after the question' ['/usr/bin/id', '-u']"
    )


def test_a_recorder_in_the_background_of_its_terminal_asks_once_back_in_the_foreground(place: Path) -> None:
    """Reading the terminal from the background would stop the whole recorder (SIGTTIN) with the
    exec held: the approver waits for the foreground instead."""
    child = pexpect.spawn(
        sys.executable,
        ["-c", RECORDER, EXEC_LAUNCHER, "/usr/bin/id -u; echo rc=$?", str(TERMINAL_OWNER), "background"],
        encoding="utf-8",
        timeout=60,
        cwd=str(place),
    )
    try:
        child.expect(r"allow\? \[y/N")
        child.sendline("y")
        child.expect("JOB-OUTPUT-END")
        job_out = child.before.split("JOB-OUTPUT-BEGIN", 1)[1]
    finally:
        child.close(force=True)
    assert "rc=0" in job_out.split(), job_out
