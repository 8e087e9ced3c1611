"""Attacks by an unprivileged job on the recording, each performed for real, with its outcome asserted.

Hole 1 of the escape review: a job without root attached with ptrace (or sent signals) to a process of
the same uid outside its run, and made it act for it unrecorded; in agent mode the victim is the
job's own `evidence run --agent` client. Every recorded command now runs with no_new_privs and a
Landlock domain (scoped to signals and abstract unix sockets on ABI 6+), and the client is not
dumpable. `--allow-setuid` opts out, recorded as a degradation that lint flags at --fail-on warn.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from evidence.policy.landlock_syscalls import abi_version
from tests.kernel.test_run_via_agent import NOBODY, agent, client, out, workdir  # noqa: F401 - fixtures
from tests.kernel.util import PY, evidence, of_type, read_bundle

AS_NOBODY = ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--")

# Signal and ptrace-attach a process; print the errno of each (or "ok").
ATTACK = r"""
import ctypes, json, os, sys
victim = int(sys.argv[1])
out = {}
try:
    os.kill(victim, 0)
    out["signal"] = "ok"
except OSError as e:
    out["signal"] = e.errno
libc = ctypes.CDLL(None, use_errno=True)
if libc.ptrace(16, victim, 0, 0) == 0:  # PTRACE_ATTACH
    out["ptrace"] = "ok"
    libc.ptrace(17, victim, 0, 0)  # PTRACE_DETACH
else:
    out["ptrace"] = ctypes.get_errno()
print(json.dumps(out))
"""


@pytest.fixture
def victim() -> Iterator[int]:
    """A process of the job's uid outside the run (another job's, a runner's helper)."""
    p = subprocess.Popen([*AS_NOBODY, "sleep", "120"])
    try:
        yield p.pid
    finally:
        p.kill()
        p.wait()


def _attack(tmp_path: Path, victim: int, *extra: str) -> tuple[dict[str, object], Path]:
    bundle = tmp_path / "run.tar.gz"
    proc = evidence("run", "--bundle", str(bundle), *extra, "--", *AS_NOBODY, PY, "-c", ATTACK, str(victim))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), bundle


def test_a_job_cannot_ptrace_or_signal_a_process_of_its_uid_outside_the_run(
    tmp_path: Path, victim: int
) -> None:
    got, bundle = _attack(tmp_path, victim)
    assert got["ptrace"] == 1  # EPERM: outside the job's Landlock domain
    if abi_version() >= 6:
        assert got["signal"] == 1  # EPERM: signals scoped to the domain
    manifest, events = read_bundle(bundle)
    assert manifest["capabilities"]["isolation"].startswith("no_new_privs, Landlock")
    assert not of_type(events, "degradation")
    lint = evidence("lint", str(bundle), "--fail-on", "warn")
    assert lint.returncode == 0, lint.stdout


def test_allow_setuid_opts_out_and_says_so(tmp_path: Path, victim: int) -> None:
    got, bundle = _attack(tmp_path, victim, "--allow-setuid")
    assert got == {"signal": "ok", "ptrace": "ok"}  # the attack works without the domain: the test bites
    _, events = read_bundle(bundle)
    (d,) = [e["data"] for e in of_type(events, "degradation")]
    assert d["component"] == "isolation" and "--allow-setuid" in d["reason"]
    lint = evidence("lint", str(bundle), "--fail-on", "warn")
    assert lint.returncode == 1 and "EV002" in lint.stdout and "isolation" in lint.stdout


def test_a_job_cannot_ptrace_its_own_agent_client(agent, out: Path) -> None:  # noqa: F811
    """In agent mode the job's parent is the `evidence run --agent` client, of the job's uid: it
    finishes the run and reports the exit code, so it must be out of the job's reach."""
    attack_parent = ATTACK.replace("int(sys.argv[1])", "os.getppid()")
    proc = client(
        agent.socket, out / "a.tar.gz", PY, "-c", attack_parent,
        cwd=out, user=NOBODY, group=NOBODY, extra_groups=[],
    )  # fmt: skip
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr + agent.output()
    got = json.loads(stdout)
    assert got["ptrace"] == 1, got  # EPERM: the client is not dumpable and outside the domain
    if abi_version() >= 6:
        assert got["signal"] == 1, got


# Push a character into the terminal's input queue (TIOCSTI) and report the errno (or "ok").
STI = r"""
import ctypes, fcntl, sys
try:
    fcntl.ioctl(0, 0x5412, b"#")
    print("ok")
except OSError as e:
    print(e.errno)
"""


def _in_a_terminal(*command: str) -> str:
    """Run command in a new pseudo-terminal (its controlling terminal), as a shell on a CI runner
    or a developer's terminal would run `evidence run`; return what it printed."""
    import shlex

    proc = subprocess.run(
        ["script", "-qec", shlex.join(command), "/dev/null"], capture_output=True, text=True, timeout=120
    )
    return proc.stdout.replace("\r", "")


