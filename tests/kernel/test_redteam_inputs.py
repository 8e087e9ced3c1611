"""Red team: hostile inputs that must neither crash the recorder nor corrupt the bundle, each made by a
job running as nobody: names that are not UTF-8 (with a newline, an escape and a bidi override),
a NUL-free 4,096-byte path that ends where the mapping ends, a symlink loop, sockaddrs of unknown
families, wrong lengths and bad pointers, execve with a NULL argv, with a bad argv pointer and
past E2BIG, and execveat of a memfd. All were recorded right: the run exits 0, the bundle verifies
and lints clean at the default level, and each attempt is in it with its result
(docs/threat-model.md, row 24)."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from tests.kernel.util import PY, as_user, evidence, of_type, record

NOBODY = 65534

_SCRIPT = r"""
import ctypes, mmap, os, socket, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
os.chdir(sys.argv[1])

def fails(errno, fn, *args):
    assert fn(*args) == -1, fn
    assert ctypes.get_errno() == errno, (fn, args, ctypes.get_errno())

# a name that is not UTF-8, with a newline, a carriage return, an escape and a bidi override
os.close(os.open(b'bad-\xff\xfe\xed\xa0\x80\n\r\x1b[31m\xe2\x80\xae', os.O_RDONLY | os.O_CREAT, 0o600))
# 4,096 bytes without a NUL, the last one at the end of a mapping (the next page unmapped)
page = libc.mmap(None, 8192, 3, 0x22, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
ctypes.memset(page, ord('c'), 4096)
ctypes.memset(page, ord('/'), 1)
assert libc.munmap(ctypes.c_void_p(page + 4096), 4096) == 0
fails(36, libc.open, ctypes.c_void_p(page), 0)  # ENAMETOOLONG
os.symlink('loop', 'loop')
try:
    open('loop')
except OSError as e:
    assert e.errno == 40  # ELOOP
# sockaddrs: an unknown family, too long, too short, without a NUL, empty, not in memory
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
def connect(raw, length=None):
    buf = ctypes.create_string_buffer(raw, max(len(raw), 1))
    return libc.connect(s.fileno(), buf, len(raw) if length is None else length)
connect(struct.pack('<H', 40) + b'\x01' * 14)
connect(struct.pack('<H', 2) + b'\xff' * 198)
connect(struct.pack('<H', 10) + b'\x00' * 3)
connect(struct.pack('<H', 1) + b'u' * 108)
connect(b'', 0)
fails(14, libc.connect, s.fileno(), ctypes.c_void_p(16), 16)  # EFAULT
# execve: a NULL argv (the kernel gives the program one empty argument), an argv pointer not in
# memory, and more argument bytes than the kernel takes
pid = os.fork()
if pid == 0:
    libc.syscall(59, b'/usr/bin/true', None, None)
    os._exit(99)
assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
fails(14, libc.syscall, 59, b'/usr/bin/true', ctypes.c_void_p(16), None)
big = b'\xff' * 100000
argv = (ctypes.c_char_p * 402)(b'big', *([big] * 400), None)
fails(7, libc.syscall, 59, b'/usr/bin/true', argv, None)  # E2BIG
# execveat of a memfd holding /usr/bin/true
fd = os.memfd_create('evil\nname')
with open('/usr/bin/true', 'rb') as f:
    os.write(fd, f.read())
pid = os.fork()
if pid == 0:
    argv = (ctypes.c_char_p * 3)(b'memfd', b'x', None)
    libc.syscall(322, fd, b'', argv, None, 0x1000)  # AT_EMPTY_PATH
    os._exit(99)
assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
"""


@pytest.mark.parametrize("detail", ["summary", "full"])
def test_hostile_names_addresses_and_execs_are_recorded_and_the_bundle_verifies(
    tmp_path: Path, place: Path, detail: str
) -> None:
    proc, manifest, events = record(
        tmp_path, *as_user(NOBODY, PY, "-c", textwrap.dedent(_SCRIPT), str(place)), extra=("--detail", detail)
    )
    assert proc.returncode == 0, proc.stderr
    assert manifest["lost"]["total"] == 0
    lint = evidence("lint", str(tmp_path / "run.tar.gz"))
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert "verified" in lint.stdout

    opens = {(e["data"]["raw_path"], e["data"]["result"]) for e in of_type(events, "file.open")}
    bad = "bad-\\xff\\xfe\\xed\\xa0\\x80\n\r\x1b[31m\u202e"
    assert (bad, 0) in opens
    assert ("/" + "c" * 4094, "ENAMETOOLONG") in opens  # the probe's 4,095 bytes, and the result
    assert ("loop", "ELOOP") in opens
    (change,) = [e["data"] for e in of_type(events, "file.change") if e["data"]["operation"] == "symlink"]
    assert (change["path"], change["target"], change["result"]) == (f"{place}/loop", "loop", 0)

    connects = {
        (d["family"], d["address"][:12], d["result"])
        for d in (e["data"] for e in of_type(events, "network.connect"))
        if d["exe"] == PY
    }
    assert ("OTHER", "family=40", "EAFNOSUPPORT") in connects or ("OTHER", "family=40", "EINVAL") in connects
    assert ("AF_INET", "255.255.255.", "EINVAL") in connects
    assert ("OTHER", "", "EINVAL") in connects  # too short, or empty: no address
    # 108 bytes without a NUL: a name relative to the cwd, resolved against it (threat model row 27)
    unix = [
        d for d in (e["data"] for e in of_type(events, "network.connect")) if d["address"].endswith("u" * 108)
    ]
    assert [(d["family"], d["address"]) for d in unix] == [("AF_UNIX", f"{place}/" + "u" * 108)]
    assert any(f == "AF_UNSPEC" or r == "EFAULT" for f, _, r in connects)

    execs = [e["data"] for e in of_type(events, "process.exec")]
    null_argv = [x for x in execs if x["filename"] == "/usr/bin/true" and x["result"] == 0]
    assert [x["argv"] for x in null_argv] == [[""]]
    assert {x["result"] for x in execs if x["filename"] == "/usr/bin/true" and x["result"] != 0} == {
        "EFAULT",
        "E2BIG",
    }
    (e2big,) = [x for x in execs if x["result"] == "E2BIG"]
    assert e2big["argv_truncated"] and e2big["argv"][0] == "big"
    (memfd,) = [x for x in execs if x["argv"] == ["memfd", "x"]]
    assert memfd["result"] == 0 and memfd["filename"].startswith("/dev/fd/")
    assert "EV006" in lint.stdout  # a program from a file descriptor, with no file behind it


@pytest.mark.parametrize("policy", [(), ("--policy", "default")], ids=["observe", "policy"])
def test_a_cwd_whose_name_is_not_utf8_is_recorded_as_text(
    tmp_path: Path, place: Path, policy: tuple[str, ...]
) -> None:
    """`evidence run` started in a directory whose name is not UTF-8 (its caller's cwd, os.getcwd()
    gives lone surrogates): the run failed (exit 70, no bundle: the spool's encoder raised and the
    consumer died; with a policy, the manifest could not be written). Now the cwd is recorded with such bytes as \\xNN, like the kernel's names, and
    the job (as nobody) works there as anywhere."""
    bad = os.fsencode(place) + b"/bad\xffdir"
    os.mkdir(bad)
    os.chmod(bad, 0o777)
    script = "open('made-here', 'w').write('x'); print(open('made-here').read())"
    proc, manifest, events = record(tmp_path, *as_user(NOBODY, PY, "-c", script), cwd=bad, extra=policy)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "x\n"
    text = f"{place}/bad\\xffdir"
    assert manifest["cwd"] == text
    if policy:  # the workspace is the cwd: the manifest's policy names it as text too
        assert manifest["policy"]["workspace"] == text and manifest["policy"]["mode"] == "enforce"
    made = {e["data"]["path"] for e in of_type(events, "file.open") if e["data"]["raw_path"] == "made-here"}
    assert made == {f"{text}/made-here"}
