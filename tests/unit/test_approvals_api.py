"""GET/POST /approvals (agent/daemon/api.py) and `evidence approvals` (agent/commands/approvals.py)
over a real Unix socket: a real ApprovalBroker behind a fake backend, an exec held on a thread of
the test as the supervisor would hold it. Who sees and answers what (uid from SO_PEERCRED: root,
the run's owner, another uid as a real process), what is recorded, one-line errors, and that a
request reaches the live event stream as soon as it is written to the run's spool."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from evidence.agent.daemon.api import AgentAPI, RunStatus
from evidence.agent.daemon.authz import Peer, PeerPolicy, peer_cgroup
from evidence.agent.daemon.delivery import live_event
from evidence.agent.daemon.wrappers import ObservedSpool
from evidence.agent.recorder.approvals import ApprovalBroker, Asked
from evidence.bundle import format as fmt
from evidence.cli import main
from evidence.policy.commands import CommandDecision
from evidence.policy.model import ApprovalsPolicy
from tests.unit.test_api import NOT_THE_AGENT, FakeBackend

NOBODY = 65534


class ApprovalsBackend(FakeBackend):
    def __init__(self) -> None:
        super().__init__()
        self.recs: list[Any] = []
        self.approvals = ApprovalBroker(record=self.recs.append, poll_s=0.01)


@pytest.fixture
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="evidence-approvals-"))  # not tmp_path (0700): uid 65534 connects
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def cgroup_root(workdir: Path) -> Path:
    (workdir / "cgroup").mkdir()
    return workdir / "cgroup"


@pytest.fixture
def backend() -> ApprovalsBackend:
    return ApprovalsBackend()


@pytest.fixture
def api(workdir: Path, cgroup_root: Path, backend: ApprovalsBackend) -> Iterator[AgentAPI]:
    server = AgentAPI(
        backend,
        workdir / "run" / "agent.sock",
        workdir / "bundles",
        cgroup_root=cgroup_root,
        socket_gid=NOBODY,
        policy=PeerPolicy(allowed_uids=frozenset({NOBODY})),
        agent_pid=NOT_THE_AGENT,
    )
    server.start()
    yield server
    server.stop()


class Held:
    """An exec held for approval, as the supervisor's approver holds it: on its own thread."""

    def __init__(self, broker: ApprovalBroker, run: str, owner: int, argv: tuple[str, ...]) -> None:
        decision = CommandDecision("approve", 1, "push", "force-push needs a human")
        asked = Asked(4321, "/usr/bin/git", argv, False, 2, decision)
        policy = ApprovalsPolicy.model_validate({"timeout": "10m", "on_timeout": "deny"})
        self.request = broker.open(asked, run=run, owner_uid=owner, policy=policy)
        self.allowed: list[bool] = []
        self.thread = threading.Thread(
            target=lambda: self.allowed.append(broker.wait(self.request.id).allowed)
        )
        self.thread.start()

    def outcome(self) -> bool:
        self.thread.join(10)
        assert not self.thread.is_alive()
        return self.allowed[0]


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


_CHILD = r"""
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
body = sys.argv[3].encode()
s.sendall(f"{sys.argv[2]} HTTP/1.0\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
data = b""
while chunk := s.recv(65536):
    data += chunk
head, _, payload = data.partition(b"\r\n\r\n")
print(json.dumps([int(head.split()[1]), json.loads(payload)]))
"""


