"""The reader's fast path over event lines in C (src/fast/_verify.c) against its Python loop
(bundle/fastpath.py `fast_python`, the reference): the same events passed, the same content hashes
and counts, the same line it stops at, on good lines and on generated damage; and lint (which the
agent's fleet publisher runs on every bundle it indexes) says the same of any bundle either way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evidence.bundle import fastpath, schemas
from evidence.bundle import format as fmt
from tests.unit.conftest_bundles import WS, damaged, members, open_, records, write
from tests.unit.test_hostile import HOSTILE
from tests.unit.test_lint_same import _outcome, _rule_runs

needs_c = pytest.mark.skipif(fastpath._verify is None, reason="the compiled module is not built (make setup)")


def test_pure_python_leaves_it_unused() -> None:
    code = "from evidence.bundle import fastpath; print(fastpath._verify is None)"
    env = {**os.environ, "EVIDENCE_PURE_PYTHON": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


@pytest.fixture(scope="module")
def valid() -> tuple[fastpath.Context, list[bytes]]:
    import tempfile

    with tempfile.TemporaryDirectory() as t:
        recs = [*records(), *(open_(10_000 + i, f"{WS}/src/f{i}.c", ["read"]) for i in range(30))]
        manifest, lines = members(write(Path(t) / "a.tar.gz", recs, labels={"job": "x"}))
    ctx = fastpath.Context(
        manifest["run_id"], manifest["source"], fmt.MAX_LINE, fmt.labels_attribute(manifest.get("labels"))
    )
    return ctx, list(lines)


def _run(
    c: bool, lines: list[bytes] | bytes, seq: int, ctx: fastpath.Context, take: int | None = None
) -> Any:
    """What the fast path makes of `lines` (the C's: a list, or a piece of lines each ending with a
    newline): the events it yields, the Passed, or the error raised."""
    passed = fastpath.Passed()
    if c:
        it = fastpath._fast_c(lines, seq, ctx, passed)
    else:
        it = fastpath.fast_python(
            fastpath.split(lines) if isinstance(lines, bytes) else lines, seq, ctx, passed
        )
    got = []
    try:
        for ev in it:
            got.append(ev)
            if take is not None and len(got) == take:
                getattr(it, "close", lambda: None)()  # (a generator: closed; C's iterator: dropped)
                break
    except Exception as e:
        return type(e), str(e)
    return got, passed.n, passed.hashes, passed.counts


@needs_c
def test_good_lines_pass_the_same(valid: tuple[fastpath.Context, list[bytes]]) -> None:
    ctx, lines = valid
    body = lines[1:-1]  # between run.started (the careful path's) and run.finished (it stops there)
    got = _run(True, body, 1, ctx)
    assert got == _run(False, body, 1, ctx)
    assert got[1] == len(body) and len(got[2]) == len(body)
    assert _run(True, b"".join(line + b"\n" for line in body), 1, ctx) == got  # the C over a piece
    assert _run(True, lines, 0, ctx) == _run(False, lines, 0, ctx) == ([], 0, [], {})  # the first: careful
    assert _run(True, body, 1, ctx, take=2) == _run(False, body, 1, ctx, take=2)  # closed early
    assert _run(True, body, 2, ctx) == _run(False, body, 2, ctx) == ([], 0, [], {})  # not its seq


_EDITS = st.sampled_from(
    ["byte", "drop", "swap", "repeat", "field", "space", "escape", "order", "dup", "other"]
)


@needs_c
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    where=st.integers(min_value=0),
    at=st.integers(min_value=0),
    byte=st.integers(min_value=0, max_value=255),
    how=_EDITS,
    value=st.sampled_from(
        [
            None,
            0,
            -1,
            2**64,
            1.5,
            "x",
            "",
            "\u2028",
            "\x7f",
            "é",
            [],
            {},
            {"a": 1},
            True,
            "2023-11-14T22:13:20Z",
        ]
    ),
)
def test_damaged_lines_stop_where_python_stops(
    valid: tuple[fastpath.Context, list[bytes]], where: int, at: int, byte: int, how: str, value: Any
) -> None:
    """A byte changed, a line dropped, swapped or repeated, a field given any JSON value (a float,
    an int past 64 bits, a string to escape), whitespace, a needless escape, keys out of order, a
    key twice, a line that is not an object: the same events pass, then both stop at the same line,
    with the same hashes and counts."""
    ctx, lines = valid
    lines = lines[1:-1]
    i = where % len(lines)
    line = lines[i]
    if how == "byte":
        lines[i] = line[: at % len(line)] + bytes([byte]) + line[at % len(line) + 1 :]
    elif how == "drop":
        del lines[i]
    elif how == "swap":
        j = (i + 1 + at) % len(lines)
        lines[i], lines[j] = lines[j], lines[i]
    elif how == "repeat":
        lines.insert(i, line)
    elif how == "field":  # canonical still: the envelope's or the data's field changed
        ev = orjson.loads(line)
        target = ev if at % 2 else ev["data"]
        target[sorted(target)[byte % len(target)]] = value
        try:
            lines[i] = orjson.dumps(ev, option=orjson.OPT_SORT_KEYS)
        except orjson.JSONEncodeError:
            lines[i] = line.replace(b'"data":{', b'"data":{"big":' + str(2**70).encode() + b",", 1)
    elif how == "space":
        k = at % len(line)
        lines[i] = line[:k] + b" " + line[k:]
    elif how == "escape":
        lines[i] = line.replace(b"/", b"\\/", 1) if byte % 2 else line.replace(b"a", b"\\u0061", 1)
    elif how == "order":
        ev = orjson.loads(line)
        lines[i] = orjson.dumps(dict(reversed(list(ev.items()))))
    elif how == "dup":
        lines[i] = line[:-1] + b',"type":"dev.evidence.file.open"}'
    else:
        lines[i] = json.dumps(value).encode()
    got = _run(True, lines, 1, ctx)
    assert got == _run(False, lines, 1, ctx)
    if not any(b"\n" in line for line in lines):  # the same lines as a piece, read in place by the C
        assert _run(True, b"".join(line + b"\n" for line in lines), 1, ctx) == got


@needs_c
def test_an_unexpected_error_is_raised_both_ways(
    valid: tuple[fastpath.Context, list[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx, lines = valid

    def boom(data: Any) -> None:
        raise RuntimeError("a check that fails")

    tails = fastpath._TYPES[fmt.FILE_OPEN][:2]
    monkeypatch.setitem(fastpath._TYPES, fmt.FILE_OPEN, (*tails, boom))
    monkeypatch.delitem(fastpath._SPECS, fmt.FILE_OPEN)  # (a type without a check in C calls Python's)
    assert (
        _run(True, lines[1:-1], 1, ctx)
        == _run(False, lines[1:-1], 1, ctx)
        == (RuntimeError, "a check that fails")
    )


def _both(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """lint's outcome with the loop in C, and with the Python loop (in this process, one thread)."""
    monkeypatch.setattr(fastpath.Helper, "usable", staticmethod(lambda: False))
    c = _outcome(path, parallel=False)
    with monkeypatch.context() as m:
        m.setattr(fastpath, "_verify", None)
        python = _outcome(path, parallel=False)
    return c, python


