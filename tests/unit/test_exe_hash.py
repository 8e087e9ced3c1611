"""The program hasher (agent/recorder/exe_hash.py) over a fake /proc tree: <root>/<pid>/exe is a
symlink to the file the fake process runs, as the kernel's magic link resolves to it."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

from evidence.agent.recorder import exe_hash
from evidence.agent.recorder.correlate import Correlator


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class FakeProc:
    def __init__(self, root: Path) -> None:
        self.root = root

    def run(self, pid: int, path: Path) -> None:
        d = self.root / str(pid)
        d.mkdir(parents=True, exist_ok=True)
        (d / "exe").unlink(missing_ok=True)
        (d / "exe").symlink_to(path)

    def gone(self, pid: int) -> None:
        (self.root / str(pid) / "exe").unlink()
        (self.root / str(pid)).rmdir()


@pytest.fixture
def env(tmp_path: Path) -> tuple[FakeProc, exe_hash.ExeHasher, Path]:
    proc = FakeProc(tmp_path / "proc")
    (tmp_path / "proc").mkdir()
    files = tmp_path / "files"
    files.mkdir()
    return proc, exe_hash.ExeHasher(max_size=1024, proc_root=str(proc.root)), files


def test_hashes_through_exe_and_caches(env: tuple[FakeProc, exe_hash.ExeHasher, Path]) -> None:
    proc, h, files = env
    cc = files / "cc"
    cc.write_bytes(b"\x7fELF compiler")
    for pid in range(100, 110):
        proc.run(pid, cc)
        got = h.lookup(pid, str(cc)) or h._program(pid, str(cc))
        assert got.fields() == {"sha256": sha(b"\x7fELF compiler"), "size": 13, "hash_source": "exe"}
    assert h.stats["hashed"] == 1 and h.stats["hits"] == 9


def test_changed_file_is_hashed_again(env: tuple[FakeProc, exe_hash.ExeHasher, Path]) -> None:
    proc, h, files = env
    prog = files / "prog"
    prog.write_bytes(b"one")
    proc.run(1, prog)
    assert h.hash_exec(1, str(prog))["sha256"] == sha(b"one")
    new = files / "prog.new"
    new.write_bytes(b"two!")
    os.replace(new, prog)  # a new inode at the same path
    proc.run(2, prog)
    assert h.lookup(2, str(prog)) is None
    assert h.hash_exec(2, str(prog))["sha256"] == sha(b"two!")
    assert h.stats["hashed"] == 2


def test_size_limit(env: tuple[FakeProc, exe_hash.ExeHasher, Path]) -> None:
    proc, h, files = env
    big = files / "big"
    big.write_bytes(b"x" * 1025)
    proc.run(7, big)
    assert h.hash_exec(7, str(big)) == {"not_hashed": "too_large", "size": 1025}
    assert h.stats["hashed"] == 0


def test_gone_process_falls_back_to_the_path(env: tuple[FakeProc, exe_hash.ExeHasher, Path]) -> None:
    _proc, h, files = env
    prog = files / "prog"
    prog.write_bytes(b"abc")
    assert h.hash_exec(99, str(prog)) == {"sha256": sha(b"abc"), "size": 3, "hash_source": "path"}
    hit = h.lookup(98, str(prog))  # another one gone: answered from the cache, by path
    assert hit is not None and hit.fields() == {"sha256": sha(b"abc"), "size": 3, "hash_source": "path"}
    prog.unlink()
    assert h.hash_exec(99, str(prog)) == {"not_hashed": "gone"}


def _ident(path: Path) -> exe_hash.Ident:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns)


def test_a_gone_process_is_hashed_by_path_as_the_file_the_kernel_mapped(
    env: tuple[FakeProc, exe_hash.ExeHasher, Path],
) -> None:
    """The exec record's identity of the mapped file (device, inode, size, ctime) makes a hash read by
    path as good as one read through /proc ("inode"), and only when the path still names that file."""
    _, h, files = env
    prog = files / "prog"
    prog.write_bytes(b"\x7fELF ran")
    ran = _ident(prog)
    assert h.hash_exec(7, str(prog), ran)["hash_source"] == "inode"
    assert h.lookup(7, str(prog), ran).source == "inode"  # the cached answer too
    assert h.hash_exec(7, str(prog))["hash_source"] == "path"  # no identity: not shown
    # replaced at the path after it ran (a job covering its tracks): read, but not as the file that ran
    prog.unlink()
    prog.write_bytes(b"\x7fELF innocent")
    got = h.hash_exec(7, str(prog), ran)
    assert got["hash_source"] == "path" and got["sha256"] == sha(b"\x7fELF innocent")
    hit = h.lookup(7, str(prog), ran)
    assert hit is None or hit.source == "path"
    # changed in place (same inode; the job set the mtime back): the ctime tells
    prog2 = files / "prog2"
    prog2.write_bytes(b"\x7fELF v1")
    ran2 = _ident(prog2)
    st = os.stat(prog2)
    time.sleep(0.01)
    prog2.write_bytes(b"\x7fELF v2")
    os.utime(prog2, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert h.hash_exec(8, str(prog2), ran2)["hash_source"] == "path"


def test_moved_on_process_is_not_trusted(env: tuple[FakeProc, exe_hash.ExeHasher, Path]) -> None:
    proc, h, files = env
    first, second = files / "first", files / "second"
    first.write_bytes(b"first")
    second.write_bytes(b"second")
    proc.run(5, second)  # pid 5 exec'd `first`, then `second` before its first exec was hashed
    assert h.lookup(5, str(first)) is None
    assert h.hash_exec(5, str(first)) == {"sha256": sha(b"first"), "size": 5, "hash_source": "path"}
    # ...and a cached hash of `second` is not given to the record of `first`
    assert h.hash_exec(5, str(second))["hash_source"] == "exe"
    assert h.lookup(5, str(first)) is None


def test_replaced_binary_still_hashed_through_exe(env: tuple[FakeProc, exe_hash.ExeHasher, Path]) -> None:
    """The kernel names a replaced program `<path> (deleted)`: the record's path still matches."""
    _proc, h, files = env
    root = Path(h.proc_root)
    (root / "3").mkdir()
    old = files / "old-inode"
    old.write_bytes(b"what ran")
    # a fake magic link cannot hold " (deleted)" and still open: check the name rule alone
    (root / "3" / "exe").symlink_to(old)
    os.rename(old, files / "kept")
    assert not h._matches(3, str(files / "prog"), os.stat(files / "kept"))


