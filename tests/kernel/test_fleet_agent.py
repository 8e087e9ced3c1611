"""A real `evidence agent` publishing to a real nats-server (issue 25): real BPF, real runs through
`evidence run --agent`, then `evidence fleet` reading what arrived.

- one server: the run's live events arrive exactly once (ids `<session>:<seq>` 0..n-1, as many as the
  agent recorded), its bundle and index entry are in the buckets, `fleet get` returns the very bytes
  the client got, and lint verifies them;
- the server stopped before a run and started after it: the backlog shows in the metrics, then
  nothing is lost and nothing duplicated;
- the agent killed with SIGKILL while the server is away: a new agent sends the outbox.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from evidence.bundle.reader import read_manifest
from tests.fleet.servers import Server
from tests.fleet.wait import until
from tests.kernel.test_daemon import Agent
from tests.kernel.util import PY, evidence
from tests.unit.test_fleet_publish import stream_events

pytestmark = pytest.mark.kernel

JOB = "for i in range(25):\n    try: open(f'/tmp/evidence-fleet-missing-{i}')\n    except OSError: pass\n"


def agent_env(server: Server, node: str = "k1") -> dict[str, str]:
    sink = {"nats": {"servers": [server.url], "node": node, "batch_interval": 0.05, "ack_timeout": 3}}
    return {"EVIDENCE_SINK": json.dumps(sink), "EVIDENCE_RETRY_INITIAL": "0.2", "EVIDENCE_RETRY_MAX": "1"}


def record(agent: Agent, bundle: Path, *labels: str) -> dict[str, Any]:
    args = ["run", "--agent", str(agent.socket), "--bundle", str(bundle)]
    for label in labels:
        args += ["--label", label]
    proc = evidence(*args, "--", PY, "-c", JOB)
    assert proc.returncode == 0, proc.stderr + agent.output()
    return read_manifest(bundle)


def wait_metric(agent: Agent, name: str, want: float, timeout: float = 60.0) -> dict[str, float]:
    def reached() -> dict[str, float] | None:
        got = agent.metrics()
        return got if got.get(name, 0.0) >= want else None

    return until(reached, timeout, lambda: f"{name} >= {want}: {agent.metrics()}\n{agent.output()}", pace=0.2)


def recorded_events(metrics: dict[str, float]) -> int:
    return int(sum(v for k, v in metrics.items() if k.startswith("evidence_events_total{")))


def check_arrived(server: Server, manifest: dict[str, Any], bundle: Path, tmp: Path, n_events: int) -> None:
    sid = manifest["session_id"]
    events = [e for e in stream_events(server.url) if e["sessionid"] == sid]
    ids = [e["id"] for e in events]
    assert len(ids) == len(set(ids)) == n_events, (len(ids), len(set(ids)), n_events)
    assert sorted(e["seq"] for e in events) == list(range(n_events))
    assert any(e["type"] == "dev.evidence.process.exec" for e in events)
    got = tmp / "got.tar.gz"
    proc = evidence("fleet", "--server", server.url, "get", sid, "-o", str(got))
    assert proc.returncode == 0, proc.stderr
    assert got.read_bytes() == bundle.read_bytes()
    row = index_row(server, sid, got)
    assert row["node"] == row["written_by"] == "k1" and row["run_id"] == manifest["run_id"]
    assert row["exit_code"] == 0 and row["events"] == manifest["events"]


def index_row(server: Server, sid: str, bundle: Path) -> dict[str, Any]:
    """The run's index entry (`fleet ls`), its lint counts checked against `evidence lint`'s own of
    the bundle: the agent's lint (in its one thread) finds what the command finds."""
    lint = evidence("lint", str(bundle), "--fail-on", "none", "--format", "json")
    assert lint.returncode == 0, lint.stdout + lint.stderr
    findings = json.loads(lint.stdout)["findings"]
    ls = evidence("fleet", "--server", server.url, "ls", "--format", "json")
    assert ls.returncode == 0, ls.stderr
    (row,) = [r for r in json.loads(ls.stdout) if r["session_id"] == sid]
    assert row["lint"] == {s: sum(f["severity"] == s for f in findings) for s in ("error", "warning", "note")}
    return dict(row)


