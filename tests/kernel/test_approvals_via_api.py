"""An exec of a job run as nobody, held by a `commands` rule's approve, answered through the agent's
API by `evidence approvals` run as nobody, the run's owner: allowed, it runs; denied, it fails with
EACCES and the job goes on. The API is served over its real socket with a real ApprovalBroker behind
a fake backend (tests/unit/test_approvals_api.py); the supervisor and the job are real."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
from pathlib import Path
from typing import Any

from evidence.agent.daemon.api import AgentAPI
from evidence.agent.daemon.authz import PeerPolicy
from evidence.agent.recorder.approvals import ApprovalRequest
from evidence.agent.recorder.exec_supervisor import ExecSupervisor, receive_listener
from evidence.policy.model import ApprovalsPolicy
from tests.kernel.test_approvals import _commands, _launch
from tests.kernel.test_exec_supervisor import NOBODY
from tests.kernel.util import as_user
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
