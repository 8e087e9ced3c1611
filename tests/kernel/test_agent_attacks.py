"""The agent's API under attack by an allowed, unprivileged peer (uid 65534), and by root on what no
one may touch: each attack is performed against a real agent and its outcome asserted.

Run ownership: a run is its starter's; only it and root see, finish and download it. Starts on a
pid or a cgroup follow the isolate_pid rule. PID 1, the agent and its ancestors are refused to all.
The exit status of an isolated run is the one the agent observed (pidfd), not the client's word.
Connections are bounded; a loop of connects by one uid denies the agent to no other uid, nor a job
its own client's finish; and a killed agent takes its isolated runs' jobs with it (watchdog).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from evidence.agent.recorder.cgroups import find_cgroup2_mount
from tests.kernel.test_daemon import Agent
from tests.kernel.util import in_cgroup, of_type, read_bundle

pytestmark = pytest.mark.kernel

NOBODY = 65534
PER_UID = 4
TOTAL = 12

# As uid 65534: one request, printed as `status` then the JSON answer on one line.
_REQUEST = r"""
import json, sys
from evidence.agent.commands.client import _UnixConnection
c = _UnixConnection(sys.argv[1], 30)
body = sys.argv[4] if len(sys.argv) > 4 else None
c.request(sys.argv[2], sys.argv[3], body=body, headers={"Content-Type": "application/json"})
r = c.getresponse()
raw = r.read()
print(r.status)
print(raw.decode().strip() if r.getheader("Content-Type") == "application/json" else f"<{len(raw)} bytes>")
"""

# As uid 65534: an isolated run of its own, finished with a forged status. `exit` lets the child
# exit 3 and reaps it before finishing; `early` finishes while the child still waits to exec.
_OWN_RUN = r"""
import json, os, sys
from evidence.agent.commands.client import AgentClient
sock, mode = sys.argv[1], sys.argv[2]
c = AgentClient(sock, 60)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(w)
    if os.read(r, 1) == b"g":
        os.execv("/bin/sh", ["sh", "-c", "exit 3"])
    os._exit(9)
os.close(r)
started = c.isolate(pid, command=["sh", "-c", "exit 3"])
if mode == "exit":
    os.write(w, b"g")
    os.waitpid(pid, 0)
answer = c.finish(started["session_id"], f"forged-{mode}.tar.gz", exit_code=0)
os.close(w)
if mode == "early":
    os.waitpid(pid, 0)
