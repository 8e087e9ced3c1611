"""agent.api + agent.client(_finish) over a real Unix socket, with a fake backend that writes real bundles."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tarfile
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from evidence.agent.commands.client import AgentClient
from evidence.agent.daemon import metrics as m
from evidence.agent.daemon import models
from evidence.agent.daemon.api import AgentAPI, RunConflict, RunStatus, UnknownRun
from evidence.agent.daemon.authz import Forbidden, Peer, PeerPolicy, bundle_target, claim_pid, resolve_cgroup
from evidence.bundle.writer import RunMeta, write_bundle
from evidence.cli import main
from evidence.errors import SetupError, UsageError

NOT_THE_AGENT = 4_194_305  # over pid_max's ceiling: the API serves in this process, which is not the agent


class FakeBackend:
    """Records what the API asked; finish writes a real (empty) bundle with the bundle writer."""

    def __init__(self) -> None:
        self.active: dict[str, RunStatus] = {}
        self.started: list[tuple[Path, dict[str, str], int | None]] = []
        self.isolated: list[tuple[int, dict[str, str], list[str], str, Path]] = []
        self.finished_with: list[tuple[int | None, str | None]] = []
        self.not_ready: str | None = None
        self.finished = 0
        self.lock = threading.Lock()

    def start(self, cgroup: Path, labels: Mapping[str, str], pid: int | None = None) -> RunStatus:
        with self.lock:
            if any(r.cgroup == str(cgroup) for r in self.active.values()):
                raise RunConflict(f"{cgroup} is already being recorded")
            sid = f"s{len(self.started) + 1:04d}"
            self.started.append((cgroup, dict(labels), pid))
            info = RunStatus(sid, str(cgroup), dict(labels), started_ns=1_700_000_000_000_000_000, pid=pid)
            self.active[sid] = info
            return info

    def isolate(
        self,
        pid: int,
        labels: Mapping[str, str],
        mount: Path,
        *,
        command: Sequence[str] = (),
        detail: str = "summary",
        pidfd: int | None = None,
        policy: models.PolicySpec | None = None,
        net: Literal["none", "loopback"] | None = None,
        subjects: Sequence[str] = (),
        subjects_as: tuple[int, int] | None = None,
    ) -> RunStatus:
        assert pidfd is not None
        with self.lock:
            sid = f"i{len(self.isolated) + 1:04d}"
            self.isolated.append((pid, dict(labels), list(command), detail, mount))
            info = RunStatus(
                sid, str(mount / "evidence" / sid), dict(labels), started_ns=1, pid=pid, isolated=True
            )
            self.active[sid] = info
            return info

    def finish(
        self,
        session_id: str,
        bundle_path: Path,
        *,
        exit_code: int | None = None,
        signal: str | None = None,
    ) -> Mapping[str, Any]:
        self.finished_with.append((exit_code, signal))
        with self.lock:
            info = self.active.pop(session_id, None)
        if info is None:
            raise UnknownRun(f"no run {session_id}")
        meta = RunMeta(
            session_id=session_id,
            command=[],
            cwd="/",
            pid=info.pid or 0,
            cgroup=info.cgroup,
            started_ns=info.started_ns,
            finished_ns=info.started_ns + 5,
            exit_code=exit_code,
            signal=signal,
            attached_late=not info.isolated,
            detail="summary",
            host={},
            capabilities={},
            headers={},
            labels=dict(info.labels),
            lost={"open": 3},
        )
        manifest = write_bundle(bundle_path, meta, lambda: [])
        self.finished += 1
        return manifest

    def runs(self) -> Sequence[RunStatus]:
        with self.lock:
            return list(self.active.values())

    def metrics(self) -> m.MetricsSnapshot:
        return m.MetricsSnapshot(
            events_by_kind={"exec": 12, "open": 40, 'we"ird\\kind': 1},
            lost_by_kind={"open": 3},
            runs_active=len(self.active),
            runs_started=len(self.started),
            runs_finished=self.finished,
            consumer_lag_seconds=0.25,
            bundle_bytes=1234,
            bundles_written=self.finished,
        )

    def ready(self) -> str | None:
        return self.not_ready


@pytest.fixture
def workdir() -> Iterator[Path]:
    # Not tmp_path: pytest makes that 0700, and the uid tests need another user to reach the socket.
    d = Path(tempfile.mkdtemp(prefix="evidence-api-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def cgroup_root(workdir: Path) -> Path:
    root = workdir / "cgroup"
    (root / "ci" / "job-42").mkdir(parents=True)
    (root / "cgroup.procs").write_text("")
    (root / "ci" / "job-42" / "cgroup.procs").write_text("")
    (root / "ci" / "cgroup.procs").write_text("")
    return root


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def api(workdir: Path, cgroup_root: Path, backend: FakeBackend) -> Iterator[AgentAPI]:
    server = AgentAPI(
        backend,
        workdir / "run" / "agent.sock",
        workdir / "bundles",
        cgroup_root=cgroup_root,
        socket_gid=65534,
        tcp_listen=("127.0.0.1", 0),
        agent_pid=NOT_THE_AGENT,
    )
    server.start()
    yield server
    server.stop()


def cli(*argv: str) -> int:
    return main(list(argv))


def test_socket_is_mode_0660_with_the_configured_group(api: AgentAPI) -> None:
    st = os.stat(api.socket_path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o660
    assert st.st_gid == 65534


def test_start_and_finish_through_the_cli(
    api: AgentAPI, backend: FakeBackend, cgroup_root: Path, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sock = str(api.socket_path)
    assert (
        cli("start", "--agent", sock, "--cgroup", "/ci/job-42", "--label", "job=42", "--label", "repo=x/y")
        == 0
    )
    sid = capsys.readouterr().out
    assert sid == "s0001\n"  # the session id, alone on stdout
    assert backend.started == [(cgroup_root / "ci" / "job-42", {"job": "42", "repo": "x/y"}, None)]

    # the run is listed
    runs = AgentClient(sock).runs()
    assert [(r["session_id"], r["labels"]) for r in runs] == [("s0001", {"job": "42", "repo": "x/y"})]

    out = workdir / "out" / "job.tar.gz"
    out.parent.mkdir()
    assert cli("finish", "--agent", sock, "s0001", "--bundle", str(out)) == 0
    run_id, path = capsys.readouterr().out.rstrip("\n").split("\t")
    assert path == str(out)
    agent_copy = workdir / "bundles" / "s0001.tar.gz"
    assert out.read_bytes() == agent_copy.read_bytes()  # downloaded over the socket, byte for byte
    with tarfile.open(out) as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
    assert manifest["run_id"] == run_id
    assert manifest["labels"] == {"job": "42", "repo": "x/y"}
    assert manifest["attached_late"] is True
    assert AgentClient(sock).runs() == []

    # finishing again: the run is gone -> exit 2, one line on stderr
    assert cli("finish", "--agent", sock, "s0001") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no run s0001" in err


def test_start_by_pid_and_json_answers(
    api: AgentAPI, backend: FakeBackend, cgroup_root: Path, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a process 4242 (in a fake /proc) whose /proc/PID/cgroup path, under the fake root, is a "cgroup"
    api.proc_root = workdir / "proc"
    _fake_proc(api.proc_root, 4242, "0 0 0 0", "4242")
    (api.proc_root / "4242" / "cgroup").write_text("0::/ci/job-42\n")
    target = cgroup_root / "ci" / "job-42"
    assert cli("start", "--agent", str(api.socket_path), "--pid", "4242", "--json") == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["pid"] == 4242 and answer["owner_uid"] == 0
    assert answer["cgroup"] == str(target.resolve())
    assert backend.started[0][2] == 4242

    assert (
        cli(
            "finish", "--agent", str(api.socket_path), answer["session_id"], "--name", "mine.tar.gz", "--json"
        )
        == 0
    )
    done = json.loads(capsys.readouterr().out)
    assert done["name"] == "mine.tar.gz" and done["lost"] == 3 and done["run_id"].startswith("run-")
    assert Path(done["path"]).stat().st_size == done["size"]


def test_bad_requests_are_exit_2_with_one_line(
    api: AgentAPI, backend: FakeBackend, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sock = str(api.socket_path)
    cases = [
        (["start", "--agent", sock, "--cgroup", "/nope"], "is not a cgroup"),
        (["start", "--agent", sock, "--cgroup", "/../../etc"], "outside the cgroup mount"),
        (["start", "--agent", sock, "--cgroup", "/ci", "--label", "novalue"], "is not KEY=VALUE"),
        (
            ["start", "--agent", sock, "--cgroup", "/ci", "--label", "bad key=1"],
            "label name 'bad key' is not valid",
        ),
        (["start", "--agent", sock, "--pid", "999999999"], "no process 999999999"),
        (["finish", "--agent", sock, "../etc"], "is not a session id"),
        (["finish", "--agent", sock, "s9999"], "no run s9999"),
    ]
    for argv, fragment in cases:
        assert cli(*argv) == 2, argv
        err = capsys.readouterr().err
        assert fragment in err, (argv, err)
        assert err.count("\n") == 1 and "Traceback" not in err
    # no agent at the socket: nothing was run, 70 as the README says (not bad input)
    assert cli("start", "--agent", str(workdir / "missing.sock"), "--cgroup", "/ci") == 70
    err = capsys.readouterr().err
    assert "no agent socket at" in err and err.count("\n") == 1
    assert backend.started == []

    # same cgroup twice: 409, still a one-line exit 2
    assert cli("start", "--agent", sock, "--cgroup", "/ci") == 0
    capsys.readouterr()
    assert cli("start", "--agent", sock, "--cgroup", "/ci") == 2
    assert "already being recorded" in capsys.readouterr().err


def test_raw_http_errors(api: AgentAPI) -> None:
    def raw(method: str, path: str, body: bytes | None = None) -> tuple[int, dict[str, Any]]:
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(api.socket_path))
        conn = http.client.HTTPConnection("localhost")
        conn.sock = s
        conn.request(method, path, body=body)
        resp = conn.getresponse()
        status, data = resp.status, json.loads(resp.read())
        conn.close()
        return status, data

    assert raw("POST", "/runs", b"{not json")[0] == 400
    assert raw("POST", "/runs", b"[1]")[0] == 400
    assert raw("POST", "/runs", json.dumps({"cgroup": "/ci", "pid": 1}).encode())[1]["error"].startswith(
        "give exactly one"
    )
    assert (
        raw("POST", "/runs", json.dumps({"cgroup": "/ci", "extra": 1}).encode())[1]["error"]
        == "unknown field(s) extra"
    )
    assert raw("POST", "/runs", json.dumps({"pid": True}).encode())[0] == 400
    assert raw("GET", "/nowhere")[0] == 404
    assert raw("GET", "/bundles/..%2Fagent.sock")[0] == 400
    assert raw("GET", "/bundles/none.tar.gz")[0] == 404
    assert raw("DELETE", "/runs")[0] == 404


def test_readiness_and_health(
    api: AgentAPI, backend: FakeBackend, capsys: pytest.CaptureFixture[str]
) -> None:
    client = AgentClient(api.socket_path)
    assert client.health() == {"status": "ready"}
    assert client.request("GET", "/healthz") == {"status": "ok"}
    backend.not_ready = "probes not loaded yet"
    with pytest.raises(Exception, match="probes not loaded yet"):
        client.health()
    assert cli("start", "--agent", str(api.socket_path), "--cgroup", "/ci") == 70  # SetupError's exit code
    assert "not ready: probes not loaded yet" in capsys.readouterr().err
    assert backend.started == []


def test_metrics_scrape_parses_as_prometheus_text(api: AgentAPI) -> None:
    AgentClient(api.socket_path).request("GET", "/healthz")
    conn = _unix_conn(api.socket_path)
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    assert resp.getheader("Content-Type", "").startswith("text/plain; version=0.0.4")
    text = resp.read().decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    assert samples[("evidence_events_total", (("kind", "exec"),))] == 12
    assert samples[("evidence_events_total", (("kind", 'we"ird\\kind'),))] == 1  # escaping survives
    assert samples[("evidence_events_lost_total", (("kind", "open"),))] == 3
    assert samples[("evidence_consumer_lag_seconds", ())] == 0.25
    assert samples[("evidence_runs_active", ())] == 0
    assert samples[("evidence_bundle_bytes_total", ())] == 1234
    assert samples[("evidence_api_requests_total", (("code", "200"), ("route", "/healthz")))] >= 1
    types = {fam.name: fam.type for fam in text_string_to_metric_families(text)}
    assert types["evidence_events"] == "counter" and types["evidence_runs_active"] == "gauge"


def test_tcp_listener_is_read_only(api: AgentAPI) -> None:
    assert api.tcp_listen is not None
    host, port = api.tcp_listen
    for method, path, status in (
        ("GET", "/healthz", 200),
        ("GET", "/readyz", 200),
        ("GET", "/metrics", 200),
        ("POST", "/runs", 404),
        ("GET", "/runs", 404),
        ("POST", "/runs/s0001/finish", 404),
        ("GET", "/bundles/a.tar.gz", 404),
    ):
        conn = http.client.HTTPConnection(host, port, timeout=5)
        conn.request(method, path, body=b"{}" if method == "POST" else None)
        resp = conn.getresponse()
        assert resp.status == status, path
        resp.read()
        conn.close()


def _unix_conn(path: Path) -> http.client.HTTPConnection:
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(path))
    conn = http.client.HTTPConnection("localhost")
    conn.sock = s
    return conn


_CHILD = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except PermissionError:
    print("EACCES"); sys.exit(0)
try:  # a refused peer is answered at accept, maybe before this is sent: the answer is still read
    s.sendall(b"POST /runs HTTP/1.0\r\nContent-Length: 17\r\n\r\n{\"cgroup\": \"/ci\"}")
except BrokenPipeError:
    pass
data = b""
try:
    while chunk := s.recv(65536):
        data += chunk
except ConnectionResetError:  # closed with what it had not read: after its answer
    pass
print(data.split(b"\r\n", 1)[0].decode())
print(data.rsplit(b"\r\n\r\n", 1)[1].decode())
"""


