"""Names matched whole, connection bounds, exit statuses from wait statuses, the watchdog's protocol
with several cgroups: the daemon's small pieces, without root."""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from evidence.agent.commands.client import AgentClient, AgentNotReady
from evidence.agent.daemon import exits, models, transport
from evidence.agent.daemon.authz import Peer, bundle_target, peer_of, protected_pids
from evidence.agent.daemon.wire import MAX_DEPTH, ConnectionLimits
from evidence.errors import UsageError
from tests.unit.test_api import NOT_THE_AGENT, FakeBackend


@pytest.mark.parametrize(
    "check, good",
    [
        (models.session_id, "abc123"),
        (models.bundle_name, "run.tar.gz"),
    ],
)
def test_names_in_paths_are_matched_whole(check: object, good: str) -> None:
    assert check(good) == good  # type: ignore[operator]
    for bad in (good + "\n", good + "\nx", "\n" + good):
        with pytest.raises(UsageError):
            check(bad)  # type: ignore[operator]


def test_names_in_bodies_are_matched_whole(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="label name"):
        models.parse(models.StartRequest, {"cgroup": "/x", "labels": {"key\n": "v"}})
    with pytest.raises(UsageError, match="signal name"):
        models.parse(models.ExitStatus, {"signal": "SIGTERM\n"})
    with pytest.raises(UsageError, match="plain file name"):
        bundle_target("x.tar.gz\n", "s1", tmp_path, 1000)
    assert models.parse(models.ExitStatus, {"signal": "SIGTERM"}).signal == "SIGTERM"


def test_connection_limits_total_and_per_uid() -> None:
    limits = ConnectionLimits(total=3, per_uid=2)
    a, b, c, d, e = (object() for _ in range(5))
    nobody, root = Peer(10, 65534, 65534), Peer(11, 0, 0)
    assert limits.admit(a, nobody) is None
    assert limits.admit(b, nobody) is None
    assert "max_connections_per_uid" in (limits.admit(c, nobody) or "")
    assert limits.admit(c, root) is None  # root: only the total
    assert "max_connections)" in (limits.admit(d, root) or "")
    limits.release(a)
    assert limits.admit(e, nobody) is None  # a slot of its uid is free again
    assert limits.open == 3


def test_a_held_connection_counts_towards_no_bound_until_its_run_is_over() -> None:
    limits = ConnectionLimits(total=2, per_uid=1)
    held, job, other = object(), object(), object()
    uid = Peer(10, 1000, 1000)
    assert limits.admit(held, uid) is None
    limits.hold(held)  # its request started a run
    assert limits.admit(job, uid) is None  # the run's job takes its uid's one place
    assert "max_connections_per_uid" in (limits.admit(other, uid) or "")
    assert limits.admit(other, Peer(11, 2000, 2000)) is None
    assert limits.open == 2
    limits.unhold(held)  # the run is over: counted again, past the bounds
    assert limits.open == 3
    assert "max_connections)" in (limits.admit(object(), Peer(12, 0, 0)) or "")
    for c in (held, job, other):
        limits.release(c)
    assert limits.open == 0
    limits.hold(held)  # released already: nothing to hold
    limits.release(held)
    assert limits.open == 0


def test_busy_is_a_one_line_503_and_the_thread_count_stays(tmp_path: Path) -> None:
    from evidence.agent.daemon.api import AgentAPI

    api = AgentAPI(
        FakeBackend(),
        tmp_path / "a.sock",
        tmp_path / "bundles",
        cgroup_root=tmp_path,
        max_connections=3,
        agent_pid=NOT_THE_AGENT,
    )
    with api:
        before = threading.active_count()
        idle = [socket.socket(socket.AF_UNIX) for _ in range(3)]
        for s in idle:
            s.connect(str(api.socket_path))
        client = AgentClient(api.socket_path, timeout=5)
        with pytest.raises(AgentNotReady, match=r"busy: .*max_connections") as e:
            client.runs()
        assert "\n" not in str(e.value)
        assert threading.active_count() <= before + 3
        for s in idle:
            s.close()
        for _ in range(100):  # the handler threads see EOF and end
            try:
                assert client.runs() == []
                break
            except Exception:
                threading.Event().wait(0.05)
        else:
            raise AssertionError("the agent did not answer again")