def test_run_arrives_exactly_once(tmp_path: Path) -> None:
    server = Server(tmp_path)
    agent = Agent(tmp_path, env=agent_env(server))
    try:
        bundle = tmp_path / "run.tar.gz"
        manifest = record(agent, bundle, "job=fleet")
        metrics = wait_metric(agent, "evidence_fleet_bundles_stored_total", 1)
        n = recorded_events(metrics)
        metrics = wait_metric(agent, "evidence_fleet_events_published_total", n)
        assert metrics['evidence_fleet_backlog_items{kind="bundle"}'] == 0
        check_arrived(server, manifest, bundle, tmp_path, n)
    finally:
        assert agent.stop() == 0, agent.output()
        server.kill()


def test_server_down_during_run_nothing_lost(tmp_path: Path) -> None:
    server = Server(tmp_path)
    server.stop()
    agent = Agent(tmp_path, env=agent_env(server))
    try:
        bundle = tmp_path / "run.tar.gz"
        manifest = record(agent, bundle, "job=fleet")
        metrics = wait_metric(agent, 'evidence_fleet_backlog_items{kind="bundle"}', 1)
        n = recorded_events(metrics)
        wait_metric(agent, 'evidence_fleet_backlog_items{kind="event"}', n)
        assert agent.proc.poll() is None
        assert "fleet" in agent.output()  # the refused connections are said, once
        server.start()
        wait_metric(agent, "evidence_fleet_bundles_stored_total", 1)
        metrics = wait_metric(agent, "evidence_fleet_events_published_total", n)
        assert recorded_events(metrics) == n
        check_arrived(server, manifest, bundle, tmp_path, n)
    finally:
        assert agent.stop() == 0, agent.output()
        server.kill()


def test_outbox_survives_kill_9(tmp_path: Path) -> None:
    server = Server(tmp_path)
    server.stop()
    agent = Agent(tmp_path, env=agent_env(server))
    bundle = tmp_path / "run.tar.gz"
    try:
        manifest = record(agent, bundle, "job=fleet")
        metrics = wait_metric(agent, 'evidence_fleet_backlog_items{kind="bundle"}', 1)
        n = recorded_events(metrics)
        wait_metric(agent, 'evidence_fleet_backlog_items{kind="event"}', n)
    finally:
        agent.stop(signal.SIGKILL)  # the test's kill -9; after a failure, no agent is left running
    outbox = tmp_path / "fleet-outbox"
    assert list((outbox / "bundles").glob("*.json")) and list((outbox / "events").glob("seg-*"))
    server.start()
    again = Agent(tmp_path, env=agent_env(server))
    try:
        wait_metric(again, "evidence_fleet_bundles_stored_total", 1)
        wait_metric(again, "evidence_fleet_events_published_total", n)
        check_arrived(server, manifest, bundle, tmp_path, n)
        assert not list((outbox / "bundles").iterdir()) and not list((outbox / "events").iterdir())
    finally:
        assert again.stop() == 0, again.output()
        server.kill()


HOSTILE = (
    "import os\n"
    "d = os.environ['D']\n"
    "names = ['x\\r\\nNats-Msg-Id: forged', 'y\\nce-id: forged', 'z\\r\\n\\r\\nbody', 'p%0D%0Aq', 'q\"r',\n"
    "         'token=s3cr3tvalue']\n"
    "for n in names:\n"
    "    try: open(os.path.join(d, n), 'w').close()\n"
    "    except OSError: pass\n"
)