def _as_nobody(sock: Path, groups: bool = True) -> list[str]:
    if os.geteuid() != 0:
        pytest.skip("needs root to run a client as uid 65534")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(sock)],
        user=65534,
        group=65534 if groups else 1,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return proc.stdout.splitlines()


def test_peer_with_a_wrong_uid_is_refused(api: AgentAPI, backend: FakeBackend) -> None:
    # the socket's group (65534) lets uid 65534 connect; SO_PEERCRED then refuses it: not allowed
    lines = _as_nobody(api.socket_path)
    assert lines[0].endswith("403 Forbidden"), lines
    assert "permission denied" in json.loads(lines[1])["error"]
    assert backend.started == []
    assert api.registry.value("evidence_api_refused_peers_total") == 1


def test_peer_outside_the_socket_group_cannot_even_connect(api: AgentAPI) -> None:
    assert _as_nobody(api.socket_path, groups=False) == ["EACCES"]


def test_allowed_uid_and_gid_are_let_in(workdir: Path, cgroup_root: Path, backend: FakeBackend) -> None:
    for d in (cgroup_root / "ci", cgroup_root / "ci" / "job-42"):  # delegated to 65534
        os.chown(d, 65534, 65534)
    for policy in (PeerPolicy(allowed_uids=frozenset({65534})), PeerPolicy(allowed_gids=frozenset({65534}))):
        with AgentAPI(
            backend,
            workdir / "a.sock",
            workdir / "bundles",
            cgroup_root=cgroup_root,
            socket_gid=65534,
            policy=policy,
            agent_pid=NOT_THE_AGENT,
        ):
            lines = _as_nobody(workdir / "a.sock")
        assert lines[0].endswith("201 Created"), lines
        backend.active.clear()
    assert len(backend.started) == 2


