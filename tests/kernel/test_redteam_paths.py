"""Red team: names the bundle gives to what a hostile job (as nobody) opened, executed or connected
to. Each test performs the attack for real and asserts the correct outcome; the ones the recorder
gets wrong today, and that need probes/record.bpf.c to get right, are strict xfails that say what
the fix is (docs/threat-model.md, rows 25-27, 29, 30, 36 and 38; 25-27, 29 and 30 were fixed in
record.bpf.c after they were found)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kernel.util import PY, as_user, evidence, of_type, record

NOBODY = 65534


def _opens(events: list[dict], raw: str) -> list[dict]:
    return [e["data"] for e in of_type(events, "file.open") if e["data"]["raw_path"] == raw]


def test_openat2_resolve_in_root_is_named_under_its_dirfd(tmp_path: Path) -> None:
    """openat2(fd of /etc, "/passwd", RESOLVE_IN_ROOT) opens /etc/passwd: the bundle must not say
    "/passwd" (a file that does not exist) was read."""
    script = textwrap.dedent(
        """
        import ctypes, os, struct
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        etc = os.open('/etc', os.O_RDONLY | os.O_DIRECTORY)
        how = ctypes.create_string_buffer(struct.pack('QQQ', os.O_RDONLY, 0, 0x10), 24)  # RESOLVE_IN_ROOT
        fd = libc.syscall(437, etc, b'/passwd', how, 24)  # openat2
        assert fd >= 0, ctypes.get_errno()
        assert os.read(fd, 5) == b'root:'
        """
    )
    proc, _, events = record(tmp_path, *as_user(NOBODY, PY, "-c", script))
    assert proc.returncode == 0, proc.stderr
    (rec,) = _opens(events, "/passwd")
    assert rec["result"] == 0
    assert rec["path"] == "/etc/passwd"


def test_dotdot_after_a_magic_link_is_not_collapsed_into_another_name(tmp_path: Path) -> None:
    """fd 3 = /etc/ssh; open("/proc/self/fd/3/../passwd") reads /etc/passwd, and chdir to
    /proc/self/fd/3 then open("../group") reads /etc/group. The bundle said /proc/self/fd/passwd and
    /proc/self/fd/group (and, through Debian's /var/run -> /run, /var/etc/hostname for
    /var/run/../etc/hostname): names of files that do not exist, for files that were read. Correct
    is the file's name or the name as given (with its '..'), never a third one."""
    script = textwrap.dedent(
        """
        import os
        d = os.open('/etc/ssh', os.O_RDONLY | os.O_DIRECTORY)
        assert d == 3, d
        assert open('/proc/self/fd/3/../passwd').read(5) == 'root:'
        os.chdir('/proc/self/fd/3')
        assert os.getcwd() == '/etc/ssh'
        assert open('../group').read(5) == 'root:'
        """
    )
    proc, _, events = record(tmp_path, *as_user(NOBODY, PY, "-c", script))
    assert proc.returncode == 0, proc.stderr
    (passwd,) = _opens(events, "/proc/self/fd/3/../passwd")
    (group,) = _opens(events, "../group")
    assert passwd["path"] in ("/etc/passwd", "/proc/self/fd/3/../passwd")
    assert group["path"] in ("/etc/group", "/proc/self/fd/3/../group")


