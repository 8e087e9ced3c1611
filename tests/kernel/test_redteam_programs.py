"""Red team: the programs a job runs, and what the recorder reads of them as root.

Hang the recorder: a job (as nobody) runs a program from a directory it owns and, while the
recorder is still to read it, renames a FIFO over its path. The recorder reads the program's first
bytes by path (is it a script? a 32-bit ELF?): a plain open of a FIFO waits for a writer, for ever.
`evidence run` wrote its bundle and then hung at exit (its hash worker never returned; SIGTERM is
forwarded to the job, which is gone); through an agent, its two hash workers would hang for good
and every later exec wait 10 s for its hash (docs/threat-model.md, row 31).

Lie about a hash: rewrite a program in place and put its mtime back (row 34); run it through a name
the recorder resolves wrong (row 37)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.kernel.util import as_user, of_type, read_bundle

NOBODY = 65534

_JOB = """
cd "$1"
for i in 1 2 3; do
  cp /usr/bin/sleep prog$i
  ./prog$i 0.5 &
  # the FIFO goes over the program once it runs (before, the exec could lose the race and fail)
  until [ "$(readlink /proc/$!/exe)" = "$PWD/prog$i" ]; do :; done
  mkfifo f$i && mv -f f$i prog$i
done
wait
"""


def _unblock(place: Path) -> None:
    """Open each FIFO for writing: a reader waiting in open() gets its writer, then EOF."""
    for fifo in place.glob("prog*"):
        with contextlib.suppress(OSError):  # ENXIO: no reader waiting
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_a_fifo_renamed_over_a_program_that_ran_does_not_hang_the_recorder(
    tmp_path: Path, place: Path
) -> None:
    bundle = tmp_path / "run.tar.gz"
    proc = subprocess.Popen(
        [sys.executable, "-m", "evidence", "run", "--bundle", str(bundle), "--",
         *as_user(NOBODY, "/bin/sh", "-c", _JOB, "sh", str(place))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 90  # a hash given up takes 10 s; the run itself ~1 s
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    hung = proc.poll() is None
    if hung:
        _unblock(place)  # let it finish (and clean up after itself) before failing
    _, stderr = proc.communicate(timeout=120)
    assert not hung, f"evidence run hung (bundle written: {bundle.exists()})"
    assert proc.returncode == 0, stderr
    _, events = read_bundle(bundle)
    progs = [
        e["data"] for e in of_type(events, "process.exec") if e["data"]["filename"].startswith(str(place))
    ]
    assert len(progs) == 3 and all(p["result"] == 0 for p in progs)
    assert all(p["argv"][1] == "0.5" for p in progs)


_SWAP = """
import os, shutil, subprocess, sys
os.chdir(sys.argv[1])
shutil.copyfile('/usr/bin/sleep', 'prog')
os.chmod('prog', 0o755)
st = os.stat('prog')
subprocess.run(['./prog', '2'], check=True)  # alive long enough to be hashed through /proc/<pid>/exe
# the same inode, the same size, another program (one byte of its usage text); its mtime put back
data = open('prog', 'rb').read()
at = data.index(b'Usage')
with open('prog', 'r+b') as f:
    f.seek(at)
    f.write(b'u')