def test_root_can_be_refused_too() -> None:
    p = PeerPolicy(allow_root=False, own_uid=1234)
    assert not p.allows(0, [0])
    assert p.allows(1234, [])
    assert not p.allows(1000, [1000])
    assert PeerPolicy(allowed_gids=frozenset({10}), own_uid=1234).allows(1000, [1000, 10])


def test_only_root_may_name_an_absolute_bundle_path(tmp_path: Path) -> None:
    assert bundle_target(None, "s1", tmp_path, 1000) == tmp_path / "s1.tar.gz"
    assert bundle_target("x.tar.gz", "s1", tmp_path, 1000) == tmp_path / "x.tar.gz"
    assert bundle_target("/srv/x.tar.gz", "s1", tmp_path, 0) == Path("/srv/x.tar.gz")
    for bad, uid in (("/etc/passwd", 1000), ("../x.tar.gz", 1000), ("x.zip", 0), ("", 0), (3, 0)):
        with pytest.raises(UsageError):
            bundle_target(bad, "s1", tmp_path, uid)


def test_existing_bundle_is_not_overwritten(api: AgentAPI, backend: FakeBackend) -> None:
    client = AgentClient(api.socket_path)
    sid = client.start(cgroup="/ci")["session_id"]
    (api.bundle_dir / "taken.tar.gz").write_bytes(b"precious")
    with pytest.raises(UsageError, match="already exists"):
        client.finish(sid, "taken.tar.gz")
    assert (api.bundle_dir / "taken.tar.gz").read_bytes() == b"precious"
    assert client.finish(sid, "other.tar.gz")["name"] == "other.tar.gz"


