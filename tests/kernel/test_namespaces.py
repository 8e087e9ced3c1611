"""Hole 2 of the escape review, performed for real: a job without root makes a user and mount
namespace of its own and bind-mounts files over /etc/hostname and /usr/bin/true. The bundle must
say so (the unshare and the mounts as dev.evidence.process.namespace events, every later event of
those processes with mntns "other") and lint must warn (EV010). And ptrace on a process outside the
run: recorded with its target and result; lint errors when it worked (--allow-setuid), notes when
the job's Landlock domain refused it."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kernel.test_escapes import AS_NOBODY, ATTACK, victim  # noqa: F401 - fixture
from tests.kernel.util import PY, evidence, of_type, record

ATTACK_NS = r"""
set -e
mount --bind "$1/secret" /etc/hostname
mount --bind "$1/fake-true" /usr/bin/true
cat /etc/hostname
/usr/bin/true
"""

# clone(CLONE_NEWUSER | SIGCHLD) with no new stack (as fork), the child opens a file; then the
# parent itself unshares a user namespace and opens one
CLONE_NEWUSER = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
pid = libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)
if pid == 0:
    os.close(os.open("/etc/passwd", os.O_RDONLY))
    os._exit(0)
assert pid > 0, ctypes.get_errno()
os.waitpid(pid, 0)
os.close(os.open("/etc/group", os.O_RDONLY))
assert libc.unshare(0x10000000) == 0, ctypes.get_errno()
os.close(os.open("/etc/hosts", os.O_RDONLY))
"""


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory the job (as nobody) can read: the secret and the fake program it mounts."""
    d = Path(tempfile.mkdtemp(prefix="evidence-ns-"))
    d.chmod(0o755)
    (d / "secret").write_text("a secret of the job's\n")
    (d / "fake-true").write_text("#!/bin/sh\necho faked true\nsleep 1\n")  # alive while it is hashed, mostly
    (d / "secret").chmod(0o644)
    (d / "fake-true").chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d)


def _namespace(events: list[dict], op: str) -> list[dict]:
    return [e["data"] for e in of_type(events, "process.namespace") if e["data"]["operation"] == op]


def test_a_bind_mount_in_a_user_namespace_is_recorded_and_flagged(tmp_path: Path, shared: Path) -> None:
    proc, _, events = record(
        tmp_path, *AS_NOBODY, "unshare", "-Urm", "sh", "-c", ATTACK_NS, "sh", str(shared), cwd=shared
    )
    assert proc.returncode == 0, proc.stderr
    assert "a secret of the job's" in proc.stdout and "faked true" in proc.stdout  # the attack worked
    (unshare,) = _namespace(events, "unshare")
    assert {"CLONE_NEWUSER", "CLONE_NEWNS"} <= set(unshare["flags"]) and unshare["result"] == 0
    assert unshare["exe"].endswith("/unshare") and "mntns" not in unshare
    binds = {tuple(m["paths"]): m for m in _namespace(events, "mount") if "MS_BIND" in m["flags"]}
    assert set(binds) == {(f"{shared}/secret", "/etc/hostname"), (f"{shared}/fake-true", "/usr/bin/true")}
    assert all(m["result"] == 0 and m["mntns"] == "other" for m in binds.values())
    opens = [e["data"] for e in of_type(events, "file.open") if e["data"]["path"] == "/etc/hostname"]
    assert opens and all(o["mntns"] == "other" for o in opens)
    assert any(o["exe"].endswith("/cat") and o["result"] == 0 for o in opens)
    true = [e["data"] for e in of_type(events, "process.exec") if e["data"]["filename"] == "/usr/bin/true"]
    assert true and all(t["mntns"] == "other" for t in true)
    # the program's hash is of the file that ran (read through the process's root), never of the
    # real /usr/bin/true; a process gone before it was read is not hashed
    fake = hashlib.sha256((shared / "fake-true").read_bytes()).hexdigest()
    real = hashlib.sha256(Path("/usr/bin/true").read_bytes()).hexdigest()
    for t in true:
        assert t.get("sha256") != real and (t.get("sha256") == fake or t.get("not_hashed") == "gone"), t
    # the run's own processes, before the unshare, are not marked
    setpriv = [e["data"] for e in of_type(events, "process.exec") if e["data"]["argv"][:1] == ["setpriv"]]
    assert setpriv and all("mntns" not in s for s in setpriv)
    lint = evidence("lint", str(tmp_path / "run.tar.gz"), "--fail-on", "warn")
    assert lint.returncode == 1, lint.stdout
    assert "EV010" in lint.stdout and "mount MS_BIND" in lint.stdout and "/etc/hostname" in lint.stdout


def test_a_job_that_stays_in_the_run_namespace_is_not_marked(tmp_path: Path) -> None:
    proc, _, events = record(tmp_path, *AS_NOBODY, "cat", "/etc/hostname", cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert not of_type(events, "process.namespace")
    assert not any("mntns" in e["data"] for e in events if isinstance(e["data"], dict))
    lint = evidence("lint", str(tmp_path / "run.tar.gz"), "--fail-on", "warn")
    assert lint.returncode == 0 and "EV010" not in lint.stdout, lint.stdout


def test_clone_and_unshare_into_a_user_namespace_are_recorded(tmp_path: Path) -> None:
    proc, _, events = record(tmp_path, *AS_NOBODY, PY, "-S", "-c", CLONE_NEWUSER, cwd="/")
    assert proc.returncode == 0, proc.stderr
    (clone,) = _namespace(events, "clone")
    assert clone["flags"] == ["CLONE_NEWUSER"] and clone["result"] == 0 and clone["target_pid"] > 0
    (unshare,) = _namespace(events, "unshare")
    assert unshare["flags"] == ["CLONE_NEWUSER"] and unshare["result"] == 0
    opened = {e["data"]["path"]: e["data"] for e in of_type(events, "file.open")}
    assert opened["/etc/passwd"]["mntns"] == "other"  # the clone's child
    assert opened["/etc/passwd"]["pid"] == clone["target_pid"]
    assert "mntns" not in opened["/etc/group"]  # the parent, before its own unshare
    assert opened["/etc/hosts"]["mntns"] == "other"  # ... and after it


def _ptrace(tmp_path: Path, victim: int, *extra: str) -> tuple[str, list[dict]]:  # noqa: F811
    proc, _, events = record(tmp_path, *AS_NOBODY, PY, "-c", ATTACK, str(victim), extra=extra, cwd="/")
    assert proc.returncode == 0, proc.stderr
    (attach,) = _namespace(events, "ptrace")
    assert attach["flags"] == ["PTRACE_ATTACH"] and attach["target_pid"] == victim
    assert attach["target_in_run"] is False
    return proc.stdout, [attach]


def test_ptrace_outside_the_run_with_allow_setuid_is_an_error(tmp_path: Path, victim: int) -> None:  # noqa: F811
    out, (attach,) = _ptrace(tmp_path, victim, "--allow-setuid")
    assert '"ptrace": "ok"' in out and attach["result"] == 0  # it worked: the test bites
    lint = evidence("lint", str(tmp_path / "run.tar.gz"))
    assert (
        lint.returncode == 1
        and "EV011 tampered-outside-run" in lint.stdout
        and f"pid {victim}" in lint.stdout
    ), lint.stdout


def test_ptrace_outside_the_run_is_refused_and_recorded(tmp_path: Path, victim: int) -> None:  # noqa: F811
    out, (attach,) = _ptrace(tmp_path, victim)
    assert '"ptrace": 1' in out and attach["result"] == "EPERM"
    lint = evidence("lint", str(tmp_path / "run.tar.gz"), "--fail-on", "warn")
    assert (
        lint.returncode == 0
        and "EV012 tamper-attempt-outside-run" in lint.stdout
        and "EV011" not in lint.stdout
    ), lint.stdout
    assert os.path.exists(f"/proc/{victim}")


@pytest.mark.parametrize(
    ("command", "op", "flags", "paths"),
    [
        (("chroot", "/", "cat", "/etc/hostname"), "chroot", [], ["/"]),
        # its own namespace (PID 1's is outside the job's Landlock domain): the mark is conservative
        (("nsenter", "--mount=/proc/self/ns/mnt", "cat", "/etc/hostname"), "setns", ["CLONE_NEWNS"], []),
    ],
    ids=["chroot", "setns"],
)
def test_chroot_and_setns_are_recorded_and_mark_what_follows(
    command: tuple[str, ...], op: str, flags: list[str], paths: list[str], tmp_path: Path
) -> None:
    # as root: a job without root cannot chroot or enter PID 1's namespace outside a user namespace
    # of its own (which the first test covers), and these calls mark a process on their own
    proc, _, events = record(tmp_path, *command, cwd="/")
    assert proc.returncode == 0, proc.stderr
    (call,) = _namespace(events, op)
    assert call["flags"] == flags and call["paths"] == paths and call["result"] == 0 and "mntns" not in call
    cats = [e["data"] for e in of_type(events, "process.exec") if e["data"]["filename"].endswith("/cat")]
    assert any(c["result"] == 0 for c in cats) and all(c["mntns"] == "other" for c in cats)
    opens = [e["data"] for e in of_type(events, "file.open") if e["data"]["path"] == "/etc/hostname"]
    assert opens and all(o["mntns"] == "other" for o in opens)


# the parent unshares (marked), forks a child (marked at fork), and exits at once: its mark is
# removed, and the child's must still count (nslive), or fill() would skip the lookup in nsmark
ORPHANED_MARK = r"""
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
assert libc.unshare(0x10000000 | 0x20000) == 0, ctypes.get_errno()
r, w = os.pipe()
if os.fork() == 0:
    os.close(w)
    os.read(r, 1)  # the parent has exited
    time.sleep(0.2)
    os.close(os.open("/etc/services", os.O_RDONLY))
    os._exit(0)
os.close(r)
os._exit(0)  # w closes with it: the child goes on as the run's only marked process
"""


def test_a_mark_outlives_the_process_that_made_it(tmp_path: Path) -> None:
    proc, _, events = record(
        tmp_path,
        *AS_NOBODY,
        "sh",
        "-c",
        '"$0" -S -c "$1"; sleep 1; cat /etc/services >/dev/null',
        PY,
        ORPHANED_MARK,
        cwd="/",
    )
    assert proc.returncode == 0, proc.stderr
    opens = [e["data"] for e in of_type(events, "file.open") if e["data"]["path"] == "/etc/services"]
    marked = [o for o in opens if o.get("mntns") == "other"]
    plain = [o for o in opens if "mntns" not in o]
    assert len(marked) == 1 and marked[0]["exe"] == PY  # the orphaned child's, after its parent died
    assert plain and all(o["exe"].endswith("/cat") for o in plain)  # the run's own cat is not marked