def test_unprivileged_job_cannot_forge_headers(tmp_path: Path, place: Path) -> None:
    """A job run as nobody names its files with CR/LF and header lines: in the stream each is one
    event under its own id (`Nats-Msg-Id` = the event's id: a forged one would make JetStream drop
    other events as duplicates), its subject header percent-encoded and decoded back exactly; the
    index's lint counts are `evidence lint`'s of the bundle (a secret in a file's name among them)."""
    import shutil
    import subprocess
    import tempfile

    from tests.kernel.util import as_user

    server = Server(tmp_path)
    home = Path(tempfile.mkdtemp(prefix="evidence-fleet-"))  # nobody must reach the socket
    home.chmod(0o755)
    env = {**agent_env(server), "EVIDENCE_ALLOWED_UIDS": "65534", "EVIDENCE_SOCKET_GID": "65534"}
    agent = Agent(home, env=env)
    try:
        bundle = place / "run.tar.gz"
        proc = subprocess.run(
            as_user(65534, sys.executable, "-m", "evidence", "run", "--agent", str(agent.socket), "--bundle",
                    str(bundle), "--", PY, "-c", HOSTILE),
            env={**os.environ, "D": str(place)}, cwd=place, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr + agent.output()
        manifest = read_manifest(bundle)
        metrics = wait_metric(agent, "evidence_fleet_bundles_stored_total", 1)
        n = recorded_events(metrics)
        wait_metric(agent, "evidence_fleet_events_published_total", n)
        events = [e for e in stream_events(server.url) if e["sessionid"] == manifest["session_id"]]
        assert len(events) == n and len({e["id"] for e in events}) == n
        assert all(e["id"] == f"{e['sessionid']}:{e['seq']}" for e in events)
        subjects = {e.get("subject") for e in events}
        for name in ("x\r\nNats-Msg-Id: forged", "y\nce-id: forged", "z\r\n\r\nbody", "p%0D%0Aq", 'q"r'):
            assert str(place / name) in subjects, name
        row = index_row(server, manifest["session_id"], bundle)  # and the index's lint is lint's
        assert row["lint"]["error"] >= 1  # a secret in a path (EV003)
    finally:
        assert agent.stop() == 0, agent.output()
        server.kill()
        shutil.rmtree(home, ignore_errors=True)


PLAIN_TRICKS = (
    "import os\n"
    "d = os.environ['D']\n"
    "names = ['HPUB evidence.events.k1.x _INBOX.1.2 0 0', 'Nats-Msg-Id: forged', 'ce-id: forged', ' lead',\n"
    "         'trail ', '-ERR x', 'MSG _INBOX.k1.0.0 1 9', \"it's\", 'a' * 250]\n"
    "for n in names:\n"
    "    open(os.path.join(d, n), 'w').close()\n"
)
TRICK_NAMES = (
    "HPUB evidence.events.k1.x _INBOX.1.2 0 0", "Nats-Msg-Id: forged", "ce-id: forged", " lead", "trail ",
    "-ERR x", "MSG _INBOX.k1.0.0 1 9", "it's", "a" * 250,
)  # fmt: skip


@pytest.mark.parametrize("pure", [False, True], ids=["compiled", "python"])
def test_unprivileged_plain_names_framed_in_c_as_in_python(tmp_path: Path, place: Path, pure: bool) -> None:
    """A job run as nobody names its files with printable text that looks like the protocol (an
    `HPUB` line, header lines without a line break, an `-ERR`, long names): such values are framed
    by the compiled path (src/fast/_wire.c: every header value of the run is plain, so it takes every
    batch), and each event arrives once under its own id with its subject exactly the file's name;
    the same with the compiled parts off (EVIDENCE_PURE_PYTHON=1)."""
    import shutil
    import subprocess
    import tempfile

    from tests.kernel.util import as_user

    server = Server(tmp_path)
    home = Path(tempfile.mkdtemp(prefix="evidence-fleet-"))  # nobody must reach the socket
    home.chmod(0o755)
    env = {**agent_env(server), "EVIDENCE_ALLOWED_UIDS": "65534", "EVIDENCE_SOCKET_GID": "65534"}
    if pure:
        env["EVIDENCE_PURE_PYTHON"] = "1"
    agent = Agent(home, env=env)
    try:
        bundle = place / "run.tar.gz"
        proc = subprocess.run(
            as_user(65534, sys.executable, "-m", "evidence", "run", "--agent", str(agent.socket), "--bundle",
                    str(bundle), "--", PY, "-c", PLAIN_TRICKS),
            env={**os.environ, "D": str(place)}, cwd=place, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr + agent.output()
        manifest = read_manifest(bundle)
        metrics = wait_metric(agent, "evidence_fleet_events_published_total", 1)
        n = recorded_events(metrics)
        wait_metric(agent, "evidence_fleet_events_published_total", n)
        events = [e for e in stream_events(server.url) if e["sessionid"] == manifest["session_id"]]
        assert len(events) == n and len({e["id"] for e in events}) == n
        assert sorted(e["seq"] for e in events) == list(range(n))
        subjects = {e.get("subject") for e in events}
        for name in TRICK_NAMES:
            assert str(place / name) in subjects, name
        assert not any("forged" in str(e["id"]) for e in events)
        # every header value plain (printable ASCII, no % or "): what the compiled path frames
        values = [v for e in events for k, v in e.items() if k != "data" and v is not None]
        assert all(
            type(v) is int or (v.isascii() and v.isprintable() and not set(v) & set('%"')) for v in values
        )
    finally:
        assert agent.stop() == 0, agent.output()
        server.kill()
        shutil.rmtree(home, ignore_errors=True)


JSON_TRICKS = (
    "import os\n"
    "d = os.environ['D']\n"
    'names = [\'a","time":"2020-01-01T00:00:00.000000000Z","type":"dev.evidence.run.finished"}\',\n'
    "         'b\\\\u0041\\\\\"', 'c\\u2028d', 'e\\x7ff', '\\u00e9t\\u00e9', 'g\\x01h', 'i\\\\/j', '{\"data\":{}}',\n"
    "         'AKIA' + 'Z' * 16, 'k' * 240]\n"
    "for n in names:\n"
    "    try: open(os.path.join(d, n), 'w').close()\n"
    "    except OSError: pass\n"
    "for n in names[:3]:\n"
    "    try: open(os.path.join(d, n), 'r').close()\n"
    "    except OSError: pass\n"
)


def test_unprivileged_names_lint_the_same_in_c_and_python(tmp_path: Path, place: Path) -> None:
    """A job run as nobody names its files like pieces of an event line (a quote and an envelope's
    tail, escapes, U+2028, DEL, a control byte, non-ASCII, a line's head, a key that looks like a
    secret, a long name): the agent's lint for the index entry, in C (src/fast/_verify.c), counts
    what `evidence lint` finds with the compiled parts off, and lint's findings are the same both ways."""
    import shutil
    import subprocess
    import tempfile

    from tests.kernel.util import as_user

    server = Server(tmp_path)
    home = Path(tempfile.mkdtemp(prefix="evidence-fleet-"))  # nobody must reach the socket
    home.chmod(0o755)
    env = {**agent_env(server), "EVIDENCE_ALLOWED_UIDS": "65534", "EVIDENCE_SOCKET_GID": "65534"}
    agent = Agent(home, env=env)
    try:
        bundle = place / "run.tar.gz"
        proc = subprocess.run(
            as_user(65534, sys.executable, "-m", "evidence", "run", "--agent", str(agent.socket), "--bundle",
                    str(bundle), "--", PY, "-c", JSON_TRICKS),
            env={**os.environ, "D": str(place)}, cwd=place, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr + agent.output()
        manifest = read_manifest(bundle)
        wait_metric(agent, "evidence_fleet_bundles_stored_total", 1)
        args = ("lint", str(bundle), "--fail-on", "none", "--format", "json")
        compiled = evidence(*args)
        python = evidence(*args, env={**os.environ, "EVIDENCE_PURE_PYTHON": "1"})
        assert compiled.returncode == python.returncode == 0, compiled.stderr + python.stderr
        assert json.loads(compiled.stdout) == json.loads(python.stdout)
        findings = json.loads(python.stdout)["findings"]
        assert any(f["rule"] == "EV003" for f in findings)  # the key in a file's name
        ls = evidence("fleet", "--server", server.url, "ls", "--format", "json")
        (row,) = [r for r in json.loads(ls.stdout) if r["session_id"] == manifest["session_id"]]
        assert row["lint"] == {
            s: sum(f["severity"] == s for f in findings) for s in ("error", "warning", "note")
        }
        subjects = {
            e["subject"] for e in stream_events(server.url) if e["sessionid"] == manifest["session_id"]
        }
        assert (
            str(place / 'a","time":"2020-01-01T00:00:00.000000000Z","type":"dev.evidence.run.finished"}')
            in subjects
        )
    finally:
        assert agent.stop() == 0, agent.output()
        server.kill()
        shutil.rmtree(home, ignore_errors=True)
