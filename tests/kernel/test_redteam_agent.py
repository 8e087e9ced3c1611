"""Red team, issue 22: what an unprivileged peer of the agent (uid 65534) could take from it or make
it sign, against a real agent started with umask 0.

- Bundles (argv, file names, peers) are their owners' alone: the API hid other owners' runs, but the
  bundle directory was 0755 and bundles 0644, so nobody read root's bundles straight from the disk.
  The agent's directories are 0700 and every bundle 0600, whatever the umask; an older agent's
  readable directory is made so at start; one that others can write, or someone else's, is refused.
- The agent signs the command the kernel executed, not the one a client claims: a client that claims
  `make test` and execs `sh -c 'cat SECRET'` gets a signed bundle whose command is the latter, the
  claim beside it (`claimed_command`), a degradation and lint EV014.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from evidence.bundle.reader import open_bundle
from evidence.bundle.signing import generate, load_public_key
from tests.kernel.test_daemon import Agent
from tests.kernel.util import evidence

pytestmark = pytest.mark.kernel

NOBODY = 65534

# As uid 65534: an isolated run that claims `claim` and execs `argv` (none: exits without an exec),
# finished and downloaded to `out`; prints the agent's answer.
_CLAIM = r"""
import json, os, sys
from pathlib import Path
from evidence.agent.commands.client import AgentClient
from evidence.agent.commands.finish import fetch_bundle
sock, out, claim, argv = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
c = AgentClient(sock, 60)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(w)
    if os.read(r, 1) == b"g" and argv:
        os.execv(argv[0], argv)
    os._exit(0)
os.close(r)
started = c.isolate(pid, command=claim)
os.write(w, b"g")
os.close(w)
_, status = os.waitpid(pid, 0)
answer = c.finish(started["session_id"], exit_code=os.waitstatus_to_exitcode(status))
fetch_bundle(c, answer, Path(out))
print(json.dumps(answer))
"""

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
    keys = workdir / "keys"
    keys.mkdir(mode=0o700)
    generate(keys / "agent-key")  # root's, 0600: every bundle the agent writes is signed with it
    a = Agent(
        workdir,
        env={
            "EVIDENCE_SIGNING_KEY": str(keys / "agent-key"),
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
    assert len(kept) >= 3, kept  # the older agent's, root's run's and nobody's run's
    peek = as_nobody(sys.executable, "-c", _PEEK, str(bundles), *map(str, kept))
    assert peek.returncode == 0, peek.stderr
    assert set(json.loads(peek.stdout).values()) == {"EACCES"}, peek.stdout
    # everything the agent wrote: directories 0700, files 0600 (spools and run records are gone
    # once their bundles are written; the live events wait in the spill directory)
    deadline = time.monotonic() + 30
    while not any((workdir / "stream-spill").iterdir()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert any((workdir / "stream-spill").iterdir()), "no live event spilled: the directory was not exercised"
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


def _claim(agent: Agent, out: Path, claim: list[str], argv: list[str]) -> dict[str, Any]:
    """As nobody, an isolated run that claims `claim` and execs `argv`: the bundle, downloaded."""
    got = as_nobody(
        sys.executable, "-c", _CLAIM, str(agent.socket), str(out), json.dumps(claim), json.dumps(argv)
    )
    assert got.returncode == 0, got.stderr + agent.output()
    answer: dict[str, Any] = json.loads(got.stdout.splitlines()[-1])  # after what the command printed
    return answer


def test_the_agent_signs_the_command_the_kernel_executed_not_the_claim(agent: Agent, workdir: Path) -> None:
    """Nobody claims `make test` and runs `sh -c 'cat SECRET'`: the agent-signed manifest and its
    predicate say `sh -c 'cat SECRET'`, keep `make test` as the claim, and lint fails with EV014. A
    claim of a command that never ran: no command, the claim, EV014. Honest claims (a program, a
    `#!` script run as its interpreter) agree and lint clean of EV014."""
    pub = workdir / "keys" / "agent-key.pub"
    out = workdir / "claims"
    out.mkdir()
    os.chown(out, NOBODY, NOBODY)
    secret = workdir / "SECRET"
    secret.write_text("the job's token\n")
    secret.chmod(0o644)
    forged = ["/bin/sh", "-c", f"cat {secret}"]
    _claim(agent, out / "forged.tar.gz", ["make", "test"], forged)
    b = open_bundle(out / "forged.tar.gz")
    b.verify()
    assert b.check_signature(load_public_key(pub))  # signed by the agent's key
    m = b.manifest
    assert m["command"] == forged and m["claimed_command"] == ["make", "test"], m
    assert b.attestation is not None
    predicate = b.attestation.statement["predicate"]["evidenceRun"]  # ours, within the runtime trace
    assert predicate["command"] == forged and predicate["claimedCommand"] == ["make", "test"]
    degraded = [e["data"] for e in b.events() if e["type"] == "dev.evidence.degradation"]
    # its own client gave its child none of evidence's seccomp filters: the agent says so too
    assert [d["component"] for d in degraded if d["component"] != "isolation"] == ["command"], degraded
    lint = evidence("lint", str(out / "forged.tar.gz"), "--key", str(pub))
    assert lint.returncode == 1 and "EV014 command-not-as-claimed" in lint.stdout, lint.stdout + lint.stderr
    # a claim of a command that never ran (the client's child exits without an exec)
    _claim(agent, out / "none.tar.gz", ["make", "test"], [])
    m = open_bundle(out / "none.tar.gz").manifest
    assert m["command"] == [] and m["claimed_command"] == ["make", "test"], m
    lint = evidence("lint", str(out / "none.tar.gz"))
    assert lint.returncode == 1 and "EV014" in lint.stdout, lint.stdout
    # honest claims, through the real client: a program, and a script the kernel runs as /bin/sh
    script = out / "build.sh"
    script.write_text('#!/bin/sh\necho built "$1"\n')
    script.chmod(0o755)
    for name, command, kernel in (
        ("program.tar.gz", ["/bin/cat", str(secret)], ["/bin/cat", str(secret)]),
        ("script.tar.gz", ["./build.sh", "all"], ["/bin/sh", "./build.sh", "all"]),
    ):
        run = as_nobody(
            sys.executable, "-m", "evidence", "run", "--agent", str(agent.socket),
            "--bundle", str(out / name), "--", *command, cwd=out,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr + agent.output()
        m = open_bundle(out / name).manifest
        assert m["command"] == kernel and m["claimed_command"] == command, m
        lint = evidence("lint", str(out / name), "--format", "json")
        assert "EV014" not in lint.stdout, lint.stdout