print(json.dumps(answer))
"""


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="evidence-attacks-"))  # not tmp_path: 0700, nobody must reach it
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def agent(workdir: Path) -> Iterator[Agent]:
    a = Agent(
        workdir,
        env={
            "EVIDENCE_ALLOWED_UIDS": str(NOBODY),
            "EVIDENCE_SOCKET_GID": str(NOBODY),
            "EVIDENCE_MAX_CONNECTIONS": str(TOTAL),
            "EVIDENCE_MAX_CONNECTIONS_PER_UID": str(PER_UID),
            "EVIDENCE_HASH_RUN_BYTES": str(1 << 30),  # a run's 1 GiB: four of 250 MiB
        },
    )
    yield a
    assert a.stop() == 0, a.output()


@pytest.fixture
def cgroup() -> Iterator[Path]:
    path = find_cgroup2_mount() / f"evidence-test-attacks-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    yield path
    (path / "cgroup.kill").write_text("1")
    # children first (a delegated "mine" below it), then the test's own cgroup
    for d in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [path]:
        for _ in range(100):
            try:
                d.rmdir()
                break
            except OSError:
                time.sleep(0.05)


def as_nobody(agent: Agent, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    args = [sys.executable, "-c", _REQUEST, str(agent.socket), method, path]
    if body is not None:
        args.append(json.dumps(body))
    got = subprocess.run(
        args, user=NOBODY, group=NOBODY, extra_groups=[], capture_output=True, text=True, timeout=60
    )
    assert got.returncode == 0, got.stderr
    status, answer = got.stdout.splitlines()
    return int(status), json.loads(answer) if answer.startswith("{") else answer


def sleeper(cgroup: Path, *, nobody: bool) -> subprocess.Popen[bytes]:
    as_who = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"] if nobody else []
    return subprocess.Popen(
        in_cgroup(cgroup / "cgroup.procs", *as_who, "/bin/sleep", "600")
    )  # in before setpriv


def test_another_users_runs_cannot_be_seen_finished_or_downloaded(agent: Agent, cgroup: Path) -> None:
    root_job = sleeper(cgroup, nobody=False)
    try:
        sid = agent.client.start(cgroup=str(cgroup))["session_id"]
        # attack 1: list root's runs, or look one up
        status, answer = as_nobody(agent, "GET", "/runs")
        assert status == 200 and answer["runs"] == [], answer
        assert as_nobody(agent, "GET", f"/runs/{sid}")[0] == 404
        # attack 2: finish root's run with a forged exit code
        status, answer = as_nobody(agent, "POST", f"/runs/{sid}/finish", {"exit_code": 0})
        assert status == 404 and answer["error"] == f"no run {sid}", answer
        assert [r["session_id"] for r in agent.client.runs()] == [sid]  # still recording
        # attack 4: download root's bundle (it holds root's argv)
        done = agent.client.finish(sid, "root-secret.tar.gz")
        status, answer = as_nobody(agent, "GET", "/bundles/root-secret.tar.gz")
        assert status == 404 and "no bundle" in answer["error"], answer
        assert (agent.bundles / "root-secret.tar.gz").stat().st_size == done["size"]  # it is there
        # names: a trailing newline is not a bundle name (`$` would have taken it)
        assert as_nobody(agent, "GET", "/bundles/root-secret.tar.gz%0A")[0] == 400
    finally:
        root_job.kill()
        root_job.wait()


def test_starts_follow_the_ownership_rule(agent: Agent, cgroup: Path) -> None:
    theirs = cgroup / "theirs"
    theirs.mkdir()
    root_job, nobody_job = sleeper(theirs, nobody=False), sleeper(theirs, nobody=True)
    mine = cgroup / "mine"
    mine.mkdir()
    for p in (mine, mine / "cgroup.procs"):  # delegated to uid 65534
        os.chown(p, NOBODY, NOBODY)
    own_job = sleeper(mine, nobody=True)
    try:
        # attack 3: a run on root's pid, on root's cgroup, on its own pid in a cgroup with root's
        status, answer = as_nobody(agent, "POST", "/runs", {"pid": root_job.pid})
        assert status == 403 and f"process {root_job.pid} is not yours" in answer["error"], answer
        status, answer = as_nobody(agent, "POST", "/runs", {"cgroup": str(theirs)})
        assert status == 403 and "is not delegated to uid 65534" in answer["error"], answer
        status, answer = as_nobody(agent, "POST", "/runs", {"pid": nobody_job.pid})
        assert status == 403 and "holds processes of other users" in answer["error"], answer
        assert agent.client.runs() == []
        # its own delegated cgroup: allowed, its run and its bundle are its own
        status, started = as_nobody(agent, "POST", "/runs", {"pid": own_job.pid})
        assert status == 201 and started["owner_uid"] == NOBODY, started
        sid = started["session_id"]
        status, answer = as_nobody(agent, "GET", "/runs")
        assert [r["session_id"] for r in answer["runs"]] == [sid]
        status, done = as_nobody(agent, "POST", f"/runs/{sid}/finish", {"bundle": "nobodys.tar.gz"})
        assert status == 200, done
        status, answer = as_nobody(agent, "GET", "/bundles/nobodys.tar.gz")
        assert status == 200 and answer == f"<{done['size']} bytes>", answer
        # exit status only for isolated runs
        sid = agent.client.start(cgroup=str(mine))["session_id"]
        status, answer = as_nobody(agent, "POST", f"/runs/{sid}/finish", {"exit_code": 0})
        assert status == 404, answer  # root's run: not even there for uid 65534
        with pytest.raises(Exception, match="only for isolated runs"):
            agent.client.finish(sid, exit_code=0)
        agent.client.finish(sid)
    finally:
        for p in (root_job, nobody_job, own_job):
            p.kill()
            p.wait()


def test_pid_1_the_agent_and_its_ancestors_are_refused_even_to_root(agent: Agent) -> None:
    for pid in (1, agent.proc.pid, os.getpid()):  # os.getpid(): this test started the agent
        for body in ({"isolate_pid": pid}, {"pid": pid}):
            with pytest.raises(Exception, match="PID 1, the agent or an ancestor"):
                agent.client.request("POST", "/runs", body)
    assert agent.client.runs() == []


def _own_run(agent: Agent, mode: str) -> dict[str, Any]:
    got = subprocess.run(
        [sys.executable, "-c", _OWN_RUN, str(agent.socket), mode],
        user=NOBODY, group=NOBODY, extra_groups=[], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert got.returncode == 0, got.stderr + agent.output()
    answer: dict[str, Any] = json.loads(got.stdout)
    return answer


def test_a_forged_exit_status_is_not_recorded(agent: Agent) -> None:
    # the command exited 3; the client says 0: the bundle says 3, and that the client said otherwise
    answer = _own_run(agent, "exit")
    manifest, events = read_bundle(agent.bundles / answer["name"])
    assert manifest["exit_code"] == 3 and not manifest["cut_short"], manifest
    said = [e["data"] for e in of_type(events, "degradation") if e["data"].get("component") == "exit-status"]
    assert said and "the client reported exit 0; the agent observed exit 3" in said[0]["reason"], events
    # finished while the command had not even started: no exit code at all, cut short
    answer = _own_run(agent, "early")
    manifest, events = read_bundle(agent.bundles / answer["name"])
    assert answer["cut_short"] and manifest["cut_short"] and manifest["exit_code"] is None, manifest
    said = [e["data"] for e in of_type(events, "degradation") if e["data"].get("component") == "exit-status"]
    assert said and "still running" in said[0]["reason"], events


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


_IDLE = r"""
import socket, sys, time
held, busy = [], []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    held.append(s)
import select
waiting, deadline = list(held), time.monotonic() + 3
while waiting and time.monotonic() < deadline:
    for s in select.select(waiting, [], [], 0.1)[0]:
        waiting.remove(s)
        data = s.recv(4096)
        if data.startswith(b"HTTP/1.1 503"):
            busy.append(data.rsplit(b"\r\n\r\n", 1)[1].decode().strip())
