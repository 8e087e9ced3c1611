"""`evidence run --agent SOCKET -- COMMAND`: a real agent subprocess records, the client only runs.

One agent for the module (BCC compiles once). It lets uid 65534 in (allowed_uids, socket group
65534), so an unprivileged client can be tried too; uid 65533 can reach the socket (group) but is
not allowed, so a refused peer can be tried on the same agent.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from evidence.agent.recorder.cgroups import find_cgroup2_mount
from tests.kernel.test_daemon import Agent
from tests.kernel.util import as_user, in_cgroup, of_type, read_bundle

pytestmark = pytest.mark.kernel

NOBODY = 65534
SUMMARY = re.compile(
    r"^evidence: (\d+) events \((.*)\); (\d+) lost; run (run-[0-9a-f]+); bundle (\S+)$", re.MULTILINE
)


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    # not tmp_path: pytest makes that 0700, and uid 65534 must reach the socket and write bundles
    d = Path(tempfile.mkdtemp(prefix="evidence-rva-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def agent(workdir: Path) -> Iterator[Agent]:
    a = Agent(workdir, env={"EVIDENCE_ALLOWED_UIDS": str(NOBODY), "EVIDENCE_SOCKET_GID": str(NOBODY)})
    yield a
    assert a.stop() == 0, a.output()


@pytest.fixture
def out(workdir: Path) -> Path:
    """A directory every test user can write into."""
    d = Path(tempfile.mkdtemp(dir=workdir))
    d.chmod(0o777)
    return d


def client(
    agent_socket: Path | str,
    bundle: Path | None,
    *command: str,
    labels: tuple[str, ...] = (),
    launcher: Callable[[list[str]], list[str]] = list,
    **kw: Any,
) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "evidence", "run", "--agent", str(agent_socket)]
    if bundle is not None:
        args += ["--bundle", str(bundle)]
    for label in labels:
        args += ["--label", label]
    return subprocess.Popen(
        launcher([*args, "--", *command]),
        stdin=kw.pop("stdin", subprocess.DEVNULL),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        **kw,
    )


def pids_in(events: list[dict[str, Any]]) -> set[int]:
    return {e["data"]["pid"] for e in events if isinstance(e["data"].get("pid"), int)}


def alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting for whoever adopted it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def run_cgroup(events: list[dict[str, Any]]) -> Path:
    return Path(of_type(events, "run.started")[0]["data"]["cgroup"])


def test_command_recorded_from_its_first_instruction_in_a_cgroup_of_its_own(agent: Agent, out: Path) -> None:
    bundle = out / "out.tar.gz"
    proc = client(
        agent.socket, bundle, "/bin/sh", "-c", "cat /etc/hostname; exit 3", labels=("job=7",), cwd=out
    )
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 3, stderr + agent.output()
    assert stdout == Path("/etc/hostname").read_text()  # the command's stdout, untouched
    # the same one-line summary `evidence run` prints
    assert stderr.count("\n") == 1, stderr
    m = SUMMARY.search(stderr)
    assert m and m.group(5) == str(bundle), stderr

    manifest, events = read_bundle(bundle)
    assert manifest["run_id"] == m.group(4) and manifest["events"] == int(m.group(1))
    assert manifest["labels"] == {"job": "7"} and manifest["exit_code"] == 3 and manifest["signal"] is None
    assert manifest["attached_late"] is False and manifest["cut_short"] is False
    assert manifest["command"] == ["/bin/sh", "-c", "cat /etc/hostname; exit 3"]

    execs = [e["data"] for e in of_type(events, "process.exec")]
    sh = next(x for x in execs if x["filename"] == "/bin/sh")
    cat = next(x for x in execs if x["argv"] == ["cat", "/etc/hostname"])
    # the command's root process is the client's child, depth 0; cat is sh's child, depth 1
    assert sh["ppid"] == proc.pid and sh["depth"] == 0 and sh["argv"][0] == "/bin/sh"
    assert cat["ppid"] == sh["pid"] and cat["depth"] == 1
    assert execs[0] is sh  # nothing ran before the command's own exec
    opens = [e["data"] for e in of_type(events, "file.open") if e["data"]["path"] == "/etc/hostname"]
    assert opens and opens[0]["pid"] == cat["pid"] and opens[0]["result"] == 0
    exits = {e["data"]["pid"]: e["data"]["exit_code"] for e in of_type(events, "process.exit")}
    assert exits[sh["pid"]] == 3

    # nothing of the client's: only the command's processes appear
    assert proc.pid not in pids_in(events)
    assert pids_in(events) == {sh["pid"], cat["pid"]}
    assert not any("python" in str(e["data"].get("exe", "")) for e in events)

    # the cgroup the agent made for the run is gone, and so is the run
    cg = run_cgroup(events)
    assert cg.parent.name == "evidence" and not cg.exists()
    assert agent.client.runs() == []


def test_unprivileged_client_records_its_own_command(agent: Agent, out: Path) -> None:
    bundle = out / "nobody.tar.gz"
    proc = client(
        agent.socket, bundle, "/bin/sh", "-c", "id -u; touch mine",
        cwd=out, user=NOBODY, group=NOBODY, extra_groups=[],
    )  # fmt: skip
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr + agent.output()
    assert stdout == f"{NOBODY}\n" and SUMMARY.search(stderr)
    assert bundle.stat().st_uid == NOBODY  # written with the client's credentials
    assert (out / "mine").stat().st_uid == NOBODY
    _, events = read_bundle(bundle)
    assert str(out / "mine") in {e["data"]["path"] for e in of_type(events, "file.open")}
    assert proc.pid not in pids_in(events)
    assert not run_cgroup(events).exists()


# As uid 65534: ask the agent to isolate a process of another user (this test, root).
_ISOLATE = r"""
import json, sys
from evidence.agent.commands.client import _UnixConnection
c = _UnixConnection(sys.argv[1], 30)
c.request("POST", "/runs", body=json.dumps({"isolate_pid": int(sys.argv[2])}),
          headers={"Content-Type": "application/json"})
