"""evidence diff: behaviour differences (added / removed / changed) after normalisation, loss
stated plainly, --fail-on, --ignore, baselines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from evidence.bundle import diff, diff_keys
from evidence.cli import main
from tests.unit.conftest_bundles import WS, connect, denial, exec_, open_, records, write


def _diff(a: Path, b: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict[str, Any]]:
    code = main(["diff", "--format", "json", *extra, str(a), str(b)])
    return code, orjson.loads(capsys.readouterr().out)


def _keys(doc: dict[str, Any], what: str) -> set[tuple[str, str]]:
    return {(c["kind"], c["key"]) for c in doc[what]}


def test_same_behaviour_no_differences(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = write(tmp_path / "a.tar.gz")
    b = write(
        tmp_path / "b.tar.gz",
        session_id="other",
        started_ns=1_800_000_000_000_000_000,
        finished_ns=1_800_000_005_000_000_000,
    )
    code, doc = _diff(a, b, capsys, "--fail-on", "any")
    assert code == 0 and doc["differences"] == 0
    assert main(["diff", str(a), str(b)]) == 0
    assert "No behaviour differences observed." in capsys.readouterr().out


def test_added_removed_changed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = records()
    a = write(
        tmp_path / "a.tar.gz", [*base, open_(9100, WS + "/gone.txt", ["read"]), denial(9200, "/etc/shadow")]
    )
    changed = [r for r in base if r.get("path") != WS + "/app.c"]
    changed += [
        open_(9100, WS + "/app.c", ["read", "write"]),  # new access class on a known path
        open_(9150, WS + "/Makefile", ["read"]),  # count 2 -> 3
        exec_(9300, 300, 101, "/usr/bin/curl", ["curl", "https://example.com"]),
        connect(9400, "140.82.112.3", 443),
        open_(9500, "/etc/missing.conf", ["read"]),  # ENOENT before; now also a success
    ]
    changed = [r for r in changed if not (r.get("k") == "connect" and r.get("address") == "127.0.0.1")]
    b = write(tmp_path / "b.tar.gz", changed, exit_code=3)
    code, doc = _diff(a, b, capsys)
    assert code == 1  # --fail-on added by default
    assert ("exec", "/usr/bin/curl -- curl https://example.com") in _keys(doc, "added")
    assert ("network", "140.82.112.3:443") in _keys(doc, "added")
    assert {
        ("file", "${WORKSPACE}/gone.txt"),
        ("network", "127.0.0.1:8080"),
        ("denial", "write /etc/shadow (rule workspace-only, enforced)"),
    } <= _keys(doc, "removed")
    changes = {c["key"]: c["detail"] for c in doc["changed"]}
    assert "new access write" in changes["${WORKSPACE}/app.c"]
    assert "read count 2 -> 3" in changes["${WORKSPACE}/Makefile"]
    assert changes["exit code"] == "0 -> 3"
    assert main(["diff", "--fail-on", "none", str(a), str(b)]) == 0
    assert main(["diff", "--fail-on", "removed", str(a), str(b)]) == 1
    capsys.readouterr()


def test_success_to_failure_is_a_change(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = write(tmp_path / "a.tar.gz", [*records(), connect(9100, "10.0.0.1", 443)])
    b = write(tmp_path / "b.tar.gz", [*records(), connect(9100, "10.0.0.1", 443, result="ECONNREFUSED")])
    code, doc = _diff(a, b, capsys, "--fail-on", "changed")
    assert code == 1
    assert any("now fails" in c["detail"] for c in doc["changed"])


def test_normalisation_of_roots_and_random_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def run(ws: str, tmp: str, rand: str) -> list[dict[str, Any]]:
        return [
            exec_(1000, 101, 100, "/usr/bin/make", ["make", "-C", ws], depth=0),
            open_(2000, ws + "/Makefile", ["read"]),
            open_(3000, f"{tmp}/tmp{rand}/out", ["write", "create"]),
            open_(4000, "/proc/4242/status", ["read"]),
        ]

    a = write(
        tmp_path / "a.tar.gz",
        run("/w/one", "/tmp/ev-1", "abcd1234"),
        cwd="/w/one",
        policy={"workspace": "/w/one", "tmpdir": "/tmp/ev-1"},
    )
    b = write(
        tmp_path / "b.tar.gz",
        run("/w/two", "/tmp/ev-2", "zz9_8y7x"),
        cwd="/w/two",
        policy={"workspace": "/w/two", "tmpdir": "/tmp/ev-2"},
    )
    code, doc = _diff(a, b, capsys, "--fail-on", "any")
    assert doc["differences"] == 0 and code == 0, doc


def test_ignore_patterns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = write(tmp_path / "a.tar.gz", [*records(), open_(9100, WS + "/build-101.log", ["write"])])
    b = write(tmp_path / "b.tar.gz", [*records(), open_(9100, WS + "/build-102.log", ["write"])])
    assert _diff(a, b, capsys)[0] == 1
    code, doc = _diff(a, b, capsys, "--ignore", r"build-\d+")
    assert code == 0 and doc["differences"] == 0
    assert main(["diff", "--ignore", "(", str(a), str(b)]) == 2
    assert "not a valid regular expression" in capsys.readouterr().err


def test_loss_is_stated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = write(tmp_path / "a.tar.gz")
    b = write(tmp_path / "b.tar.gz", lost={"ringbuf": 12})
    assert main(["diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "No behaviour differences observed." in out and "B: 12" in out and "lost" in out
    code, doc = _diff(a, b, capsys)
    assert doc["b"]["lost"] == 12 and "B: 12" in doc["note"]
    assert main(["diff", "--format", "markdown", str(a), str(b)]) == 0
    assert "Warning" in capsys.readouterr().out


def test_markdown_and_text_group_by_kind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = write(tmp_path / "a.tar.gz")
    b = write(
        tmp_path / "b.tar.gz", [*records(), connect(9100, "1.1.1.1", 53), open_(9200, WS + "/n|ew", ["read"])]
    )
    main(["diff", "--format", "markdown", str(a), str(b)])
    md = capsys.readouterr().out
    assert "### file" in md and "### network" in md and "n\\|ew" in md
    main(["diff", str(a), str(b)])
    text = capsys.readouterr().out
    assert "2 differences: 2 added" in text and "  + 1.1.1.1:53" in text and "Absence in B" in text


def test_baseline_store_compare_update(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = tmp_path / "baselines"
    a = write(tmp_path / "a.tar.gz")
    b = write(tmp_path / "b.tar.gz", [*records(), connect(9100, "1.1.1.1", 53)])
    assert main(["diff", "--baseline", str(base), "--name", "ci", str(a)]) == 0
    assert "stored" in capsys.readouterr().out
    assert (base / ("ci" + diff.BASELINE_SUFFIX)).read_bytes() == a.read_bytes()
    assert main(["diff", "--baseline", str(base), "--name", "ci", str(a)]) == 0
    assert main(["diff", "--baseline", str(base), "--name", "ci", str(b)]) == 1
    assert main(["diff", "--baseline", str(base), "--name", "ci", "--update", str(b)]) == 0
    assert main(["diff", "--baseline", str(base), "--name", "ci", str(b)]) == 0
    capsys.readouterr()
    assert main(["diff", "--baseline", str(base), "--name", "../x", str(b)]) == 2
    assert main(["diff", "--baseline", str(base), str(a), str(b)]) == 2
    assert main(["diff", str(a)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 3


def test_baseline_refuses_to_store_a_bad_bundle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"not a bundle")
    assert main(["diff", "--baseline", str(tmp_path / "b"), str(bad)]) == 2
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())
    capsys.readouterr()


def test_behaviour_keeps_only_keys(tmp_path: Path) -> None:
    b = diff_keys.behaviour(str(write(tmp_path / "a.tar.gz")))
    assert b.files["${WORKSPACE}/Makefile"] == {"read": [2, 2, 0]}
    assert b.files["/etc/missing.conf"] == {"read": [1, 0, 1]}
    assert b.exit == "0" and b.lost == 0


def test_a_program_whose_content_changed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def run(digest: str) -> list[dict[str, Any]]:
        tool = {
            **exec_(9100, 200, 101, f"{WS}/bin/tool", ["tool"]),
            "sha256": digest,
            "size": 3,
            "hash_source": "exe",
        }
        return [*records(), tool]

    a = write(tmp_path / "a.tar.gz", run("a" * 64))
    same = write(tmp_path / "same.tar.gz", run("a" * 64))
    b = write(tmp_path / "b.tar.gz", run("b" * 64))
    assert _diff(a, same, capsys)[1]["differences"] == 0
    code, doc = _diff(a, b, capsys, "--fail-on", "changed")
    assert code == 1
    assert doc["changed"] == [
        {
            "kind": "exec",
            "what": "changed",
            "key": "${WORKSPACE}/bin/tool",
            "detail": f"content changed: sha256 {'a' * 16} -> {'b' * 16}",
        }
    ]


def test_connects_compare_by_name_where_dns_named_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def named(t: int, address: str, *names: str) -> dict[str, Any]:
        return dict(connect(t, address, 443), names=list(names))

    a = write(
        tmp_path / "a.tar.gz",
        [
            *records(),
            named(9100, "192.0.2.7", "api.example.org", "edge-1.cdn.example"),
            named(9200, "192.0.2.9", "x.example"),
        ],
    )
    # the CDN answers with other addresses and another edge name: the same destinations
    b = write(
        tmp_path / "b.tar.gz",
        [
            *records(),
            named(9100, "198.51.100.4", "api.example.org", "edge-7.cdn.example"),
            named(9200, "192.0.2.10", "x.example"),
        ],
    )
    code, doc = _diff(a, b, capsys, "--fail-on", "any")
    assert code == 0 and doc["differences"] == 0, doc
    # a new name is a new destination, whatever its address
    c = write(
        tmp_path / "c.tar.gz",
        [*records(), named(9100, "192.0.2.7", "evil.example"), named(9200, "192.0.2.9", "x.example")],
    )
    code, doc = _diff(a, c, capsys, "--fail-on", "added")
    assert code == 1
    assert ("network", "evil.example:443") in _keys(doc, "added")
    assert ("network", "api.example.org edge-1.cdn.example:443") in _keys(doc, "removed")


def test_a_side_past_the_cap_on_keys_is_a_difference_and_memory_stays_bounded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A side keeps at most MAX_KEYS distinct keys (a valid bundle of 1.5M distinct execs took 3 GB):
    the events of keys past it are counted by kind, and each such kind is a difference of its own
    (added for B, removed for A), so a flood of keys cannot hide what came after it (the default
    --fail-on added fails). At most MAX_CHANGES differences are listed, the rest counted."""
    monkeypatch.setattr(diff_keys, "MAX_KEYS", 40)
    monkeypatch.setattr(diff, "MAX_CHANGES", 5)
    flood = [exec_(9000 + i, 300 + i, 101, "/usr/bin/true", ["true", str(i)]) for i in range(60)]
    a = write(tmp_path / "a.tar.gz")
    b = write(tmp_path / "b.tar.gz", [*records(), *flood, exec_(9999, 999, 101, "/tmp/evil", ["evil"])])
    behaviour = diff_keys.behaviour(str(b))
    assert sum(map(len, (behaviour.execs, behaviour.files, behaviour.network, behaviour.denials))) <= 40
    code, doc = _diff(a, b, capsys)
    assert code == 1
    (past,) = [c for c in doc["added"] if c["key"] == diff.PAST_CAP]
    assert past["kind"] == "exec" and int(past["detail"].split()[0]) > 20 and "not compared" in past["detail"]
    assert ("exec", "/tmp/evil -- evil") not in _keys(doc, "added")  # past the cap: said by the above
    assert doc["differences"] > 5 and doc["not_listed"] == doc["differences"] - 5
    assert len(doc["added"]) + len(doc["removed"]) + len(doc["changed"]) == 5
    _, doc = _diff(b, a, capsys)
    assert [c["kind"] for c in doc["removed"] if c["key"] == diff.PAST_CAP] == ["exec"]
    assert main(["diff", str(a), str(b)]) == 1
    assert "more differences are not listed (at most 5 are)" in capsys.readouterr().out


