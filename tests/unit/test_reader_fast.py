"""The reader's fast path and its helper process check exactly what the careful path checks.

The fast path (fastpath.fast) computes content hashes from slices of the canonical line and checks
pieces of events on a second CPU (fastpath.Helper). A small bundle is one piece, checked in this
process, so these tests shrink the pieces to a line or so and force the helper.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from evidence.bundle import container, fastpath, reader, schemas, verify
from evidence.bundle import format as fmt
from tests.unit.conftest_bundles import members, write
from tests.unit.test_hostile import HOSTILE


def _read(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """(events yielded, problems) of one verifying pass."""
    seen: list[dict[str, Any]] = []
    try:
        for ev in reader.open_bundle(path).events():
            seen.append(ev)
    except reader.VerificationError as e:
        return seen, e.problems
    return seen, []


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Pieces of about one line, and the helper process for any bundle."""
    monkeypatch.setattr(container, "CHUNK", 200)
    monkeypatch.setattr(verify, "PARALLEL_MIN", 0)
    monkeypatch.setattr(fastpath.Helper, "usable", staticmethod(lambda: True))
    yield
    assert multiprocessing.active_children() == []  # every helper was ended


@pytest.fixture(scope="module")
def valid(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[bytes]]:
    return members(write(tmp_path_factory.mktemp("valid") / "a.tar.gz"))


def test_a_valid_bundle_reads_the_same(tmp_path: Path, small_pieces: None) -> None:
    path = write(tmp_path / "a.tar.gz")
    _, lines = members(path)
    events, problems = _read(path)
    assert problems == []
    assert events == [orjson.loads(x) for x in lines]