r = c.getresponse()
print(r.status)
print(json.loads(r.read())["error"])
"""


def test_another_users_process_cannot_be_isolated_and_refusals_start_nothing(agent: Agent, out: Path) -> None:
    victim = subprocess.Popen(["/bin/sleep", "60"])
    try:
        before = Path(f"/proc/{victim.pid}/cgroup").read_text()
        got = subprocess.run(
            [sys.executable, "-c", _ISOLATE, str(agent.socket), str(victim.pid)],
            user=NOBODY, group=NOBODY, extra_groups=[], capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        status, error = got.stdout.splitlines()
        assert status == "403", got.stdout + got.stderr
        assert f"process {victim.pid} is not yours" in error and "\n" not in error
        assert Path(f"/proc/{victim.pid}/cgroup").read_text() == before  # not moved
        assert agent.client.runs() == []
    finally:
        victim.kill()
        victim.wait()

    # a peer the agent does not allow (uid 65533, in the socket's group): one line, exit 70, and
    # the command never ran
    marker = out / "ran"
    refused = client(
        agent.socket, out / "r.tar.gz", "/usr/bin/touch", str(marker),
        cwd=out, user=NOBODY - 1, group=NOBODY, extra_groups=[],
    )  # fmt: skip
    _, stderr = refused.communicate(timeout=60)
    assert refused.returncode == 70, stderr
    assert stderr.count("\n") == 1 and "permission denied" in stderr and "Traceback" not in stderr
    # no agent at all: the same
    missing = client(out / "none.sock", None, "/usr/bin/touch", str(marker), cwd=out)
    _, stderr = missing.communicate(timeout=60)
    assert missing.returncode == 70 and stderr.count("\n") == 1 and "no agent socket" in stderr, stderr
    # a label the agent rejects: a usage error, exit 2
    bad = client(agent.socket, None, "/usr/bin/touch", str(marker), labels=("bad key=1",), cwd=out)
    _, stderr = bad.communicate(timeout=60)
    assert bad.returncode == 2 and stderr.count("\n") == 1 and "label name" in stderr, stderr
    time.sleep(0.2)
    assert not marker.exists()
    assert not list(out.glob("*.tar.gz"))
    assert agent.client.runs() == []


def test_sigterm_is_forwarded_and_leftovers_are_killed(agent: Agent, out: Path) -> None:
    bundle = out / "term.tar.gz"
    proc = client(agent.socket, bundle, "/bin/sh", "-c", "sleep 300 & echo $!; exec sleep 301", cwd=out)
    assert proc.stdout is not None
    leftover = int(proc.stdout.readline())
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stderr + agent.output()
    assert SUMMARY.search(stderr), stderr
    manifest, events = read_bundle(bundle)
    assert manifest["signal"] == "SIGTERM" and manifest["exit_code"] is None
    root = next(e["data"] for e in of_type(events, "process.exec") if e["data"]["depth"] == 0)
    exits = {e["data"]["pid"]: e["data"]["signal"] for e in of_type(events, "process.exit")}
    assert exits[root["pid"]] == "SIGTERM"  # the command got the client's SIGTERM
    assert exits[leftover] == "SIGKILL"  # what it left running was killed when the run finished
    assert not alive(leftover)
    assert not run_cgroup(events).exists()


def test_two_clients_at_once_each_get_only_their_own_events(agent: Agent, out: Path) -> None:
    procs = {}
    for name in ("a", "b"):
        (out / f"{name}.txt").write_text(f"{name}-content\n")
        procs[name] = client(
            agent.socket, out / f"{name}.tar.gz",
            "/bin/sh", "-c", f"sleep 0.5; cat {name}.txt; cat",
            cwd=out, stdin=subprocess.PIPE,
        )  # fmt: skip
    results = {n: p.communicate(input=f"{n}-stdin\n", timeout=60) for n, p in procs.items()}
    bundles = {}
    for name, p in procs.items():
        stdout, stderr = results[name]
        assert p.returncode == 0, stderr
        assert stdout == f"{name}-content\n{name}-stdin\n"  # stdin passed through, too
        bundles[name] = read_bundle(out / f"{name}.tar.gz")
    for name, other in (("a", "b"), ("b", "a")):
        manifest, events = bundles[name]
        paths = {e["data"]["path"] for e in of_type(events, "file.open")}
        assert str(out / f"{name}.txt") in paths and str(out / f"{other}.txt") not in paths
        assert not pids_in(events) & pids_in(bundles[other][1])
        assert run_cgroup(events) != run_cgroup(bundles[other][1])
    assert json.dumps(agent.client.runs()) == "[]"


@pytest.fixture
def job_cgroup() -> Iterator[Path]:
    """A CI job's cgroup, made for the test (removed after, with anything left below it)."""
    mount = find_cgroup2_mount()
    job = mount / f"evidence-test-job-{os.getpid()}"
    job.mkdir()
    yield job
    for sub in sorted(job.rglob("*"), key=lambda p: -len(p.parts)):
        if sub.is_dir():
            sub.rmdir()
    job.rmdir()