def test_script_hashes_script_and_interpreter(env: tuple[FakeProc, exe_hash.ExeHasher, Path]) -> None:
    proc, h, files = env
    interp = files / "sh"
    interp.write_bytes(b"\x7fELF shell")
    script = files / "build.sh"
    script.write_bytes(b"#!" + bytes(interp) + b" -e\necho hi\n")
    proc.run(8, interp)
    assert h.lookup(8, str(script)) is None  # a script is never answered from the exe's cache
    h.hash_exec(8, str(script))
    assert h.lookup(9, str(script)) is None  # ...nor, gone, from its path's
    assert h.hash_exec(8, str(script)) == {
        "sha256": sha(script.read_bytes()),
        "size": script.stat().st_size,
        "hash_source": "path",
        "interpreter": str(interp),
        "interpreter_sha256": sha(b"\x7fELF shell"),
        "interpreter_size": 10,
        "interpreter_hash_source": "exe",
    }


def test_shebang_parsing() -> None:
    assert exe_hash.shebang_interpreter(b"#!/bin/sh\n") == "/bin/sh"
    assert exe_hash.shebang_interpreter(b"#! /usr/bin/env python3 -u\nx") == "/usr/bin/env"
    assert exe_hash.shebang_interpreter(b"#!\n") is None
    assert exe_hash.shebang_interpreter(b"\x7fELF") is None


def test_not_regular(env: tuple[FakeProc, exe_hash.ExeHasher, Path]) -> None:
    _proc, h, files = env
    assert h.hash_exec(1, str(files)) == {"not_hashed": "not_regular"}


def test_hasher_pending_and_settle(env: tuple[FakeProc, exe_hash.ExeHasher, Path]) -> None:
    proc, h, files = env
    prog = files / "prog"
    prog.write_bytes(b"abc")
    proc.run(1, prog)
    hasher = exe_hash.Hasher(h)
    try:
        first = hasher(1, str(prog))
        assert isinstance(first, exe_hash.Pending)
        recs = [{"k": "exec", "filename": str(prog), exe_hash.PENDING: first}, {"k": "open"}]
        assert exe_hash.settle(recs, wait=True) == 2
        assert recs[0] == {
            "k": "exec",
            "filename": str(prog),
            "sha256": sha(b"abc"),
            "size": 3,
            "hash_source": "exe",
        }
        # now cached: answered at once, no worker involved
        assert hasher(1, str(prog)) == {"sha256": sha(b"abc"), "size": 3, "hash_source": "exe"}
    finally:
        hasher.close()


