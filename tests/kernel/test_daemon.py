"""`evidence agent` end to end: the real daemon as a subprocess, real BPF, real cgroups, the real CLI.

Each test starts an agent on a socket in tmp, makes cgroups of its own under the cgroup2 mount, puts
processes in them that already run before recording starts (attach late), and reads the bundles.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from evidence.agent.commands.client import AgentClient
from evidence.agent.recorder.cgroups import find_cgroup2_mount
from evidence.errors import Error
from tests.kernel.util import PY, evidence, in_cgroup, of_type, read_bundle

pytestmark = pytest.mark.kernel


class Agent:
    def __init__(self, tmp: Path, *extra: str, env: dict[str, str] | None = None, umask: int = -1) -> None:
        self.socket = tmp / "agent.sock"
        self.bundles = tmp / "bundles"
        self.log = tmp / f"agent-{uuid.uuid4().hex[:6]}.log"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "evidence", "agent", "--socket", str(self.socket),
                 "--bundle-dir", str(self.bundles), *extra],
                stdout=log, stderr=subprocess.STDOUT, env=full_env, umask=umask,
            )  # fmt: skip
        self.client = AgentClient(self.socket, timeout=60)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                if self.client.health().get("status") == "ready":
                    return
            except Error:
                pass
            time.sleep(0.1)
        raise AssertionError(f"agent not ready: {self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        conn, resp = self.client._open("GET", "/metrics", None)
        try:
            text = resp.read().decode()
        finally:
            conn.close()
        return parse_prometheus(text)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"agent did not stop: {self.output()}") from None


def parse_prometheus(text: str) -> dict[str, float]:
    """{'name{label="value",...}': value}, labels sorted by name; the whole text must parse."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


@pytest.fixture
def cgroups() -> Iterator[Path]:
    """A parent cgroup of our own under the cgroup2 mount; everything in it is killed and removed."""
    parent = find_cgroup2_mount() / f"evidence-test-daemon-{uuid.uuid4().hex[:8]}"
    parent.mkdir()
    yield parent
    for dirpath, _dirs, _files in sorted(os.walk(parent), key=lambda t: -t[0].count("/")):
        d = Path(dirpath)
        if (d / "cgroup.kill").exists():
            (d / "cgroup.kill").write_text("1")
        for _ in range(100):
            try:
                d.rmdir()
                break
            except OSError:
                time.sleep(0.05)


@pytest.fixture
def listener() -> Iterator[int]:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    yield srv.getsockname()[1]
    srv.close()


# A job that is already running when recording starts: it listens on a socket (for the inventory),
# then waits for `go`, opens its marker file, connects to the test's listener and runs cat.
JOB = textwrap.dedent(
    """
    import os, socket, subprocess, sys, time
    go, marker, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
    print("listening", flush=True)
    while not os.path.exists(go):
        time.sleep(0.02)
    open(marker).close()
    c = socket.create_connection(("127.0.0.1", port)); c.close()
    subprocess.run(["/bin/cat", marker], stdout=subprocess.DEVNULL)
    print("done", flush=True)
    sys.stdin.read()
    """
)


