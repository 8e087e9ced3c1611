"""lint made cheaper says what it said: the same findings, counts and problems for any bundle.

The reference is the careful path alone (verify.Verifier._careful, line by line, saying what is wrong
with each event), which is how a bundle's first piece (up to container.CHUNK bytes of events, so
the whole of most runs' bundles) was checked before the fast path took the events after the first.
Compared on the lint rules' own bundles, on every hostile bundle, and on damage hypothesis makes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evidence.bundle import fastpath, lint, reader, verify
from evidence.bundle import format as fmt
from tests.unit.conftest_bundles import (
    WS,
    connect,
    denial,
    dns,
    exec_,
    members,
    open_,
    rebuild,
    records,
    violation,
    write,
)
from tests.unit.test_hostile import HOSTILE

Outcome = tuple[list[dict[str, Any]], int, list[str], tuple[str, ...]]


def _outcome(path: Path, parallel: bool = True) -> Outcome:
    """(findings, findings not listed, verification problems, keyids) of lint_signed."""
    try:
        _, findings, dropped, signature = lint.lint_signed(str(path), parallel=parallel)
    except reader.VerificationError as e:
        return [], 0, e.problems, ()
    return [f.as_dict() for f in findings], dropped, [], signature.keyids


def _careful_only(lines: list[bytes], seq: int, ctx: Any, passed: Any) -> Iterator[Any]:
    return iter(())  # the fast path gives up at once: every event the careful way


def _both(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Outcome, Outcome]:
    """(as lint does it now, the careful path alone), in this process; in the caller's thread alone
    (the agent's way: no inflating thread) as with one."""
    monkeypatch.setattr(fastpath.Helper, "usable", staticmethod(lambda: False))
    now = _outcome(path)
    assert _outcome(path, parallel=False) == now
    with monkeypatch.context() as m:
        m.setattr(verify, "fast", _careful_only)
        careful = _outcome(path)
    return now, careful


def _rule_runs() -> list[list[dict[str, Any]]]:
    """Runs that make every per-event rule fire, and one of each with many events."""
    base = records()
    return [
        base,
        [*base, open_(9100, "/etc/passwd", ["write"]), open_(9200, WS + "/x", ["write", "create"])],
        [*base, exec_(9100, 300, 101, "/tmp/dropper", ["dropper", "--token=abcdef123"])],
        [*base, exec_(9100, 301, 101, WS + "/build/tool", ["tool", "ghp_" + "a" * 30])],
        [*base, connect(9100, "203.0.113.9", 443)],
        [*base, denial(9100, "/etc/shadow"), violation(9200, "args")],
        [*base, dns(9100, "github.com", ["127.0.0.77"], unsolicited="unverified")],
        [*base, open_(-2_000_000_000, WS + "/late", ["read"])],
        [*base, *(open_(10_000 + i, f"{WS}/src/f{i}.c", ["read"]) for i in range(3000))],
    ]


@pytest.mark.parametrize("k", range(len(_rule_runs())))
def test_the_rules_bundles_lint_the_same(k: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "a.tar.gz", _rule_runs()[k])
    now, careful = _both(path, monkeypatch)
    assert now == careful
    assert not now[2]


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_bundles_lint_the_same(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make, _ = HOSTILE[case]
    manifest, lines = members(write(tmp_path / "valid.tar.gz"))
    path = make(tmp_path / f"{case}.tar.gz", dict(manifest), list(lines))
    now, careful = _both(path, monkeypatch)
    assert now == careful
    assert now[2], "a hostile bundle fails"


@pytest.fixture(scope="module")
def valid(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[bytes]]:
    recs = [*records(), *(open_(10_000 + i, f"{WS}/src/f{i}.c", ["read"]) for i in range(40))]
    return members(write(tmp_path_factory.mktemp("valid") / "a.tar.gz", recs))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    where=st.integers(min_value=0),
    at=st.integers(min_value=0),
    byte=st.integers(min_value=0, max_value=255),
    how=st.sampled_from(["byte", "drop", "swap", "repeat", "field"]),
    fix_root=st.booleans(),
)
def test_damaged_bundles_lint_the_same(
    valid: tuple[dict[str, Any], list[bytes]],
    where: int,
    at: int,
    byte: int,
    how: str,
    fix_root: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    manifest, lines = valid
    lines = list(lines)
    i = where % len(lines)
    if how == "byte":
        line = lines[i]
        lines[i] = line[: at % len(line)] + bytes([byte]) + line[at % len(line) + 1 :]
    elif how == "drop":
        del lines[i]
    elif how == "swap":
        j = (i + 1 + at) % len(lines)
        lines[i], lines[j] = lines[j], lines[i]
    elif how == "repeat":
        lines.insert(i, lines[i])
    else:  # a field changed in a way that keeps the line canonical JSON
        ev = orjson.loads(lines[i])
        key = sorted(ev)[at % len(ev)]
        ev[key] = [None, 0, "x", byte, {"a": byte}][byte % 5]
        lines[i] = orjson.dumps(ev, option=orjson.OPT_SORT_KEYS)
    path = rebuild(tmp_path / f"d{where}-{at}.tar.gz", manifest, lines, fix_root=fix_root)
    now, careful = _both(path, monkeypatch)
    assert now == careful


def test_the_first_piece_is_checked_the_fast_way_after_its_first_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The careful path checks the run's first event (run.started against the manifest) and the
    run.finished (nothing may follow it); the fast path the events between, in the same piece."""
    recs = [*records(), *(open_(10_000 + i, f"{WS}/src/f{i}.c", ["read"]) for i in range(500))]
    path = write(tmp_path / "a.tar.gz", recs)
    careful: list[int] = []
    real = verify.Verifier._careful

    def counting(self: verify.Verifier, lines: list[bytes]) -> Iterator[Any]:
        careful.append(len(lines))
        return real(self, lines)

    monkeypatch.setattr(verify.Verifier, "_careful", counting)
    monkeypatch.setattr(fastpath.Helper, "usable", staticmethod(lambda: False))
    manifest, findings, _, _ = lint.lint_signed(str(path))
    assert manifest["events"] > 500
    assert careful == [1, 1]  # run.started, run.finished
    assert manifest["counts"][fmt.FILE_OPEN] >= 500 and findings == []


def test_the_manifest_is_read_without_inflating_the_events(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """open_bundle reads the manifest alone: a little of the stream, not a CHUNK of events it never
    reads (lint opens a bundle, then makes its pass)."""
    recs = [*records(), *(open_(10_000 + i, f"{WS}/src/f{i}.c", ["read"]) for i in range(3000))]
    path = write(tmp_path / "a.tar.gz", recs)
    produced: list[int] = []
    real = verify.inflate

    def counting(*args: Any) -> Iterator[bytes]:
        for chunk in real(*args):
            produced.append(len(chunk))
            yield chunk

    monkeypatch.setattr(verify, "inflate", counting)
    bundle = reader.open_bundle(path)
    assert bundle.manifest["events"] > 3000
    assert sum(produced) <= 1 << 16 < bundle.manifest["files"][fmt.EVENTS_NAME]["size"]


def test_one_thread_lints_without_an_inflating_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path / "a.tar.gz")
    started: list[bool] = []
    real = verify.Ahead

    def ahead(*args: Any) -> verify.Ahead:
        started.append(True)
        return real(*args)

    monkeypatch.setattr(verify, "Ahead", ahead)
    lint.lint_signed(str(path), parallel=False)
    assert started == []
    lint.lint_signed(str(path))
    assert started == [True]  # `evidence lint`'s way: inflating ahead, in a thread of its own