@needs_c
@pytest.mark.parametrize("k", range(len(_rule_runs())))
def test_the_rules_bundles_lint_the_same(k: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c, python = _both(write(tmp_path / "a.tar.gz", _rule_runs()[k]), monkeypatch)
    assert c == python and not c[2]


@needs_c
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_bundles_lint_the_same(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make, _ = HOSTILE[case]
    manifest, lines = members(write(tmp_path / "valid.tar.gz"))
    c, python = _both(make(tmp_path / f"{case}.tar.gz", dict(manifest), list(lines)), monkeypatch)
    assert c == python and c[2]


@needs_c
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    where=st.integers(min_value=0), at=st.integers(min_value=0), byte=st.integers(0, 255), fix=st.booleans()
)
def test_damaged_bundles_lint_the_same(
    where: int,
    at: int,
    byte: int,
    fix: bool,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tmp = tmp_path_factory.mktemp("d")
    recs = [*records(), *(open_(10_000 + i, f"{WS}/src/f{i}.c", ["read", "write"]) for i in range(20))]
    c, python = _both(damaged(tmp, recs, where, at, byte, fix), monkeypatch)
    assert c == python


# --- the data checks in C: schemas.compile_checker's checks, the same answer on any value --------------


def _literals() -> list[Any]:
    out: list[Any] = []

    def walk(ann: Any) -> None:
        if typing.get_origin(ann) is typing.Literal:
            out.extend(typing.get_args(ann))
        for a in typing.get_args(ann):
            walk(a)

    for model in fmt.DATA_MODELS.values():
        for field in model.model_fields.values():
            walk(field.annotation)
    return out


_TIME = "2026-11-27T20:00:00.000000001Z"
_scalar = st.sampled_from(
    [None, True, False, 0, 1, -1, 2**63, 0.0, 1.5, "", "x", _TIME, _TIME + "\n", _TIME.replace("T", "t"),
     "２０２６-11-27T20:00:00.000000001Z", _TIME[:-1] + "z", "0" * 30, *_literals()]
)  # fmt: skip
_value = st.recursive(
    _scalar,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["a", "read", ""]), inner, max_size=2)
    ),
    max_leaves=5,
)