def test_settle_keeps_order() -> None:
    import concurrent.futures

    fut: concurrent.futures.Future[dict[str, object]] = concurrent.futures.Future()
    recs = [{"k": "open"}, {"k": "exec", exe_hash.PENDING: exe_hash.Pending(fut)}, {"k": "open"}]
    assert exe_hash.settle(recs) == 1  # the exec and what follows it wait
    fut.set_result({"sha256": "0" * 64, "size": 1, "hash_source": "exe"})
    assert exe_hash.settle(recs) == 3 and recs[1]["size"] == 1


def test_correlator_hook() -> None:
    seen: list[tuple[int, str]] = []

    def hash_of(pid: int, filename: str, ident: object = None) -> dict[str, object]:
        seen.append((pid, filename))
        return {"sha256": "a" * 64, "size": 9, "hash_source": "exe"}

    c = Correlator(time.time_ns() - time.monotonic_ns(), hash_of=hash_of)
    ev = {
        "kind": "exec_ok",
        "tgid": 42,
        "tid": 42,
        "old_tid": 0,
        "filename": "/bin/true",
        "argv": ["true"],
        "flags": 0,
        "ts": 1,
    }
    recs = c.feed(ev)
    assert seen == [(42, "/bin/true")]
    assert recs[0]["sha256"] == "a" * 64 and recs[0]["hash_source"] == "exe"


def test_a_hash_that_never_comes_is_given_up() -> None:
    import concurrent.futures

    fut: concurrent.futures.Future[dict[str, object]] = concurrent.futures.Future()
    recs = [
        {
            "k": "exec",
            "filename": "/fuse/x",
            exe_hash.PENDING: exe_hash.Pending(fut, deadline=time.monotonic() + 0.05),
        }
    ]
    assert exe_hash.settle(recs) == 0
    time.sleep(0.06)
    assert exe_hash.settle(recs) == 1
    assert recs[0] == {"k": "exec", "filename": "/fuse/x", "not_hashed": "timeout"}


