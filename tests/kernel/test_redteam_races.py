"""Red team: races between the threads of a hostile job (as nobody) that make the bundle name the
wrong file, made deterministic (an open held in flight by a FIFO). docs/threat-model.md, row 28."""

from __future__ import annotations

import os
import shutil
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.kernel.util import PY, as_user, of_type, record

NOBODY = 65534


def test_a_cwd_changed_while_an_open_is_in_flight_does_not_rename_what_was_opened(
    tmp_path: Path, place: Path
) -> None:
    """A thread opens "fifo" in REAL (the lookup is done, the open waits for a writer); another
    thread then changes the cwd to DECOY and opens REAL/fifo for writing, which completes the first
    open. The bundle named DECOY/fifo (no such file), result 0, in summary and full detail alike.
    The same race without a FIFO (a thread flipping the cwd between /etc and DECOY while another
    opens "passwd" 50,000 times, in C) recorded every successful read of /etc/passwd as
    DECOY/passwd in 2 runs of 3 (16,815 and 10,590 opens), none in the third: a job can retry until
    it wins. Correct: REAL/fifo, or a name that says the cwd is not known."""
    real, decoy = place / "real", place / "decoy"
    real.mkdir()
    real.chmod(0o777)
    decoy.mkdir()
    decoy.chmod(0o755)
    script = textwrap.dedent(
        f"""
        import os, threading, time
        os.chdir({str(real)!r})
        os.mkfifo('fifo')
        got = []
        def reader():
            fd = os.open('fifo', os.O_RDONLY)
            got.append(os.read(fd, 16))
        t = threading.Thread(target=reader)
        t.start()
        wchan = f'/proc/self/task/{{t.native_id}}/wchan'
        for _ in range(3000):  # the lookup is done: it waits for a writer
            if open(wchan).read() == 'wait_for_partner':
                break
            time.sleep(0.01)
        else:
            raise SystemExit('the reader never waited in the open')
        os.chdir({str(decoy)!r})
        w = os.open({str(real / "fifo")!r}, os.O_WRONLY)
        os.write(w, b'through the fifo')
        t.join()
        assert got == [b'through the fifo'], got
        """
    )
    for detail in ("summary", "full"):
        proc, _, events = record(
            tmp_path, *as_user(NOBODY, PY, "-c", script), extra=("--detail", detail), name=f"{detail}.tar.gz"
        )
        assert proc.returncode == 0, proc.stderr
        (rec,) = [e["data"] for e in of_type(events, "file.open") if e["data"]["raw_path"] == "fifo"]
        assert rec["result"] == 0
        assert rec["path"] == str(real / "fifo"), detail  # the directory a chdir of the run entered
        (real / "fifo").unlink()


@pytest.mark.parametrize(("mode", "detail"), [("r", "summary"), ("w", "summary"), ("r", "full")])
def test_a_name_flipped_in_memory_during_an_open_names_the_file_opened(
    tmp_path: Path, place: Path, mode: str, detail: str
) -> None:
    """One thread opens a name 20,000 times while another flips the name's bytes between a decoy
    in /tmp and a file elsewhere: the probe reads the name at entry, the kernel reads it again, and
    the two can differ. Before, about one read in 300 of the other file was recorded as the decoy
    (the job can retry until the bundle names the decoy for what it really read). A record names
    the file the kernel opened (a key's first open is named by the kernel, and its repeats are the
    same inode): the bundle's count for each file is exactly what the job opened (it tells by the
    inode)."""
    out = Path(tempfile.mkdtemp(prefix="evidence-test-rt-", dir="/var/lib"))
    out.chmod(0o777)
    try:
        real, decoy = f"{out}/f", f"{place}/f"
        width = max(len(real), len(decoy))
        script = textwrap.dedent(
            f"""
            import ctypes, os, threading
            libc = ctypes.CDLL(None, use_errno=True)
            real, decoy = {real!r}, {decoy!r}
            for p in (real, decoy):
                open(p, 'w').close()
            pad = lambda p: ('/' * ({width} - len(p)) + p).encode()  # same length: '//' is '/'
            a, b = pad(real), pad(decoy)
            buf = ctypes.create_string_buffer(a, len(a) + 1)
            inode = {{os.stat(real).st_ino: 'real', os.stat(decoy).st_ino: 'decoy'}}
            done = False
            def flip():
                while not done:
                    ctypes.memmove(buf, b, len(b))
                    ctypes.memmove(buf, a, len(a))
            t = threading.Thread(target=flip)
            t.start()
            n = {{'real': 0, 'decoy': 0}}
            for _ in range(20000):
                fd = libc.open(buf, {os.O_WRONLY if mode == "w" else os.O_RDONLY})
                if fd >= 0:
                    n[inode[os.fstat(fd).st_ino]] += 1
                    os.close(fd)
            done = True
            t.join()
            print(n['real'], n['decoy'])
            """
        )
        proc, _, events = record(tmp_path, *as_user(NOBODY, PY, "-c", script), extra=("--detail", detail))
        assert proc.returncode == 0, proc.stderr
        n_real, n_decoy = (int(x) for x in proc.stdout.split()[-2:])
        counts: dict[str, int] = {}
        for e in of_type(events, "file.open"):
            d = e["data"]
            if d["result"] == 0 and ("write" in d["access"]) == (mode == "w"):
                counts[d["path"]] = counts.get(d["path"], 0) + d.get("count", 1)
        made = 1 if mode == "w" else 0  # each file was made by one open for writing first
        assert (counts.get(real, 0), counts.get(decoy, 0)) == (n_real + made, n_decoy + made), counts
    finally:
        shutil.rmtree(out)