class Job:
    def __init__(self, cgroup: Path, tmp: Path, name: str, port: int) -> None:
        cgroup.mkdir()
        self.cgroup = cgroup
        self.go = tmp / f"{name}.go"
        self.marker = tmp / f"{name}-marker.txt"
        self.marker.write_text(name)
        self.proc = subprocess.Popen(
            in_cgroup(cgroup / "cgroup.procs", PY, "-c", JOB, str(self.go), str(self.marker), str(port)),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "listening"

    def run(self) -> None:
        self.go.touch()
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "done"

    def end(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


def start(agent: Agent, cgroup: Path, *labels: str) -> str:
    args = ["start", "--agent", str(agent.socket), "--cgroup", str(cgroup)]
    for label in labels:
        args += ["--label", label]
    proc = evidence(*args)
    assert proc.returncode == 0, proc.stderr
    sid = proc.stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{32}", sid), proc.stdout
    return sid


def finish(agent: Agent, sid: str, bundle: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    proc = evidence("finish", "--agent", str(agent.socket), sid, "--bundle", str(bundle))
    assert proc.returncode == 0, proc.stderr + agent.output()
    run_id, path = proc.stdout.strip().split("\t")
    assert path == str(bundle)
    manifest, events = read_bundle(bundle)
    assert manifest["run_id"] == run_id
    return manifest, events


def _paths(events: list[dict[str, Any]]) -> set[str]:
    return {e["data"]["path"] for e in of_type(events, "file.open")}


def test_attach_late_two_runs_metrics(tmp_path: Path, cgroups: Path, listener: int) -> None:
    agent = Agent(tmp_path)
    try:
        a = Job(cgroups / "job-a", tmp_path, "a", listener)
        b = Job(cgroups / "job-b", tmp_path, "b", listener)
        sid_a = start(agent, a.cgroup, "job=1", "team=x")
        sid_b = start(agent, b.cgroup, "job=2")
        runs = {r["session_id"]: r for r in agent.client.runs()}
        assert runs[sid_a]["labels"] == {"job": "1", "team": "x"} and runs[sid_a]["attached_late"] is True

        # the same cgroup, or one inside a recorded one, cannot be recorded twice
        again = evidence("start", "--agent", str(agent.socket), "--cgroup", str(a.cgroup))
        assert again.returncode == 2 and "already recorded" in again.stderr
        assert again.stderr.count("\n") == 1 and "Traceback" not in again.stderr

        a.run()
        b.run()
        kinds = ("inventory", "open", "exec", "connect")

        def counted() -> dict[str, float] | None:  # the consumer is asynchronous: wait for it
            got = agent.metrics()
            return (
                got if all(got.get(f'evidence_events_total{{kind="{k}"}}', 0) >= 2 for k in kinds) else None
            )

        metrics = _wait_for(counted, agent)
        assert metrics["evidence_runs_active"] == 2
        assert metrics["evidence_consumer_lag_seconds"] >= 0

        manifest, events = finish(agent, sid_a, tmp_path / "a.tar.gz")
        _, events_b = finish(agent, sid_b, tmp_path / "b.tar.gz")
        a.end()
        b.end()

        assert manifest["attached_late"] is True and manifest["cut_short"] is False
        assert manifest["labels"] == {"job": "1", "team": "x"}
        started = of_type(events, "run.started")[0]["data"]
        assert started["labels"] == {"job": "1", "team": "x"} and started["cgroup"] == str(a.cgroup)

        # the process that was there before: listed first (after the run's own degradations: an
        # adopted cgroup's 32-bit system calls are not refused), with its listening socket
        inv = of_type(events, "inventory")
        first = inv[0]["seq"]
        assert [e["seq"] for e in inv] == list(range(first, first + len(inv)))
        assert {e["type"] for e in events if e["seq"] < first} <= {
            "dev.evidence.run.started",
            "dev.evidence.degradation",
        }
        job = next(e["data"] for e in inv if e["data"]["pid"] == a.proc.pid)
        assert (
            job["argv"][:2] == [PY, "-c"]
            and job["exe"]
            and os.path.realpath(job["exe"]) == os.path.realpath(PY)
        )
        assert any(s.startswith("tcp listen 127.0.0.1:") for s in job["sockets"]), job

        # what it did afterwards, with the inventoried process as parent
        assert str(a.marker) in _paths(events)
        connects = [e["data"] for e in of_type(events, "network.connect")]
        assert any(
            c["address"] == "127.0.0.1" and c["port"] == listener and c["result"] == 0 for c in connects
        )
        cat = next(e["data"] for e in of_type(events, "process.exec") if e["data"]["filename"] == "/bin/cat")
        assert cat["argv"] == ["/bin/cat", str(a.marker)] and cat["ppid"] == a.proc.pid and cat["depth"] == 1

        # each run saw only its own cgroup
        assert str(b.marker) not in _paths(events)
        assert str(b.marker) in _paths(events_b) and str(a.marker) not in _paths(events_b)
        pids_b = {e["data"]["pid"] for e in events_b if "pid" in e["data"]}
        assert a.proc.pid not in pids_b and b.proc.pid in pids_b

        metrics = agent.metrics()
        assert metrics["evidence_runs_active"] == 0
        assert metrics["evidence_runs_finished_total"] == 2 and metrics["evidence_bundles_written_total"] == 2
        assert metrics["evidence_bundle_bytes_total"] == sum(
            (agent.bundles / f"{s}.tar.gz").stat().st_size for s in (sid_a, sid_b)
        )
        assert metrics['evidence_api_requests_total{code="201",route="/runs"}'] == 2
        lint = evidence("lint", str(tmp_path / "a.tar.gz"))
        assert "verified" in lint.stdout, lint.stdout + lint.stderr
    finally:
        assert agent.stop() == 0, agent.output()


def test_sigterm_writes_open_runs_cut_short(tmp_path: Path, cgroups: Path, listener: int) -> None:
    agent = Agent(tmp_path)
    job = Job(cgroups / "job", tmp_path, "t", listener)
    try:
        sid = start(agent, job.cgroup, "job=term")
        job.run()
    finally:
        rc = agent.stop(signal.SIGTERM)
        job.end()
    assert rc == 0, agent.output()
    manifest, events = read_bundle(agent.bundles / f"{sid}.tar.gz")
    assert manifest["cut_short"] is True and manifest["labels"] == {"job": "term"}
    assert of_type(events, "run.finished")[0]["data"]["cut_short"] is True
    assert str(job.marker) in _paths(events)
    assert not agent.socket.exists()
    assert list((tmp_path / "spool").iterdir()) == []  # nothing left to recover
    assert not list(agent.bundles.glob(".evidence-*"))


def test_killed_agent_spool_recovered_on_restart(tmp_path: Path, cgroups: Path, listener: int) -> None:
    agent = Agent(tmp_path)
    job = Job(cgroups / "job", tmp_path, "k", listener)
    try:
        sid = start(agent, job.cgroup, "job=killed")
        job.run()
        time.sleep(3.5)  # the agent flushes spools every 2 s
        agent.stop(signal.SIGKILL)
    finally:
        job.end()
    spool = tmp_path / "spool"
    assert (spool / f"{sid}.spool.zst").exists() and (spool / f"{sid}.run.json").exists()

    again = Agent(tmp_path)  # recovers before it listens: the bundle is there once it is ready
    try:
        bundle = again.bundles / f"{sid}.tar.gz"
        manifest, events = read_bundle(bundle)
        assert manifest["cut_short"] is True and manifest["session_id"] == sid
        assert manifest["labels"] == {"job": "killed"} and manifest["attached_late"] is True
        # the run's own degradations (an adopted cgroup's 32-bit calls are not refused, its IPC and
        # /dev/shm not made private), then recovery's
        assert [e["data"]["component"] for e in of_type(events, "degradation")] == [
            "isolation",
            "isolation",
            "agent",
        ]
        assert str(job.marker) in _paths(events)
        assert any(e["data"]["pid"] == job.proc.pid for e in of_type(events, "inventory"))
        assert sorted(p.name for p in spool.iterdir()) == []
        assert "recovered run" in again.output()
    finally:
        assert again.stop() == 0


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("window_seconds: -1\nnot_a_setting: 1\n")
    proc = evidence("agent", "--socket", str(tmp_path / "s"), "--config", str(cfg))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "not_a_setting" in proc.stderr
    # no agent at the socket: nothing was run (70, as the README says), not bad input (2)
    missing = evidence("start", "--agent", str(tmp_path / "none.sock"), "--cgroup", "/x")
    assert (
        missing.returncode == 70 and "no agent socket" in missing.stderr and "Traceback" not in missing.stderr
    )


class _Receiver:
    """A loopback HTTP endpoint that records every request (bundle uploads, live event batches)."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def _take(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.requests.append((self.command, self.path, dict(self.headers), body))
                self.send_response(201)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_PUT = do_POST = _take

            def log_message(self, *a: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_bundles_uploaded_and_events_streamed(tmp_path: Path, cgroups: Path, listener: int) -> None:
    import hashlib
    import json

    rx = _Receiver()
    env = {
        "EVIDENCE_UPLOAD_URL": f"{rx.url}/bundles",
        "EVIDENCE_STREAM_URL": f"{rx.url}/events",
        "EVIDENCE_BATCH_INTERVAL": "0.2",
        "EVIDENCE_DELIVERY_TOKEN": "t0ken",
    }
    agent = Agent(tmp_path, env=env)
    job = Job(cgroups / "job", tmp_path, "u", listener)
    try:
        sid = start(agent, job.cgroup, "job=up")
        job.run()
        finish(agent, sid, tmp_path / "u.tar.gz")
        name = f"{sid}.tar.gz"
        put = _wait_for(lambda: [r for r in rx.requests if r[0] == "PUT"], agent)
        marker = agent.bundles / f"{name}.delivered"
        _wait_for(marker.exists, agent)
    finally:
        job.end()
        assert agent.stop() == 0, agent.output()
        rx.close()
    method, path, headers, body = put[0]
    assert path == f"/bundles/{name}" and headers["Authorization"] == "Bearer t0ken"
    assert body == (agent.bundles / name).read_bytes()
    assert headers["X-Evidence-Sha256"] == hashlib.sha256(body).hexdigest()
    live = [e for m, p, _h, b in rx.requests if m == "POST" and p == "/events" for e in json.loads(b)]
    assert live and {e["sessionid"] for e in live} == {sid}
    assert any(e["type"] == "dev.evidence.file.open" and e["subject"] == str(job.marker) for e in live)
    assert any(e["type"] == "dev.evidence.inventory" and e["data"]["pid"] == job.proc.pid for e in live)
    assert len({e["id"] for e in live}) == len(live)


def _wait_for(check, agent: Agent, timeout: float = 30.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out\n{agent.output()}")