def test_stale_socket_is_replaced_and_a_live_one_is_not(
    workdir: Path, cgroup_root: Path, backend: FakeBackend
) -> None:
    path = workdir / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()  # bound, never listened: a leftover from a crash
    with AgentAPI(backend, path, workdir / "b", cgroup_root=cgroup_root) as first:
        assert AgentClient(path).request("GET", "/healthz") == {"status": "ok"}
        with pytest.raises(SetupError, match="another agent is listening"):
            AgentAPI(backend, path, workdir / "b", cgroup_root=cgroup_root).start()
        assert first.socket_path.exists()
    assert not path.exists()  # removed on stop
    (workdir / "plain").write_text("x")
    with pytest.raises(SetupError, match="not a socket"):
        AgentAPI(backend, workdir / "plain", workdir / "b", cgroup_root=cgroup_root).start()


def test_resolve_cgroup_in_a_cgroup_namespace(cgroup_root: Path, tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "77").mkdir(parents=True)
    (proc / "77" / "cgroup").write_text("0::/../job-42\n")  # a sibling, seen from inside a namespace
    got = resolve_cgroup(None, 77, cgroup_root, proc_root=proc, ns_base="ci/agent")
    assert got == (cgroup_root / "ci" / "job-42").resolve()
    with pytest.raises(UsageError, match="outside the cgroup mount"):
        resolve_cgroup(None, 77, cgroup_root, proc_root=proc, ns_base="")