def test_past_a_bound_a_peer_that_sends_nothing_is_answered_at_accept(tmp_path: Path) -> None:
    # the refusal does not wait for the request: each connection has its 503 before it sends a byte
    from evidence.agent.daemon.api import AgentAPI

    api = AgentAPI(
        FakeBackend(), tmp_path / "a.sock", tmp_path / "bundles", cgroup_root=tmp_path,
        max_connections=2, agent_pid=NOT_THE_AGENT,
    )  # fmt: skip
    before = threading.active_count()
    with api:
        held = [socket.socket(socket.AF_UNIX) for _ in range(2)]
        for s in held:
            s.connect(str(api.socket_path))
        for _ in range(50):
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(30)
                s.connect(str(api.socket_path))
                answer = s.makefile("rb").read()
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503 "), head
            assert body.count(b"\n") == 1 and b"max_connections" in body
        assert threading.active_count() <= before + 1 + 2  # the server's, and the two admitted ones'
        for s in held:
            s.close()
    assert api.registry.value("evidence_api_requests_total", route="busy", code="503") == 50


def test_peer_credentials_and_groups_are_those_of_connect_time() -> None:
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        peer = peer_of(a)
    assert (peer.pid, peer.uid, peer.gid) == (os.getpid(), os.geteuid(), os.getegid())
    assert sorted(peer.groups) == sorted(os.getgroups())


def test_supplementary_groups_come_from_the_socket() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to connect as uid 65534 with other groups")
    name = f"evidence-test-{os.getpid()}"  # abstract: no file a uid 65534 must reach
    code = "import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect('\\0' + sys.argv[1]); s.recv(1)"
    with socket.socket(socket.AF_UNIX) as srv:
        srv.bind("\0" + name)
        srv.listen()
        srv.settimeout(30)
        child = subprocess.Popen(
            [sys.executable, "-c", code, name], user=65534, group=65534, extra_groups=[4, 27]
        )
        conn, _ = srv.accept()
        with conn:
            peer = peer_of(conn)
            conn.send(b"x")
    child.wait(timeout=30)
    assert (peer.pid, peer.uid, peer.gid, sorted(peer.groups)) == (child.pid, 65534, 65534, [4, 27])


def _api(tmp_path: Path, backend: FakeBackend, **kw: Any) -> Any:
    from evidence.agent.daemon.api import AgentAPI

    return AgentAPI(
        backend,
        tmp_path / "a.sock",
        tmp_path / "bundles",
        cgroup_root=tmp_path,
        agent_pid=NOT_THE_AGENT,
        **kw,
    )


def _idle(path: Path, n: int) -> list[socket.socket]:
    conns = [socket.socket(socket.AF_UNIX) for _ in range(n)]
    for c in conns:
        c.connect(str(path))
    return conns


def test_the_connection_that_started_a_run_finishes_it_whatever_fills_the_agent(tmp_path: Path) -> None:
    # the run's job (same uid) fills every place, and waits past the idle timeout: its client still
    # finishes and downloads over the connection it started the run on
    backend = FakeBackend()
    with _api(tmp_path, backend, max_connections=2, max_connections_per_uid=2) as api:
        client = AgentClient(api.socket_path, timeout=30, keep_alive=True)
        child = subprocess.Popen(["sleep", "30"])
        try:
            sid = client.isolate(child.pid, command=["job"])["session_id"]
            job = _idle(api.socket_path, 2)  # the places the held connection no longer counts in
            threading.Event().wait(0.2)
            assert select.select(job, [], [], 0)[0] == []  # both admitted: a refusal is answered at once
            with pytest.raises(AgentNotReady, match="busy"):
                AgentClient(api.socket_path, timeout=30).runs()
            threading.Event().wait(0.2)  # that refused connection is gone
            done = client.finish(sid, "job.tar.gz", exit_code=0)
            with open(tmp_path / "job.tar.gz", "wb") as out:
                assert client.download(f"/bundles/{done['name']}", out) == done["size"]
        finally:
            child.kill()
            child.wait()
            client.close()
        for c in job:
            c.close()
    assert backend.finished_with == [(0, None)]