def as_nobody(sock: Path, request: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    """One request from a real process of uid 65534 (SO_PEERCRED says so)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a client as uid 65534")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(sock), request, json.dumps(body) if body is not None else ""],
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    status, payload = json.loads(proc.stdout)
    return status, payload


def test_root_lists_and_allows_through_the_cli_and_the_answer_is_recorded(
    api: AgentAPI, backend: ApprovalsBackend, capsys: pytest.CaptureFixture[str]
) -> None:
    held = Held(backend.approvals, "i0001", NOBODY, ("git", "push", "--force"))
    rid = held.request.id
    code, out, _ = cli(capsys, "approvals", "--agent", str(api.socket_path), "list", "--format", "json")
    assert code == 0
    (view,) = json.loads(out)["approvals"]
    assert view["id"] == rid and view["session_id"] == "i0001" and view["owner_uid"] == NOBODY
    assert view["argv"] == ["git", "push", "--force"] and view["rule"] == "commands.rules[1] (push)"
    assert view["on_timeout"] == "deny" and view["expires_at"] > view["requested_at"]
    code, out, _ = cli(capsys, "approvals", "--agent", str(api.socket_path), "list")
    assert code == 0 and rid in out and "exec of /usr/bin/git (pid 4321, depth 2)" in out
    assert "git push --force" in out and "force-push needs a human" in out
    assert held.thread.is_alive()  # still held: listing answers nothing

    code, out, _ = cli(capsys, "approvals", "--agent", str(api.socket_path), "allow", rid, "--reason", "ok'd")
    assert code == 0 and out.startswith(f"{rid}: allow (uid 0, ")
    assert held.outcome() is True
    requested, allowed = backend.recs
    assert requested["state"] == "requested" and requested["id"] == rid
    assert (allowed["state"], allowed["via"], allowed["by_uid"], allowed["reason"]) == (
        "allowed",
        "api",
        0,
        "ok'd",
    )
    fmt.PolicyApproval.model_validate({k: v for k, v in allowed.items() if k not in ("k", "t")})

    # a second answer: 409, one line, exit 2; nothing more recorded
    code, _, err = cli(capsys, "approvals", "--agent", str(api.socket_path), "deny", rid, "--reason", "late")
    assert code == 2 and err.count("\n") == 1 and "already resolved" in err
    assert len(backend.recs) == 2
    code, out, _ = cli(capsys, "approvals", "--agent", str(api.socket_path), "list")
    assert code == 0 and out == "no exec waits for your answer\n"


def test_a_deny_refuses_the_exec(
    api: AgentAPI, backend: ApprovalsBackend, capsys: pytest.CaptureFixture[str]
) -> None:
    held = Held(backend.approvals, "i0001", 0, ("git", "push"))
    code, _, _ = cli(
        capsys, "approvals", "--agent", str(api.socket_path), "deny", held.request.id, "--reason", "not today"
    )
    assert code == 0 and held.outcome() is False
    assert backend.recs[-1]["state"] == "denied" and backend.recs[-1]["reason"] == "not today"


def test_bad_bodies_ids_and_unknown_requests_are_one_line_4xx(
    api: AgentAPI, backend: ApprovalsBackend, capsys: pytest.CaptureFixture[str]
) -> None:
    held = Held(backend.approvals, "i0001", 0, ("git", "push"))
    rid = held.request.id
    handle = api.handle
    root = Peer(1, 0, 0, cgroup="/user.slice/a-shell")  # outside every run
    cases: list[tuple[str, dict[str, Any], int, str]] = [
        (f"/approvals/{rid}", {}, 400, "decision"),
        (
            f"/approvals/{rid}",
            {"decision": "maybe", "reason": "x"},
            400,
            '"decision" must be "allow" or "deny"',
        ),
        (f"/approvals/{rid}", {"decision": "allow"}, 400, "reason"),
        (
            f"/approvals/{rid}",
            {"decision": "allow", "reason": "  "},
            400,
            '"reason" must be a non-empty string',
        ),
        (f"/approvals/{rid}", {"decision": "allow", "reason": "x" * 1025}, 400, "longer than 1024"),
        (f"/approvals/{rid}", {"decision": "allow", "reason": 3}, 400, '"reason" must be a non-empty string'),
        (f"/approvals/{rid}", {"decision": "allow", "reason": "x", "who": 0}, 400, "unknown field(s) who"),
        ("/approvals/../runs", {"decision": "allow", "reason": "x"}, 404, "no route"),
        ("/approvals/NOT-AN-ID", {"decision": "allow", "reason": "x"}, 400, "is not an approval request id"),
        ("/approvals/0123456789abcdef", {"decision": "allow", "reason": "x"}, 404, "no approval request"),
    ]
    cases.append((f"/approvals/{rid}", {"decision": "allow", "reason": "x"}, 403, "cannot tell whether"))
    for path, body, status, words in cases:
        if status == 403:
            root = Peer(1, 0, 0)  # where it is could not be read: refused
        resp = handle("POST", path, body, root)
        got = json.loads(resp.body)
        assert resp.status == status, (path, body, got)
        assert words in got["error"] and "\n" not in got["error"], (path, body, got)
    assert held.thread.is_alive() and len(backend.recs) == 1  # none of them answered it
    code, _, err = cli(capsys, "approvals", "--agent", str(api.socket_path), "allow", rid, "--reason", "")
    assert code == 2 and "--reason" in err and err.count("\n") == 1
    code, _, err = cli(
        capsys, "approvals", "--agent", str(api.socket_path), "allow", "feedfacefeedface", "--reason", "x"
    )
    assert code == 2 and "no approval request feedfacefeedface" in err and err.count("\n") == 1
    backend.approvals.answer(rid, False, uid=0, via="terminal", reason="cleanup")
    assert held.outcome() is False


def test_another_uid_sees_and_answers_only_its_own_runs_requests(
    api: AgentAPI, backend: ApprovalsBackend
) -> None:
    roots = Held(backend.approvals, "s0001", 0, ("git", "push", "root's"))
    own = Held(backend.approvals, "i0002", NOBODY, ("git", "push", "nobody's"))
    status, listed = as_nobody(api.socket_path, "GET /approvals")
    assert status == 200 and [r["id"] for r in listed["approvals"]] == [own.request.id]
    # root's request: not disclosed, as another user's run is not (404), and still held
    status, err = as_nobody(
        api.socket_path, f"POST /approvals/{roots.request.id}", {"decision": "allow", "reason": "mine now"}
    )
    assert status == 404 and err["error"] == f"no approval request {roots.request.id}"
    assert roots.thread.is_alive()
    status, answer = as_nobody(
        api.socket_path, f"POST /approvals/{own.request.id}", {"decision": "allow", "reason": "my job"}
    )
    assert status == 200 and answer["by_uid"] == NOBODY and answer["via"] == "api"
    assert own.outcome() is True
    assert backend.recs[-1]["by_uid"] == NOBODY and backend.recs[-1]["state"] == "allowed"
    status, err = as_nobody(
        api.socket_path,
        f"POST /approvals/{own.request.id}",
        {"decision": "deny", "reason": "changed my mind"},
    )
    assert status == 409 and "already resolved" in err["error"]
    backend.approvals.close_run("s0001")  # the run ends: its request is withdrawn, the exec refused
    assert roots.outcome() is False and backend.recs[-1]["via"] == "withdrawn"


def test_the_text_listing_escapes_what_the_job_chose(
    api: AgentAPI, backend: ApprovalsBackend, capsys: pytest.CaptureFixture[str]
) -> None:
    held = Held(backend.approvals, "i0001", 0, ("git", "\x1b[2J\x1b[Hallow? y", "a\nb"))
    code, out, _ = cli(capsys, "approvals", "--agent", str(api.socket_path), "list")
    assert code == 0 and "\x1b" not in out and "\\x1b[2J" in out
    assert out.count("\n") == 5  # five lines per request: the job's newline is shown, not made
    backend.approvals.answer(held.request.id, False, uid=0, via="terminal", reason="cleanup")
    held.outcome()


def test_a_request_is_a_live_event_as_soon_as_it_is_written_to_the_runs_spool(tmp_path: Path) -> None:
    """What the agent's live stream needs: the broker's record written to the run's spool writer
    (agent/daemon/wrappers.py: ObservedSpool) is passed to the stream on that write, while the exec
    waits, as a dev.evidence.policy.approval CloudEvent carrying the id a bot answers with."""

    class Inner:
        path = tmp_path / "spool"
        records = 0

        def write_many(self, recs: Any) -> None:
            self.records += len(recs)

    streamed: list[dict[str, Any]] = []
    spool = ObservedSpool(Inner(), lambda recs: streamed.extend(live_event("i0001", 0, r) for r in recs))  # type: ignore[arg-type]
    spool.set_prelude([])  # an isolated run's (empty) inventory
    broker = ApprovalBroker(record=spool.write, poll_s=0.01)
    held = Held(broker, "i0001", 0, ("git", "push"))
    (event,) = streamed  # before any answer
    assert held.thread.is_alive()
    assert event["type"] == fmt.POLICY_APPROVAL and event["data"]["state"] == "requested"
    assert event["data"]["id"] == held.request.id and event["subject"] == "/usr/bin/git"
    broker.answer(held.request.id, True, uid=0, via="api", reason="ok")
    assert held.outcome() is True and streamed[-1]["data"]["state"] == "allowed"


def test_the_runs_owner_is_the_apis_whatever_uid_the_backend_opened_the_request_with(
    api: AgentAPI, backend: ApprovalsBackend, cgroup_root: Path
) -> None:
    """The backend does not know who asked for a run; the API does (SO_PEERCRED at POST /runs) and
    tells the broker, so the owner sees and answers the run's requests, open ones included."""
    job = cgroup_root / "ci"
    job.mkdir()
    (job / "cgroup.procs").write_text("")
    os.chown(job, NOBODY, NOBODY)
    early = Held(backend.approvals, "s0001", 0, ("git", "push", "early"))  # opened before the owner is known
    status, run = as_nobody(api.socket_path, "POST /runs", {"cgroup": "ci"})
    assert status == 201 and run["session_id"] == "s0001" and run["owner_uid"] == NOBODY
    later = Held(backend.approvals, "s0001", 0, ("git", "push", "later"))  # the backend still says 0
    status, listed = as_nobody(api.socket_path, "GET /approvals")
    assert status == 200 and [r["id"] for r in listed["approvals"]] == [early.request.id, later.request.id]
    assert {r["owner_uid"] for r in listed["approvals"]} == {NOBODY}
    for held in (early, later):
        status, answer = as_nobody(
            api.socket_path, f"POST /approvals/{held.request.id}", {"decision": "deny", "reason": "mine"}
        )
        assert status == 200 and answer["by_uid"] == NOBODY and held.outcome() is False


def _own_cgroup() -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    pytest.skip("no cgroup v2 line in /proc/self/cgroup")


def test_an_answer_from_inside_a_recorded_run_is_refused(
    api: AgentAPI, backend: ApprovalsBackend, cgroup_root: Path
) -> None:
    """The job usually runs as its run's owner and can reach the socket: it must not approve its own
    execs. A process of the owner's inside a recorded cgroup (here: the test's own cgroup, which the
    fake backend says it records) is refused; the exec stays held; from outside it is answered."""
    held = Held(backend.approvals, "i0001", NOBODY, ("git", "push", "--force"))
    inside = cgroup_root / _own_cgroup().lstrip("/")
    backend.active["i0001"] = RunStatus("i0001", str(inside), isolated=True)
    status, err = as_nobody(
        api.socket_path, f"POST /approvals/{held.request.id}", {"decision": "allow", "reason": "me"}
    )
    assert status == 403 and "from inside a recorded run is refused" in err["error"]
    assert held.thread.is_alive() and len(backend.recs) == 1  # still held, nothing recorded
    status, listed = as_nobody(api.socket_path, "GET /approvals")  # seeing it is no harm
    assert status == 200 and [r["id"] for r in listed["approvals"]] == [held.request.id]
    backend.active["i0001"] = RunStatus("i0001", str(inside / "job"), isolated=True)  # the run is below us
    status, answer = as_nobody(
        api.socket_path, f"POST /approvals/{held.request.id}", {"decision": "deny", "reason": "no"}
    )
    assert status == 200 and answer["by_uid"] == NOBODY and held.outcome() is False


def test_the_peers_cgroup_is_read_through_its_pidfd_and_unknown_once_it_is_gone(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(4)
    try:
        client = socket.socket(socket.AF_UNIX)
        client.connect(path)
        conn, _ = server.accept()
        assert peer_cgroup(conn) == _own_cgroup()
        conn.close()
        client.close()
        # a peer that connected and exited before the agent looked: its pid may be anyone's now
        subprocess.run(
            [sys.executable, "-c", f"import socket; socket.socket(socket.AF_UNIX).connect({path!r})"],
            check=True,
        )
        conn, _ = server.accept()
        assert peer_cgroup(conn) is None
        conn.close()
    finally:
        server.close()
