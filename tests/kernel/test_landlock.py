"""Landlock on the real kernel: apply a plan in a child before it execs and try to break it.

Landlock needs no privilege, only a kernel that offers it; the test is skipped (a failure under
CI=true) when landlock_create_ruleset reports no ABI.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from evidence.policy import landlock
from evidence.policy.model import load_policy
from tests.kernel.util import IO_URING, landlocked

pytestmark = pytest.mark.kernel

PYTHON = os.path.realpath("/usr/bin/python3")  # the system interpreter: its files are under /usr


@pytest.fixture(scope="module")
def abi() -> int:
    version = landlock.abi_version()
    if version <= 0:
        pytest.skip("needs Landlock (landlock_create_ruleset reports no ABI: lsm=landlock missing)")
    return version


POLICY = """\
version: 1
fs:
  read:  ["/usr", "/lib", "/lib64", "/etc", "/proc", "/dev/null", "${HOME}"]
  write: ["${WORKSPACE}", "${TMPDIR}"]
  exec:  ["/usr", "/lib", "/lib64", "${WORKSPACE}"]
  deny:  ["${HOME}/.ssh", "${HOME}/.aws"]
"""


@pytest.fixture
def box(tmp_path: Path, abi: int) -> dict[str, Path]:
    home, ws, tmp, outside = tmp_path / "home", tmp_path / "ws", tmp_path / "tmp", tmp_path / "outside"
    for d in (home / ".ssh", home / ".config", home / "bin", ws / "src" / "pkg", ws / "bin", tmp, outside):
        d.mkdir(parents=True)
    (home / ".ssh" / "id_rsa").write_text("SECRET-KEY\n")
    (home / "notes.txt").write_text("notes\n")
    (home / ".config" / "app.ini").write_text("[app]\n")
    (ws / "src" / "pkg" / "__init__.py").write_text("")
    (ws / "src" / "pkg" / "mod.py").write_text("def f():\n    return 42\n")
    (ws / "link_to_secret").symlink_to(home / ".ssh" / "id_rsa")
    (outside / "data.txt").write_text("outside\n")
    for d in (home / "bin", ws / "bin"):
        shutil.copy2("/usr/bin/true", d / "true")
    (tmp_path / "policy.yaml").write_text(POLICY)
    return {"root": tmp_path, "home": home, "ws": ws, "tmp": tmp, "outside": outside}


def _plan(box: dict[str, Path], abi: int) -> landlock.LandlockPlan:
    policy = load_policy(
        box["root"] / "policy.yaml", workspace=str(box["ws"]), tmpdir=str(box["tmp"]), home=str(box["home"])
    )
    return landlock.plan(policy, abi)


ATTEMPTS = r"""
import errno, json, os, subprocess, sys
home, ws, outside = sys.argv[1], sys.argv[2], sys.argv[3]
secret = home + "/.ssh/id_rsa"
out = {}
def attempt(name, fn):
    try:
        r = fn()
        out[name] = "ok" if r is None else r
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno, str(e.errno))
def read(p):
    with open(p) as f:
        return "read:" + f.read().strip()
attempt("read_allowed", lambda: read(home + "/notes.txt"))
attempt("read_denied", lambda: read(secret))
attempt("read_denied_symlink", lambda: read(ws + "/link_to_secret"))
attempt("list_denied_dir", lambda: str(os.listdir(home + "/.ssh")))
attempt("read_via_proc_root", lambda: read("/proc/self/root" + secret))
def via_proc_fd():
    fd = os.open(secret, os.O_PATH)
    return read("/proc/self/fd/%d" % fd)