def test_metrics_registry_rules() -> None:
    reg = m.Registry()
    c = reg.counter("x_things", "Things.\nSecond line", ("k",))
    c.labels(k="a").inc()
    c.labels(k="a").inc(2.5)
    c.labels(k='we"ird\\').inc()
    g = reg.gauge("x_level", "Level.")
    g.set(float("inf"))
    assert reg.counter("x_things", "again", ("k",)) is c  # the same metric, shared
    for clash in (lambda: reg.gauge("x_things", "clash", ("k",)), lambda: reg.counter("x_things", "", ())):
        with pytest.raises(ValueError):
            clash()
    with pytest.raises(ValueError):
        reg.counter("evidence_events", "a name the backend's snapshot uses")
    with pytest.raises(ValueError):
        c.labels(k="a").inc(-1)
    with pytest.raises(ValueError):
        c.labels(wrong="a")
    assert reg.value("x_things_total", k="a") == 3.5 and reg.value("x_things_total", k="b") == 0
    text = reg.render().decode()
    assert "_created" not in text  # the exposition has the series it always had, no more
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(families) == {"x_things", "x_level"}  # no snapshot source: no snapshot families
    things = families["x_things"]
    assert (things.type, things.documentation) == ("counter", "Things.\nSecond line")
    assert {(s.name, s.labels["k"]): s.value for s in things.samples} == {
        ("x_things_total", "a"): 3.5,
        ("x_things_total", 'we"ird\\'): 1.0,
    }
    assert families["x_level"].type == "gauge" and families["x_level"].samples[0].value == float("inf")

    reg.read_snapshot_from(lambda: m.MetricsSnapshot(events_by_kind={"exec": 2}, runs_active=1))
    scraped = {
        s.name: s.value for f in text_string_to_metric_families(reg.render().decode()) for s in f.samples
    }
    assert scraped["evidence_events_total"] == 2 and scraped["evidence_runs_active"] == 1
    assert scraped["evidence_bundles_written_total"] == 0