@pytest.mark.parametrize("detail", ["summary", "full"])
def test_a_dotdot_after_a_symlink_is_named_by_the_kernel_each_time(
    tmp_path: Path, place: Path, detail: str
) -> None:
    """l -> x/sub: "l/../f" opens x/f; l retargeted to y/sub, the same name opens y/f. Each open is
    named by the kernel (never lexically DIR/f, never aggregated under the first one's name), by
    its absolute name and relative to the cwd, three times each."""
    script = textwrap.dedent(
        f"""
        import os
        os.chdir({str(place)!r})
        for d in ('x', 'y'):
            os.makedirs(d + '/sub')
            open(d + '/f', 'w').write(d)
        for target in ('x/sub', 'y/sub'):
            os.symlink(target, 'l')
            for _ in range(3):
                for name in ('l/../f', {str(place)!r} + '/l/../f'):
                    assert open(name).read() == target[0]
            os.unlink('l')
        """
    )
    proc, _, events = record(tmp_path, *as_user(NOBODY, PY, "-c", script), extra=("--detail", detail))
    assert proc.returncode == 0, proc.stderr
    opened = _opens(events, "l/../f") + _opens(events, f"{place}/l/../f")
    assert {o["path"] for o in opened} == {f"{place}/x/f", f"{place}/y/f"}, opened
    for path in ("x/f", "y/f"):  # (a summary keeps one raw name of a path's opens)
        assert sum(o.get("count", 1) for o in opened if o["path"] == f"{place}/{path}") == 6


def test_a_cwd_entered_through_a_symlink_is_its_kernel_name(tmp_path: Path, place: Path) -> None:
    """chdir("l") with l -> x/sub: the cwd is x/sub, so "../f" is x/f (opened, or not: a failed
    open's leading '..' is the real parent too), and a '..' after a component of the name that the
    kernel did not name (the open failed) stays: never a third name."""
    script = textwrap.dedent(
        f"""
        import os, subprocess
        os.chdir({str(place)!r})
        os.makedirs('x/sub')
        open('x/f', 'w').write('x')
        os.symlink('x/sub', 'l')
        os.chdir('l')
        assert open('../f').read() == 'x'
        for name in ('../missing', 'nope/../g'):
            try:
                open(name)
            except FileNotFoundError:
                pass
        subprocess.run(['/bin/true'])
        """
    )
    proc, _, events = record(tmp_path, *as_user(NOBODY, PY, "-c", script))
    assert proc.returncode == 0, proc.stderr
    assert [o["path"] for o in _opens(events, "../f")] == [f"{place}/x/f"]
    assert [o["path"] for o in _opens(events, "../missing")] == [f"{place}/x/missing"]
    assert [o["path"] for o in _opens(events, "nope/../g")] == [f"{place}/x/sub/nope/../g"]
    (true,) = [e["data"] for e in of_type(events, "process.exec") if e["data"]["filename"] == "/bin/true"]
    assert true["cwd"] == f"{place}/x/sub"


def test_a_write_through_a_symlink_is_named_where_it_went(tmp_path: Path, place: Path) -> None:
    """A job (no policy: lint's EV004 is what says it wrote outside the workspace) writes through a
    symlink in /tmp to a directory elsewhere: the open is named by the kernel, the file it wrote,
    and lint flags it. Before, the bundle said /tmp/.../l/written, a scratch place: nothing to see.
    A read through the same symlink is named by the kernel too."""
    out = Path(tempfile.mkdtemp(prefix="evidence-test-rt-", dir="/var/lib"))
    out.chmod(0o777)
    (out / "readme").write_text("r")
    try:
        script = textwrap.dedent(
            f"""
            import os
            os.chdir({str(place)!r})
            os.symlink({str(out)!r}, 'l')
            open('l/written', 'w').write('w')
            assert open('l/readme').read() == 'r'
            """
        )
        proc, _, events = record(tmp_path, *as_user(NOBODY, PY, "-c", script))
        assert proc.returncode == 0, proc.stderr
        assert [o["path"] for o in _opens(events, "l/written")] == [f"{out}/written"]
        assert [o["path"] for o in _opens(events, "l/readme")] == [f"{out}/readme"]
        lint = evidence("lint", "--format", "json", str(tmp_path / "run.tar.gz"))
        findings = json.loads(lint.stdout)["findings"]
        assert any(f["rule"] == "EV004" and f"{out}/written" in f["message"] for f in findings), findings
    finally:
        shutil.rmtree(out)


