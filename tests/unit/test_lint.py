"""evidence lint: each rule fires on the run that deserves it and stays quiet otherwise; output
formats; --fail-on; --explain."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from evidence.bundle import container, fastpath, lint, verify
from evidence.bundle import format as fmt
from evidence.cli import main
from tests.unit.conftest_bundles import WS, connect, denial, dns, exec_, open_, records, violation, write


def _lint(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict[str, Any]]:
    code = main(["lint", "--format", "json", *extra, str(path)])
    return code, orjson.loads(capsys.readouterr().out)


def _refused_32bit(t: int) -> dict[str, Any]:
    """A system call through a 32-bit entry, refused by the run's seccomp filter (correlate.py)."""
    return {**denial(t, "i386 open (5)", "syscall"), "rule": fmt.COMPAT_RULE, "result": "SIGSYS"}


def _codes(doc: dict[str, Any]) -> list[str]:
    return sorted({f["rule"] for f in doc["findings"]})


def test_clean_run_has_no_findings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = _lint(write(tmp_path / "a.tar.gz"), capsys)
    assert code == 0 and doc["verified"] and doc["findings"] == []


@pytest.mark.parametrize(
    ("recs", "over", "rule"),
    [
        ([], {"lost": {"ringbuf": 7}}, "EV001"),
        (
            [],
            {
                "degradations": [
                    {
                        "component": "landlock",
                        "reason": "kernel lacks ABI 3",
                        "impact": "truncate not enforced",
                    }
                ]
            },
            "EV002",
        ),
        (
            [
                exec_(
                    9100,
                    200,
                    101,
                    "/usr/bin/curl",
                    ["curl", "-H", "Authorization: Bearer abcdefghijkl0123", "https://x"],
                )
            ],
            {},
            "EV003",
        ),
        (
            [
                exec_(
                    9100,
                    200,
                    101,
                    "/usr/bin/git",
                    ["git", "push", "https://ghp_" + "a" * 36 + "@github.com/x"],
                )
            ],
            {},
            "EV003",
        ),
        ([exec_(9100, 200, 101, "/usr/bin/aws", ["aws", "--key", "AKIAABCDEFGHIJKLMNOP"])], {}, "EV003"),
        ([exec_(9100, 200, 101, "/usr/bin/x", ["x", "--password=hunter22"])], {}, "EV003"),
        ([open_(9100, "/home/ci/sk-abcdefghijklmnopqrstu.txt", ["read"])], {}, "EV003"),
        ([], {"command": ["deploy", "xoxb-1234567890-abcdef"]}, "EV003"),
        ([open_(9100, "/home/ci/.bashrc", ["write"])], {}, "EV004"),
        ([open_(9100, "/usr/local/bin/tool", ["create", "write"])], {}, "EV004"),
        ([connect(9100, "140.82.112.3", 443)], {}, "EV005"),
        ([connect(9100, "2606:4700::1111", 443, family="AF_INET6", result="ECONNREFUSED")], {}, "EV005"),
        ([exec_(9100, 200, 101, "/tmp/dropper", ["/tmp/dropper"])], {}, "EV006"),
        ([exec_(9100, 200, 101, "/dev/shm/x", ["x"])], {}, "EV006"),
        # a '..' after a component that may be a symlink: it may lead anywhere, even out of the workspace
        ([open_(9100, WS + "/l/../x", ["write"])], {}, "EV004"),
        ([exec_(9100, 200, 101, WS + "/l/../tool", ["tool"])], {}, "EV006"),
        ([], {"cut_short": True}, "EV007"),
        ([open_(-2_000_000_000, WS + "/late", ["read"])], {}, "EV008"),
        ([_refused_32bit(9100)], {}, "EV013"),
        ([violation(9100, "args")], {}, "EV021"),
        ([violation(9100, "no_pin", killed=False)], {}, "EV021"),
        # a job answering its own query from a port of its own; a server that is not the run's resolver
        (
            [
                dns(
                    9100,
                    "github.com",
                    ["127.0.0.77"],
                    unsolicited="other source",
                    source=("127.0.0.1", 40000),
                )
            ],
            {"resolvers": ["127.0.0.53"]},
            "EV015",
        ),
        ([dns(9100, "github.com", ["127.0.0.77"], unsolicited="unverified")], {}, "EV015"),
        (
            [dns(9100, "pkg.example", ["192.0.2.1"], server="198.51.100.53", configured=False)],
            {"resolvers": ["127.0.0.53"]},
            "EV016",
        ),
    ],
)
def test_rule_fires(
    recs: list[dict[str, Any]],
    over: dict[str, Any],
    rule: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = write(tmp_path / "a.tar.gz", [*records(), *recs], **over)
    _, doc = _lint(path, capsys, "--fail-on", "none")
    assert rule in _codes(doc), doc["findings"]
    f = next(f for f in doc["findings"] if f["rule"] == rule)
    assert f["severity"] == lint.RULES[rule].severity and f["message"]


def test_secret_is_redacted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    token = "ghp_" + "Z" * 36
    path = write(tmp_path / "a.tar.gz", [*records(), exec_(9100, 200, 101, "/usr/bin/git", ["git", token])])
    code = main(["lint", str(path)])
    out = capsys.readouterr().out
    assert code == 1 and "EV003" in out and token not in out and "ghp_ZZ..." in out


@pytest.mark.parametrize(
    ("recs", "over"),
    [
        (
            [
                open_(9100, "/tmp/scratch", ["write", "create"]),
                open_(9100, "/dev/null", ["write"]),
                open_(9100, WS + "/out", ["write"]),
            ],
            {},
        ),
        (
            [open_(9100, "/etc/passwd", ["write"], result="EACCES"), open_(9100, "rel/path", ["write"])],
            {},
        ),  # failed / relative: not judged
        ([open_(9100, "/srv/ws/out", ["write"])], {"policy": {"workspace": "/srv/ws"}}),
        (
            [
                connect(9100, "127.0.0.1", 80),
                connect(9100, "::1", 80, family="AF_INET6"),
                connect(9100, "/run/x.sock", None, family="AF_UNIX"),
            ],
            {},
        ),
        ([connect(9100, "140.82.112.3", 443)], {"policy": {"workspace": WS}}),  # a policy was in force
        ([exec_(9100, 200, 101, "/tmp/x", ["x"], result="ENOENT")], {}),  # failed exec
        (
            [exec_(9100, 200, 101, "/tmp/build/bin/tool", ["tool"])],
            {"cwd": "/tmp/build", "policy": None},
        ),  # inside the workspace
        ([exec_(9100, 200, 101, "/usr/bin/env", ["env", "FOO=bar", "--token"])], {}),
        # an answer of the run's resolver; one of a bundle made before `resolvers` (not judged)
        ([dns(9100, "pkg.example", ["192.0.2.1"])], {"resolvers": ["127.0.0.53"]}),
        ([dns(9100, "pkg.example", ["192.0.2.1"], configured=False)], {}),
    ],
)
def test_rules_stay_quiet(
    recs: list[dict[str, Any]], over: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reads_only = [r for r in records() if "write" not in r.get("access", ())]
    path = write(tmp_path / "a.tar.gz", [*reads_only, *recs], **over)
    _, doc = _lint(path, capsys, "--fail-on", "none")
    assert [c for c in _codes(doc) if c != "EV009"] == [], doc["findings"]  # EV009: a note on any tool


def test_programs_from_writable_places_with_their_hash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = "a" * 64, "b" * 64
    recs = [
        {**exec_(9100, 200, 101, f"{WS}/bin/tool", ["tool"]), "sha256": a, "size": 3, "hash_source": "exe"},
        {**exec_(9101, 201, 101, f"{WS}/bin/tool", ["tool"]), "sha256": a, "size": 3, "hash_source": "exe"},
        {**exec_(9102, 202, 101, f"{WS}/bin/tool", ["tool"]), "sha256": b, "size": 4, "hash_source": "path"},
        {**exec_(9103, 203, 101, "/dev/shm/x", ["x"]), "not_hashed": "too_large", "size": 1 << 30},
        {**exec_(9104, 204, 101, "/usr/bin/cc", ["cc"]), "sha256": a, "size": 3, "hash_source": "exe"},
    ]
    path = write(tmp_path / "a.tar.gz", [*records(), *recs])
    _, doc = _lint(path, capsys, "--fail-on", "none")
    notes = sorted((f["message"], f["count"]) for f in doc["findings"] if f["rule"] == "EV009")
    assert notes == [
        ("ran /dev/shm/x from a writable place (not hashed: too_large)", 1),
        (f"ran {WS}/bin/tool from a writable place (sha256 {a})", 2),
        (f"ran {WS}/bin/tool from a writable place (sha256 {b})", 1),
    ]


def test_a_scripts_interpreter_is_linted_as_a_program(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A #! script whose interpreter sits in /tmp (or the workspace, or is relative to a cwd there)
    ran that interpreter: EV006 and EV009 for it, with its own hash. A script of the distribution
    run by /usr/bin/python3 gets neither."""
    i = "c" * 64
    script = {"sha256": "d" * 64, "size": 9, "hash_source": "path"}
    recs = [
        {**exec_(9100, 200, 101, "/usr/bin/tool", ["tool"]), **script, "interpreter": "/tmp/interp"}
        | {"interpreter_sha256": i, "interpreter_size": 5, "interpreter_hash_source": "exe"},
        {**exec_(9101, 201, 101, "/usr/bin/tool2", ["tool2"]), **script, "interpreter": "bin/interp"}
        | {"interpreter_not_hashed": "gone"},
        {**exec_(9102, 202, 101, "/usr/bin/ok", ["ok"]), **script, "interpreter": "/usr/bin/python3"},
        {**exec_(9103, 203, 101, "/usr/bin/bad", ["bad"], result="ENOENT"), "interpreter": "/tmp/interp"},
    ]
    path = write(tmp_path / "a.tar.gz", [*records(), *recs])
    _, doc = _lint(path, capsys, "--fail-on", "none")
    found = [(f["rule"], f["message"]) for f in doc["findings"] if f["rule"] in ("EV006", "EV009")]
    assert found == [
        ("EV006", "executed /tmp/interp (the interpreter of /usr/bin/tool) from a temp directory"),
        ("EV009", f"ran /tmp/interp (the interpreter of /usr/bin/tool) from a writable place (sha256 {i})"),
        (
            "EV009",
            f"ran {WS}/bin/interp (the interpreter of /usr/bin/tool2) from a writable place (not hashed: gone)",
        ),
    ]


def test_fail_on_thresholds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "a.tar.gz", [*records(), connect(9100, "140.82.112.3", 443)])  # one warning
    assert main(["lint", str(path)]) == 0
    assert main(["lint", "--fail-on", "warn", str(path)]) == 1
    assert main(["lint", "--fail-on", "info", str(path)]) == 1
    assert main(["lint", "--fail-on", "none", str(path)]) == 0
    capsys.readouterr()


def test_findings_are_deduplicated_with_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recs = [*records(), *[exec_(9100 + i, 300 + i, 101, "/tmp/x", ["x"]) for i in range(5)]]
    _, doc = _lint(write(tmp_path / "a.tar.gz", recs), capsys)
    ev6 = [f for f in doc["findings"] if f["rule"] == "EV006"]
    assert len(ev6) == 1 and ev6[0]["count"] == 5


def test_sarif_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(
        tmp_path / "a.tar.gz",
        [*records(), connect(9100, "140.82.112.3", 443), open_(9200, "/etc/x", ["write"])],
    )
    assert main(["lint", "--format", "sarif", str(path)]) == 0
    doc = orjson.loads(capsys.readouterr().out)
    assert doc["version"] == "2.1.0"
    run = doc["runs"][0]
    rules = run["tool"]["driver"]["rules"]
    assert [r["id"] for r in rules] == list(lint.RULES)
    for r in rules:
        assert {
            "id",
            "name",
            "shortDescription",
            "fullDescription",
            "help",
            "defaultConfiguration",
        } <= r.keys()
        assert r["defaultConfiguration"]["level"] in ("error", "warning", "note")
    assert {res["ruleId"] for res in run["results"]} == {"EV004", "EV005"}
    for res in run["results"]:
        assert res["level"] in ("error", "warning", "note")
        loc = res["locations"][0]
        assert loc["physicalLocation"]["artifactLocation"]["uri"].endswith("a.tar.gz")
        assert loc["logicalLocations"][0]["name"].startswith("run-")
        assert len(res["partialFingerprints"]["evidenceFinding/v1"]) == 64
    # stable across runs: a second bundle of a run that did the same thing gives the same fingerprints
    other = write(
        tmp_path / "b.tar.gz",
        [*records(), connect(9100, "140.82.112.3", 443), open_(9200, "/etc/x", ["write"])],
        session_id="other",
    )
    main(["lint", "--format", "sarif", str(other)])
    again = orjson.loads(capsys.readouterr().out)["runs"][0]["results"]
    assert sorted(r["partialFingerprints"]["evidenceFinding/v1"] for r in again) == sorted(
        r["partialFingerprints"]["evidenceFinding/v1"] for r in run["results"]
    )


def test_sarif_validates_against_the_sarif_schema_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the parts of SARIF 2.1.0 that GitHub code scanning requires
    path = write(tmp_path / "a.tar.gz", [*records(), open_(9200, "/etc/x", ["write"])])
    main(["lint", "--format", "sarif", str(path)])
    doc = orjson.loads(capsys.readouterr().out)
    assert doc["$schema"].endswith("sarif-2.1.0.json")
    driver = doc["runs"][0]["tool"]["driver"]
    assert driver["name"] and driver["version"]
    res = doc["runs"][0]["results"][0]
    assert res["message"]["text"] and res["ruleIndex"] == list(lint.RULES).index(res["ruleId"])


def test_text_output_and_explain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "a.tar.gz", [*records(), open_(9200, "/etc/x", ["write"])])
    assert main(["lint", str(path)]) == 0
    out = capsys.readouterr().out
    assert "verified" in out and "warning EV004 write-outside-workspace" in out and "1 findings" in out
    for code, rule in lint.RULES.items():
        assert main(["lint", "--explain", code]) == 0
        assert rule.explain in capsys.readouterr().out
    assert main(["lint", "--explain", "secret-exposed"]) == 0
    capsys.readouterr()
    assert main(["lint", "--explain", "EV999"]) == 2
    assert "no lint rule" in capsys.readouterr().err
    assert main(["lint"]) == 2


def test_run_without_finished_event_is_flagged() -> None:
    linter = lint.Linter({"cwd": WS, "policy": None, "lost": {"total": 0, "by_kind": {}}, "cut_short": False})
    assert [f.rule.code for f in linter.findings()] == ["EV007"]


@pytest.mark.parametrize("chunk", [300, 2000])  # pieces of one line, of a few
def test_lint_on_two_cpus_finds_exactly_what_one_finds(
    chunk: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rules run in the reader's folds, some in its helper process: findings seen in several
    pieces are counted once each, the first kept; the clock rule compares across pieces; the cap on
    distinct findings drops the same ones."""
    recs = [*records()]
    for i in range(30):
        recs.append(open_(10_000 + i * 100, f"/etc/conf{i % 7}", ["write"]))  # EV004, 7 distinct
        recs.append(exec_(10_050 + i * 100, 300 + i, 101, "/usr/bin/x", ["x", f"--token=abc{i % 3}def"]))
    recs.append(open_(20_000, WS + "/late", ["read"]))
    recs.append(open_(-3_000_000_000, WS + "/early", ["read"]))  # EV008
    recs.append(open_(-2_000_000_000, WS + "/early2", ["read"]))  # the same, within a piece or across
    path = write(tmp_path / "a.tar.gz", recs)
    monkeypatch.setattr(lint, "MAX_FINDINGS", 5)
    with monkeypatch.context() as m:
        m.setattr(fastpath.Helper, "usable", staticmethod(lambda: False))
        _, one, dropped_one = lint.lint(str(path))
    monkeypatch.setattr(container, "CHUNK", chunk)
    monkeypatch.setattr(verify, "PARALLEL_MIN", 0)
    monkeypatch.setattr(fastpath.Helper, "usable", staticmethod(lambda: True))
    _, two, dropped_two = lint.lint(str(path))
    assert [f.as_dict() for f in two] == [f.as_dict() for f in one]
    assert dropped_two == dropped_one > 0
    assert {f.rule.code for f in one} >= {"EV003", "EV004", "EV008"}


def test_a_secret_is_found_every_time_strings_repeat(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Strings seen to hold no secret are remembered (paths repeat): a path with a secret in it is
    never remembered so, and counts every time; a path seen clean stays clean."""
    secret = WS + "/sk-abcdefghijklmnopqrstu.txt"
    recs = [*records()]
    for i in range(4):
        recs.append(open_(10_000 + i * 100, WS + "/src/main.c", ["read"]))
        recs.append(open_(10_050 + i * 100, secret, ["read"]))
    _, doc = _lint(write(tmp_path / "a.tar.gz", recs, detail="full"), capsys, "--fail-on", "none")
    ev3 = [f for f in doc["findings"] if f["rule"] == "EV003"]
    assert len(ev3) == 1 and ev3[0]["count"] == 4 and "main.c" not in ev3[0]["message"]


_ROOT_PARTS = st.sampled_from(["", "/", "a", "ab", "/a", "/ab", "/a/b", "//", "a/"])


@given(
    path=st.lists(_ROOT_PARTS, max_size=4).map("".join),
    roots=st.lists(st.lists(_ROOT_PARTS, max_size=3).map("".join), max_size=4),
)
def test_roots_agree_with_the_plain_definition(path: str, roots: list[str]) -> None:
    """_Roots.holds(path): path is a root or under one, empty roots standing for none."""
    expected = any(path == r or path.startswith(r + "/") for r in roots if r)
    assert lint._Roots(roots).holds(path) is expected


def test_an_unsolicited_answer_says_where_it_came_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    forged = dns(9100, "github.com", ["127.0.0.77"], unsolicited="other source", source=("127.0.0.1", 40000))
    path = write(tmp_path / "a.tar.gz", [*records(), forged], resolvers=["127.0.0.53"])
    code, doc = _lint(path, capsys, "--fail-on", "warn")
    assert code == 1 and _codes(doc) == ["EV015"]
    (f,) = doc["findings"]
    assert f["message"] == (
        "a DNS answer for github.com A -> 127.0.0.77 from 127.0.0.1:40000 was credited to no query "
        "(other source): it names no connect"
    )