def test_pieces_of_many_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(container, "CHUNK", 2000)
    monkeypatch.setattr(verify, "PARALLEL_MIN", 0)
    monkeypatch.setattr(fastpath.Helper, "usable", staticmethod(lambda: True))
    path = write(tmp_path / "a.tar.gz")
    _, lines = members(path)
    assert _read(path) == ([orjson.loads(x) for x in lines], [])


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_bundles_give_the_same_problems(
    case: str, valid: tuple[dict[str, Any], list[bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make, _ = HOSTILE[case]
    manifest, lines = valid
    path = make(tmp_path / f"{case}.tar.gz", dict(manifest), list(lines))
    with monkeypatch.context() as m:
        m.setattr(fastpath.Helper, "usable", staticmethod(lambda: False))
        one_pass = _read(path)
    assert one_pass[1], "a hostile bundle must fail"
    monkeypatch.setattr(container, "CHUNK", 200)
    monkeypatch.setattr(verify, "PARALLEL_MIN", 0)
    monkeypatch.setattr(fastpath.Helper, "usable", staticmethod(lambda: True))
    assert _read(path) == one_pass
    assert _fold(path)[1] == one_pass[1]  # folding, the same problems
    assert multiprocessing.active_children() == []


def _dead_helper(*args: Any) -> None:
    os._exit(3)


def test_a_helper_that_dies_changes_nothing(
    tmp_path: Path, small_pieces: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fastpath, "serve", _dead_helper)
    path = write(tmp_path / "a.tar.gz")
    _, lines = members(path)
    assert _read(path) == ([orjson.loads(x) for x in lines], [])
    folds, problems = _fold(path)  # and folding
    assert problems == []
    assert [ev for f in folds for ev in f.events] == [orjson.loads(x) for x in lines]


def test_stopping_early_ends_the_helper(tmp_path: Path, small_pieces: None) -> None:
    path = write(tmp_path / "a.tar.gz")
    stream = reader.open_bundle(path).events()
    next(stream)
    next(stream)
    stream.close()  # the fixture checks that no helper is left


# --- the content hash from slices ------------------------------------------------------------------

_RUN_IDS = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
_TEXT = st.text(max_size=40)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    run_id=_RUN_IDS,
    seq=st.integers(min_value=1, max_value=10**12),
    which=st.integers(min_value=1),
    subject=_TEXT,
    strings=st.lists(_TEXT, min_size=1, max_size=4),
    labels=st.dictionaries(_TEXT, _TEXT, max_size=3),
)
def test_fast_content_hash_is_format_content_hash(
    valid: tuple[dict[str, Any], list[bytes]],
    run_id: str,
    seq: int,
    which: int,
    subject: str,
    strings: list[str],
    labels: dict[str, str],
) -> None:
    """Any valid event (any run id, seq, subject, strings in its data, including quotes,
    backslashes, control characters, non-ASCII and the text of other attributes) passes the fast
    path with the content hash that format.content_hash gives."""
    _, lines = valid
    ev = orjson.loads(lines[which % len(lines)])
    source = fmt.source_for(run_id)
    ev.update(id=fmt.event_id(run_id, seq), runid=run_id, seq=seq, source=source, subject=subject)
    data = ev["data"]
    for key, value in zip(
        sorted(k for k, v in data.items() if type(v) is str and "time" not in k), strings, strict=False
    ):
        data[key] = value
    if "argv" in data:
        data["argv"] = strings + [',"subject":', '","datacontenttype":"application/json","id":"']
    if "labels" in data:
        data["labels"] = labels
    assume(schemas.DATA_CHECKERS[ev["type"]](data) is None)  # e.g. a literal field took a string
    line = orjson.dumps(ev, option=orjson.OPT_SORT_KEYS)  # as the writer has it
    passed = fastpath.Passed()
    out = list(fastpath.fast([line], seq, fastpath.Context(run_id, source, fmt.MAX_LINE), passed))
    if ev["type"] in (fmt.RUN_STARTED, fmt.RUN_FINISHED):  # left to the careful path
        assert out == [] and passed.hashes == []
        return
    assert out == [ev]
    assert passed.hashes == [fmt.content_hash(ev)]
    assert passed.counts == {ev["type"]: 1}


@given(garbage=st.binary(max_size=300))
def test_fast_path_refuses_what_it_cannot_prove(garbage: bytes) -> None:
    """A line that is not a valid event never passes the fast path (it says no; the careful path
    says why)."""
    passed = fastpath.Passed()
    ctx = fastpath.Context("run-x", fmt.source_for("run-x"), fmt.MAX_LINE)
    assert list(fastpath.fast([garbage], 1, ctx, passed)) == []
    assert passed.n == 0


# --- the time attribute ----------------------------------------------------------------------------

_GOOD_TIME = "2023-11-14T22:13:20.000000000Z"
_TIMES = st.one_of(
    st.from_regex(schemas.py_regex(schemas.TIME_PATTERN)),
    st.sampled_from([_GOOD_TIME, _GOOD_TIME + "\n", _GOOD_TIME[:-1], "2023-11-14T22:13:20.00000000\u0663Z"]),
    st.builds(
        lambda i, c: _GOOD_TIME[:i] + c + _GOOD_TIME[i + 1 :],
        st.integers(min_value=0, max_value=29),
        st.characters(codec="utf-8"),  # no lone surrogates: a bundle line is UTF-8
    ),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.integers(min_value=1), time=_TIMES, last=_TIMES, same=st.booleans())
def test_fast_path_time_agrees_with_the_pattern(
    valid: tuple[dict[str, Any], list[bytes]], which: int, time: str, last: str, same: bool
) -> None:
    """The event's time passes the fast path exactly when it matches TIME_PATTERN, also when it
    equals the data's last_time (which the data check has matched by then)."""
    _, lines = valid
    ev = orjson.loads(lines[which % len(lines)])
    assume(ev["type"] not in (fmt.RUN_STARTED, fmt.RUN_FINISHED))
    data = ev["data"]
    if "last_time" in data:
        data["last_time"] = time if same else last
    ev["time"] = time
    expected = fastpath.TIME(time) is not None and schemas.DATA_CHECKERS[ev["type"]](data) is None
    line = orjson.dumps(ev, option=orjson.OPT_SORT_KEYS)
    passed = fastpath.Passed()
    ctx = fastpath.Context(ev["runid"], ev["source"], fmt.MAX_LINE, ev.get("labels"))
    out = list(fastpath.fast([line], ev["seq"], ctx, passed))
    assert out == ([ev] if expected else [])
    if expected:
        assert passed.hashes == [fmt.content_hash(ev)]


# --- folding -------------------------------------------------------------------------------------


class _Collect:
    """A fold that keeps what it is fed, and where it ran."""

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.pid = os.getpid()
        self.events: list[dict[str, Any]] = []

    def feed(self, ev: dict[str, Any]) -> None:
        self.events.append(ev)


def _fold(path: Path, start: Any = _Collect) -> tuple[list[_Collect], list[str]]:
    folds: list[_Collect] = []
    try:
        for f in reader.open_bundle(path).fold(start):
            folds.append(f)
    except reader.VerificationError as e:
        return folds, e.problems
    return folds, []


def test_folds_cover_every_event_once_in_order_on_both_cpus(tmp_path: Path, small_pieces: None) -> None:
    path = write(tmp_path / "a.tar.gz")
    _, lines = members(path)
    folds, problems = _fold(path)
    assert problems == []
    assert [ev for f in folds for ev in f.events] == [orjson.loads(x) for x in lines]
    assert all(f.events[0]["seq"] == f.seq for f in folds)
    assert len({f.pid for f in folds}) == 2  # some folded by the helper, some here


def test_a_fold_that_does_not_pickle_runs_here(tmp_path: Path, small_pieces: None) -> None:
    path = write(tmp_path / "a.tar.gz")
    _, lines = members(path)
    folds, problems = _fold(path, lambda seq: _Collect(seq))
    assert problems == []
    assert [ev for f in folds for ev in f.events] == [orjson.loads(x) for x in lines]
    assert {f.pid for f in folds} == {os.getpid()}
