"""An exec of a job run as nobody, held by a `commands` rule's approve, answered through the agent's
API by `evidence approvals` run as nobody, the run's owner: allowed, it runs; denied, it fails with
EACCES and the job goes on. The API is served over its real socket with a real ApprovalBroker behind
a fake backend (tests/unit/test_approvals_api.py); the supervisor and the job are real."""

from __future__ import annotations

import json
import queue
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from evidence.agent.daemon.api import AgentAPI, RunStatus
from evidence.agent.daemon.authz import PeerPolicy
from evidence.agent.recorder.approvals import ApprovalRequest
from evidence.agent.recorder.cgroups import RunCgroup, find_cgroup2_mount
from evidence.agent.recorder.exec_supervisor import ExecSupervisor, receive_listener
from evidence.policy.model import ApprovalsPolicy
from tests.kernel.test_approvals import _commands, _launch
from tests.kernel.test_exec_supervisor import NOBODY
from tests.kernel.util import EXEC_LAUNCHER, as_user, in_cgroup
from tests.unit.test_api import NOT_THE_AGENT
from tests.unit.test_approvals_api import ApprovalsBackend


def _cli(sock: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        as_user(NOBODY, sys.executable, "-m", "evidence", "approvals", "--agent", str(sock), *argv),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_held_execs_answered_through_the_api_by_the_runs_owner(place: Path) -> None:
    backend = ApprovalsBackend()
    (place / "cgroup").mkdir()
    api = AgentAPI(
        backend,
        place / "agent.sock",
        place / "bundles",
        cgroup_root=place / "cgroup",
        socket_gid=NOBODY,
        policy=PeerPolicy(allowed_uids=frozenset({NOBODY})),
        agent_pid=NOT_THE_AGENT,
    )
    api.start()
    opened: queue.Queue[ApprovalRequest] = queue.Queue()
    backend.approvals.subscribe(opened.put)
    script = "/usr/bin/id -u; echo first=$?; /usr/bin/id -g; echo second=$?; echo end"
    proc, sock = _launch(script, place)
    sup = None
    try:
        approver = backend.approvals.approver("i0001", 0, ApprovalsPolicy.model_validate({"timeout": "5m"}))
        backend.approvals.set_owner("i0001", NOBODY)  # what the API does when nobody starts the run
        sup = ExecSupervisor(receive_listener(sock), _commands(), proc.pid, approver=approver)
        sup.start()
        answers: list[dict[str, Any]] = []
        for decision in ("allow", "deny"):
            held = opened.get(timeout=60)
            listed = _cli(place / "agent.sock", "list", "--format", "json")
            assert listed.returncode == 0, listed.stderr
            (view,) = json.loads(listed.stdout)["approvals"]
            assert view["id"] == held.id and view["program"] == "/usr/bin/id" and view["owner_uid"] == NOBODY
            done = _cli(place / "agent.sock", decision, held.id, "--reason", f"{decision} from the cli")
            assert done.returncode == 0 and done.stdout.startswith(f"{held.id}: {decision} (uid {NOBODY}, ")
            answers.append(view)
        out, err = proc.communicate(timeout=60)
    finally:
        if sup is not None:
            sup.stop()
        sock.close()
        if proc.poll() is None:
            proc.kill()
        api.stop()
    lines = out.splitlines()
    assert lines == [str(NOBODY), "first=0", "second=126", "end"], (out, err)
    assert "Permission denied" in err
    resolved = [r for r in backend.recs if r["state"] != "requested"]
    assert [(r["state"], r["via"], r["by_uid"], r["reason"]) for r in resolved] == [
        ("allowed", "api", NOBODY, "allow from the cli"),
        ("denied", "api", NOBODY, "deny from the cli"),
    ]


SELF_APPROVE = r"""
import json, socket, sys, time
def ask(method, path, body=b""):
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    s.sendall(f"{method} {path} HTTP/1.0\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)
for _ in range(600):
    status, listed = ask("GET", "/approvals")
    if listed.get("approvals"):
        break
    time.sleep(0.05)
rid = listed["approvals"][0]["id"]
status, answer = ask("POST", f"/approvals/{rid}", json.dumps({"decision": "allow", "reason": "trust me"}).encode())
with open(sys.argv[2], "w") as f:
    f.write(f"self-approval {status} {answer.get('error', '')}")
"""


def test_the_job_cannot_approve_its_own_exec_through_the_api(place: Path) -> None:
    """Red team: the job runs as its run's owner (nobody), inside the run's cgroup, and the agent's
    socket lets that uid in. While its exec of /usr/bin/id is held, it lists the request and answers
    allow itself: 403, the exec stays held; a person outside the run then denies it."""
    mount = find_cgroup2_mount()
    cg = RunCgroup.create(f"approvals-rt-{place.name}")
    backend = ApprovalsBackend()
    backend.active["i0001"] = RunStatus("i0001", str(cg.path), isolated=True)
    api = AgentAPI(
        backend,
        place / "agent.sock",
        place / "bundles",
        cgroup_root=mount,
        socket_gid=NOBODY,
        policy=PeerPolicy(allowed_uids=frozenset({NOBODY})),
        agent_pid=NOT_THE_AGENT,
    )
    api.start()
    (place / "self.py").write_text(SELF_APPROVE)
    attempt = place / "attempt"
    opened: queue.Queue[ApprovalRequest] = queue.Queue()
    backend.approvals.subscribe(opened.put)
    script = f"/usr/bin/id -u & {sys.executable} {place / 'self.py'} {place / 'agent.sock'} {attempt}; wait $!; echo held=$?"
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen(
        in_cgroup(
            cg.procs_file(),
            *as_user(
                NOBODY, sys.executable, "-c", EXEC_LAUNCHER, str(theirs.fileno()), "/bin/sh", "-c", script
            ),
        ),
        pass_fds=[theirs.fileno()],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=place,
    )
    theirs.close()
    sup = None
    try:
        ours.settimeout(30)
        approver = backend.approvals.approver(
            "i0001", NOBODY, ApprovalsPolicy.model_validate({"timeout": "5m"})
        )
        sup = ExecSupervisor(receive_listener(ours), _commands(), proc.pid, approver=approver)
        sup.start()
        held = opened.get(timeout=60)
        for _ in range(1200):  # the job's attempt, written once its answer came back
            if attempt.exists() and attempt.read_text():
                break
            time.sleep(0.05)
        assert backend.approvals.get(held.id) is not None, attempt.read_text()  # the job did not answer it
        backend.approvals.answer(held.id, False, uid=0, via="api", reason="a person said no")
        out, err = proc.communicate(timeout=60)
    finally:
        if sup is not None:
            sup.stop()
        ours.close()
        if proc.poll() is None:
            proc.kill()
        api.stop()
        cg.kill()
        cg.wait_empty()
        cg.remove()
    assert attempt.read_text().startswith("self-approval 403 an answer from inside a recorded run is refused")
    assert out.splitlines() == ["held=126"], (out, err)
    resolved = [r for r in backend.recs if r["state"] != "requested"]
    assert [(r["state"], r["by_uid"], r["reason"]) for r in resolved] == [("denied", 0, "a person said no")]