def _cgroup_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("0::"))


def _in(cgroup: Path, uid: int | None = NOBODY) -> Callable[[list[str]], list[str]]:
    """A launcher for `client`: the client starts in `cgroup`, as `uid` (None: as root), like a CI
    job's. Root's shell joins the cgroup, then setpriv drops to `uid`, then the client is exec'd."""

    def launch(argv: list[str]) -> list[str]:
        return in_cgroup(cgroup / "cgroup.procs", *(argv if uid is None else as_user(uid, *argv)))

    return launch


def test_the_command_stays_below_the_clients_cgroup_so_its_limits_still_apply(
    agent: Agent, out: Path, job_cgroup: Path
) -> None:
    mount = find_cgroup2_mount()
    bundle = out / "job.tar.gz"
    proc = client(agent.socket, bundle, "/bin/cat", "/proc/self/cgroup", cwd=out, launcher=_in(job_cgroup))
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr + agent.output()
    # the command ran in a cgroup of its own below the job's: what limits the job limits it
    rel = "/" + str(job_cgroup.relative_to(mount))
    assert _cgroup_line(stdout).startswith(f"0::{rel}/evidence-"), stdout
    manifest, events = read_bundle(bundle)
    cg = run_cgroup(events)
    assert cg.parent == job_cgroup and cg.name == f"evidence-{manifest['session_id']}"
    assert not cg.exists() and job_cgroup.exists()  # the run's cgroup is gone, the job's stays
    # an unprivileged client's command shares the host's IPC (test_private_ipc.py): nothing else said
    assert not [e for e in of_type(events, "degradation") if "IPC" not in e["data"]["reason"]]
    assert [e["data"]["argv"] for e in of_type(events, "process.exec")] == [["/bin/cat", "/proc/self/cgroup"]]

    # while a run records the job's cgroup, a run of its own is refused: it would take the command
    # out of that recording
    outer = agent.client.start(cgroup=str(job_cgroup))
    try:
        marker = out / "ran"
        refused = client(
            agent.socket, out / "r.tar.gz", "/usr/bin/touch", str(marker), cwd=out, launcher=_in(job_cgroup)
        )
        _, stderr = refused.communicate(timeout=60)
        assert refused.returncode == 2 and stderr.count("\n") == 1, stderr
        assert f"is already recorded, by run {outer['session_id']}" in stderr, stderr
        assert not marker.exists()
    finally:
        agent.client.finish(outer["session_id"])
    assert [r["session_id"] for r in agent.client.runs()] == []