def test_a_name_too_deep_for_the_kernel_to_name_keeps_its_dotdot(tmp_path: Path, place: Path) -> None:
    """A directory 70 levels deep (deeper than the probe walks): the kernel gives no name for the
    cwd or for "../f" opened there, and the bundle keeps the name as given, '..' and all, for a
    file that was read (never a third name)."""
    script = textwrap.dedent(
        f"""
        import os
        deep = {str(place)!r} + ''.join('/d%d' % i for i in range(70))
        os.makedirs(deep)
        open(os.path.dirname(deep) + '/f', 'w').write('deep')
        os.chdir(deep)
        assert open('../f').read() == 'deep'
        print(deep)
        """
    )
    proc, _, events = record(tmp_path, *as_user(NOBODY, PY, "-c", script))
    assert proc.returncode == 0, proc.stderr
    deep = proc.stdout.strip().splitlines()[-1]
    assert [o["path"] for o in _opens(events, "../f")] == [f"{deep}/../f"]


def test_a_failed_exec_of_a_name_not_in_memory_is_not_named_after_the_cwd(tmp_path: Path) -> None:
    """execve of a name on a page the process never touched (a fresh shared mapping of a memfd):
    the probe cannot read it at entry (the kernel faults it in for itself), and a failed exec has
    no exec_ok to name it. The bundle said the job tried to execute its working directory; it must
    say the name was unreadable, and the same name read from touched memory is recorded as given."""
    script = textwrap.dedent(
        """
        import ctypes, mmap, os
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        name = b'/usr/bin/evidence-redteam-missing'
        fd = os.memfd_create('name')
        os.ftruncate(fd, 4096)
        os.write(fd, name + b'\\0')
        m = mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        where = ctypes.addressof(ctypes.c_char.from_buffer(m))  # the page is not touched
        argv = (ctypes.c_char_p * 2)(b'x', None)
        assert libc.syscall(59, ctypes.c_void_p(where), argv, argv) == -1  # execve
        assert ctypes.get_errno() == 2
        assert libc.syscall(59, name, argv, argv) == -1 and ctypes.get_errno() == 2
        os.chdir('/tmp')
        """
    )
    proc, manifest, events = record(tmp_path, *as_user(NOBODY, PY, "-c", script), extra=("--detail", "full"))
    assert proc.returncode == 0, proc.stderr
    failed = [e["data"] for e in of_type(events, "process.exec") if e["data"]["argv"] == ["x"]]
    assert all(f["result"] == "ENOENT" for f in failed)
    names = [f["filename"] for f in failed]
    assert manifest["cwd"] not in names
    assert names.count("/usr/bin/evidence-redteam-missing") >= 1
    assert len(failed) == 2
    assert set(names) <= {"<unreadable path>", "/usr/bin/evidence-redteam-missing"}


@pytest.fixture
def two_sockets() -> Iterator[tuple[Path, Path, list[socket.socket]]]:
    """Two listening unix sockets of the same name in two directories nobody can enter."""
    dirs = [Path(tempfile.mkdtemp(prefix="evidence-test-rt-", dir=d)) for d in ("/tmp", "/run")]
    socks = []
    for d in dirs:
        d.chmod(0o755)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(d / "sock"))
        os.chmod(d / "sock", 0o777)
        s.listen(8)
        socks.append(s)
    yield dirs[0], dirs[1], socks
    for s in socks:
        s.close()
    for d in dirs:
        (d / "sock").unlink()
        d.rmdir()


def test_relative_unix_socket_paths_are_resolved_and_kept_apart(tmp_path: Path, two_sockets) -> None:
    """chdir to each directory and connect to "sock" there: two different servers. The bundle had
    one connect to "sock" with count 2 (and a policy cannot check a name without its directory)."""
    a, b, _ = two_sockets
    script = textwrap.dedent(
        f"""
        import os, socket
        for d in ({str(a)!r}, {str(b)!r}):
            os.chdir(d)
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect('sock')
        """
    )
    proc, _, events = record(tmp_path, *as_user(NOBODY, PY, "-c", script))
    assert proc.returncode == 0, proc.stderr
    got = sorted(
        (e["data"]["address"], e["data"]["count"])
        for e in of_type(events, "network.connect")
        if e["data"]["family"] == "AF_UNIX" and e["data"]["address"].endswith("sock")
    )
    assert got == sorted([(str(a / "sock"), 1), (str(b / "sock"), 1)])