print(len(busy)); print(busy[0] if busy else "")
sys.stdout.flush()
sys.stdin.read()
"""


def test_idle_connections_are_bounded(agent: Agent) -> None:
    before = _threads(agent.proc.pid)
    opened = 5 * PER_UID
    hog = subprocess.Popen(
        [sys.executable, "-c", _IDLE, str(agent.socket), str(opened)],
        user=NOBODY, group=NOBODY, extra_groups=[],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert hog.stdout is not None
        refused = int(hog.stdout.readline())
        line = json.loads(hog.stdout.readline())
        assert refused == opened - PER_UID, refused
        assert "max_connections_per_uid" in line["error"], line
        # a legitimate client is still answered, and the agent holds a thread per admitted one only
        assert agent.client.health()["status"] == "ready"
        assert agent.client.runs() == []
        assert _threads(agent.proc.pid) <= before + PER_UID + 2
        # past the total, root is refused too, with the same one line
        extra = [socket.socket(socket.AF_UNIX) for _ in range(TOTAL)]
        for s in extra:
            s.connect(str(agent.socket))
        time.sleep(0.3)
        # the connection of the request before is released once the agent has seen it closed: when
        # that was after some of these were refused, a place is free, then taken by one more
        for _ in range(3):
            try:
                agent.client.runs()
            except Exception as e:
                assert "busy: " in str(e) and "max_connections" in str(e), e
                break
            time.sleep(0.3)
            extra.append(socket.socket(socket.AF_UNIX))
            extra[-1].connect(str(agent.socket))
            time.sleep(0.3)
        else:
            raise AssertionError("root was not refused past max_connections")
        for s in extra:
            s.close()
        assert _threads(agent.proc.pid) <= before + TOTAL + 2
    finally:
        assert hog.stdin is not None
        hog.stdin.close()
        hog.wait(timeout=10)
    deadline = time.monotonic() + 10
    while agent.client.health()["status"] != "ready" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "refused a connection from uid 65534" in agent.output()


def test_killed_agent_takes_its_isolated_jobs_with_it(tmp_path: Path, workdir: Path) -> None:
    d = Path(tempfile.mkdtemp(dir=workdir))
    d.chmod(0o777)
    killed = Agent(d, env={"EVIDENCE_ALLOWED_UIDS": str(NOBODY), "EVIDENCE_SOCKET_GID": str(NOBODY)})
    started = d / "started"
    job = subprocess.Popen(
        [sys.executable, "-m", "evidence", "run", "--agent", str(killed.socket), "--bundle", str(d / "b.tar.gz"),
         "--", "/bin/sh", "-c", f"touch {started}; exec sleep 3.5"],
        user=NOBODY, group=NOBODY, extra_groups=[], cwd=d,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not started.exists():
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.05)
        sleep_pid = int(subprocess.run(["pgrep", "-u", str(NOBODY), "-xf", "sleep 3.5"],
                                       capture_output=True, text=True).stdout.split()[0])  # fmt: skip
        killed.proc.send_signal(signal.SIGKILL)
        killed.proc.wait()
        t0 = time.monotonic()
        while Path(f"/proc/{sleep_pid}").exists() and time.monotonic() - t0 < 2:
            time.sleep(0.02)
        assert not Path(f"/proc/{sleep_pid}").exists(), "the job ran on after its agent died"
        _, stderr = job.communicate(timeout=30)
        assert job.returncode == 70, stderr  # the client says it could not finish the recording
        assert "died" in killed.output(), killed.output()
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


# As uid 65534: hold `argv[3]` connections (its uid's places), then connect in a loop (a blocking
# connect: it waits for a place in a full backlog, as every client does) and keep the last 256 open,
# counting them in `argv[2]` now and then, until killed.
_FLOOD = r"""
import collections, os, socket, sys
path, report, hold = sys.argv[1], sys.argv[2], int(sys.argv[3])
held = []
for _ in range(hold):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    held.append(s)
n = 0
last = collections.deque()
while True:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        n += 1
    except OSError:
        pass
    last.append(s)
    if len(last) > 256:
        last.popleft().close()
    if n % 500 == 1:  # whole or not at all: the test reads it while the flood goes on
        with open(report + ".tmp", "w") as f:
            f.write(str(n))
        os.replace(report + ".tmp", report)