def test_a_name_whose_addresses_move_to_a_local_range_is_a_change(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run's own resolver answers github.com with 127.0.0.77 (a job that registers names with
    it, a resolver it controls): compared by name alone, nothing changed."""

    def named(t: int, address: str, *names: str, **kw: Any) -> dict[str, Any]:
        return dict(connect(t, address, 443), names=list(names), **kw)

    a = write(tmp_path / "a.tar.gz", [*records(), named(9100, "140.82.112.3", "github.com")])
    b = write(tmp_path / "b.tar.gz", [*records(), named(9100, "127.0.0.77", "github.com")])
    code, doc = _diff(a, b, capsys)  # the default gate: --fail-on added
    assert code == 1 and doc["differences"] == 1, doc
    (moved,) = doc["added"]
    assert moved["key"] == "github.com:443 at a loopback address"
    assert moved["detail"] == "127.0.0.77; the name's addresses in A: public"
    # another public address is no change, nor the way back from a local range
    c = write(tmp_path / "c.tar.gz", [*records(), named(9100, "140.82.112.4", "github.com")])
    assert _diff(a, c, capsys, "--fail-on", "any")[0] == 0
    assert _diff(b, a, capsys, "--fail-on", "any")[0] == 0
    # under another CNAME chain to the same name: still the same name, still moved
    d = write(tmp_path / "d.tar.gz", [*records(), named(9100, "10.1.2.3", "github.com", "gh.corp.example")])
    code, doc = _diff(a, d, capsys)
    assert code == 1 and [(c["key"], c["detail"]) for c in doc["added"]] == [
        ("github.com:443 at a private address", "10.1.2.3; the name's addresses in A: public")
    ]
    # names of another server's answers are no key: the connect is compared by its address
    e = write(
        tmp_path / "e.tar.gz",
        [*records(), dict(connect(9100, "127.0.0.77", 443), other_names=["github.com"])],
    )
    code, doc = _diff(a, e, capsys, "--fail-on", "added")
    assert code == 1 and ("network", "127.0.0.77:443") in _keys(doc, "added")
    assert ("network", "github.com:443") in _keys(doc, "removed")


@pytest.mark.parametrize(
    ("address", "scope"),
    [
        ("127.0.0.77", "loopback"),
        ("::1", "loopback"),
        ("0.0.0.0", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),
        ("169.254.169.254", "link-local"),
        ("fe80::1%eth0", "link-local"),
        ("10.0.0.1", "private"),
        ("172.16.5.4", "private"),
        ("192.168.1.1", "private"),
        ("100.64.0.1", "private"),
        ("fd00::1", "private"),
        ("140.82.112.3", "public"),
        ("2606:4700::1111", "public"),
        ("224.0.0.1", "other"),
        ("not an address", "other"),
    ],
)
def test_address_scopes(address: str, scope: str) -> None:
    assert diff_keys.address_scope(address) == scope