def test_a_held_connection_outlives_the_idle_timeout_while_its_run_lives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(transport, "IDLE_SECONDS", 0.3)
    backend = FakeBackend()
    with _api(tmp_path, backend) as api:
        client = AgentClient(api.socket_path, timeout=30, keep_alive=True)
        [plain] = _idle(api.socket_path, 1)
        plain.settimeout(30)
        (tmp_path / "ci").mkdir()
        (tmp_path / "ci" / "cgroup.procs").write_text("")
        sid = client.start(cgroup="/ci")["session_id"]
        threading.Event().wait(1.0)
        assert plain.recv(1) == b""  # closed for idleness
        kept = client._kept
        assert kept is not None
        assert [r["session_id"] for r in client.runs()] == [sid]  # over the same connection
        assert client._kept is kept
        backend.active.clear()  # the run ends (as if finished elsewhere): the connection is plain again
        threading.Event().wait(1.0)
        assert [r["session_id"] for r in client.runs()] == []  # closed meanwhile: a new connection
        assert client._kept is not kept
        client.close()


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 100_000])
def test_a_deeply_nested_body_is_a_400_without_a_traceback(
    tmp_path: Path, depth: int, caplog: pytest.LogCaptureFixture
) -> None:
    body = b'{"labels": ' + b"[" * depth + b"]" * depth + b"}"
    with _api(tmp_path, FakeBackend()) as api, socket.socket(socket.AF_UNIX) as s:
        s.connect(str(api.socket_path))
        s.sendall(b"POST /runs HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        answer = s.makefile("rb").read()
    head, _, text = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), head
    assert json.loads(text) == {"error": f"request body is nested more than {MAX_DEPTH} deep"}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]


def test_exit_from_wait_status() -> None:
    assert exits.from_wait_status(3 << 8) == exits.Exit("exited", 3, None)
    assert exits.from_wait_status(signal.SIGKILL) == exits.Exit("exited", None, "SIGKILL")
    assert exits.describe(0, None) == "exit 0" and exits.describe(None, None) == "nothing"


def test_observe_a_child_through_its_pidfd() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read(); sys.exit(4)"], stdin=subprocess.PIPE
    )
    pidfd = os.pidfd_open(proc.pid)
    try:
        assert exits.observe(pidfd, 0).state == "running"
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()
        got = exits.observe(pidfd, 1)
        assert got.state == "exited" and got.exit_code == 4 or got.state == "unknown", got  # unknown: < 6.15
    finally:
        os.close(pidfd)


def test_protected_pids_are_pid_1_and_this_process_and_its_ancestors() -> None:
    got = protected_pids()
    assert {1, os.getpid(), os.getppid()} <= got
    assert protected_pids(agent_pid=NOT_THE_AGENT) == {1, NOT_THE_AGENT}


def _fake_cgroup(path: Path) -> Path:
    path.mkdir()
    (path / "cgroup.procs").write_text("1\n")
    (path / "cgroup.events").write_text("populated 0\n")
    return path


def test_watchdog_kills_the_cgroups_still_watched_at_eof(tmp_path: Path) -> None:
    kept, gone, other = (_fake_cgroup(tmp_path / n) for n in ("kept", "gone", "other"))
    lines = [
        {"cgroup": str(kept), "session": "s1"},
        {"cgroup": str(gone), "session": "s2"},
        {"unwatch": str(gone)},
    ]
    r, w = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "evidence.agent.recorder.watchdog", str(r)],
        pass_fds=(r,),
        stderr=subprocess.PIPE,
    )
    os.close(r)
    for line in lines:
        os.write(w, json.dumps(line).encode() + b"\n")
    os.close(w)  # the recorder "died"
    _, err = proc.communicate(timeout=30)
    assert (kept / "cgroup.kill").read_text() == "1"
    assert not (gone / "cgroup.kill").exists() and not (other / "cgroup.kill").exists()
    assert b"run s1 died" in err and b"s2" not in err


def test_watchdog_done_kills_nothing(tmp_path: Path) -> None:
    kept = _fake_cgroup(tmp_path / "kept")
    r, w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "evidence.agent.recorder.watchdog", str(r)], pass_fds=(r,))
    os.close(r)
    os.write(w, json.dumps({"cgroup": str(kept), "session": "s1"}).encode() + b"\ndone\n")
    os.close(w)
    assert proc.wait(timeout=30) == 0
    assert not (kept / "cgroup.kill").exists()