def test_cli_help_for_both_commands(capsys: pytest.CaptureFixture[str]) -> None:
    for command, flags in (
        ("start", ("--cgroup", "--pid", "--label", "--agent")),
        ("finish", ("--bundle", "RUN")),
    ):
        with pytest.raises(SystemExit) as e:
            cli(command, "--help")
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert all(f in out for f in flags), out
    with pytest.raises(SystemExit) as e:
        cli("start", "--agent", "/x")  # neither --cgroup nor --pid: argparse's usage error, exit 2
    assert e.value.code == 2


# --- isolated runs (`evidence run --agent`) -----------------------------------------------------------


def test_isolate_a_process_of_ones_own_then_finish_with_its_exit_code(
    api: AgentAPI, backend: FakeBackend, cgroup_root: Path
) -> None:
    client = AgentClient(api.socket_path)
    child = subprocess.Popen(["sleep", "30"])
    try:
        got = client.isolate(child.pid, labels={"job": "7"}, command=["make", "test"], detail="full")
    finally:
        child.kill()
        child.wait()
    assert got["isolated"] is True and got["pid"] == child.pid
    assert backend.isolated == [(child.pid, {"job": "7"}, ["make", "test"], "full", cgroup_root)]
    assert backend.started == []  # not an ordinary start
    done = client.finish(got["session_id"], exit_code=3)
    assert backend.finished_with == [(3, None)]
    assert done["counts"] == {
        "dev.evidence.loss": 1,
        "dev.evidence.run.finished": 1,
        "dev.evidence.run.started": 1,
    }

    # an ordinary run has no exit code to report: the agent ran nothing
    sid = client.start(cgroup="/ci")["session_id"]
    with pytest.raises(UsageError, match="only for isolated runs"):
        client.finish(sid, exit_code=0)
    other = subprocess.Popen(["sleep", "30"])
    try:
        sid2 = client.isolate(other.pid)["session_id"]
    finally:
        other.kill()
        other.wait()
    for bad, why in (({"exit_code": 256}, "0 to 255"), ({"signal": "TERM; rm"}, "signal name")):
        with pytest.raises(UsageError, match=why):
            client.request("POST", f"/runs/{sid2}/finish", bad)
    assert client.finish(sid2, signal="SIGTERM")["run_id"]
    assert backend.finished_with[-1] == (None, "SIGTERM")