os.utime('prog', ns=(st.st_atime_ns, st.st_mtime_ns))
assert os.stat('prog').st_mtime_ns == st.st_mtime_ns and os.stat('prog').st_size == st.st_size
subprocess.run(['./prog', '0'], check=True)
"""


@pytest.mark.parametrize("detail", ["summary", "full"])
def test_a_program_rewritten_in_place_with_its_mtime_put_back_is_hashed_again(
    tmp_path: Path, place: Path, detail: str
) -> None:
    """The hash cache was keyed by (device, inode, mtime, size): a job that rewrote a program it had
    run (same size) and put its mtime back (utimensat: its own file) got the first program's sha256
    on the second exec, with hash_source "exe". The ctime, which no user can set, is in
    the key now."""
    from hashlib import sha256

    from tests.kernel.util import PY, record

    proc, _, events = record(
        tmp_path, *as_user(NOBODY, PY, "-c", _SWAP, str(place)), extra=("--detail", detail)
    )
    assert proc.returncode == 0, proc.stderr
    runs = [e["data"] for e in of_type(events, "process.exec") if e["data"]["filename"] == f"{place}/prog"]
    assert [r["result"] for r in runs] == [0, 0]
    first = Path("/usr/bin/sleep").read_bytes()
    second = first.replace(b"Usage", b"usage", 1)
    assert [r.get("sha256") for r in runs] == [sha256(first).hexdigest(), sha256(second).hexdigest()], runs


def test_a_program_run_through_a_dotdot_after_a_symlink_is_still_hashed(tmp_path: Path, place: Path) -> None:
    """exec of DIR/l/../bin/sleep with l -> /usr/lib: the kernel runs /usr/bin/sleep. The recorder
    named it DIR/bin/sleep ('..' collapsed lexically, row 26), a name of nothing, so the program was
    `not_hashed`: the hash, which a path cannot fool, was lost too. The name now keeps its '..' (an
    exec has no descriptor for the kernel to name), which names the program that ran, and the
    program is hashed (and proven the file the kernel mapped)."""
    from hashlib import sha256

    from tests.kernel.util import PY, record

    script = textwrap.dedent(
        f"""
        import os, subprocess
        os.symlink('/usr/lib', {str(place / "l")!r})
        subprocess.run([{str(place / "l" / ".." / "bin" / "sleep")!r}, '2'], check=True)
        """
    )
    proc, _, events = record(tmp_path, *as_user(NOBODY, PY, "-c", script))
    assert proc.returncode == 0, proc.stderr
    (run,) = [e["data"] for e in of_type(events, "process.exec") if e["data"]["argv"][1:] == ["2"]]
    assert run["result"] == 0
    assert run["filename"] == f"{place}/l/../bin/sleep"
    assert run.get("sha256") == sha256(Path("/usr/bin/sleep").read_bytes()).hexdigest(), run
    assert run["hash_source"] == "exe"


def test_a_script_whose_interpreter_sits_in_tmp_is_linted_as_the_program_that_ran(
    tmp_path: Path, place: Path
) -> None:
    """Issue 22, item 7. A script in a place the job cannot write (root's, /var/lib) whose #! line
    names an interpreter in /tmp, which the job (as nobody) puts there and then runs the script:
    the kernel ran the job's interpreter. The exec's record names it with its hash, and lint says
    what it says of a program run from /tmp: EV006 and EV009 (before: neither, the script's path
    being a place the job cannot write)."""
    import json
    import shutil
    import tempfile
    from hashlib import sha256

    from tests.kernel.util import evidence, record

    home = Path(tempfile.mkdtemp(prefix="evidence-test-rt-", dir="/var/lib"))
    try:
        home.chmod(0o755)
        script = home / "script"
        interp = place / "interp"
        script.write_text(f"#!{interp}\necho ran\n")
        script.chmod(0o755)
        job = f"cp /bin/dash {interp} && {script}"
        proc, _, events = record(tmp_path, *as_user(NOBODY, "/bin/sh", "-c", job))
        assert proc.returncode == 0, proc.stderr
        assert "ran" in proc.stdout
        (run,) = [e["data"] for e in of_type(events, "process.exec") if e["data"]["filename"] == str(script)]
        assert run["result"] == 0 and run["interpreter"] == str(interp)
        assert run["interpreter_sha256"] == sha256(Path("/bin/dash").read_bytes()).hexdigest(), run
        lint = evidence("lint", "--format", "json", str(tmp_path / "run.tar.gz"))
        found = {(f["rule"], f["message"]) for f in json.loads(lint.stdout)["findings"]}
        how = f"{interp} (the interpreter of {script})"
        assert ("EV006", f"executed {how} from a temp directory") in found, found
        assert ("EV009", f"ran {how} from a writable place (sha256 {run['interpreter_sha256']})") in found, (
            found
        )
    finally:
        shutil.rmtree(home)