@pytest.mark.parametrize("detail", ["summary", "full"])
def test_a_cwd_shared_by_clone_fs_and_changed_by_the_child_does_not_rename_the_parents_opens(
    tmp_path: Path, detail: str
) -> None:
    """The parent (cwd /tmp) makes a child with clone(CLONE_FS); the child does chdir("/etc"),
    which moves the parent too; the parent then opens "passwd": /etc/passwd. The bundle said
    /tmp/passwd (no such file), result 0. Correct: /etc/passwd, or `<unknown cwd>/passwd`."""
    script = textwrap.dedent(
        """
        import ctypes, os
        os.chdir('/tmp')
        r, w = os.pipe()
        libc = ctypes.CDLL(None, use_errno=True)
        pid = libc.syscall(56, 0x200 | 17, 0, 0, 0, 0)  # clone(CLONE_FS | SIGCHLD)
        if pid == 0:
            os.chdir('/etc')
            os.write(w, b'x')
            os._exit(0)
        os.read(r, 1)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        assert os.getcwd() == '/etc'
        assert open('passwd').read(5) == 'root:'
        """
    )
    proc, _, events = record(tmp_path, *as_user(NOBODY, PY, "-c", script), extra=("--detail", detail))
    assert proc.returncode == 0, proc.stderr
    (rec,) = _opens(events, "passwd")
    assert rec["result"] == 0
    assert rec["path"] == "/etc/passwd"  # the directory a chdir of the run entered


# a thread makes its cwd its own (unshare(CLONE_FS), not traced) and goes to /tmp; the main thread
# stays in /etc (what comes after it runs there)
_PRIVATE_CWD = textwrap.dedent(
    """
    import ctypes, os, threading
    os.chdir('/etc')
    libc = ctypes.CDLL(None, use_errno=True)
    def private():
        assert libc.unshare(0x200) == 0, ctypes.get_errno()  # CLONE_FS
        os.chdir('/tmp')
    t = threading.Thread(target=private)
    t.start()
    t.join()
    assert os.getcwd() == '/etc'
    """
)


def test_a_threads_private_cwd_does_not_rename_the_other_threads_opens(tmp_path: Path) -> None:
    """A thread does unshare(CLONE_FS) (its cwd becomes its own), then chdir("/tmp"); the main
    thread, still in /etc, opens "passwd": /etc/passwd. The bundle said /tmp/passwd."""
    script = _PRIVATE_CWD + "assert open('passwd').read(5) == 'root:'\n"
    proc, _, events = record(tmp_path, *as_user(NOBODY, PY, "-c", script))
    assert proc.returncode == 0, proc.stderr
    (rec,) = _opens(events, "passwd")
    assert rec["result"] == 0
    assert rec["path"] == "/etc/passwd"  # the directory a chdir of the run entered


def test_a_threads_private_cwd_does_not_rename_the_other_threads_namespace_calls(tmp_path: Path) -> None:
    """The same with a namespace call: in a user namespace of its own, the main thread (in /etc)
    does chroot("ssh") after a thread with a private cwd did chdir("/tmp"): /etc/ssh, not
    /tmp/ssh (namespace calls now carry the cwd's identity like opens)."""
    userns = "import ctypes\nassert ctypes.CDLL(None).unshare(0x10000000) == 0  # CLONE_NEWUSER: may chroot\n"
    script = userns + _PRIVATE_CWD + "os.chroot('ssh')\n"
    proc, _, events = record(tmp_path, *as_user(NOBODY, PY, "-c", script))
    assert proc.returncode == 0, proc.stderr
    (rec,) = [e["data"] for e in of_type(events, "process.namespace") if e["data"]["operation"] == "chroot"]
    assert rec["result"] == 0
    assert rec["paths"] == ["/etc/ssh"]