def test_a_job_cannot_type_into_the_terminal_it_shares_with_its_caller(tmp_path: Path) -> None:
    """With TIOCSTI a job could type a command into the shell that started `evidence run`: it would
    run after the run, outside it, as that shell's user (root). A seccomp filter refuses it."""
    outside = _in_a_terminal(*AS_NOBODY, PY, "-c", STI)  # the same attack without evidence
    bundle = tmp_path / "sti.tar.gz"
    inside = _in_a_terminal(
        sys.executable, "-m", "evidence", "run", "--bundle", str(bundle), "--", *AS_NOBODY, PY, "-c", STI
    )
    assert inside.splitlines()[0] == "1", inside  # EPERM
    legacy = Path("/proc/sys/dev/tty/legacy_tiocsti")
    if legacy.exists() and legacy.read_text().strip() == "1":
        assert outside.rstrip().endswith("ok"), outside  # the kernel allows it: the filter is what refused


# Set up an io_uring instance; print "ok" or the errno. Its operations (IORING_OP_OPENAT, CONNECT,
# RENAMEAT, ...) run without system calls of their own: no syscall tracepoint would see them.
URING = r"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
params = (ctypes.c_char * 120)()
fd = libc.syscall(425, 8, params)  # io_uring_setup
print("ok" if fd >= 0 else ctypes.get_errno())
"""


def test_a_job_cannot_act_through_io_uring(tmp_path: Path, agent, out: Path) -> None:  # noqa: F811
    """io_uring would let a job open, write and connect with no system call the recorder sees: a
    seccomp filter refuses io_uring_setup to every recorded command, standalone and through the
    agent, with or without a policy."""
    outside = subprocess.run([*AS_NOBODY, PY, "-c", URING], capture_output=True, text=True, timeout=60)
    inside = evidence("run", "--bundle", str(tmp_path / "u.tar.gz"), "--", *AS_NOBODY, PY, "-c", URING)
    assert inside.returncode == 0, inside.stderr
    assert inside.stdout.strip() == "1", inside.stdout  # EPERM
    proc = client(
        agent.socket, out / "u.tar.gz", PY, "-c", URING, cwd=out, user=NOBODY, group=NOBODY, extra_groups=[]
    )
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr + agent.output()
    assert stdout.strip() == "1", stdout
    disabled = Path("/proc/sys/kernel/io_uring_disabled")
    if not disabled.exists() or disabled.read_text().strip() == "0":
        assert outside.stdout.strip() == "ok", outside  # the kernel allows it: the filter is what refused


def test_a_job_killed_by_a_signal_without_a_name_leaves_nothing_behind(tmp_path: Path) -> None:
    """A real-time signal (SIG40) has no name in Python: the run still ends cleanly, its leftover
    processes are killed, and the bundle says how the command died."""
    shared = Path(tempfile.mkdtemp(dir="/tmp"))
    shared.chmod(0o777)
    escaped = shared / "escaped"
    bundle = tmp_path / "rt.tar.gz"
    proc = evidence(
        "run",
        "--bundle",
        str(bundle),
        "--",
        *AS_NOBODY,
        "sh",
        "-c",
        f"(sleep 2; touch {escaped}) & kill -40 $$",
    )
    assert proc.returncode == 128 + 40 and "Traceback" not in proc.stderr, proc.stderr
    time.sleep(3)
    assert not escaped.exists(), "a process of the run outlived it"
    manifest, _ = read_bundle(bundle)
    assert manifest["signal"] == "SIG40" and manifest["exit_code"] is None
    shared.rmdir()


def test_a_job_cannot_redirect_the_bundle_through_a_symlink(tmp_path: Path) -> None:
    """The bundle's directory is writable by the job (a workspace): swapping it for a symlink to /etc
    during the run must not make root write the bundle into /etc."""
    base = Path(tempfile.mkdtemp(dir="/tmp"))
    base.chmod(0o777)
    outdir = base / "out"
    outdir.mkdir()
    os.chown(outdir, NOBODY, NOBODY)
    name = f"evidence-test-{os.getpid()}.tar.gz"
    try:
        proc = evidence(
            "run",
            "--bundle",
            str(outdir / name),
            "--",
            *AS_NOBODY,
            "sh",
            "-c",
            f"mv {outdir} {base}/old && ln -s /etc {outdir}",
        )
        assert proc.returncode == 0, proc.stderr
        assert not Path("/etc", name).exists()
        assert (base / "old" / name).is_file()  # written where the directory went
        assert f"bundle {base}/old/{name}" in proc.stderr
    finally:
        Path("/etc", name).unlink(missing_ok=True)
        subprocess.run(["rm", "-rf", str(base)], check=False)