"""


def _runs(socket_path: Path, out: Path, n: int, as_who: list[str]) -> list[tuple[int, str]]:
    """`evidence run --agent` n times, one after the other: (exit code, stderr) of each."""
    got = []
    for i in range(n):
        bundle = out / f"run-{i}.tar.gz"
        proc = subprocess.run(
            [*as_who, sys.executable, "-m", "evidence", "run", "--agent", str(socket_path),
             "--bundle", str(bundle), "--", "/bin/true"],
            cwd=out, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        got.append((proc.returncode, proc.stderr.strip().splitlines()[-1:]))
        assert proc.returncode != 0 or bundle.exists(), proc.stderr
    return got


def test_a_flood_of_connects_by_one_uid_does_not_deny_the_agent_to_the_others(workdir: Path) -> None:
    # uid 65534 loops connects from 4 processes (past its places, each refused at once; a refusal
    # took the agent 0.2 s, the backlog held 5, and the others' connect() failed with EAGAIN) while
    # root and uid 65533 each record 20 runs through the agent: every one of theirs succeeds
    d = Path(tempfile.mkdtemp(dir=workdir))
    d.chmod(0o755)
    other = 65533
    agent = Agent(d, env={"EVIDENCE_ALLOWED_UIDS": f"{NOBODY},{other}", "EVIDENCE_SOCKET_GID": str(NOBODY)})
    floods: list[subprocess.Popen[bytes]] = []
    reports = d / "reports"
    reports.mkdir(mode=0o777)
    reports.chmod(0o777)
    try:
        for i in range(4):
            floods.append(
                subprocess.Popen(
                    [sys.executable, "-c", _FLOOD, str(agent.socket), str(reports / str(i)), "4"],
                    user=NOBODY,
                    group=NOBODY,
                    extra_groups=[],
                )  # fmt: skip
            )
        deadline = time.monotonic() + 60
        while not all((reports / str(i)).exists() for i in range(4)):  # every flood is under way
            assert time.monotonic() < deadline and all(f.poll() is None for f in floods)
            time.sleep(0.1)
        outs = {uid: Path(tempfile.mkdtemp(dir=d)) for uid in (0, other)}
        for uid, out in outs.items():
            os.chown(out, uid, NOBODY)
        as_other = ["setpriv", f"--reuid={other}", f"--regid={NOBODY}", "--clear-groups", "--"]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            theirs = pool.submit(_runs, agent.socket, outs[other], 20, as_other)
            root = _runs(agent.socket, outs[0], 20, [])
            other_runs = theirs.result()
        assert all(f.poll() is None for f in floods)  # it flooded all along
        counts = [int((reports / str(i)).read_text()) for i in range(4)]
    finally:
        for f in floods:
            f.kill()
            f.wait()
    assert [rc for rc, _ in root] == [0] * 20, root
    assert [rc for rc, _ in other_runs] == [0] * 20, other_runs
    assert sum(counts) >= 2000, counts
    busy = agent.metrics()['evidence_api_requests_total{code="503",route="busy"}']
    assert busy > 0  # uid 65534 was past its places, and refused
    assert agent.stop() == 0, agent.output()
    assert "Traceback" not in agent.output()


_FLOODING_JOB = r"""
import os, subprocess, sys, time
path, report = sys.argv[1], sys.argv[2]
# a daemon of the job's (the same uid as its client): holds every place of the uid and floods
daemon = subprocess.Popen([sys.executable, "-c", sys.argv[3], path, report, sys.argv[4]], start_new_session=True)
with open(report + ".pid", "w") as f:
    f.write(str(daemon.pid))
