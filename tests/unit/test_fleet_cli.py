"""`evidence fleet` in-process against a real nats-server: ls, get (byte-identical, verified, lint
passes), follow, baseline build and diff on fetched bundles, and its one-line errors."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from evidence.bundle.fleet import client, names
from evidence.bundle.signing import generate
from evidence.cli import main
from tests.fleet.servers import Server, free_port
from tests.fleet.wait import until
from tests.unit import conftest_bundles as cb
from tests.unit.test_fleet_publish import event, publisher


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, dict[str, Path]]]:
    """A server holding four runs of two nodes (two of job=build on node-a, one failed)."""
    tmp = tmp_path_factory.mktemp("fleet")
    server = Server(tmp)
    bundles = {
        "node-a.a1": cb.write(tmp / "a1.tar.gz", session_id="a1", labels={"job": "build"}),
        "node-a.a2": cb.write(
            tmp / "a2.tar.gz",
            [*cb.records(), cb.connect(7500, "10.9.9.9", 443)],
            session_id="a2",
            labels={"job": "build"},
            exit_code=3,
        ),
        "node-b.b1": cb.write(tmp / "b1.tar.gz", session_id="b1", labels={"job": "test"}),
    }
    pubs = []
    for node in ("node-a", "node-b"):
        pub, reg = publisher(tmp, server.url, node)
        pub.start()
        for key, path in bundles.items():
            if key.startswith(node + "."):
                pub.bundle_written(path)
        if node == "node-b":
            for i in range(5):
                pub.submit(event("b1", i))
        pubs.append((pub, reg))
    try:
        for pub, reg in pubs:
            want = sum(k.startswith(pub.node + ".") for k in bundles)
            until(lambda reg=reg, want=want: reg.value("evidence_fleet_bundles_stored_total") == want)
        until(lambda: pubs[1][1].value("evidence_fleet_events_published_total") == 5)
    finally:
        for pub, _ in pubs:
            pub.close()
    yield server, bundles
    server.kill()


def fleet_cli(server: Server, *args: str) -> list[str]:
    return ["fleet", "--server", server.url, *args]


def test_ls_filters(fleet: tuple[Server, dict[str, Path]], capsys: pytest.CaptureFixture[str]) -> None:
    server, bundles = fleet
    assert main(fleet_cli(server, "ls", "--format", "json")) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(r["node"] + "." + r["session_id"] for r in rows) == sorted(bundles)
    assert all(r["written_by"] == r["node"] for r in rows)
    assert main(fleet_cli(server, "ls", "--format", "json", "--node", "node-a", "--failed")) == 0
    assert [r["session_id"] for r in json.loads(capsys.readouterr().out)] == ["a2"]
    assert main(fleet_cli(server, "ls", "--label", "job=test")) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("FINISHED") and len(out) == 2 and "node-b" in out[1] and "b1" in out[1]
    # the test bundles finished in 2023: none in the last day
    assert main(fleet_cli(server, "ls", "--since", "24h", "--format", "json")) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_get_byte_identical_and_lint_verifies(
    fleet: tuple[Server, dict[str, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server, bundles = fleet
    out = tmp_path / "got.tar.gz"
    assert main(fleet_cli(server, "get", "a1", "-o", str(out))) == 0
    assert out.read_bytes() == bundles["node-a.a1"].read_bytes()
    assert (out.stat().st_mode & 0o777) == 0o600
    assert "verified" in capsys.readouterr().err
    assert main(["lint", str(out), "--fail-on", "none"]) == 0
    # by key and by run id (the same behaviour: a1 and b1 share theirs)
    assert main(fleet_cli(server, "get", "node-b.b1", "-o", str(tmp_path / "b.tar.gz"))) == 0
    manifest = cb.members(bundles["node-a.a1"])[0]
    assert main(fleet_cli(server, "get", manifest["run_id"], "-o", str(tmp_path / "c.tar.gz"))) == 2
    err = capsys.readouterr().err
    assert "names 2 runs" in err and "node-a.a1" in err and "node-b.b1" in err


def test_get_with_key_refuses_unsigned(
    fleet: tuple[Server, dict[str, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server, _ = fleet
    _priv, pub, _keyid = generate(tmp_path / "k")
    out = tmp_path / "x.tar.gz"
    assert main(fleet_cli(server, "get", "a1", "-o", str(out), "--key", str(pub))) == 2
    assert not out.exists()
    assert "not signed" in capsys.readouterr().err


def test_baseline_build_and_diff(
    fleet: tuple[Server, dict[str, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server, _ = fleet
    assert main(fleet_cli(server, "baseline", "build", "--label", "job=build", "--last", "1")) == 0
    assert json.loads(capsys.readouterr().out)["runs"] == 1
    assert main(fleet_cli(server, "baseline", "build", "--label", "job=test")) == 0
    bl = tmp_path / "b.json"
    bl.write_text(capsys.readouterr().out)
    assert json.loads(bl.read_text())["runs"] == 1
    # a2 connected to 10.9.9.9:443, which the baseline (b1) never did: exit 1, and it says so
    assert main(fleet_cli(server, "diff", "--baseline", str(bl), "node-a.a2")) == 1
    assert "10.9.9.9" in capsys.readouterr().out
    assert main(fleet_cli(server, "diff", "--baseline", str(bl), "node-a.a1")) == 0


def test_follow_prints_live_events(
    fleet: tuple[Server, dict[str, Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    server, _ = fleet
    args = ["follow", "--node", "node-b", "--since", "1h", "--count", "5", "--format", "json"]
    assert main(fleet_cli(server, *args)) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [e["id"] for e in lines] == [f"b1:{i}" for i in range(5)] and {e["node"] for e in lines} == {
        "node-b"
    }


def test_one_line_errors(
    fleet: tuple[Server, dict[str, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server, _ = fleet
    cases = [
        (["fleet", "ls"], 2, "no servers"),
        (["fleet", "--server", f"nats://127.0.0.1:{free_port()}", "ls"], 70, "cannot connect"),
        (fleet_cli(server, "get", "nope", "-o", str(tmp_path / "n")), 2, "no run 'nope'"),
        (fleet_cli(server, "get", "bad.node.x", "-o", str(tmp_path / "n")), 2, "not one NATS subject token"),
        (fleet_cli(server, "ls", "--since", "yesterday"), 2, "--since"),
        (fleet_cli(server, "ls", "--label", "nolabel"), 2, "KEY=VALUE"),
        (["fleet", "--server", server.url, "--nkey", str(tmp_path / "missing"), "ls"], 2, "cannot read"),
    ]
    for argv, code, text in cases:
        assert main(argv) == code, argv
        err = capsys.readouterr().err
        assert text in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (argv, err)


def test_tampered_object_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An object replaced in the bucket (an operator's credentials, or a node's that may write
    there) no longer matches the digest the node's index entry names: get refuses it."""
    server = Server(tmp_path)
    try:
        pub, reg = publisher(tmp_path, server.url)
        pub.start()
        bundle = cb.write(tmp_path / "t.tar.gz", session_id="t1")
        pub.bundle_written(bundle)
        until(lambda: reg.value("evidence_fleet_bundles_stored_total") == 1)
        pub.close()
        other = cb.write(tmp_path / "o.tar.gz", session_id="t1", exit_code=1)

        async def swap() -> None:
            nc = await client.connect([server.url])
            store = await nc.jetstream().object_store(names.bundle_bucket("node-a"))
            await store.put("node-a.t1", other.read_bytes())
            await nc.close()

        asyncio.run(swap())
        out = tmp_path / "got.tar.gz"
        assert main(fleet_cli(server, "get", "node-a.t1", "-o", str(out))) == 2
        assert "is not the one the index names" in capsys.readouterr().err and not out.exists()
    finally:
        server.kill()