def test_a_fifo_put_at_a_programs_path_is_never_opened_to_wait(
    env: tuple[FakeProc, exe_hash.ExeHasher, Path],
) -> None:
    """The job renames a FIFO over the program it just ran: reading the path (the script check, the
    ELF class, the hash by path) must not wait for a writer that never comes (red team: `evidence
    run` hung after its bundle, and the agent's hash workers for good)."""
    import threading

    from evidence.agent.recorder.recording import elf_abi

    proc, h, files = env
    prog = files / "prog"
    prog.write_bytes(b"\x7fELF program")
    proc.run(70, prog)
    fifo = files / "fifo"
    os.mkfifo(fifo)
    os.replace(fifo, prog)  # the process runs the old file; the path is a FIFO now
    got: list[object] = []

    def read_all() -> None:
        got.append(h.hash_exec(71, str(prog)))  # pid 71: gone, so the path is read
        got.append(elf_abi(71, str(prog)))

    t = threading.Thread(target=read_all, daemon=True)
    t.start()
    t.join(timeout=20)
    if t.is_alive():  # let the thread go before failing
        os.close(os.open(prog, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("blocked opening a FIFO")
    fields, abi = got
    assert isinstance(fields, dict) and "sha256" not in fields and fields["not_hashed"]
    assert abi is None


class GatedHasher(exe_hash.ExeHasher):
    """Hashes nothing: records each file asked for and waits for its gate (a slow or stuck read)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []
        self.gates: dict[str, threading.Event] = {}
        self.started = threading.Semaphore(0)

    def lookup(self, pid: int, filename: str, ident: object = None, root: object = None) -> None:
        return None

    def hash_exec(
        self, pid: int, filename: str, ident: object = None, root: object = None
    ) -> dict[str, object]:
        self.asked.append(filename)
        self.started.release()
        self.gates.setdefault(filename, threading.Event()).wait(30)
        self._read.n = 100  # as if it read 100 bytes
        return {"sha256": "0" * 64, "size": 100, "hash_source": "exe"}

    def open_gate(self, name: str) -> None:
        self.gates.setdefault(name, threading.Event()).set()


def test_runs_take_turns_one_file_each() -> None:
    # run a queues five files, run b one: b's is hashed second, not after all of a's
    h = GatedHasher()
    hasher = exe_hash.Hasher(h, workers=1)
    a, b = hasher.run("a"), hasher.run("b")
    try:
        pending = [a(1, f"a{i}") for i in range(5)]
        assert h.started.acquire(timeout=30)  # a0 is being hashed
        pending.append(b(2, "b0"))
        for name in ["a0", "b0", "a1", "a2", "a3", "a4"]:
            h.open_gate(name)
        recs = [{"k": "exec", exe_hash.PENDING: p} for p in pending]
        assert exe_hash.settle(recs, wait=True) == 6
        assert h.asked == ["a0", "b0", "a1", "a2", "a3", "a4"]
    finally:
        hasher.close()


def test_a_stuck_read_holds_back_only_its_own_run() -> None:
    h = GatedHasher()
    hasher = exe_hash.Hasher(h, workers=1)
    hasher.STUCK = 0.0  # the one worker counts as stuck at once (its gate never opens)
    a, b = hasher.run("a"), hasher.run("b")
    try:
        stuck = a(1, "fuse")
        assert h.started.acquire(timeout=30)
        also_a = a(1, "a1")  # waits behind its run's stuck file
        h.open_gate("b0")
        got = b(2, "b0")
        assert isinstance(got, exe_hash.Pending)
        assert got.future.result(timeout=30)["size"] == 100  # another worker took b's turn
        assert h.asked == ["fuse", "b0"] and not also_a.ready() and not stuck.ready()
    finally:
        h.open_gate("fuse")
        h.open_gate("a1")
        hasher.close()


def test_a_run_over_its_budget_says_what_it_did_not_hash(
    env: tuple[FakeProc, exe_hash.ExeHasher, Path],
) -> None:
    proc, h, files = env
    progs = []
    for i in range(3):
        prog = files / f"prog{i}"
        prog.write_bytes(b"x" * (10 + i))  # distinct contents, sizes 10, 11, 12
        proc.run(10 + i, prog)
        progs.append(prog)
    hasher = exe_hash.Hasher(h, budget=(15, 600.0))
    run, other = hasher.run("big"), hasher.run("other")
    try:
        for i in range(2):  # 10 bytes, then 11: past 15 after the second
            got = run(10 + i, str(progs[i]))
            assert isinstance(got, exe_hash.Pending)
            assert got.future.result(timeout=30)["size"] == 10 + i
        assert run(12, str(progs[2])) == {"not_hashed": "over_budget", "size": 12}
        assert run(10, str(progs[0]))["sha256"] == sha(b"x" * 10)  # a cache hit costs nothing
        said = run.degradation()
        assert said is not None and said.component == "exe-hash" and "1 program(s)" in said.reason
        got = other(12, str(progs[2]))  # its own budget
        assert isinstance(got, exe_hash.Pending) and got.future.result(timeout=30)["size"] == 12
        assert other.degradation() is None
    finally:
        hasher.close()


def test_a_file_whose_record_stopped_waiting_is_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    h = GatedHasher()
    hasher = exe_hash.Hasher(h, workers=1)
    run = hasher.run("a")
    try:
        first = run(1, "a0")
        assert h.started.acquire(timeout=30)
        monkeypatch.setattr(exe_hash, "HASH_SECONDS", 0.0)
        late = run(1, "a1")  # its deadline has passed by the time its turn comes
        h.open_gate("a0")
        assert first.future.result(timeout=30)["size"] == 100
        assert late.future.result(timeout=30) == {"not_hashed": "timeout"}
        assert h.asked == ["a0"] and run.not_hashed["timeout"] == 1
    finally:
        hasher.close()


def test_a_file_that_grows_while_hashed_is_read_one_byte_past_its_size(tmp_path: Path) -> None:
    prog = tmp_path / "prog"
    prog.write_bytes(b"abc")
    h = exe_hash.ExeHasher()
    fd = os.open(prog, os.O_RDONLY)
    try:
        st = os.fstat(fd)  # its size when its hashing began
        with open(prog, "ab") as f:
            f.write(b"x" * (8 << 20))  # the job keeps writing to it
        h.reset_read()
        got = h._hash_fd(fd, st, "path")
    finally:
        os.close(fd)
    assert (got.sha256, got.size) == (sha(b"abcx"), 4) and h.read_bytes() == 4
    assert h._cache == {}  # not what the file is: not cached
