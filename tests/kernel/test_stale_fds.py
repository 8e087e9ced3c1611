"""A descriptor put at a number the recorder's tables know, in a way the recorder does not see
(fcntl F_DUPFD, SCM_RIGHTS to oneself, pidfd_getfd, a table shared by CLONE_FILES; close is not a
record), must not make the bundle name the wrong file: records resolved against a descriptor carry
what it names (its inode, read by the kernel), and a table entry is used only while the descriptor
names that inode still. Each attack (opens, an execveat, fchdir, mkdir through it) runs as nobody,
in summary and in full detail; a directory removed and made again at the same path, opened and
used as a dirfd, still resolves exactly."""

from __future__ import annotations

import os
import shutil
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kernel.util import PY, as_user, of_type, record

NOBODY = 65534

# Every attack: fd 3 = /etc and fd 4 = /tmp, both recorded; fd 4 closed (not a record); then a
# copy of fd 3 put at number 4 unseen; a relative open through fd 4 really opens /etc/NAME.
_SETUP = """
import ctypes, fcntl, os, socket
etc = os.open('/etc', os.O_RDONLY | os.O_DIRECTORY)
tmp = os.open('/tmp', os.O_RDONLY | os.O_DIRECTORY)
assert (etc, tmp) == (3, 4), (etc, tmp)
"""

ATTACKS = {
    # fcntl(F_DUPFD) is not traced
    "passwd": """
os.close(tmp)
new = fcntl.fcntl(etc, fcntl.F_DUPFD, tmp)
# execveat through it (fails: not executable; the attempt is recorded)
libc = ctypes.CDLL(None, use_errno=True)
argv = (ctypes.c_char_p * 2)(b'passwd', None)
assert libc.syscall(322, new, b'passwd', argv, argv, 0) == -1  # execveat
""",
    # a descriptor sent to oneself over a socketpair (the pair moved out of the way first)
    "group": """
a, b = socket.socketpair()
os.dup2(a.fileno(), 100); os.dup2(b.fileno(), 101); a.close(); b.close()
a, b = socket.socket(fileno=100), socket.socket(fileno=101)
os.close(tmp)
socket.send_fds(a, [b'x'], [etc])
_, (new,), _, _ = socket.recv_fds(b, 1, 1)
""",
    # pidfd_getfd on one's own pidfd
    "hostname": """
pidfd = os.pidfd_open(os.getpid())
os.dup2(pidfd, 100); os.close(pidfd)
os.close(tmp)
libc = ctypes.CDLL(None, use_errno=True)
new = libc.syscall(438, 100, etc, 0)  # pidfd_getfd
assert new >= 0, ctypes.get_errno()
""",
}

# a descriptor table shared by clone(CLONE_FILES): the parent's dup2 is recorded for the parent,
# while the child's table (copied at the fork) still says fd 4 = /tmp
_CLONE_FILES = """
import ctypes, os
r, w = os.pipe(); os.dup2(r, 100); os.dup2(w, 101); os.close(r); os.close(w)
etc = os.open('/etc', os.O_RDONLY | os.O_DIRECTORY)
tmp = os.open('/tmp', os.O_RDONLY | os.O_DIRECTORY)
assert (etc, tmp) == (3, 4), (etc, tmp)
libc = ctypes.CDLL(None, use_errno=True)
pid = libc.syscall(56, 0x400 | 17, 0, 0, 0, 0)  # clone(CLONE_FILES | SIGCHLD)
if pid == 0:
    os.read(100, 1)
    os.close(os.open('shells', os.O_RDONLY, dir_fd=4))
    os._exit(0)
os.dup2(etc, tmp)
os.write(101, b'x')
assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
"""

# What a job could do with it: open through the descriptor, fchdir to it and open relative to the
# cwd, make a directory through it (the decoy: /tmp)
_USE = """
assert new == 4, new
os.close(os.open({name!r}, os.O_RDONLY, dir_fd=new))
"""

_FCHDIR = """
os.close(tmp)
new = fcntl.fcntl(etc, fcntl.F_DUPFD, tmp)
assert new == 4, new
os.fchdir(new)
os.close(os.open('services', os.O_RDONLY))
"""