def test_isolate_request_checks(api: AgentAPI, backend: FakeBackend) -> None:
    client = AgentClient(api.socket_path)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"isolate_pid": os.getpid(), "cgroup": "/ci"}, "unknown field(s) cgroup"),
        ({"isolate_pid": True}, "positive integer"),
        ({"isolate_pid": -4}, "positive integer"),
        ({"isolate_pid": 999999999}, "no process 999999999"),
        ({"isolate_pid": os.getpid(), "command": "make test"}, "list of strings"),
        ({"isolate_pid": os.getpid(), "command": ["x" * 200_000]}, "over"),
        ({"isolate_pid": os.getpid(), "detail": "all"}, '"detail"'),
        ({"isolate_pid": os.getpid(), "labels": {"bad key": "1"}}, "label name"),
    ]
    for body, fragment in cases:
        with pytest.raises(UsageError) as e:
            client.request("POST", "/runs", body)
        assert fragment in e.value.message, (body, e.value.message)
    backend.not_ready = "loading"
    with pytest.raises(Exception, match="not ready: loading"):
        client.isolate(os.getppid())
    assert backend.isolated == []


def test_request_models_answer_as_the_api_always_did(api: AgentAPI) -> None:
    req = models.parse(
        models.IsolateRequest, {"isolate_pid": 5, "labels": {"b": "1", "a": "2"}, "command": ["x"]}
    )
    assert list(req.labels) == ["a", "b"] and req.command == ("x",) and req.detail == "summary"
    with pytest.raises(ValidationError):
        req.detail = "full"  # type: ignore[misc]  # frozen
    # several faults: the one the API always reported first is the one reported
    for model, body, message in (
        (models.StartRequest, {"extra": 1, "labels": 3}, "unknown field(s) extra"),
        (models.StartRequest, {"labels": 3, "pid": True}, '"labels" must be an object of string: string'),
        (models.StartRequest, {"pid": True, "cgroup": 5}, '"pid" must be a positive integer'),
        (models.StartRequest, {"pid": -1, "cgroup": 5}, 'give exactly one of "cgroup" and "pid"'),
        (models.StartRequest, {"pid": -1}, '"pid" must be a positive integer'),
        (models.StartRequest, {"cgroup": ""}, '"cgroup" must be a non-empty path'),
        (models.IsolateRequest, {"isolate_pid": 0, "detail": None}, '"detail" must be "summary" or "full"'),
        (models.IsolateRequest, {"isolate_pid": 0, "x": 1}, "unknown field(s) x (with isolate_pid)"),
        (models.FinishRequest, {"bundle": "", "exit_code": "x"}, '"bundle" must be a file name'),
    ):
        with pytest.raises(UsageError) as e:
            models.parse(model, body)
        assert e.value.message == message, body
    # the exit status is looked at only once the run is known, and known to be isolated
    client = AgentClient(api.socket_path)
    with pytest.raises(UsageError, match="no run s9999"):
        client.request("POST", "/runs/s9999/finish", {"exit_code": 300})
    sid = client.start(cgroup="/ci")["session_id"]
    with pytest.raises(UsageError, match="only for isolated runs"):
        client.request("POST", f"/runs/{sid}/finish", {"exit_code": "x"})


def _fake_proc(root: Path, pid: int, uids: str, nspid: str, children: str = "") -> None:
    d = root / str(pid)
    (d / "task" / str(pid)).mkdir(parents=True)
    (d / "status").write_text(f"Name:\tx\nUid:\t{uids}\nNSpid:\t{nspid}\n")
    (d / "task" / str(pid) / "children").write_text(children)