@st.composite
def _data(draw: st.DrawFn) -> tuple[str, Any]:
    """An event type and a data value for it: a valid one (optional fields there or not), then up
    to three damages: a field given any value, a field dropped (even a required one), a field the
    model does not have or a key that is not a string; now and then no object at all."""
    etype = draw(st.sampled_from(sorted(fmt.DATA_MODELS)))
    fields = fmt.DATA_MODELS[etype].model_fields
    d: dict[Any, Any] = {}
    for name, field in fields.items():
        if field.is_required() or draw(st.booleans()):
            d[name] = draw(_good(field.annotation, name))
    for _ in range(draw(st.integers(0, 3))):
        how = draw(st.integers(0, 2))
        name = draw(st.sampled_from(sorted(fields)))
        if how == 0:
            d[name] = draw(_value)
        elif how == 1:
            d.pop(name, None)
        else:
            d[draw(st.sampled_from(["extra", 1, "pid"]))] = draw(_value)
    if draw(st.integers(0, 19)) == 0:
        return etype, draw(_value)
    return etype, d


def _good(ann: Any, name: str) -> st.SearchStrategy[Any]:
    origin = typing.get_origin(ann)
    if name in ("first_time", "last_time", "requested_at"):
        return st.just(_TIME)
    if ann is str:
        return st.text(max_size=5)
    if ann is int:
        return st.integers(-5, 5)
    if ann is bool:
        return st.booleans()
    if ann is type(None):
        return st.none()
    if origin is typing.Literal:
        return st.sampled_from(typing.get_args(ann))
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(_good(a, name) for a in typing.get_args(ann)))
    if origin is list:
        return st.lists(_good(typing.get_args(ann)[0], name), max_size=3)
    if origin is dict:
        return st.dictionaries(st.text(max_size=3), _good(typing.get_args(ann)[1], name), max_size=2)
    raise TypeError(ann)


@needs_c
def test_every_type_has_its_check_in_c() -> None:
    assert set(fastpath._SPECS) == set(fmt.DATA_MODELS)


@needs_c
@settings(max_examples=3000, deadline=None)
@given(case=_data())
def test_the_data_checks_in_c_say_what_python_says(case: tuple[str, Any]) -> None:
    etype, data = case
    try:
        python = schemas.DATA_CHECKERS[etype](data) is None
    except TypeError:  # (its reason sorts the keys: one that is not a string, which JSON never has)
        python = False  # the fast path's end too (TypeError is among what ends it)
    assert fastpath._verify.valid(fastpath._SPECS[etype], data) == python


@needs_c
def test_a_valid_and_a_few_invalid_data_by_hand() -> None:
    spec = fastpath._SPECS[fmt.FILE_OPEN]
    good = {
        "access": ["read"], "count": 1, "exe": None, "first_time": _TIME, "flags": ["O_RDONLY"],
        "last_time": _TIME, "path": "/a", "pid": 1, "ppid": 0, "raw_path": "a", "result": 0,
    }  # fmt: skip
    assert schemas.DATA_CHECKERS[fmt.FILE_OPEN](good) is None and fastpath._verify.valid(spec, good)
    for bad in (
        {"count": True}, {"count": 1.0}, {"access": ["read", "fly"]}, {"access": "read"},
        {"result": 1}, {"result": False}, {"last_time": _TIME + "\n"}, {"flags": [1]}, {"mystery": 1},
    ):  # fmt: skip
        data = {**good, **bad}
        assert schemas.DATA_CHECKERS[fmt.FILE_OPEN](data) is not None
        assert not fastpath._verify.valid(spec, data)
    assert not fastpath._verify.valid(spec, {k: v for k, v in good.items() if k != "pid"})


