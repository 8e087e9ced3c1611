"""Issue 24's red team: a job that shares the recorder's terminal takes its foreground process group
(tcsetpgrp, SIGTTOU ignored) and gives it back, over and over, with TOSTOP set, while an exec waits
for approval there. A read (or, with TOSTOP, a write) of the terminal approver that falls in the
background after its foreground check made the kernel stop the whole recorder (SIGTTIN, SIGTTOU):
its records unread, every approval stuck. The approver now waits the moment out and the answer
typed gets through."""

from __future__ import annotations

import sys
from pathlib import Path

import pexpect

from tests.kernel.test_daemon import Agent
from tests.kernel.test_policy_via_agent import agent  # noqa: F401 - the module's agent fixture
from tests.kernel.test_tty_approver import RECORDER, TERMINAL_OWNER
from tests.kernel.util import EXEC_LAUNCHER

TOGGLER = """\
import os, signal, termios, time
signal.signal(signal.SIGTTOU, signal.SIG_IGN)
fd = os.open("/dev/tty", os.O_RDWR)
theirs = os.tcgetpgrp(fd)
os.setpgid(0, 0)
mine = os.getpgrp()
attrs = termios.tcgetattr(fd)
saved = list(attrs)
attrs[3] |= termios.TOSTOP  # a background write stops its writer too
termios.tcsetattr(fd, termios.TCSANOW, attrs)
flips = 0
end = time.monotonic() + 8
while time.monotonic() < end:
    os.tcsetpgrp(fd, mine)
    os.tcsetpgrp(fd, theirs)
    flips += 1
termios.tcsetattr(fd, termios.TCSANOW, saved)
print("flips", flips, flush=True)
"""


def test_a_job_flipping_the_terminals_foreground_never_stops_the_recorder(place: Path) -> None:
    toggler = place / "toggler.py"
    toggler.write_text(TOGGLER)
    toggler.chmod(0o644)
    job = f"/usr/bin/python3 {toggler} & sleep 0.5; /usr/bin/id -u; echo rc=$?; wait"
    job_out, records = _answered(place, job, "y", timeout=60)
    assert "rc=0" in job_out.split(), job_out
    assert "flips" in job_out, job_out  # the job flipped the foreground all along
    assert "RECORD allowed terminal" in records, records


KEEPER = """\
import os, signal, termios
signal.signal(signal.SIGTTOU, signal.SIG_IGN)
attrs = termios.tcgetattr(2)
attrs[3] |= termios.TOSTOP
termios.tcsetattr(2, termios.TCSANOW, attrs)
os.setpgid(0, 0)
os.tcsetpgrp(2, os.getpgrp())  # the terminal's foreground is the job's, and stays so
try:
    open("/etc/shadow").read()  # refused: evidence tells the job on this terminal
except OSError:
    pass
print("job done", flush=True)
raise SystemExit(3)
"""


def test_a_job_that_keeps_the_terminals_foreground_neither_stops_evidence_nor_changes_its_exit(
    place: Path,
) -> None:
    """`evidence run` on a terminal, the job takes its foreground for good (TOSTOP set): evidence's
    own writes there (the job's notice, its closing line) stopped it (SIGTTOU) under a job-control
    shell, or failed (EIO) where its process group is orphaned, as here: it exited 1, not the
    job's 3, and said nothing. SIGTTOU and SIGTTIN are blocked in evidence (not in the job)."""
    keeper = place / "keeper.py"
    keeper.write_text(KEEPER)
    keeper.chmod(0o644)
    policy = place / "policy.yaml"
    policy.write_text('version: 1\nfs:\n  read: ["/"]\n  exec: ["/usr", "/bin"]\n  deny: ["/etc/shadow"]\n')
    status, out = _to_the_end(
        place,
        sys.executable,
        ["-m", "evidence", "run", "--bundle", str(place / "b.tar.gz"), "--policy", str(policy), "--",
         "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", "/usr/bin/python3", str(keeper)],
    )  # fmt: skip
    assert status == 3, (status, out)
    assert "job done" in out and "read of /etc/shadow refused by fs.deny[0]" in out, out
    assert "evidence: " in out and " events (" in out, out  # the closing line


def test_the_same_through_the_agent(agent: Agent, place: Path) -> None:  # noqa: F811
    """`evidence run --agent` as nobody on a terminal: the client's closing line and exit code."""
    keeper = place / "keeper.py"
    keeper.write_text(KEEPER)
    keeper.chmod(0o644)
    policy = place / "policy.yaml"
    policy.write_text('version: 1\nfs:\n  read: ["/"]\n  exec: ["/usr", "/bin"]\n  deny: ["/etc/shadow"]\n')
    policy.chmod(0o644)
    status, out = _to_the_end(
        place,
        "setpriv",
        ["--reuid=65534", "--regid=65534", "--clear-groups", "--", sys.executable, "-m", "evidence", "run",
         "--agent", str(agent.socket), "--bundle", str(place / "a.tar.gz"), "--policy", str(policy),
         "--workspace", str(place), "--", "/usr/bin/python3", str(keeper)],
    )  # fmt: skip
    assert status == 3, (status, out)
    assert "job done" in out and "read of /etc/shadow refused by fs.deny[0]" in out, out


def test_a_no_the_job_turns_into_an_end_of_file_is_still_a_no(place: Path) -> None:
    """The job makes `n` the terminal's end-of-file character: the person's `n` read as end of file
    was taken for a hang-up, the approver gave up and the request waited for its timeout (which
    `on_timeout: allow` lets run). It is an answer that is no yes: denied at once."""
    veof = (
        "import os, termios; fd = os.open('/dev/tty', os.O_RDWR); a = termios.tcgetattr(fd); "
        "a[6][termios.VEOF] = b'n'; termios.tcsetattr(fd, termios.TCSANOW, a)"
    )
    job = f'/usr/bin/python3 -c "{veof}"; /usr/bin/id -u; echo rc=$?'
    job_out, records = _answered(place, job, "n", timeout=30)  # below the request's 60 s: a
    # timeout's answer would come too late
    assert "rc=126" in job_out.split() and "65534" not in job_out.split(), job_out
    assert f"RECORD denied terminal {TERMINAL_OWNER} None" in records, records


def _answered(place: Path, job: str, answer: str, timeout: int) -> tuple[str, str]:
    """(the job's output, the recorder's records) of `job` run under the tty approver, whose
    request is answered `answer` on the recorder's terminal."""
    child = pexpect.spawn(
        sys.executable,
        ["-c", RECORDER, EXEC_LAUNCHER, job, str(TERMINAL_OWNER)],
        encoding="utf-8",
        timeout=timeout,
        cwd=str(place),
    )
    try:
        child.expect(r"allow\? \[y/N")
        child.sendline(answer)
        child.expect("JOB-OUTPUT-END")
        job_out = child.before.split("JOB-OUTPUT-BEGIN", 1)[1]
        child.expect(pexpect.EOF)
        return job_out, child.before
    finally:
        child.close(force=True)


def _to_the_end(place: Path, program: str, args: list[str]) -> tuple[int | None, str]:
    """(exit status, all it wrote) of `program` run on a terminal of its own to its end."""
    child = pexpect.spawn(program, args, encoding="utf-8", timeout=60, cwd=str(place))
    try:
        child.expect(pexpect.EOF)
        out = child.before
    finally:
        child.close()
    return child.exitstatus, out