def test_a_write_through_proc_self_fd_of_an_o_path_descriptor_names_the_file(tmp_path: Path) -> None:
    """open(F, O_PATH) (no access: Landlock does not check it either), then open("/proc/self/fd/N",
    O_WRONLY) writes F. The bundle said a write of "/proc/self/fd/3"; which file it was is not in
    it (opens do not record the descriptor they return). Correct: the write names F."""
    target = Path(tempfile.mkdtemp(prefix="evidence-test-rt-", dir="/tmp"))
    try:
        target.chmod(0o777)
        script = textwrap.dedent(
            f"""
            import os
            f = {str(target / "victim")!r}
            os.close(os.open(f, os.O_WRONLY | os.O_CREAT, 0o600))
            p = os.open(f, os.O_PATH)
            assert p == 3, p
            os.write(os.open('/proc/self/fd/3', os.O_WRONLY), b'planted')
            """
        )
        proc, _, events = record(tmp_path, *as_user(NOBODY, PY, "-c", script))
        assert proc.returncode == 0, proc.stderr
        assert (target / "victim").read_bytes() == b"planted"
    finally:
        shutil.rmtree(target)
    (rec,) = _opens(events, "/proc/self/fd/3")
    assert rec["access"] == ["write"] and rec["result"] == 0
    assert rec["path"] == str(target / "victim")


def test_changes_through_magic_links_name_the_file_the_descriptor_holds(tmp_path: Path) -> None:
    """Issue 22, item 6. With O_PATH descriptors of a file and a directory outside the workspace
    (no access: neither recorded as one nor checked by Landlock), a job truncates, chmods, makes
    directories in and renames through /proc/self/fd/N, /dev/fd/N, /proc/thread-self/fd/N, its own
    /proc/<pid>/fd/N, and relative fd/N from /proc/self and N from /proc/self/fd. The bundle said
    /proc/self/fd/3 and the like, which lint takes for scratch; it must name the real files, and
    lint must flag them (EV004). A descriptor the recorder never saw opened (fcntl F_DUPFD is not
    traced) leaves the name as given, and lint flags that too: it may be any file."""
    out = Path(tempfile.mkdtemp(prefix="evidence-test-rt-", dir="/var/lib"))
    try:
        (out / "victim").write_text("secret")
        (out / "dir").mkdir()
        for p in (out, out / "victim", out / "dir"):
            os.chown(p, NOBODY, NOBODY)
        script = textwrap.dedent(
            f"""
            import fcntl, os
            assert os.open({str(out / "victim")!r}, os.O_PATH) == 3
            assert os.open({str(out / "dir")!r}, os.O_PATH | os.O_DIRECTORY) == 4
            os.truncate('/proc/self/fd/3', 1)
            os.chmod('/dev/fd/3', 0o666)
            os.mkdir('/proc/self/fd/4/sub')
            os.rename('/proc/self/fd/4/sub', '/proc/thread-self/fd/4/sub2')
            os.rmdir('/proc/%d/fd/4/sub2' % os.getpid())
            os.chdir('/proc/self')
            os.truncate('fd/3', 2)
            os.chdir('fd')
            os.mkdir('4/sub3')
            os.chdir('/')
            assert fcntl.fcntl(3, fcntl.F_DUPFD, 100) == 100
            os.truncate('/proc/self/fd/100', 3)
            """
        )
        # in full detail: each change an event (a summary counts equal ones under one)
        proc, _, events = record(tmp_path, *as_user(NOBODY, PY, "-c", script), extra=("--detail", "full"))
        assert proc.returncode == 0, proc.stderr
        assert (out / "victim").read_bytes() == b"s\0\0" and (out / "dir" / "sub3").is_dir()
        changes = [e["data"] for e in of_type(events, "file.change")]
        named = [(c["operation"], c["raw_path"], c["path"], c.get("target")) for c in changes]
        victim, d = str(out / "victim"), str(out / "dir")
        pid_fd = [c["raw_path"] for c in changes if c["operation"] == "rmdir"][0]
        assert named == [
            ("truncate", "/proc/self/fd/3", victim, None),
            ("chmod", "/dev/fd/3", victim, None),
            ("mkdir", "/proc/self/fd/4/sub", f"{d}/sub", None),
            ("rename", "/proc/self/fd/4/sub", f"{d}/sub", f"{d}/sub2"),
            ("rmdir", pid_fd, f"{d}/sub2", None),
            ("truncate", "fd/3", victim, None),
            ("mkdir", "4/sub3", f"{d}/sub3", None),
            ("truncate", "/proc/self/fd/100", "/proc/self/fd/100", None),
        ], named
        assert all(c["result"] == 0 for c in changes)
        lint = evidence("lint", "--format", "json", str(tmp_path / "run.tar.gz"))
        flagged = {
            f["message"].split(" ")[2] for f in json.loads(lint.stdout)["findings"] if f["rule"] == "EV004"
        }
        assert flagged == {victim, f"{d}/sub", f"{d}/sub2", f"{d}/sub3", "/proc/self/fd/100"}, flagged
    finally:
        shutil.rmtree(out)


