"""The exec supervisor's usual request in C (src/fast/_exec.c) against the Python path it stands in
for (exec_resolve.read_request): the same request, or the same error, for names and argvs laid out
in memory as a job lays them out, across page boundaries and up to an unreadable page; and the C
path taking the usual case (else it would cost without helping). The caller is this process: what
is read is read with process_vm_readv and /proc as from a job."""

from __future__ import annotations

import ctypes
import mmap
import os
import stat
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evidence.agent.recorder import exec_resolve
from evidence.agent.recorder.exec_resolve import ExecRequest

needs_fast = pytest.mark.skipif(
    exec_resolve._fast is None, reason="the compiled module is not built (make setup)"
)
PAGE = exec_resolve.PAGE


class Layout:
    """Three pages of this process's memory, the last one unreadable (PROT_NONE): a name and an
    argv placed at given offsets, as a job's exec passes them."""

    def __init__(self) -> None:
        self.map = mmap.mmap(-1, 3 * PAGE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mprotect(ctypes.c_void_p(self.base + 2 * PAGE), PAGE, 0) != 0:
            raise OSError(ctypes.get_errno(), "mprotect")
        self.extra: list[ctypes.Array[ctypes.c_char]] = []  # strings that did not fit, elsewhere

    def put(self, at: int, data: bytes) -> int:
        """`data` at offset `at` (cut at the unreadable page); its address."""
        room = max(0, 2 * PAGE - at)
        self.map[at : at + min(room, len(data))] = data[:room]
        return self.base + at

    def elsewhere(self, data: bytes) -> int:
        buf = ctypes.create_string_buffer(data)
        self.extra.append(buf)
        return ctypes.addressof(buf)

    def close(self) -> None:
        libc = ctypes.CDLL(None)
        libc.mprotect(ctypes.c_void_p(self.base + 2 * PAGE), PAGE, mmap.PROT_READ | mmap.PROT_WRITE)
        self.map.close()


@contextmanager
def layout() -> Iterator[Layout]:
    got = Layout()
    try:
        yield got
    finally:
        got.close()


def both(path_addr: int, argv_addr: int) -> tuple[object, object]:
    """(the C path's request or error, the Python path's) for an execve of (path, argv)."""
    args = (path_addr, argv_addr, 0, 0, 0, 0)

    def one() -> object:
        try:
            return exec_resolve.read_request(os.getpid(), exec_resolve.NR_EXECVE, args)
        except OSError as e:
            return ("OSError", e.errno)
        except ValueError as e:
            return ("ValueError", str(e))

    fast = one()
    saved, exec_resolve._fast = exec_resolve._fast, None
    try:
        pure = one()
    finally:
        exec_resolve._fast = saved
    return fast, pure


def usual(path_addr: int, argv_addr: int) -> tuple[object, ...] | None:
    assert exec_resolve._fast is not None
    got = exec_resolve._fast.read_usual(
        os.getpid(),
        path_addr,
        argv_addr,
        *exec_resolve._our_root_mount(),
        exec_resolve._HEADS,
        exec_resolve._HEADS_MAX,
    )
    return got  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def names(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    """Names a job may exec: files of every kind, links, /proc's own, names that lead nowhere."""
    d = tmp_path_factory.mktemp("names")
    prog = d / "prog"
    prog.write_bytes(b"\x7fELF" + b"\0" * 300)
    prog.chmod(0o755)
    script = d / "script"
    script.write_bytes(b"#!/bin/sh -e\necho hi\n")
    script.chmod(0o755)
    loader_script = d / "loader-script"
    loader_script.write_bytes(b"#!/lib64/ld-linux-x86-64.so.2 /usr/bin/true\n")
    loader_script.chmod(0o755)
    (d / "link").symlink_to(prog)
    (d / "chain").symlink_to(d / "link")
    (d / "dangling").symlink_to(d / "nowhere")
    (d / "dir").mkdir()
    os.mkfifo(d / "fifo")
    odd = d / "na\xefve".encode("latin-1").decode("utf-8", "surrogateescape")
    odd.write_bytes(b"#!/usr/bin/true\n")
    gone = d / "gone"
    gone.write_bytes(b"x")
    fd = os.open(gone, os.O_RDONLY)  # kept open: /proc/self/fd/N names " (deleted)"
    gone.unlink()
    sd = str(d).encode()
    return [
        b"/usr/bin/true",
        b"/bin/true",
        b"//usr/bin/true",
        b"///usr//bin/../bin/true",
        b"/proc/self/exe",
        b"/proc/thread-self/exe",
        b"/proc/self/root/usr/bin/true",
        b"/lib64/ld-linux-x86-64.so.2",
        b"true",
        b"./true",
        b"",
        b"/nowhere/at/all",
        b"/" + b"a" * 5000,
        sd + b"/prog",
        sd + b"/script",
        sd + b"/loader-script",
        sd + b"/link",
        sd + b"/chain",
        sd + b"/dangling",
        sd + b"/dir",
        sd + b"/fifo",
        sd + b"/na\xefve",
        b"/proc/self/fd/%d" % fd,
        sd + b"/./prog",
    ]


argvs = st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\0", b"")), max_size=6)


@needs_fast
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    which=st.integers(min_value=0, max_value=100),
    argv=argvs,
    path_at=st.one_of(
        st.integers(0, 2 * PAGE - 1),
        st.integers(PAGE - 48, PAGE + 8),
        st.integers(2 * PAGE - 24, 2 * PAGE - 1),
    ),
    argv_at=st.one_of(
        st.integers(0, 2 * PAGE - 8),
        st.integers(PAGE - 12, PAGE - 1),
        st.integers(2 * PAGE - 16, 2 * PAGE - 1),
    ),
    null_argv=st.booleans(),
)
def test_the_c_path_gives_what_the_python_path_gives(
    names: list[bytes], which: int, argv: list[bytes], path_at: int, argv_at: int, null_argv: bool
) -> None:
    name = names[which % len(names)]
    with layout() as mem:
        path_addr = mem.put(path_at, name + b"\0")
        pointers = [mem.elsewhere(a) for a in argv] + [0]
        array = struct.pack(f"={len(pointers)}Q", *pointers)
        argv_addr = 0 if null_argv else mem.put(argv_at, array)
        fast, pure = both(path_addr, argv_addr)
    assert fast == pure


@needs_fast
@pytest.mark.parametrize(
    ("count", "size"),
    [(999, 1), (1000, 1), (1001, 1), (2, 32767), (2, 32768), (1, 65535), (1, 65536), (3, 4096 * 32)],
)
def test_argvs_at_the_limits_read_alike(count: int, size: int) -> None:
    """MAX_ARGC arguments, MAX_ARGV_BYTES of them, one past each: cut (truncated) or whole alike."""
    with layout() as mem:
        path_addr = mem.put(100, b"/usr/bin/true\0")
        pointers = [mem.elsewhere(b"x" * size) for _ in range(count)] + [0]
        argv_addr = mem.elsewhere(struct.pack(f"={len(pointers)}Q", *pointers))
        fast, pure = both(path_addr, argv_addr)
    assert fast == pure
    assert isinstance(fast, ExecRequest)


@needs_fast
def test_the_usual_request_is_read_in_c(names: list[bytes]) -> None:
    """An absolute name of a file, of a script, through links: the C path's (it returns None for
    what it leaves to Python: a relative name, no file, a deleted one, a name cut, /proc/...)."""
    taken = {}
    with layout() as mem:
        for name in names:
            argv = mem.elsewhere(struct.pack("=2Q", mem.elsewhere(b"arg0"), 0))
            taken[name] = usual(mem.put(64, name + b"\0"), argv) is not None
    d = next(n for n in names if n.endswith(b"/prog")).rsplit(b"/", 1)[0]
    for name in (b"/usr/bin/true", b"//usr/bin/true", d + b"/script", d + b"/chain", d + b"/fifo"):
        assert taken[name], name
    # Python's: a relative name, none, no file, a name too long, a name through a magic link or
    # under /proc/ (the caller's process and thread, which need its thread group)
    for name in (b"true", b"", b"/nowhere/at/all", b"/" + b"a" * 5000, d + b"/dangling", b"/proc/self/exe"):
        assert not taken[name], name
    assert not taken[next(n for n in names if n.startswith(b"/proc/self/fd/"))]  # " (deleted)"


@needs_fast
def test_a_head_read_in_c_is_the_one_python_keeps(tmp_path: Path) -> None:
    """The heads cache is shared: what C read, Python finds, and C finds what Python read."""
    prog = tmp_path / "p"
    prog.write_bytes(b"#!/bin/sh\n" + b"x" * 400)
    exec_resolve._HEADS.clear()
    with layout() as mem:
        argv = mem.elsewhere(struct.pack("=Q", 0))
        got = usual(mem.put(0, str(prog).encode() + b"\0"), argv)
    assert got is not None and got[-1] == (b"#!/bin/sh\n" + b"x" * 400)[: exec_resolve.HEAD]
    st_ = prog.stat()
    assert stat.S_ISREG(st_.st_mode)
    key = (st_.st_dev, st_.st_ino, st_.st_size, st_.st_mtime_ns, st_.st_ctime_ns)
    assert exec_resolve._HEADS[key] == got[-1]


def test_proc_self_is_the_callers_process_and_thread_self_its_thread() -> None:
    """As the kernel reads them for the caller (a thread id): /proc/self/ its thread group's,
    /proc/thread-self/ its own task's (exec_resolve._caller_path; the C path leaves /proc/ to it)."""
    import threading

    got: dict[str, str] = {}

    def in_a_thread() -> None:
        tid = threading.get_native_id()
        got["self"] = exec_resolve._caller_path(tid, "/proc/self/exe")
        got["thread"] = exec_resolve._caller_path(tid, "//proc/thread-self/cwd")
        got["tid"] = str(tid)

    t = threading.Thread(target=in_a_thread)
    t.start()
    t.join()
    assert got["tid"] != str(os.getpid())
    assert got["self"] == f"/proc/{os.getpid()}/exe"
    assert got["thread"] == f"/proc/{os.getpid()}/task/{got['tid']}/cwd"