while not os.path.exists(report) or not os.path.getsize(report):  # made, then written: wait for both
    time.sleep(0.01)
"""


def test_a_job_cannot_keep_its_own_client_from_finishing(agent: Agent, workdir: Path) -> None:
    # the job fills its uid's places, floods connects from a daemon and exits: its client (the same
    # uid) still finishes over the connection it started the run on, and the daemon goes with the run
    out = Path(tempfile.mkdtemp(dir=workdir))
    out.chmod(0o777)
    report = out / "flood"
    proc = subprocess.run(
        [sys.executable, "-m", "evidence", "run", "--agent", str(agent.socket), "--bundle",
         str(out / "job.tar.gz"), "--", sys.executable, "-c", _FLOODING_JOB, str(agent.socket), str(report),
         _FLOOD, str(PER_UID)],
        user=NOBODY, group=NOBODY, extra_groups=[], cwd=out, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert int(report.read_text()) >= 1  # the daemon held its uid's places, then flooded
    manifest, _ = read_bundle(out / "job.tar.gz")
    assert manifest["exit_code"] == 0
    daemon = Path(f"/proc/{int((out / 'flood.pid').read_text())}")
    assert not daemon.exists() or "Z" in (daemon / "stat").read_text().split(")")[1][:3], (
        "the daemon lived on"
    )


def test_one_runs_many_large_programs_do_not_starve_another_runs_hashes(agent: Agent, workdir: Path) -> None:
    # run A execs 200 programs of 250 MiB (sparse: /bin/true and zeros), each hashed afresh (~50 GB
    # to read); meanwhile run B execs 20 new small programs: each of B's is hashed (before: the
    # workers were A's for minutes and every exec of B was `not_hashed: timeout`); A's execs past
    # its budget say `over_budget`, and a degradation says how many
    d = Path(tempfile.mkdtemp(dir=workdir))
    d.chmod(0o777)
    big, small = d / "big", d / "small"
    for dirname, n, size in ((big, 200, 250 << 20), (small, 20, 0)):
        dirname.mkdir(mode=0o755)
        for i in range(n):
            prog = dirname / f"p{i:03d}"
            shutil.copyfile("/bin/true", prog)
            with open(prog, "ab") as f:
                f.write(f"{dirname.name} {i}".encode())  # contents of its own: no cache hit
                if size:
                    f.truncate(size)
            prog.chmod(0o755)
    ran, go_on = d / "ran", d / "go-on"
    a_job = f'for p in {big}/*; do "$p"; done; touch {ran}; while [ ! -e {go_on} ]; do sleep 0.05; done'
    as_nobody = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]
    run = [sys.executable, "-m", "evidence", "run", "--agent", str(agent.socket), "--bundle"]
    a = subprocess.Popen(
        [*as_nobody, *run, str(d / "a.tar.gz"), "--", "/bin/sh", "-c", a_job],
        cwd=d, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not ran.exists():
            assert a.poll() is None and time.monotonic() < deadline, a.communicate()
            time.sleep(0.05)
        b = subprocess.run(
            [*as_nobody, *run, str(d / "b.tar.gz"), "--", "/bin/sh", "-c", f'for p in {small}/*; do "$p"; done'],
            cwd=d, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert b.returncode == 0, b.stderr
    finally:
        go_on.touch()
        _, a_err = a.communicate(timeout=120)
    assert a.returncode == 0, a_err
    _, b_events = read_bundle(d / "b.tar.gz")
    b_execs = [
        e["data"] for e in of_type(b_events, "process.exec") if e["data"]["filename"].startswith(str(small))
    ]
    assert len(b_execs) == 20, b_execs
    assert all("sha256" in x and "not_hashed" not in x for x in b_execs), b_execs
    assert {x["sha256"] for x in b_execs} == {sha256_of(small / f"p{i:03d}") for i in range(20)}
    a_manifest, a_events = read_bundle(d / "a.tar.gz")
    a_execs = [
        e["data"] for e in of_type(a_events, "process.exec") if e["data"]["filename"].startswith(str(big))
    ]
    assert len(a_execs) == 200
    reasons = {x.get("not_hashed") for x in a_execs}
    # A is cut short by its budget (bytes or seconds); on a loaded machine its waits may time out
    # first: either way not all of A is hashed, and what is not says why (the budget itself:
    # tests/unit/test_exe_hash.py)
    assert reasons & {"over_budget", "timeout"} and reasons <= {None, "over_budget", "timeout"}, reasons
    said = [e["data"] for e in of_type(a_events, "degradation") if e["data"]["component"] == "exe-hash"]
    assert said and "not hashed" in said[0]["reason"], said


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
