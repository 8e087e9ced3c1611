"""TLS and credentials files against real nats-servers (issue 25): certificates and JWTs made here
(tests/fleet/auth.py). The agent's `tls_ca` verifies the server on both of its connections (events;
bundles and the index) and the CLI's; a server whose certificate another CA signed is refused with
one clear line in the log and the metrics, the publisher alive and its outbox kept. A `.creds` file
(a user JWT and its seed, the server in operator mode) authenticates both connections and the CLI;
one whose JWT no trusted account issued is refused the same way."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from evidence.cli import main
from tests.fleet.auth import Operator, make_ca, server_cert, tls_config
from tests.fleet.servers import Server
from tests.fleet.wait import until
from tests.unit import conftest_bundles as cb
from tests.unit.test_fleet_publish import event, publisher


@pytest.fixture
def said() -> Iterator[list[str]]:
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    for name in ("evidence.agent.daemon.fleet", "evidence.agent.daemon.fleet_wire"):
        logging.getLogger(name).addHandler(handler)
    yield lines
    for name in ("evidence.agent.daemon.fleet", "evidence.agent.daemon.fleet_wire"):
        logging.getLogger(name).removeHandler(handler)


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[Server, Path]]:
    ca, ca_key, ca_cert = make_ca(tmp_path, "fleet-ca")
    cert, key = server_cert(tmp_path, ca_key, ca_cert)
    server = Server(tmp_path, config=tls_config(cert, key))
    yield server, ca
    server.kill()


def test_tls_with_the_ca_events_bundles_and_the_cli(
    tmp_path: Path, tls_server: tuple[Server, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    server, ca = tls_server
    pub, reg = publisher(tmp_path, server.url, tls_ca=ca)
    pub.start()
    try:
        for i in range(300):
            pub.submit(event("t1", i))
        pub.bundle_written(cb.write(tmp_path / "t2.tar.gz", session_id="t2", labels={"job": "tls"}))
        until(lambda: reg.value("evidence_fleet_events_published_total") >= 300, what="events")
        until(lambda: reg.value("evidence_fleet_bundles_stored_total") == 1, what="bundle")
    finally:
        pub.close()
    assert reg.value("evidence_fleet_errors_total", what="connect") == 0
    args = ["fleet", "--server", server.url, "--tls-ca", str(ca)]
    assert main([*args, "ls", "--format", "json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["session_id"] == "t2" and row["labels"] == {"job": "tls"}
    assert main([*args, "follow", "--since", "1h", "--count", "300", "--format", "json"]) == 0
    ids = [json.loads(x)["id"] for x in capsys.readouterr().out.splitlines()]
    assert sorted(ids) == sorted(f"t1:{i}" for i in range(300))
    # the CLI without the CA does not trust the server: one line, exit 70
    assert main(["fleet", "--server", server.url, "ls"]) == 70
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 2 and "certificate verify failed" in err[0].lower(), err


def test_tls_with_another_ca_is_refused_not_a_crash(
    tmp_path: Path, tls_server: tuple[Server, Path], said: list[str]
) -> None:
    """Refused, said in one line naming the CA file, counted; then the server comes back with a
    certificate the agent's CA signed, and what waited in the outbox arrives."""
    server, _ca = tls_server
    other, other_key, other_cert = make_ca(tmp_path, "other-ca")
    pub, reg = publisher(tmp_path, server.url, tls_ca=other)
    pub.start()
    try:
        for i in range(20):
            pub.submit(event("t3", i))
        pub.bundle_written(cb.write(tmp_path / "t4.tar.gz", session_id="t4"))
        until(lambda: reg.value("evidence_fleet_errors_total", what="connect") >= 1, what="the refusal")
        until(lambda: pub.outbox.backlog().events == 20, what="events kept in the outbox")
        assert pub._thread is not None and pub._thread.is_alive()
        assert reg.value("evidence_fleet_connected") == 0
        assert reg.value("evidence_fleet_events_published_total") == 0
        refusals = [line for line in said if "certificate" in line.lower()]
        assert refusals and all("\n" not in line for line in refusals), said
        assert any("does not verify against the CA" in x and str(other) in x for x in refusals), refusals
        # the server's certificate replaced by one the agent's CA signed: sent, with no restart
        (tmp_path / "new").mkdir()
        cert, key = server_cert(tmp_path / "new", other_key, other_cert)
        server.kill()
        server.config.write_text(server.config.read_text().split("tls {")[0] + tls_config(cert, key))
        server.proc = None
        server.start()
        until(lambda: reg.value("evidence_fleet_events_published_total") >= 20, timeout=60, what="events")
        until(lambda: reg.value("evidence_fleet_bundles_stored_total") == 1, timeout=60, what="bundle")
    finally:
        pub.close()


def test_a_creds_file_authenticates_both_connections(
    tmp_path: Path, said: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    op = Operator()
    server = Server(tmp_path, config=op.config())
    try:
        creds = op.creds(tmp_path / "node-a.creds", "node-a")
        pub, reg = publisher(tmp_path, server.url, creds=creds)
        pub.start()
        try:
            for i in range(100):
                pub.submit(event("c1", i))
            pub.bundle_written(cb.write(tmp_path / "c2.tar.gz", session_id="c2"))
            until(lambda: reg.value("evidence_fleet_events_published_total") >= 100, what="events")
            until(lambda: reg.value("evidence_fleet_bundles_stored_total") == 1, what="bundle")
        finally:
            pub.close()
        assert reg.value("evidence_fleet_errors_total", what="connect") == 0
        # the CLI with a reader's .creds
        reader = op.creds(tmp_path / "reader.creds", "reader")
        assert main(["fleet", "--server", server.url, "--creds", str(reader), "ls", "--format", "json"]) == 0
        (row,) = json.loads(capsys.readouterr().out)
        assert row["session_id"] == "c2" and row["node"] == "node-a"
        # a user JWT that no account the server trusts issued: refused, said, counted
        stranger = Operator()
        forged = op.creds(tmp_path / "forged.creds", "node-b", signer=stranger.account)
        liar, reg_l = publisher(tmp_path, server.url, "node-b", creds=forged, outbox_dir=tmp_path / "liar")
        liar.start()
        try:
            liar.submit(event("c3", 0))
            until(lambda: reg_l.value("evidence_fleet_errors_total", what="connect") >= 1, what="the refusal")
            assert liar._thread is not None and liar._thread.is_alive()
            assert reg_l.value("evidence_fleet_events_published_total") == 0
        finally:
            liar.close()
        assert any("authorization violation" in line.lower() for line in said), said
    finally:
        server.kill()