# the directory the job really changes is W; the bundle must not say /tmp
_CHANGE = """
import fcntl, os
w = os.open({w!r}, os.O_RDONLY | os.O_DIRECTORY)
decoy = os.open('/tmp', os.O_RDONLY | os.O_DIRECTORY)
assert (w, decoy) == (3, 4), (w, decoy)
os.close(decoy)
new = fcntl.fcntl(w, fcntl.F_DUPFD, decoy)
assert new == 4, new
os.mkdir('evidence-stalefd-made', dir_fd=new)
"""

# a directory removed and made again at the same path (a new inode), opened again at the same
# descriptor number and used as a dirfd: resolves exactly (three times: the kernel counts repeats)
_REMADE = """
d = os.path.join({w!r}, 'd')
for i in range(3):
    os.mkdir(d)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    assert fd == 3, fd
    os.close(os.open('f', os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
    os.unlink('f', dir_fd=fd)
    os.close(fd)
    os.rmdir(d)
"""


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A directory nobody can write (the job's own), outside root's private pytest directory."""
    w = Path(f"/tmp/evidence-stalefd-{os.getpid()}")
    shutil.rmtree(w, ignore_errors=True)
    w.mkdir()
    w.chmod(0o1777)
    yield w
    shutil.rmtree(w, ignore_errors=True)


def _script(workdir: Path) -> str:
    """One shell command: each case in a process of its own (its descriptors numbered from 3)."""
    cases = [_SETUP + body + _USE.format(name=name) for name, body in ATTACKS.items()]
    cases += [
        _CLONE_FILES,
        _SETUP + _FCHDIR,
        _CHANGE.format(w=str(workdir)),
        "import os\n" + _REMADE.format(w=str(workdir)),
    ]
    return " && ".join(f"{PY} -S -c {_quote(textwrap.dedent(c))}" for c in cases)


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


@pytest.mark.parametrize("detail", ["summary", "full"])
def test_a_descriptor_put_unseen_at_a_known_number_is_never_misnamed(
    tmp_path: Path, workdir: Path, detail: str
) -> None:
    proc, manifest, events = record(
        tmp_path, *as_user(NOBODY, "/bin/sh", "-c", _script(workdir)), extra=("--detail", detail)
    )
    assert proc.returncode == 0, proc.stderr
    opens = {e["data"]["path"] for e in of_type(events, "file.open") if e["data"]["result"] == 0}
    changes = {(e["data"]["operation"], e["data"]["path"]) for e in of_type(events, "file.change")}
    # the decoy and the real directory were both recorded as opened
    assert {"/etc", "/tmp", str(workdir)} <= opens
    through = {
        (e["data"]["raw_path"], e["data"]["path"])
        for e in of_type(events, "file.open")
        if e["data"]["dirfd"] == 4
    }
    for name in ATTACKS:
        # the file the kernel opened (before kernel names: a descriptor the recorder cannot name,
        # `<unknown fd 4>/name`), never the decoy's name
        assert (name, f"/etc/{name}") in through, (name, sorted(through))
        assert f"/tmp/{name}" not in opens
    execs = {e["data"]["filename"] for e in of_type(events, "process.exec")}
    assert "<unknown fd 4>/passwd" in execs and "/tmp/passwd" not in execs
    # through a table shared by CLONE_FILES
    assert ("shells", "/etc/shells") in through and "/tmp/shells" not in opens
    # fchdir through it: the cwd is the kernel's name of the directory it really is (/etc), not /tmp
    assert "/etc/services" in opens and "/tmp/services" not in opens
    # a change through it
    assert ("mkdir", "<unknown fd 4>/evidence-stalefd-made") in changes
    assert ("mkdir", "/tmp/evidence-stalefd-made") not in changes
    assert (workdir / "evidence-stalefd-made").is_dir()  # where it really went
    # a directory made again at the same path: still resolved exactly through its new descriptor
    d = f"{workdir}/d"
    remade = [e["data"] for e in of_type(events, "file.open") if e["data"]["path"] == f"{d}/f"]
    assert sum(r.get("count", 1) for r in remade) == 3, remade
    assert ("unlink", f"{d}/f") in changes
    assert manifest["lost"]["total"] == 0