def test_claim_pid_ownership_and_pid_namespaces(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    _fake_proc(proc, 100, "1000 1000 1000 1000", "100", "101 ")
    _fake_proc(proc, 101, "1000 1000 1000 1000", "101")
    _fake_proc(proc, 102, "0 0 0 0", "102")
    _fake_proc(proc, 103, "1000 0 1000 1000", "103")  # setuid-root: effective uid 0
    peer = Peer(pid=100, uid=1000, gid=1000)
    assert claim_pid(101, peer, proc, agent_pid=1) == 101
    assert claim_pid(102, Peer(100, 0, 0), proc, agent_pid=1) == 102  # root may move anyone's
    for pid in (102, 103):
        with pytest.raises(Forbidden, match=f"process {pid} is not yours"):
            claim_pid(pid, peer, proc, agent_pid=1)
    with pytest.raises(Forbidden, match="PID 1, the agent or an ancestor"):
        claim_pid(102, Peer(100, 0, 0), proc, agent_pid=102)
    with pytest.raises(Forbidden, match="pid namespace"):
        claim_pid(101, Peer(0, 1000, 1000), proc, agent_pid=1)  # SO_PEERCRED: pid not visible

    # a peer in a child pid namespace names its child as it sees it (pid 5 there is 201 here)
    _fake_proc(proc, 200, "1000 1000 1000 1000", "200 1", "201 202")
    _fake_proc(proc, 201, "1000 1000 1000 1000", "201 5")
    _fake_proc(proc, 202, "1000 1000 1000 1000", "202 6")
    _fake_proc(proc, 5, "0 0 0 0", "5")  # the agent's own pid 5: someone else entirely
    nested = Peer(pid=200, uid=1000, gid=1000)
    assert claim_pid(5, nested, proc, agent_pid=1) == 201
    with pytest.raises(Forbidden, match="not a child of yours"):
        claim_pid(7, nested, proc, agent_pid=1)


def _run_agent(sock: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "evidence", "run", "--agent", str(sock), *argv],
        cwd=cwd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_run_via_agent_against_the_fake(api: AgentAPI, backend: FakeBackend, workdir: Path) -> None:
    """The client's whole path without a kernel: fork, isolate, release, wait, finish, download."""
    sock = api.socket_path
    done = _run_agent(sock, "--label", "job=7", "--", "/bin/sh", "-c", "echo hi; exit 3", cwd=workdir)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "hi\n"
    sid = "i0001"
    assert backend.isolated[0][1:3] == ({"job": "7"}, ["/bin/sh", "-c", "echo hi; exit 3"])
    assert backend.finished_with == [(3, None)]
    bundle = workdir / f"evidence-{sid}.tar.gz"  # the default name, in the current directory
    assert bundle.read_bytes() == (api.bundle_dir / f"{sid}.tar.gz").read_bytes()
    summary, warning = done.stderr.splitlines()  # the lines `evidence run` prints
    assert summary == f"evidence: 3 events (loss 1); 3 lost; run {_run_id(bundle)}; bundle {bundle}"
    assert warning.endswith("3 events were lost: the bundle says which kinds")

    killed = _run_agent(
        sock, "--bundle", str(workdir / "k.tar.gz"), "--", "/bin/sh", "-c", "kill -TERM $$", cwd=workdir
    )
    assert killed.returncode == 143 and backend.finished_with[-1] == (None, "SIGTERM"), killed.stderr


def _run_id(bundle: Path) -> str:
    with tarfile.open(bundle) as tar:
        return str(json.loads(tar.extractfile("manifest.json").read())["run_id"])  # type: ignore[union-attr]


def test_run_via_agent_starts_nothing_when_it_cannot_record(
    api: AgentAPI, backend: FakeBackend, workdir: Path
) -> None:
    marker = workdir / "ran"
    touch = ("--", "/usr/bin/touch", str(marker))
    backend.not_ready = "the probes are loading"
    for argv, code, fragment in (
        (touch, 70, "not ready: the probes are loading"),
        (("--bundle", str(workdir / "no" / "x.tar.gz"), *touch), 2, "does not exist"),
        (("--", "no-such-command-here"), 127, "cannot run 'no-such-command-here'"),
        (("--", str(workdir)), 126, "Permission denied"),
    ):
        done = _run_agent(api.socket_path, *argv, cwd=workdir)
        assert done.returncode == code, (argv, done.stderr)
        assert done.stderr.count("\n") == 1 and fragment in done.stderr, done.stderr
    missing = _run_agent(workdir / "none.sock", *touch, cwd=workdir)
    assert missing.returncode == 70 and "no agent socket" in missing.stderr
    assert not marker.exists() and backend.isolated == []