attempt("read_via_proc_self_fd", via_proc_fd)
attempt("hardlink_into_ws", lambda: os.link(secret, ws + "/hardlink"))
attempt("read_hardlink", lambda: read(ws + "/hardlink"))
attempt("rename_into_ws", lambda: os.rename(secret, ws + "/stolen"))
attempt("rename_dir_into_ws", lambda: os.rename(home + "/.ssh", ws + "/ssh"))
attempt("symlink_then_read", lambda: (os.symlink(secret, ws + "/newlink"), read(ws + "/newlink"))[1])
attempt("write_ws", lambda: open(ws + "/out.txt", "w").write("x") and None)
attempt("write_outside", lambda: open(outside + "/new.txt", "w").write("x") and None)
attempt("append_outside", lambda: open(outside + "/data.txt", "a").write("x") and None)
attempt("truncate_allowed_read_only", lambda: os.truncate(home + "/notes.txt", 0))
attempt("create_in_expanded_home", lambda: open(home + "/new.txt", "w").write("x") and None)
attempt("exec_ws", lambda: "rc=%d" % subprocess.run([ws + "/bin/true"]).returncode)
attempt("exec_outside", lambda: "rc=%d" % subprocess.run([home + "/bin/true"]).returncode)
attempt("exec_via_interpreter_dir", lambda: "rc=%d" % subprocess.run(["/usr/bin/true"]).returncode)
print(json.dumps(out))
"""


def _run_attempts(box: dict[str, Path], plan: landlock.LandlockPlan) -> dict[str, str]:
    proc = subprocess.run(
        landlocked(
            plan, PYTHON, "-I", "-S", "-c", ATTEMPTS, str(box["home"]), str(box["ws"]), str(box["outside"])
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_abi_is_recorded(abi: int) -> None:
    assert abi >= 1
    plan = landlock.plan(None, abi)
    assert plan.rules == ()


def test_apply_in_child_cannot_be_broken(box: dict[str, Path], abi: int) -> None:
    plan = _plan(box, abi)
    assert plan.enforced
    got = _run_attempts(box, plan)

    # allowed work still succeeds
    assert got["read_allowed"] == "read:notes"
    assert got["write_ws"] == "ok"
    assert got["exec_ws"] == "rc=0"
    assert got["exec_via_interpreter_dir"] == "rc=0"

    # the denied file, however it is reached
    assert got["read_denied"] == "EACCES"
    assert got["read_denied_symlink"] == "EACCES"
    assert got["list_denied_dir"] == "EACCES"
    assert got["read_via_proc_root"] == "EACCES"
    assert got["read_via_proc_self_fd"] == "EACCES"
    assert got["hardlink_into_ws"] in ("EXDEV", "EACCES", "EPERM")
    assert got["read_hardlink"] == "ENOENT"
    assert got["rename_into_ws"] in ("EXDEV", "EACCES")
    assert got["rename_dir_into_ws"] in ("EXDEV", "EACCES")
    assert got["symlink_then_read"] == "EACCES"
    assert (box["home"] / ".ssh" / "id_rsa").read_text() == "SECRET-KEY\n"
    assert not (box["ws"] / "stolen").exists() and not (box["ws"] / "ssh").exists()

    # writes outside the workspace
    assert got["write_outside"] == "EACCES"
    assert got["append_outside"] == "EACCES"
    assert not (box["outside"] / "new.txt").exists()
    assert (box["outside"] / "data.txt").read_text() == "outside\n"
    if abi >= 3:
        assert got["truncate_allowed_read_only"] == "EACCES"
        assert (box["home"] / "notes.txt").read_text() == "notes\n"

    # the stated cost of the deny-in-allow expansion of ${HOME}
    assert got["create_in_expanded_home"] == "EACCES"
    assert any(c.startswith(f"{box['home']}: read granted entry by entry") for c in plan.costs)

    # exec outside the exec allow list (the file is readable, not executable)
    assert got["exec_outside"] == "EACCES"


def test_denials_are_attributed_by_check_file(box: dict[str, Path], abi: int) -> None:
    policy = load_policy(
        box["root"] / "policy.yaml", workspace=str(box["ws"]), tmpdir=str(box["tmp"]), home=str(box["home"])
    )
    secret = str(box["home"] / ".ssh" / "id_rsa")
    assert policy.check_file(secret, "read").rule == "fs.deny[0]: ${HOME}/.ssh"
    assert policy.check_file(str(box["outside"] / "new.txt"), "create").rule == "fs.write: not allowed"
    assert policy.check_file(str(box["home"] / "bin" / "true"), "exec").rule == "fs.exec: not allowed"
    plan = _plan(box, abi)
    assert policy.check_file(str(box["home"] / "new.txt"), "read") is None
    assert "expanded entry by entry" in (plan.explain(str(box["home"] / "new.txt"), "read") or "")


def test_compileall_on_workspace_succeeds(box: dict[str, Path], abi: int) -> None:
    plan = _plan(box, abi)
    proc = subprocess.run(
        landlocked(plan, PYTHON, "-I", "-m", "compileall", "-q", str(box["ws"] / "src")),
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "TMPDIR": str(box["tmp"])},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list((box["ws"] / "src" / "pkg" / "__pycache__").glob("mod.*.pyc"))


def test_preexisting_hardlink_is_a_degradation(box: dict[str, Path], abi: int) -> None:
    os.link(box["home"] / ".ssh" / "id_rsa", box["ws"] / "old_link")
    plan = _plan(box, abi)
    assert any("hard links" in d["reason"] for d in plan.degradations)
    # and it is what Landlock cannot stop: the other link is inside an allowed tree
    code = "import sys; print(open(sys.argv[1]).read().strip())"
    proc = subprocess.run(
        landlocked(plan, PYTHON, "-I", "-S", "-c", code, str(box["ws"] / "old_link")),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.stdout.strip() == "SECRET-KEY"


def test_scoped_signals_cannot_leave_the_domain(box: dict[str, Path], abi: int) -> None:
    if abi < 6:
        pytest.skip("signal scoping needs Landlock ABI 6")
    plan = _plan(box, abi)
    code = textwrap.dedent(
        """
        import errno, os, sys
        try:
            os.kill(int(sys.argv[1]), 0)
            print("ok")
        except OSError as e:
            print(errno.errorcode[e.errno])
        """
    )
    proc = subprocess.run(
        landlocked(plan, PYTHON, "-I", "-S", "-c", code, str(os.getpid())),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.stdout.strip() == "EPERM"


# A minimal io_uring client (ctypes + mmap, no liburing), run inside the child.


URING_ATTEMPTS = (
    IO_URING
    + r"""
import errno, json, sys
home = sys.argv[1]
out = {}
for name, path in (("allowed", home + "/notes.txt"), ("denied", home + "/.ssh/id_rsa")):
    res = uring_openat(path)
    out[name] = None if res is None else ("ok" if res >= 0 else errno.errorcode[-res])
print(json.dumps(out))
"""
)


def test_io_uring_openat_is_confined_too(box: dict[str, Path], abi: int) -> None:
    if (
        Path("/proc/sys/kernel/io_uring_disabled").exists()
        and Path("/proc/sys/kernel/io_uring_disabled").read_text().strip() == "2"
    ):
        pytest.skip("io_uring is disabled on this kernel (kernel.io_uring_disabled=2)")
    plan = _plan(box, abi)
    proc = subprocess.run(
        landlocked(plan, PYTHON, "-I", "-S", "-c", URING_ATTEMPTS, str(box["home"])),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    if got["allowed"] is None:
        pytest.skip("io_uring_setup is refused for this process")
    assert got == {"allowed": "ok", "denied": "EACCES"}