def test_a_write_through_a_hard_link_made_in_an_earlier_run_says_the_file_has_other_names(
    tmp_path: Path,
) -> None:
    """Issue 22, item 7. A root-owned world-writable file outside the workspace (/var/lib); in an
    earlier run the job (as nobody) hard-links it into /var/tmp (protected_hardlinks lets it: it
    may read and write the file). In a later run it writes the link and truncates it through
    /proc/self/fd/N: the bundle names /var/tmp/..., a scratch place, and lint said nothing. The
    write open and the truncate now carry the file's link count (2), and lint flags both (EV004:
    the other name may be outside the workspace)."""
    out = Path(tempfile.mkdtemp(prefix="evidence-test-rt-", dir="/var/lib"))
    place = Path(tempfile.mkdtemp(prefix="evidence-test-rt-", dir="/var/tmp"))  # the same file system
    try:
        out.chmod(0o755)
        place.chmod(0o777)
        (out / "victim").write_text("root's")
        (out / "victim").chmod(0o666)
        link = place / "link"
        earlier, _, _ = record(
            tmp_path, *as_user(NOBODY, PY, "-c", f"import os; os.link({str(out / 'victim')!r}, {str(link)!r})"),
            name="earlier.tar.gz",
        )  # fmt: skip
        assert earlier.returncode == 0, earlier.stderr
        script = textwrap.dedent(
            f"""
            import os
            with open({str(link)!r}, 'w') as f:
                f.write('planted')
            assert os.open({str(link)!r}, os.O_PATH) == 3
            os.truncate('/proc/self/fd/3', 4)
            """
        )
        proc, _, events = record(tmp_path, *as_user(NOBODY, PY, "-c", script))
        assert proc.returncode == 0, proc.stderr
        assert (out / "victim").read_text() == "plan"
        (wrote,) = [o for o in _opens(events, str(link)) if o["access"] == ["write", "create"]]
        assert (wrote["path"], wrote["result"], wrote["nlink"]) == (str(link), 0, 2)
        (cut,) = [e["data"] for e in of_type(events, "file.change")]
        assert (cut["operation"], cut["path"], cut["nlink"]) == ("truncate", str(link), 2)
        lint = evidence("lint", "--format", "json", str(tmp_path / "run.tar.gz"))
        found = [
            (f["message"], f["count"]) for f in json.loads(lint.stdout)["findings"] if f["rule"] == "EV004"
        ]
        # one finding per file with other names, counting the write and the truncate
        assert [(m.split(",")[0], n) for m, n in found] == [
            (f"/usr/bin/python3 wrote {link} (write+create)", 2)
        ]
        assert "a file with 2 names: the others may be outside the workspace" in found[0][0]
    finally:
        shutil.rmtree(out)
        shutil.rmtree(place)