@pytest.mark.parametrize("case", ["root", "delegated", "threaded"])
def test_where_the_command_could_leave_a_cgroup_below_the_clients_it_goes_elsewhere(
    case: str, agent: Agent, out: Path, job_cgroup: Path
) -> None:
    """Below a cgroup the job may write to (delegated to it, or any, for a job running as root), the
    command could move itself out of the run's cgroup, and out of the recording: the agent puts it
    in a cgroup of its own outside the client's, and the bundle says that the job's limits did
    not apply. So it does where the client's cgroup cannot hold a process below it (threaded)."""
    home = job_cgroup
    if case == "delegated":
        os.chown(job_cgroup / "cgroup.procs", NOBODY, NOBODY)
    elif case == "threaded":
        home = job_cgroup / "threads"
        home.mkdir()
        (home / "cgroup.type").write_text("threaded")
    bundle = out / f"{case}.tar.gz"
    uid = None if case == "root" else NOBODY
    proc = client(agent.socket, bundle, "/bin/cat", "/proc/self/cgroup", cwd=out, launcher=_in(home, uid))
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr + agent.output()
    _, events = read_bundle(bundle)
    cg = run_cgroup(events)
    assert cg.parent.name == "evidence" and cg.parent.parent == find_cgroup2_mount()  # the agent's place
    assert _cgroup_line(stdout) == f"0::/evidence/{cg.name}", stdout
    (d,) = [e["data"] for e in of_type(events, "degradation") if "IPC" not in e["data"]["reason"]]
    why = {"root": "runs as root", "delegated": "is delegated", "threaded": "is threaded"}[case]
    assert d["component"] == "cgroup" and why in d["reason"] and "limits" in d["impact"], d
    lint = subprocess.run(
        [sys.executable, "-m", "evidence", "lint", "--format", "json", str(bundle)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert "EV002" in {f["rule"] for f in json.loads(lint.stdout)["findings"]}, lint.stdout
