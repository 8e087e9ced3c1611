"""Red team, issue 22: what an unprivileged peer of the agent (uid 65534) could take from it or make
it sign, against a real agent started with umask 0.

- Bundles (argv, file names, peers) are their owners' alone: the API hid other owners' runs, but the
  bundle directory was 0755 and bundles 0644, so nobody read root's bundles straight from the disk.
  The agent's directories are 0700 and every bundle 0600, whatever the umask; an older agent's
  readable directory is made so at start; one that others can write, or someone else's, is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from evidence.bundle.reader import open_bundle
from tests.kernel.test_daemon import Agent
from tests.kernel.util import evidence

pytestmark = pytest.mark.kernel

NOBODY = 65534

# As uid 65534: list each directory and read each file named; print {path: "read" | errno name}.
_PEEK = r"""
import errno, json, os, sys
out = {}
for p in sys.argv[1:]:
    try:
        if os.path.isdir(p):
            os.listdir(p)
        else:
            with open(p, "rb") as f:
                f.read(1)
        out[p] = "read"
    except OSError as e:
        out[p] = errno.errorcode.get(e.errno, str(e.errno))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="evidence-redteam-agent-"))  # not tmp_path: nobody must reach it
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def agent(workdir: Path) -> Iterator[Agent]:
    # what an older agent left: a bundle directory others may enter, a bundle others may read
    (workdir / "bundles").mkdir(mode=0o755)
    (workdir / "bundles").chmod(0o755)
    old = workdir / "bundles" / "old.tar.gz"
    old.write_bytes(b"an older agent's bundle")
    old.chmod(0o644)
    a = Agent(
        workdir,
        env={
            "EVIDENCE_ALLOWED_UIDS": str(NOBODY),
            "EVIDENCE_SOCKET_GID": str(NOBODY),
            # live events to an endpoint that refuses them: they wait in the spill directory
            "EVIDENCE_STREAM_URL": "http://127.0.0.1:9/",
            "EVIDENCE_STREAM_QUEUE": "1",
            "EVIDENCE_BATCH_SIZE": "1",
        },
        umask=0,
    )
    yield a
    assert a.stop() == 0, a.output()


def as_nobody(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`argv` as uid 65534, under umask 0."""
    return subprocess.run(
        ["/bin/sh", "-c", 'umask 0 && exec "$@"', "sh", *argv],
        user=NOBODY, group=NOBODY, extra_groups=[], cwd=cwd, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_bundles_are_their_owners_alone_whatever_the_umask(agent: Agent, workdir: Path) -> None:
    """As root, then as nobody, `run --agent` (both under umask 0): each gets its bundle (0600, its
    own) through the API; nobody can neither list the agent's bundle directory nor read any bundle
    in it, root's, an older agent's, or its own copy; everything the agent wrote is 0600 in 0700."""
    bundles = agent.bundles
    assert _mode(bundles) == 0o700 and _mode(bundles / "old.tar.gz") == 0o600  # an older agent's: made so
    root_out = workdir / "root-out"
    root_out.mkdir(mode=0o700)
    root = subprocess.run(
        [sys.executable, "-m", "evidence", "run", "--agent", str(agent.socket),
         "--bundle", str(root_out / "root.tar.gz"), "--", "/bin/cat", "/etc/hostname"],
        capture_output=True, text=True, timeout=120, umask=0,
    )  # fmt: skip
    assert root.returncode == 0, root.stderr + agent.output()
    assert _mode(root_out / "root.tar.gz") == 0o600
    mine = workdir / "nobody"
    mine.mkdir()
    os.chown(mine, NOBODY, NOBODY)
    run = as_nobody(
        sys.executable, "-m", "evidence", "run", "--agent", str(agent.socket),
        "--bundle", str(mine / "mine.tar.gz"), "--", "/bin/sh", "-c", "cat /etc/hostname", cwd=mine,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr + agent.output()
    st = os.lstat(mine / "mine.tar.gz")
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (NOBODY, 0o600)
    open_bundle(mine / "mine.tar.gz").verify()
    kept = sorted(p for p in bundles.iterdir() if p.name.endswith(".tar.gz"))
    assert len(kept) == 3, kept  # the older agent's, root's run's and nobody's run's
    peek = as_nobody(sys.executable, "-c", _PEEK, str(bundles), *map(str, kept))
    assert peek.returncode == 0, peek.stderr
    assert set(json.loads(peek.stdout).values()) == {"EACCES"}, peek.stdout
    # everything the agent wrote: directories 0700, files 0600 (spools and run records are gone
    # once their bundles are written; the live events wait in the spill directory)
    agent.stop()
    spilled = list((workdir / "stream-spill").iterdir())
    assert spilled, "no live event was spilled: the spill directory was not exercised"
    for d in (bundles, workdir / "spool", workdir / "stream-spill"):
        assert _mode(d) == 0o700, d
        for p in d.rglob("*"):
            assert _mode(p) == (0o700 if p.is_dir() else 0o600), p


def test_a_bundle_directory_others_can_write_or_someone_elses_is_refused(tmp_path: Path) -> None:
    """What others could write in the directory (a symlink named like a bundle, to upload or serve)
    is not trusted: the agent does not start (exit 70, one line), and leaves the directory as it is."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    for where, why in ((shared, "is writable by others"), (theirs, f"belongs to uid {NOBODY}")):
        proc = evidence("agent", "--socket", str(tmp_path / "s.sock"), "--bundle-dir", str(where))
        assert proc.returncode == 70 and why in proc.stderr, proc.stderr
        assert proc.stderr.count("\n") == 1 and not (tmp_path / "s.sock").exists()
    assert _mode(shared) == 0o777
    doctor = evidence("doctor", "--json", "--bundle-dir", str(shared))
    check = next(c for c in json.loads(doctor.stdout)["checks"] if c["name"] == "bundle directory")
    assert doctor.returncode == 1 and not check["ok"] and "written by others" in check["detail"], check
