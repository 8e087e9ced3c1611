"""evidence show: process tree, files by access, network, denials, loss, exit code; plain text."""

from __future__ import annotations

from pathlib import Path

import pytest

from evidence.bundle import container, fastpath, show, verify
from evidence.cli import main
from tests.unit.conftest_bundles import WS, connect, denial, dns, exec_, open_, records, write


def test_show_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recs = [
        *records(),
        denial(9000, "/etc/shadow"),
        exec_(9100, 104, 101, "/usr/bin/ld", ["ld", "-o", "app"], depth=1),
    ]
    path = write(tmp_path / "a.tar.gz", recs, lost={"ringbuf": 4}, exit_code=2)
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("Run run-")
    assert "  exit:    2" in lines and any(
        line.startswith("  lost:    4 events (ringbuf 4)") for line in lines
    )
    tree = lines[lines.index("Processes (4 execs):") + 1 :]
    assert tree[:4] == [
        "  101 make test",
        "  |- 102 sh -c 'cc -o app app.c'",
        "  |  `- 103 cc -o app app.c",
        "  `- 104 ld -o app",
    ]
    assert f"    {WS}/Makefile (x2)" in lines
    assert "  create+write:" in lines and "  failed:" in lines and "    /etc/missing.conf (ENOENT)" in lines
    assert "  127.0.0.1:8080  by /usr/bin/curl" in lines
    assert "  denied write /etc/shadow (rule workspace-only, by /bin/sh)" in lines
    assert out.isascii()


def test_show_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recs = [*records(), *[exec_(9100 + i, 200 + i, 101, "/bin/true", ["true", str(i)]) for i in range(10)]]
    path = write(tmp_path / "a.tar.gz", recs)
    main(["show", "--limit", "3", str(path)])
    assert "more (--limit 0 shows all)" in capsys.readouterr().out
    main(["show", "--limit", "0", str(path)])
    assert "true 9" in capsys.readouterr().out


def test_show_bad_bundle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(tmp_path / "missing.tar.gz")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1


def test_show_deep_process_chain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chain = [exec_(1000 + i, 1000 + i, 999 + i, "/bin/sh", ["sh", str(i)], depth=i) for i in range(5000)]
    path = write(tmp_path / "deep.tar.gz", chain)
    assert main(["show", "--limit", "0", str(path)]) == 0
    out = capsys.readouterr().out
    assert "1000 sh 0" in out and "5999 sh 4999" in out
    assert max(len(line) for line in out.splitlines()) < 200


def test_show_on_two_cpus_says_what_one_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """show sums up pieces of the run in the reader's helper process too: the pieces add up in
    order, the entries kept under the cap are the first seen in the run."""
    recs = [*records()]
    for i in range(40):
        recs.append(exec_(9000 + i * 10, 300 + i % 9, 101, "/bin/true", ["true", str(i)]))
        recs.append(open_(9005 + i * 10, f"{WS}/f{i % 11}", ["read"]))
        recs.append(denial(9006 + i * 10, f"/etc/x{i % 5}"))
    path = write(tmp_path / "a.tar.gz", recs, lost={"ringbuf": 3})
    monkeypatch.setattr(show, "MAX_TRACKED", 4)
    with monkeypatch.context() as m:
        m.setattr(fastpath.Helper, "usable", staticmethod(lambda: False))
        assert main(["show", "--limit", "0", str(path)]) == 0
        one = capsys.readouterr().out
    monkeypatch.setattr(container, "CHUNK", 700)
    monkeypatch.setattr(verify, "PARALLEL_MIN", 0)
    monkeypatch.setattr(fastpath.Helper, "usable", staticmethod(lambda: True))
    assert main(["show", "--limit", "0", str(path)]) == 0
    assert capsys.readouterr().out == one
    assert "events beyond 4 distinct entries" in one


def test_show_names_the_program_when_argv_does_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recs = [*records(), exec_(9100, 104, 101, "/usr/bin/id", ["make", "all"], depth=1)]
    path = write(tmp_path / "a.tar.gz", recs)
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "104 /usr/bin/id (argv: make all)" in out and "101 make test" in out


def test_show_dns_queries_and_names_on_destinations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recs = [
        *records(),
        dns(9000, "api.example.org", ["192.0.2.7", "192.0.2.8"]),
        dns(9001, "gone.example.org", [], result="NXDOMAIN"),
        dict(
            dns(9002, "x", []),
            name=None,
            type=None,
            result="malformed",
            malformed=True,
            received=True,
            size=9,
        ),
        dict(connect(9100, "192.0.2.7"), names=["api.example.org"]),
        dns(9003, "github.com", ["127.0.0.77"], unsolicited="other source", source=("127.0.0.1", 40000)),
        dns(9004, "pkg.example", ["192.0.2.9"], server="198.51.100.53", configured=False),
        dict(connect(9101, "192.0.2.9"), other_names=["pkg.example"]),
    ]
    path = write(tmp_path / "a.tar.gz", recs)
    assert main(["show", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "DNS (5 queries):" in lines
    assert (
        "  github.com A -> 127.0.0.77 from 127.0.0.1:40000 (unsolicited: other source, names nothing)  by /usr/bin/curl"
        in lines
    )
    assert (
        "  pkg.example A -> 192.0.2.9 via 198.51.100.53 (not a configured resolver)  by /usr/bin/curl"
        in lines
    )
    assert "  192.0.2.9:443 [by another server: pkg.example]  by /usr/bin/curl" in lines
    assert "  api.example.org A -> 192.0.2.7 192.0.2.8 via 127.0.0.53  by /usr/bin/curl" in lines
    assert "  gone.example.org A -> no address (NXDOMAIN) via 127.0.0.53  by /usr/bin/curl" in lines
    assert "  malformed message received (9 bytes) via 127.0.0.53  by /usr/bin/curl" in lines
    assert "  192.0.2.7:443 [api.example.org]  by /usr/bin/curl" in lines