@needs_c
def test_seqs_past_what_c_counts_go_the_python_way(valid: tuple[fastpath.Context, list[bytes]]) -> None:
    """No bundle has 2**63 lines, but the C path never passes what the Python path does not: the
    line after seq 2**63 - 1 is checked as seq 2**63, not a wrapped one."""
    ctx, lines = valid
    top = 2**63 - 1

    def at(seq: int, line: bytes) -> bytes:
        ev = orjson.loads(line)
        ev["seq"], ev["id"] = seq, f"{ctx.run_id}:{seq}"
        return orjson.dumps(ev, option=orjson.OPT_SORT_KEYS)

    good = lines[5]
    for seqs in ([top, top + 1], [top, -(2**63)], [top - 1, top], [top + 1, top + 2]):
        body = [at(s, good) for s in seqs]
        got = _run(True, body, seqs[0], ctx)
        assert got == _run(False, body, seqs[0], ctx), seqs
    assert _run(True, [at(top, good), at(top + 1, good)], top, ctx)[1] == 2  # both passed (in Python)
    for after in (top + 1, -(2**63)):  # the C iterator itself stops after seq 2**63 - 1, wraps never
        passed = fastpath.Passed()
        it = fastpath._verify.lines(
            [at(top, good), at(after, good)], top, *fastpath._envelope_parts(ctx), fastpath._CORE_MIDDLE,
            fastpath._TYPES, fastpath._SPECS, orjson.loads, orjson.dumps, orjson.OPT_SORT_KEYS, fastpath.TIME,
            passed.hashes, passed.counts, fastpath._ERRORS,
        )  # fmt: skip
        assert len(list(it)) == passed.n == 1


_BORROWED = """
import orjson, sys
from evidence.bundle import fastpath
from evidence.bundle import format as fmt
which, line, seq, ctx = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3]), orjson.loads(sys.argv[4])
held = {}
def loads(b):
    held["ev"] = orjson.loads(b)
    return held["ev"]
real = fastpath._TYPES[fmt.FILE_OPEN][2]
def check(data):  # replaces a value of the line's dict with an equal one: the old one is freed
    ev = held["ev"]
    ev[which] = orjson.loads(orjson.dumps(ev[which]))
    return real(data)
types = {**fastpath._TYPES, fmt.FILE_OPEN: (*fastpath._TYPES[fmt.FILE_OPEN][:2], check)}
passed = fastpath.Passed()
it = fastpath._verify.lines([line], seq, *fastpath._envelope_parts(fastpath.Context(*ctx)), fastpath._CORE_MIDDLE,
    types, {}, loads, orjson.dumps, orjson.OPT_SORT_KEYS, fastpath.TIME, passed.hashes, passed.counts,
    fastpath._ERRORS)
print(len(list(it)), passed.hashes == [fmt.content_hash(orjson.loads(line))])
"""


@needs_c
@pytest.mark.parametrize("which", ["type", "data", "time", "subject"])
def test_values_a_python_check_replaces_are_still_held(
    valid: tuple[fastpath.Context, list[bytes]], which: str
) -> None:
    """The C path holds what it read of the line (its type, data, time, subject) while a Python
    check runs (a type without a check in C), so a check that changes the line's dict frees nothing
    still read (PYTHONMALLOC=debug makes a read of freed memory show)."""
    ctx, lines = valid
    line = lines[5]
    seq = orjson.loads(line)["seq"]
    args = [which, line.decode(), str(seq), json.dumps([ctx.run_id, ctx.source, ctx.line, ctx.labels])]
    env = {**os.environ, "PYTHONMALLOC": "debug"}
    out = subprocess.run([sys.executable, "-c", _BORROWED, *args], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "True"]
