"""Red team of the verifying reader's compiled fast path (src/fast/_verify.c), as a bundle's author
would attack it: a bundle is attacker-controlled input on a reviewer's laptop, and `lint`, `verify`,
`show`, `diff` and the fleet's index run this C over its event lines.

Two questions. Does the C pass anything that the Python loop (bundle/fastpath.py `fast_python`, the
reference) or the careful path (bundle/verify.py `_careful`) rejects, or count and hash it
differently? Hypothesis builds event lines around the real envelope with adversarial data (bool for
int, floats, -0.0, ints at and past 64 bits, str for int and the reverse, nesting, extra, missing
and null fields, duplicate keys, escapes, non-ASCII, whitespace, number spellings, last_time games,
unknown types, wrong seqs) and whole bundles made by the writer and then damaged; `lint` is compared
in this process and through the CLI with and without EVIDENCE_PURE_PYTHON=1. And is it memory safe
against odd callers: lists changed under a live iterator, callbacks that raise or return odd
objects, huge lines, a seq at the top of its range?

EVIDENCE_RED_VERIFY_SO=<path of a _verify build> runs these tests against that build instead, and
EVIDENCE_RED_EXAMPLES scales the generated cases; e.g. with AddressSanitizer and UBSan (the CLI test
is skipped then: the CLI imports the normal build):
  gcc -shared -fPIC -g -O1 -fsanitize=address,undefined -I/usr/include/python3.11 -Isrc/fast \\
      src/fast/_verify.c -lcrypto -o /tmp/asan/_verify.so
  LD_PRELOAD=$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so) \\
  ASAN_OPTIONS=detect_leaks=0 PYTHONMALLOC=malloc EVIDENCE_RED_VERIFY_SO=/tmp/asan/_verify.so \\
    EVIDENCE_RED_EXAMPLES=5000 .venv/bin/python -m pytest -q tests/unit/test_red_verify.py"""

from __future__ import annotations

import functools
import gc
import hashlib
import importlib.util
import itertools
import json
import os
import random
import re
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evidence.bundle import attestation, canonical, fastpath, lint, reader, schemas, signing, verify
from evidence.bundle import format as fmt
from tests.unit.conftest_bundles import WS, members, open_, pack, rebuild, records, write

_SO = os.environ.get("EVIDENCE_RED_VERIFY_SO")
_EXAMPLES = int(os.environ.get("EVIDENCE_RED_EXAMPLES", "300"))


def _load_so(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("_verify", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_C: Any = _load_so(_SO) if _SO else fastpath._verify
needs_c = pytest.mark.skipif(_C is None, reason="the compiled module is not built (make setup)")
SORT = orjson.OPT_SORT_KEYS
TIME = "2026-11-27T20:00:00.000000001Z"
TIME2 = "2026-11-27T20:00:00.000000002Z"
_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path runs the build under test (the sanitizer's when EVIDENCE_RED_VERIFY_SO says)."""
    if _C is not None:
        monkeypatch.setattr(fastpath, "_verify", _C)


@functools.cache
def _ctx(labels: bool = True) -> fastpath.Context:
    """A run's context: with labels (to escape), or none."""
    with tempfile.TemporaryDirectory() as t:
        over = {"labels": {"job": "x", "é": "\u2028"}} if labels else {}
        manifest, _ = members(write(Path(t) / "a.tar.gz", **over))
    return fastpath.Context(
        manifest["run_id"], manifest["source"], fmt.MAX_LINE, fmt.labels_attribute(manifest.get("labels"))
    )


_SAME = object()


def _event(
    ctx: fastpath.Context, seq: Any, etype: Any, data: Any, subject: Any, time: Any, labels: Any = _SAME
) -> dict[str, Any]:
    ev = {
        "data": data,
        "datacontenttype": fmt.DATACONTENTTYPE,
        "id": f"{ctx.run_id}:{seq}",
        "runid": ctx.run_id,
        "seq": seq,
        "source": ctx.source,
        "specversion": fmt.SPECVERSION,
        "subject": subject,
        "time": time,
        "type": etype,
    }
    labels = ctx.labels if labels is _SAME else labels
    if labels is not None:
        ev["labels"] = labels
    return ev


def _dumps(ev: Any) -> bytes:
    """Canonical when orjson can write it; else (an int past 64 bits) the standard library's."""
    try:
        return orjson.dumps(ev, option=SORT)
    except orjson.JSONEncodeError:
        return json.dumps(ev, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _good_line(ctx: fastpath.Context, seq: int) -> bytes:
    data = {"count": 3, "kind": "ring", "where": "kernel"}
    return _dumps(_event(ctx, seq, fmt.LOSS, data, "loss", TIME))


def _run(c: bool, lines: list[bytes], seq: int, ctx: fastpath.Context) -> Any:
    """What the fast path makes of `lines`: (events, n, hashes, counts), or the error raised."""
    passed = fastpath.Passed()
    it = fastpath._fast_c(lines, seq, ctx, passed) if c else fastpath.fast_python(lines, seq, ctx, passed)
    try:
        got = list(it)
    except Exception as e:
        return type(e), str(e)
    return got, passed.n, passed.hashes, passed.counts


_ENVELOPE = {
    "data",
    "datacontenttype",
    "id",
    "runid",
    "seq",
    "source",
    "specversion",
    "subject",
    "time",
    "type",
}
_IS_TIME = schemas.py_regex(schemas.TIME_PATTERN).match


def _careful(line: bytes, seq: int, ctx: fastpath.Context) -> str | None:
    """The careful path's verdict on one line in the middle of a run (bundle/verify.py `_careful`,
    restated): its content hash if it is a valid event there, else None."""
    try:
        ev = orjson.loads(line)
        good = (
            orjson.dumps(ev, option=SORT) == line
            and ev.keys() == (_ENVELOPE | {"labels"} if ctx.labels is not None else _ENVELOPE)
            and ev.get("labels") == ctx.labels
            and ev["id"] == ctx.id_prefix + str(seq)
            and ev["seq"] == seq
            and type(ev["seq"]) is int
            and ev["runid"] == ctx.run_id
            and ev["source"] == ctx.source
            and ev["specversion"] == fmt.SPECVERSION
            and ev["datacontenttype"] == fmt.DATACONTENTTYPE
            and type(ev["subject"]) is str
            and type(ev["time"]) is str
            and _IS_TIME(ev["time"]) is not None
            and ev["type"] not in (fmt.RUN_STARTED, fmt.RUN_FINISHED)
            and schemas.DATA_CHECKERS[ev["type"]](ev["data"]) is None
        )
    except (orjson.JSONDecodeError, orjson.JSONEncodeError, AttributeError, KeyError, TypeError):
        return None
    return fmt.content_hash(ev) if good else None


# --- adversarial values -----------------------------------------------------------------------


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
    return sorted(set(out), key=repr)


_SCALARS = [
    None, True, False, 0, 1, -1, 2**31, 2**63 - 1, 2**63, -(2**63), 2**64 - 1, 2**64, -(2**63) - 1, 10**30,
    0.0, -0.0, 1.0, 1.5, 1e300, -1e-300, float("nan"), float("inf"),
    "", "x", "0", "1", "true", "null", "é", "\u2028", "\x00", "\x7f", "\x1f", "\\", '"', "/", "\U0001f600",
    "\ud7ff", "\ufeff", TIME, TIME2, TIME + "\n", TIME + " ", " " + TIME, TIME.replace("T", "t"),
    TIME[:-1] + "z", TIME.replace("1Z", "\u0661Z"), "２０２６" + TIME[4:], "0" * 30, TIME[:-2] + "Z",
    *_literals(),
]  # fmt: skip
_scalar = st.sampled_from(_SCALARS)


def _nest(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    keys = st.sampled_from(["a", "read", "", "pid", "last_time", "é"])
    return st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=2)


_value = st.recursive(_scalar, _nest, max_leaves=6)


def _good(ann: Any, name: str) -> st.SearchStrategy[Any]:
    origin = typing.get_origin(ann)
    if name in schemas.TIME_FIELDS:
        return st.sampled_from([TIME, TIME2])
    if ann is str:
        return st.text(max_size=4) | st.sampled_from(["é", "\u2028", "\U0001f600", "\\", '"', "</"])
    if ann is int:
        return st.sampled_from([0, 1, -1, 2**63 - 1, -(2**63), 2**64 - 1]) | st.integers(-5, 5)
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


@st.composite
def _data(draw: st.DrawFn, etype: str, clean: bool = False) -> Any:
    """Valid data for `etype`, then (unless clean) now and then a few damages."""
    fields = fmt.DATA_MODELS[etype].model_fields
    d: dict[str, Any] = {}
    for name, field in fields.items():
        if field.is_required() or draw(st.booleans()):
            d[name] = draw(_good(field.annotation, name))
    for _ in range(0 if clean else draw(st.sampled_from([0, 0, 0, 1, 2, 3]))):
        how = draw(st.integers(0, 2))
        name = draw(st.sampled_from(sorted(fields)))
        if how == 0:
            d[name] = draw(_value)
        elif how == 1:
            d.pop(name, None)
        else:
            d[draw(st.sampled_from(["extra", "Pid", "pid ", "last_time", "first_time"]))] = draw(_value)
    if not clean and draw(st.integers(0, 29)) == 0:
        return draw(_value)
    return d


_ODD_TYPES = [fmt.RUN_STARTED, fmt.RUN_FINISHED, "dev.evidence.nope", "", fmt.LOSS.upper(), fmt.LOSS + " ",
              1, None, True, 1.5, ["x"], {"a": 1}]  # fmt: skip


def _respell(line: bytes, how: int, k: int) -> bytes:
    """The same JSON value (or nearly) written another way."""
    edits: list[Callable[[bytes], bytes]] = [
        lambda b: b.replace(b"/", b"\\/", 1),
        lambda b: b.replace(b"a", b"\\u0061", 1),
        lambda b: b.replace("é".encode(), b"\\u00e9", 1),
        lambda b: b.replace("\u2028".encode(), b"\\u2028", 1),
        lambda b: b.replace("\U0001f600".encode(), b"\\ud83d\\ude00", 1),
        lambda b: b.replace(b":1,", b":1.0,", 1),
        lambda b: b.replace(b":0,", b":-0,", 1),
        lambda b: b.replace(b":1,", b":1e0,", 1),
        lambda b: b.replace(b":3,", b":03,", 1),
        lambda b: b.replace(b":true", b":1", 1),
        lambda b: b.replace(b":1,", b":true,", 1),
        lambda b: b[:-1] + b',"time":"' + TIME.encode() + b'"}',
        lambda b: b[:-1] + b',"seq":' + str(k).encode() + b"}",
        lambda b: b.replace(b'"data":{', b'"data":{"count":1,', 1),
        lambda b: b.replace(b'"data":{', b'"data":{"last_time":"' + TIME2.encode() + b'",', 1),
        lambda b: b.replace(b'"subject":', b'"subject":"x","subject":', 1),
        lambda b: b.replace(b'"type":', b'"type":"dev.evidence.nope","type":', 1),
        lambda b: b.replace(b',"time"', b' ,"time"', 1),
        lambda b: b + b" ",
        lambda b: b + b"\n",
        lambda b: b"\xef\xbb\xbf" + b,
        lambda b: b.replace(b'"seq":', b'"seq":0', 1),
        lambda b: b.replace(b'"seq":', b'"seq":-', 1),
        lambda b: b.replace(b'"data":{', b'"data":{"big":' + str(2**64).encode() + b",", 1),
        lambda b: b.replace(b'"data":{', b'"data":{"big":-' + str(2**63).encode() + b",", 1),
        lambda b: b[: k % len(b)] + b[k % len(b) + 1 :],
        lambda b: b[: k % len(b)] + bytes([k % 256]) + b[k % len(b) + 1 :],
    ]
    return edits[how % len(edits)](line)


@st.composite
def _case(draw: st.DrawFn) -> tuple[list[bytes], int, bool]:
    """Three lines from seq on: good, a candidate, good. Half the candidates are valid events (of
    any type, with any valid data), so that what passes is compared as much as what stops."""
    labelled = draw(st.booleans())
    ctx = _ctx(labelled)
    seq = draw(st.sampled_from([1, 9, 10, 99, 2**31, 2**62]))
    if draw(st.booleans()):
        etype = draw(st.sampled_from(sorted(fastpath._TYPES)))
        data = draw(_data(etype, clean=True))
        time = draw(st.sampled_from([data.get("last_time", TIME), TIME, TIME2]))
        subject = draw(
            st.text(max_size=6) | st.sampled_from(["é", "\U0001f600", "\u2028", "\x00", "\\", '"'])
        )
        line = _dumps(_event(ctx, seq + 1, etype, data, subject, time))
        return [_good_line(ctx, seq), line, _good_line(ctx, seq + 2)], seq, labelled
    etype = draw(st.sampled_from(sorted(fastpath._TYPES)) | st.sampled_from(_ODD_TYPES))
    data = draw(_data(etype)) if type(etype) is str and etype in fmt.DATA_MODELS else draw(_value)
    last = data.get("last_time") if type(data) is dict else None
    time = (
        draw(st.sampled_from([last, last, TIME]) | _scalar)
        if last is not None
        else draw(st.just(TIME) | _scalar)
    )
    subject = draw(st.text(max_size=4) | st.sampled_from(["é", "\U0001f600", "\u2028", "\x00"]) | _scalar)
    at = draw(st.sampled_from([seq + 1, seq + 1, seq + 1, seq, seq + 2, -(seq + 1)]))
    labels = draw(
        st.sampled_from([_SAME, _SAME, _SAME, None, '{"job":"y"}', "", 1, _ctx(not labelled).labels])
    )
    line = _dumps(_event(ctx, at, etype, data, subject, time, labels))
    if draw(st.integers(0, 2)) == 0:
        line = _respell(line, draw(st.integers(0, 100)), draw(st.integers(0, 10**6)))
    return [_good_line(ctx, seq), line, _good_line(ctx, seq + 2)], seq, labelled


@needs_c
@settings(max_examples=_EXAMPLES * 5, deadline=None)
@given(case=_case())
def test_lines_pass_in_c_exactly_as_in_python_and_the_careful_path(
    case: tuple[list[bytes], int, bool],
) -> None:
    """The C and the Python loop agree on every line (events, hashes, counts, where they stop), and
    every event the C passes is one the careful path passes, with the careful path's content hash."""
    lines, seq, labelled = case
    ctx = _ctx(labelled)
    c = _run(True, lines, seq, ctx)
    assert c == _run(False, lines, seq, ctx)
    events, n, hashes, counts = c
    assert n == len(events) == len(hashes) >= 1
    for k in range(n):
        assert _careful(lines[k], seq + k, ctx) == hashes[k]


_TOKENS = [b'"', b"\\", b"\\u0000", b"\\ud800", b"\\udc00", b"1", b"-", b".", b"e", b"true", b"null", b"{", b"}",
           b"[", b"]", b",", b":", b" ", b"\n", "é".encode(), b"\xff", b"\xc3", TIME.encode(), str(2**64).encode()]  # fmt: skip


@needs_c
@pytest.mark.parametrize("seed", [1, 2])
def test_random_splices_of_valid_lines(seed: int) -> None:
    """Valid events of a real run, re-numbered, then bytes inserted, cut, changed or copied from
    elsewhere in the line (JSON tokens among them): the C and Python agree, and what passes is what
    the careful path passes (ad hoc, 100,000 of these passed under ASan and UBSan)."""
    rnd = random.Random(seed)
    with tempfile.TemporaryDirectory() as t:
        recs = [*records(), *(open_(10_000 + i, f"{WS}/src/é{i}.c", ["read", "write"]) for i in range(5))]
        _, run = members(write(Path(t) / "a.tar.gz", recs))
    base = [orjson.loads(b) for b in run[1:-1]]
    passed = 0
    for _ in range(_EXAMPLES * 10):
        ctx = _ctx(rnd.random() < 0.5)
        seq = rnd.choice([1, 7, 99, 2**40])
        ev = {k: v for k, v in rnd.choice(base).items() if k != "labels"}
        line = _dumps(_event(ctx, seq + 1, ev["type"], ev["data"], ev["subject"], ev["time"]))
        for _ in range(rnd.choice([0, 1, 1, 2, 3])):
            k = rnd.randrange(len(line) + 1)
            how = rnd.randrange(4)
            if how == 0:
                line = line[:k] + rnd.choice(_TOKENS) + line[k:]
            elif how == 1:
                line = line[:k] + line[k + rnd.randint(1, 8) :]
            elif how == 2:
                line = line[:k] + bytes([rnd.randrange(256)]) + line[k + 1 :]
            else:
                j = rnd.randrange(len(line) + 1)
                line = line[:k] + line[j : j + rnd.randint(1, 30)] + line[k:]
        lines = [_good_line(ctx, seq), line, _good_line(ctx, seq + 2)]
        c = _run(True, lines, seq, ctx)
        assert c == _run(False, lines, seq, ctx), line
        for k in range(c[1]):
            assert _careful(lines[k], seq + k, ctx) == c[2][k], line
        passed += c[1] == 3
    assert passed > _EXAMPLES  # (about a quarter of the candidates are valid events still)


@needs_c
@pytest.mark.parametrize(
    "data",
    [
        {"count": True, "kind": "k"},  # bool for int
        {"count": 1.0, "kind": "k"},
        {"count": -0.0, "kind": "k"},
        {"count": 1, "kind": 1},  # int for str
        {"count": "1", "kind": "k"},  # str for int
        {"count": 1, "kind": "k", "where": "KERNEL"},
        {"count": 1, "kind": "k", "where": None},  # null for an optional field without None
        {"count": 1, "kind": "k", "extra": 1},
        {"count": 1},
        {"count": 1, "kind": ["k"]},
        {"count": 1, "kind": {"k": "k"}},
        {"count": 1, "kind": "k", "last_time": TIME},  # a last_time the type does not have
    ],
)
def test_damaged_data_is_not_passed(data: dict[str, Any]) -> None:
    ctx = _ctx()
    line = _dumps(_event(ctx, 1, fmt.LOSS, data, "s", TIME))
    assert _run(True, [line], 1, ctx) == _run(False, [line], 1, ctx) == ([], 0, [], {})


@needs_c
@pytest.mark.parametrize(
    ("time", "last_time"),
    [
        (TIME + "\n", TIME + "\n"),  # equal, both not times
        ("x", "x"),
        (TIME, TIME + "\n"),
        ("\u0661" * 30, "\u0661" * 30),
        (TIME.replace("T", "t"), TIME.replace("T", "t")),
    ],
)
def test_last_time_games(time: str, last_time: str) -> None:
    """The envelope's time is let through unchecked when it equals the data's last_time: only ever
    a last_time that the data check has found to be a time."""
    ctx = _ctx()
    base = {"access": ["read"], "exe": None, "first_time": TIME, "flags": [], "path": "/a", "pid": 1, "ppid": 0,
            "raw_path": "a", "result": 0}  # fmt: skip
    line = _dumps(_event(ctx, 1, fmt.FILE_OPEN, {**base, "last_time": last_time}, "s", time))
    assert _run(True, [line], 1, ctx) == _run(False, [line], 1, ctx) == ([], 0, [], {})


@needs_c
def test_a_valid_line_under_every_spelling_is_passed_only_canonical() -> None:
    """A valid event: passed as written canonically, and by no other spelling (escapes, spaces,
    number forms, keys twice) both ways."""
    ctx = _ctx()
    data = {"access": ["read"], "count": 1, "exe": "/usr/bin/é", "first_time": TIME, "flags": ["O_RDONLY"],
            "last_time": TIME, "path": "/a/\u2028/\U0001f600", "pid": 1, "ppid": 0, "raw_path": "a", "result": 0}  # fmt: skip
    line = _dumps(_event(ctx, 1, fmt.FILE_OPEN, data, "/a/é", TIME))
    ok = _run(True, [line], 1, ctx)
    assert ok == _run(False, [line], 1, ctx) and ok[1] == 1 and ok[2] == [_careful(line, 1, ctx)]
    for how in range(25):
        other = _respell(line, how, 7)
        if other != line:
            assert _run(True, [other], 1, ctx) == _run(False, [other], 1, ctx) == ([], 0, [], {}), how


# --- the data checks alone: any Python value, including ones orjson never makes ------------------


class _Str(str):
    pass


class _Int(int):
    pass


class _Dict(dict):  # type: ignore[type-arg]
    pass


class _List(list):  # type: ignore[type-arg]
    pass


_odd = st.sampled_from([_Str("x"), _Int(1), _Dict(), _List(), b"x", (1,), frozenset(), object()])


@st.composite
def _any_data(draw: st.DrawFn) -> tuple[str, Any]:
    etype = draw(st.sampled_from(sorted(fmt.DATA_MODELS)))
    d = draw(_data(etype))
    if type(d) is dict and d and draw(st.integers(0, 3)) == 0:
        d[draw(st.sampled_from(sorted(d)))] = draw(_odd)
    if draw(st.integers(0, 9)) == 0:
        return etype, _Dict(d) if type(d) is dict else draw(_odd)
    return etype, d


@needs_c
@settings(max_examples=_EXAMPLES * 5, deadline=None)
@given(case=_any_data())
def test_valid_says_what_the_python_check_says(case: tuple[str, Any]) -> None:
    etype, data = case
    python = schemas.DATA_CHECKERS[etype](data) is None
    assert _C.valid(fastpath._SPECS[etype], data) is python


@needs_c
def test_valid_holds_on_deep_and_wide_values() -> None:
    spec = fastpath._SPECS[fmt.POLICY_LIMIT]
    deep: Any = 1
    for _ in range(100_000):
        deep = [deep]
    wide = {"count": 1, "kind": "wall", "limit": "wall", "pids": list(range(1_000_000))}
    for data in ({"count": 1, "kind": "wall", "limit": "wall", "pids": deep}, wide, {"pids": deep}):
        assert _C.valid(spec, data) is (schemas.DATA_CHECKERS[fmt.POLICY_LIMIT](data) is None)


@needs_c
def test_valid_refuses_a_spec_that_is_not_one() -> None:
    for spec in ((("pid", True, False, (99,)),), (("pid", True, False, ()),), (1,), [("pid",)]):
        with pytest.raises(ValueError, match="spec"):
            _C.valid(spec, {"pid": 1})


# --- whole bundles, made by the writer, then damaged ---------------------------------------------


def _lines_of_a_run(tmp: Path) -> tuple[dict[str, Any], list[bytes]]:
    recs = [*records(), *(open_(10_000 + i, f"{WS}/src/f{i}.c", ["read"]) for i in range(5))]
    manifest, lines = members(write(tmp / "a.tar.gz", recs, labels={"team": "é"}))
    return manifest, list(lines)


def _set(line: bytes, where: str, key: str, value: Any) -> bytes:
    ev = orjson.loads(line)
    (ev if where == "envelope" else ev["data"])[key] = value
    return _dumps(ev)


def _of(lines: list[bytes], etype: str) -> int:
    return next(i for i, b in enumerate(lines) if orjson.loads(b)["type"] == etype and i > 0)


_DAMAGES: dict[str, Callable[[list[bytes]], None]] = {
    "count a bool": lambda ls: ls.__setitem__(k := _of(ls, fmt.FILE_OPEN), _set(ls[k], "data", "count", True)),
    "pid a float": lambda ls: ls.__setitem__(k := _of(ls, fmt.FILE_OPEN), _set(ls[k], "data", "pid", 101.0)),
    "pid past 64 bits": lambda ls: ls.__setitem__(k := _of(ls, fmt.FILE_OPEN), _set(ls[k], "data", "pid", 2**64)),
    "pid at 2**64-1": lambda ls: ls.__setitem__(k := _of(ls, fmt.FILE_OPEN), _set(ls[k], "data", "pid", 2**64 - 1)),
    "exe null": lambda ls: ls.__setitem__(k := _of(ls, fmt.FILE_OPEN), _set(ls[k], "data", "exe", None)),
    "path an int": lambda ls: ls.__setitem__(k := _of(ls, fmt.FILE_OPEN), _set(ls[k], "data", "path", 7)),
    "last_time not a time": lambda ls: ls.__setitem__(
        k := _of(ls, fmt.FILE_OPEN), _set(_set(ls[k], "data", "last_time", "soon"), "envelope", "time", "soon")
    ),
    "time another valid time": lambda ls: ls.__setitem__(
        k := _of(ls, fmt.FILE_OPEN), _set(ls[k], "envelope", "time", TIME)
    ),
    "type unknown": lambda ls: ls.__setitem__(1, _set(ls[1], "envelope", "type", "dev.evidence.nope")),
    "a second run.started": lambda ls: ls.__setitem__(2, _set(ls[2], "envelope", "type", fmt.RUN_STARTED)),
    "run.finished early": lambda ls: ls.__setitem__(
        2, _dumps({**orjson.loads(ls[-1]), "seq": 2, "id": orjson.loads(ls[2])["id"]})
    ),
    "seq repeated": lambda ls: ls.insert(3, ls[3]),
    "a line dropped": lambda ls: ls.__delitem__(3),
    "labels dropped": lambda ls: ls.__setitem__(3, _dumps({k: v for k, v in orjson.loads(ls[3]).items() if k != "labels"})),
    "subject escaped": lambda ls: ls.__setitem__(3, ls[3].replace(b'"subject":"', b'"subject":"\\u002f', 1)),
    "key twice": lambda ls: ls.__setitem__(3, ls[3].replace(b'"data":{', b'"data":{"pid":1,', 1)),
    "a space": lambda ls: ls.__setitem__(3, ls[3].replace(b'"seq":', b'"seq": ', 1)),
    "a BOM": lambda ls: ls.__setitem__(3, b"\xef\xbb\xbf" + ls[3]),
    "a CR": lambda ls: ls.__setitem__(3, ls[3] + b"\r"),
    "a list": lambda ls: ls.__setitem__(3, b"[]"),
    "id off by one": lambda ls: ls.__setitem__(3, _set(ls[3], "envelope", "id", orjson.loads(ls[4])["id"])),
}  # fmt: skip
_VALID_STILL = {"pid at 2**64-1", "exe null"}  # damages the data model allows (the root hash fixed)
_VALID_ANYWAY = {"time another valid time"}  # (the content hash leaves the time out)


def _rebuild(path: Path, manifest: dict[str, Any], lines: list[bytes], fix: str) -> Path:
    counts = fix == "root and counts" and all(b.startswith(b"{") for b in lines)
    return rebuild(path, manifest, lines, fix_root=fix != "nothing", fix_counts=counts)


def _careful_only(lines: list[bytes], seq: int, ctx: Any, passed: Any) -> Any:
    return iter(())


def _three(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, Any]:
    """lint's outcome with the loop in C, with the Python loop, and by the careful path alone."""

    def outcome() -> Any:
        try:
            _, findings, dropped, signature = lint.lint_signed(str(path), parallel=False)
        except reader.VerificationError as e:
            return [], 0, e.problems, ()
        return [f.as_dict() for f in findings], dropped, [], signature.keyids

    monkeypatch.setattr(fastpath.Helper, "usable", staticmethod(lambda: False))
    c = outcome()
    with monkeypatch.context() as m:
        m.setattr(fastpath, "_verify", None)
        python = outcome()
    with monkeypatch.context() as m:
        m.setattr(verify, "fast", _careful_only)
        careful = outcome()
    return c, python, careful


@needs_c
@pytest.mark.parametrize("fix", ["root", "root and counts", "nothing"])
@pytest.mark.parametrize("damage", sorted(_DAMAGES))
def test_damaged_bundles_lint_the_same_three_ways(
    damage: str, fix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest, lines = _lines_of_a_run(tmp_path)
    _DAMAGES[damage](lines)
    c, python, careful = _three(_rebuild(tmp_path / "d.tar.gz", manifest, lines, fix), monkeypatch)
    assert c == python == careful
    if damage not in _VALID_ANYWAY and (damage not in _VALID_STILL or fix == "nothing"):
        assert c[2], "lint passed a damaged bundle"


_LINT_ALL = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from evidence import cli
    out = []
    for path in sys.argv[1:]:
        o, e = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
            rc = cli.main(["lint", path])
        out.append([rc, o.getvalue(), e.getvalue()])
    print(json.dumps(out))
    """
)


@needs_c
def test_the_cli_says_the_same_with_and_without_the_c(tmp_path: Path) -> None:
    """`evidence lint` on each damaged bundle: the same exit code and words with the C path and
    with EVIDENCE_PURE_PYTHON=1; and never 0 for a damage the model does not allow."""
    paths = []
    for k, damage in enumerate(sorted(_DAMAGES)):
        manifest, lines = _lines_of_a_run(tmp_path)
        _DAMAGES[damage](lines)
        paths.append(str(_rebuild(tmp_path / f"d{k}.tar.gz", manifest, lines, "root and counts")))
    env = {**os.environ, "PYTHONPATH": str(_ROOT)}
    env.pop("EVIDENCE_PURE_PYTHON", None)
    if _SO:  # the CLI's own import would take the normal build: not what is under test then
        pytest.skip("the CLI imports the built module, not EVIDENCE_RED_VERIFY_SO")
    run = [sys.executable, "-c", _LINT_ALL, *paths]
    c = json.loads(subprocess.run(run, env=env, capture_output=True, text=True, check=True).stdout)
    python = json.loads(
        subprocess.run(
            run, env={**env, "EVIDENCE_PURE_PYTHON": "1"}, capture_output=True, text=True, check=True
        ).stdout
    )
    assert c == python
    for (rc, _, err), damage in zip(c, sorted(_DAMAGES), strict=True):
        assert "Traceback" not in err
        if damage not in _VALID_STILL | _VALID_ANYWAY:
            assert rc != 0, damage


# --- memory safety against odd callers (the module's functions take any callables) ----------------


def _parts(ctx: fastpath.Context) -> tuple[Any, ...]:
    return (*fastpath._envelope_parts(ctx), fastpath._CORE_MIDDLE, fastpath._TYPES, fastpath._SPECS)


def _lines(lines: list[Any], seq: int = 1, **over: Any) -> Any:
    ctx = _ctx()
    args: dict[str, Any] = dict(
        loads=orjson.loads, dumps=orjson.dumps, option=SORT, is_time=fastpath.TIME, hashes=[], counts={},
        errors=fastpath._ERRORS,
    )  # fmt: skip
    args.update(over)
    return _C.lines(lines, seq, *_parts(ctx), *args.values())


@needs_c
def test_an_iterator_outlives_changes_to_its_lists() -> None:
    ctx = _ctx()
    lines = [_good_line(ctx, s) for s in range(1, 6)]
    hashes: list[str] = []
    it = _lines(lines, hashes=hashes)
    assert next(it)["seq"] == 1
    lines.clear()  # its list emptied under it
    with pytest.raises(StopIteration):
        next(it)
    lines = [_good_line(ctx, s) for s in range(1, 6)]
    it = _lines(lines, hashes=hashes)
    next(it)
    lines[1] = "not bytes"  # type: ignore[call-overload]
    with pytest.raises(TypeError):
        next(it)
    lines[1] = _good_line(ctx, 2)
    assert next(it)["seq"] == 2  # (a TypeError does not end it)
    lines.extend(_good_line(ctx, s) for s in range(6, 10_000))
    hashes.clear()  # its hashes emptied under it
    del lines
    gc.collect()
    assert [ev["seq"] for ev in it] == list(range(3, 10_000))
    assert len(hashes) == 10_000 - 3
    with pytest.raises(StopIteration):
        next(it)


@needs_c
def test_iterators_dropped_half_way_and_in_cycles() -> None:
    ctx = _ctx()
    for k in range(200):
        hashes: list[Any] = []
        it = _lines([_good_line(ctx, s) for s in range(1, 4)], hashes=hashes)
        if k % 2:
            next(it)
        hashes.append(it)  # a cycle through the iterator
        del it, hashes
    gc.collect()


@needs_c
def test_a_callback_that_calls_the_iterator_again() -> None:
    """(A generator says "already executing"; the C has no such guard.) Whatever comes of it, every
    hash taken is that of a valid line at its seq."""
    ctx = _ctx()
    lines = [_good_line(ctx, s) for s in range(1, 5)]
    hashes: list[str] = []
    holder: dict[str, Any] = {}
    real = fastpath._TYPES[fmt.LOSS]

    def check(data: Any) -> Any:
        if not holder.get("inside"):
            holder["inside"] = True
            holder.setdefault("inner", []).append(next(holder["it"], None))
            holder["inside"] = False
        return real[2](data)

    types_ = {**fastpath._TYPES, fmt.LOSS: (*real[:2], check)}
    specs = {k: v for k, v in fastpath._SPECS.items() if k != fmt.LOSS}
    it = _C.lines(
        lines, 1, *fastpath._envelope_parts(ctx), fastpath._CORE_MIDDLE, types_, specs, orjson.loads,
        orjson.dumps, SORT, fastpath.TIME, hashes, {}, fastpath._ERRORS,
    )  # fmt: skip
    holder["it"] = it
    list(it)
    assert hashes == [_careful(lines[k], 1 + k, ctx) for k in range(len(hashes))]
    assert len(hashes) >= 1


@needs_c
@pytest.mark.parametrize(
    "odd",
    [[], None, 1, "type", b"x", {"type": []}, {"type": {}}, {"type": fmt.LOSS}, {"type": fmt.LOSS, "data": {}},
     {"type": fmt.LOSS, "data": {"count": 1, "kind": "k"}, "time": TIME, "subject": 1}, ["type"]],
)  # fmt: skip
def test_a_loads_that_returns_odd_objects(odd: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C and the Python loop end the same way on whatever `loads` makes of a line."""
    ctx = _ctx()
    fake = types.SimpleNamespace(
        loads=lambda b: odd, dumps=orjson.dumps, OPT_SORT_KEYS=SORT, JSONDecodeError=orjson.JSONDecodeError
    )
    monkeypatch.setattr(fastpath, "orjson", fake)
    lines = [_good_line(ctx, 1)]
    assert _run(True, lines, 1, ctx) == _run(False, lines, 1, ctx) == ([], 0, [], {})


@needs_c
@pytest.mark.parametrize("where", ["loads", "check", "is_time", "dumps"])
@pytest.mark.parametrize(
    "error", [KeyError, TypeError, orjson.JSONDecodeError, ValueError, RuntimeError, MemoryError]
)
def test_errors_raised_from_inside_the_callbacks(
    where: str, error: type[Exception], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One of the fast path's errors ends it quietly, any other is raised, the same both ways, and
    the iterator stays ended."""
    ctx = _ctx()

    def boom(*args: Any, **kwargs: Any) -> Any:
        if where == "dumps" and type(args[0]) is not dict:  # (the envelope's parts: not the loop's)
            return orjson.dumps(*args, **kwargs)
        if error is orjson.JSONDecodeError:
            raise orjson.JSONDecodeError("x", "doc", 0)
        raise error("from " + where)

    if where == "check":
        monkeypatch.setitem(fastpath._TYPES, fmt.LOSS, (*fastpath._TYPES[fmt.LOSS][:2], boom))
        monkeypatch.delitem(fastpath._SPECS, fmt.LOSS)
    elif where == "is_time":
        monkeypatch.setattr(fastpath, "TIME", boom)
    else:
        fake = types.SimpleNamespace(
            loads=boom if where == "loads" else orjson.loads,
            dumps=boom if where == "dumps" else orjson.dumps,
            OPT_SORT_KEYS=SORT,
        )
        monkeypatch.setattr(fastpath, "orjson", fake)
    lines = [_good_line(ctx, s) for s in range(1, 4)]
    c = _run(True, lines, 1, ctx)
    assert c == _run(False, lines, 1, ctx)
    quiet = issubclass(error, fastpath._ERRORS)
    assert c == ([], 0, [], {}) if quiet else c[0] is error, c


@needs_c
def test_a_dumps_that_makes_no_bytes_passes_nothing() -> None:
    """(The Python loop ends quietly there, the C raises TypeError: both pass nothing.)"""
    ctx = _ctx()
    it = _lines([_good_line(ctx, 1)], dumps=lambda v, option=0: orjson.dumps(v, option=option).decode())
    with pytest.raises(TypeError):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


@needs_c
@pytest.mark.parametrize("size", [1, 4096, 1 << 16, 1 << 20, 16 << 20])
def test_huge_lines(size: int) -> None:
    """A subject of `size` bytes (some of them to escape), and a line that long of nothing valid."""
    ctx = _ctx()
    subject = ('é\\"\u2028\x01' * size)[:size]
    data = {"count": 1, "kind": "k" * size}
    lines = [_dumps(_event(ctx, 1, fmt.LOSS, data, subject, TIME)), b"[" * size, b'"' + b"a" * size]
    c = _run(True, lines, 1, ctx)
    assert c == _run(False, lines, 1, ctx)
    assert c[1] == 1 and c[2] == [_careful(lines[0], 1, ctx)]


@needs_c
@pytest.mark.parametrize("seq", [0, 1, 2**31 - 1, 2**32, 2**63 - 3])
def test_seq_digits_at_their_widths(seq: int) -> None:
    ctx = _ctx()
    lines = [_good_line(ctx, seq + k) for k in range(2)]
    c = _run(True, lines, seq, ctx)
    assert c == _run(False, lines, seq, ctx)
    assert c[1] == (0 if seq == 0 else 2)


@needs_c
def test_the_seq_after_the_largest() -> None:
    """Not reachable from a bundle (2**63 lines), but the C must not pass what Python does not."""
    ctx = _ctx()
    top = 2**63 - 1
    wrapped = _dumps(
        _event(ctx, -(2**63), fmt.LOSS, {"count": 3, "kind": "ring", "where": "kernel"}, "loss", TIME)
    )
    lines = [_good_line(ctx, top), wrapped]
    assert _run(True, lines, top, ctx) == _run(False, lines, top, ctx)


# Borrowed references held across a callback: a loads whose dict the checks can change (neither
# orjson nor the generated checks do, so no bundle reaches this; only a caller of the module can).
# PYTHONMALLOC=debug fills freed memory, so a read of a freed object shows (or crashes).
_BORROWED = textwrap.dedent(
    """
    import importlib.util, os, sys, orjson
    from evidence.bundle import fastpath
    from evidence.bundle import format as fmt
    if os.environ.get("EVIDENCE_RED_VERIFY_SO"):  # the build under test
        spec = importlib.util.spec_from_file_location("_verify", os.environ["EVIDENCE_RED_VERIFY_SO"])
        fastpath._verify = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(fastpath._verify)
    which, line, seq = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3])
    holder = {}
    def loads(b):
        ev = orjson.loads(b)
        holder["ev"] = ev
        return ev
    real = fastpath._TYPES[fmt.LOSS][2]
    def check(data):
        ev = holder["ev"]
        if which == "data":
            ev["data"] = orjson.loads(orjson.dumps(data))  # equal, another object: the old one freed
        else:
            ev[which] = "".join(list(ev[which]))  # equal, another str: the old one freed
        return real(data)
    fastpath._TYPES[fmt.LOSS] = (*fastpath._TYPES[fmt.LOSS][:2], check)
    del fastpath._SPECS[fmt.LOSS]
    c = fastpath._verify.lines([line], seq, *fastpath._envelope_parts(
        fastpath.Context(*orjson.loads(sys.argv[4]))), fastpath._CORE_MIDDLE, fastpath._TYPES,
        fastpath._SPECS, loads, orjson.dumps, orjson.OPT_SORT_KEYS, fastpath.TIME, hashes := [],
        counts := {}, fastpath._ERRORS)
    print(orjson.dumps([[ev["seq"] for ev in c], hashes, counts]).decode())
    """
)


@needs_c
@pytest.mark.parametrize("which", ["time", "subject", "type", "data"])
def test_values_replaced_by_a_callback_are_not_read_freed(which: str) -> None:
    ctx = _ctx()
    line = _good_line(ctx, 5)
    env = {**os.environ, "PYTHONPATH": str(_ROOT), "PYTHONMALLOC": "debug"}
    env.pop("EVIDENCE_PURE_PYTHON", None)
    args = [which, line.decode(), "5", orjson.dumps([ctx.run_id, ctx.source, ctx.line, ctx.labels]).decode()]
    out = subprocess.run([sys.executable, "-c", _BORROWED, *args], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout) == [[5], [_careful(line, 5, ctx)], {fmt.LOSS: 1}]


def test_the_time_pattern_is_the_one_the_c_restates() -> None:
    """_verify.c's time_form spells schemas.TIME_PATTERN out by hand: the pattern is unchanged."""
    assert schemas.TIME_PATTERN == r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{9}Z$"
    assert re.fullmatch(r"\^.*\$", schemas.TIME_PATTERN)


_near_time = st.one_of(
    st.from_regex(r"\A[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{9}Z\Z"),
    st.text(alphabet="0123456789-T:.Zzt \n\u0661\uff10\x00", min_size=28, max_size=32),
    st.builds(
        lambda at, c: TIME[:at] + c + TIME[at + 1 :],
        st.integers(0, 30),
        st.sampled_from(["", "0", "9", "/", ":", "\u0660", "\uff19", "\U0001d7ce", "Z", "T", "\n", "\x00"]),
    ),
)


@needs_c
@settings(max_examples=_EXAMPLES * 5, deadline=None)
@given(text=_near_time)
def test_the_time_fields_in_c_match_the_pattern(text: str) -> None:
    """The C's own reading of TIME_PATTERN (time_form) against Python's regex, on strings near a
    time: other digits, a character more or less, a newline at the end."""
    spec = fastpath._SPECS[fmt.POLICY_APPROVAL]
    data = {"argv": [], "argv_truncated": False, "depth": 0, "id": "a", "message": None, "pid": 1,
            "program": "p", "requested_at": text, "rule": "r", "state": "requested"}  # fmt: skip
    python = schemas.DATA_CHECKERS[fmt.POLICY_APPROVAL](data) is None
    assert python is (fastpath.TIME(text) is not None)
    assert _C.valid(spec, data) is python


@needs_c
@pytest.mark.parametrize("where", [1, 2_700, 5_000, 7_999])
def test_a_damage_pieces_deep_lints_the_same(
    where: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bundles of several pieces (container.CHUNK each), one event damaged deep inside: the same
    outcome three ways, and with the helper process (parallel) as in one."""
    recs = [*records(), *(open_(10_000 + i, f"{WS}/src/{i}/é.c", ["read"]) for i in range(8_000))]
    manifest, lines = members(write(tmp_path / "a.tar.gz", recs))
    lines = list(lines)
    lines[where] = _set(lines[where], "data", "ppid", True)
    path = _rebuild(tmp_path / "d.tar.gz", manifest, lines, "root and counts")
    c, python, careful = _three(path, monkeypatch)
    assert c == python == careful and c[2]
    monkeypatch.undo()
    monkeypatch.setattr(fastpath, "_verify", _C)
    try:
        _, findings, dropped, signature = lint.lint_signed(str(path), parallel=True)
        parallel: Any = ([f.as_dict() for f in findings], dropped, [], signature.keyids)
    except reader.VerificationError as e:
        parallel = [], 0, e.problems, ()
    assert parallel == c


def test_a_bundle_of_many_shapes_does_not_compile_a_check_per_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """Canonical data of one type in 256 shapes (the optional fields there or not), twice over: the
    data checks compile at most MAX_SHAPES checks, not one per event."""
    compiled = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        compiled.append(args[1])
        return compile(*args, **kwargs)

    check = schemas.compile_checker(fmt.DATA_MODELS[fmt.PROCESS_EXEC])
    monkeypatch.setattr(schemas, "compile", counting, raising=False)  # `learn` looks it up there
    base = {"argv": [], "cwd": None, "depth": 0, "filename": "/a", "pid": 1, "ppid": 0, "result": 0}
    optional = {"cgroup": None, "container": None, "count": 1, "interpreter": None, "interpreter_size": None,
                "not_hashed": None, "sha256": None, "size": None}  # fmt: skip
    shapes = [
        dict(sorted({**base, **{k: optional[k] for k in chosen}}.items()))
        for r in range(len(optional) + 1)
        for chosen in itertools.combinations(optional, r)
    ]
    for d in shapes * 2:
        assert check(d) is None
    assert len(compiled) <= schemas.MAX_SHAPES


# --- JSON spelled every way loads takes ----------------------------------------------------------
# A forger's way past the C would be a line that is not canonical but that it passes: it would
# then hash bytes the reference never makes. So: events written every way orjson.loads takes (and a
# few it does not), near canonical, through the C and the Python loop alike.

# characters at the edges of UTF-8's widths, of orjson's escaping and of key order (byte order is
# code point order; UTF-16's is not: U+E000..U+FFFF sort after the surrogates there)
_EDGE = ["a", "b", "z", "/", "0", "\x7f", "\x80", "é", "\u07ff", "\u0800", "\u2028", "\u2029", "\ud7ff",
         "\ue000", "\ufeff", "\ufffe", "\uffff", "\U00010000", "\U0001f600", "\U0010ffff", "\x1f", "\x00",
         '"', "\\", "\t"]  # fmt: skip
_EDGE_TEXT = st.text(st.sampled_from(_EDGE), max_size=4) | st.text(max_size=3)


def _spell(v: Any, r: random.Random, p: float, at: list[int] | None = None) -> bytes:
    """`v` as JSON text: each part as orjson.dumps writes it with sorted keys, but with chance `p`
    another way (most of them ways orjson.loads takes to the same value); or, given `at` ([k]),
    the k-th part only (in the order written, from 0)."""
    if at is None:
        odd = r.random() < p
    else:
        odd = at[0] == 0
        at[0] -= 1
    if v is None or type(v) is bool:
        return orjson.dumps(v) if not odd else r.choice([b" " + orjson.dumps(v), orjson.dumps(v) + b"\t"])
    if type(v) is int:
        s = str(v).encode()
        if not odd:
            return s
        return r.choice([s + b".0", s + b"e0", s + b"E+0", b"-0" if v == 0 else s + b"0e-1", b"0" + s,
                         b"+" + s, b" " + s, s + b"\r", s + b".", str(float(v)).encode()])  # fmt: skip
    if type(v) is float:
        s = orjson.dumps(v)
        return s if not odd else r.choice([s + b"0", s + b"e0", repr(v).encode(), s.replace(b"e", b"E")])
    if type(v) is str:
        if not odd or not v:
            return orjson.dumps(v) if not odd else b' ""'
        k = r.randrange(len(v))
        ch = v[k]
        code = ord(ch)
        if code > 0xFFFF:  # as a surrogate pair, in either case of hex
            hi, lo = 0xD800 + ((code - 0x10000) >> 10), 0xDC00 + ((code - 0x10000) & 0x3FF)
            esc = (f"\\u{hi:04x}\\u{lo:04x}" if r.random() < 0.5 else f"\\u{hi:04X}\\u{lo:04X}").encode()
        else:
            esc = r.choice(
                [f"\\u{code:04x}", f"\\u{code:04X}", "\\/" if ch == "/" else f"\\u{code:04x}"]
            ).encode()
        return orjson.dumps(v[:k])[:-1] + esc + orjson.dumps(v[k + 1 :])[1:]
    if type(v) is list:
        items = [_spell(x, r, p, at) for x in v]
        sep = b"," if not odd else r.choice([b", ", b" ,", b",\n"])
        return b"[" + sep.join(items) + b"]"
    assert type(v) is dict
    pairs = [
        (orjson.dumps(k) if at is not None or r.random() >= p else _spell(k, r, 1.0), _spell(x, r, p, at))
        for k, x in sorted(v.items(), key=lambda kv: kv[0].encode())
    ]
    if odd and pairs:
        how = r.randrange(4)
        if how == 0:  # another order
            r.shuffle(pairs)
        elif how == 1:  # a key twice (the last one's value is what loads keeps)
            k = r.randrange(len(pairs))
            pairs.insert(k, (pairs[k][0], _spell(r.choice([0, "x", None, [], {}]), r, 0)))
        elif how == 2:
            return b"{" + b", ".join(k + b":" + x for k, x in pairs) + b"}"
        else:
            return b"{" + b",".join(k + b" : " + x for k, x in pairs) + b"}"
    return b"{" + b",".join(k + b":" + x for k, x in pairs) + b"}"


@needs_c
@settings(max_examples=_EXAMPLES * 5, deadline=None)
@given(
    labelled=st.sampled_from([False, False, True]),
    etype=st.sampled_from(sorted(fastpath._TYPES)),
    subject=_EDGE_TEXT | st.text(st.sampled_from(_EDGE[:-5]), max_size=4),  # (the last five: escaped)
    seed=st.integers(0, 2**32),
    p=st.sampled_from([0.0, 0.01, 0.05, 1.0, 1.0, 1.0]),
    data=st.data(),
)
def test_events_spelled_every_way_pass_in_c_as_in_python(
    labelled: bool, etype: str, subject: str, seed: int, p: float, data: st.DataObject
) -> None:
    """Valid events of every type (data with edge strings and integers where its model allows)
    written with one part, or a part now and then, spelled another way that loads takes: the C and
    the Python loop agree on every line, and every event
    that passes is one the careful path passes, with its content hash."""
    ctx = _ctx(labelled)
    r = random.Random(seed)
    d = data.draw(_data(etype, clean=True))
    time = d.get("last_time", TIME) if type(d) is dict else TIME
    ev = _event(ctx, 2, etype, d, subject, time)
    if p == 1.0:  # one part: mostly of the data
        parts, data_parts = [10**9], [10**9]
        _spell(ev, r, 0.0, parts)
        _spell(d, r, 0.0, data_parts)
        k = 1 + r.randrange(10**9 - data_parts[0]) if r.random() < 0.8 else r.randrange(10**9 - parts[0])
        line = _spell(ev, r, p, [k])
    else:
        line = _spell(ev, r, p)
    lines = [_good_line(ctx, 1), line, _good_line(ctx, 3)]
    c = _run(True, lines, 1, ctx)
    assert c == _run(False, lines, 1, ctx), line
    for k in range(c[1]):
        assert _careful(lines[k], 1 + k, ctx) == c[2][k], line
    if p == 0.0 and _careful(line, 2, ctx) is not None:
        assert c[1] == 3  # (nothing passed that should not be; and what should, did)


@needs_c
def test_every_part_of_a_real_run_spelled_other_ways() -> None:
    """Every event of a real run, each of its
    parts in turn spelled a dozen other ways: the C and the Python loop agree on every one, and
    pass none the careful path does not."""
    with tempfile.TemporaryDirectory() as t:
        recs = [*records(), *(open_(10_000 + i, f"{WS}/src/é{i}.c", ["read", "write"]) for i in range(3))]
        _, run = members(write(Path(t) / "a.tar.gz", recs))
    ctx = _ctx(False)
    tried = passed = 0
    for base in run[1:-1]:
        ev = orjson.loads(base)
        ev = _event(ctx, 2, ev["type"], ev["data"], ev["subject"], ev["time"])
        parts = [10**9]
        _spell(ev, random.Random(0), 0.0, parts)
        for k in range(10**9 - parts[0]):
            for seed in range(12):
                line = _spell(ev, random.Random(seed), 1.0, [k])
                lines = [_good_line(ctx, 1), line, _good_line(ctx, 3)]
                c = _run(True, lines, 1, ctx)
                assert c == _run(False, lines, 1, ctx), line
                assert c[1] < 3 or _careful(line, 2, ctx) == c[2][1], line
                tried += 1
                passed += c[1] == 3
    assert tried > 1000 and passed  # (a few spellings are dumps' own: `\\/` of no "/", and so on)


def _respelled(old: bytes, new: bytes) -> Callable[[list[bytes]], None]:
    """The first `old` of the open of src/é0.c written as `new`."""

    def damage(ls: list[bytes]) -> None:
        k = next(i for i, b in enumerate(ls) if "src/é0.c".encode() in b)
        assert old in ls[k], (old, ls[k])
        ls[k] = ls[k].replace(old, new, 1)

    return damage


# lines of a run written another way that loads takes, or with values at the edges of 64 bits and
# UTF-8: (damage, whether the bundle is still valid)
_SPELLINGS: dict[str, tuple[Callable[[list[bytes]], None], bool]] = {
    "as written": (lambda ls: None, True),
    "data keys swapped": (_respelled(b'{"access":["read"],"count":1,', b'{"count":1,"access":["read"],'), False),
    "a data key twice": (_respelled(b'"data":{', b'"data":{"pid":7,'), False),
    "the data twice": (_respelled(b'{"data":', b'{"data":{},"data":'), False),
    "the subject twice": (_respelled(b'"subject":', b'"subject":"x","subject":'), False),
    "result -0": (_respelled(b'"result":0', b'"result":-0'), False),
    "result 0.0": (_respelled(b'"result":0', b'"result":0.0'), False),
    "count 1e0": (_respelled(b'"count":1', b'"count":1e0'), False),
    "a path escaped": (_respelled(b'"path":"/', b'"path":"\\/'), False),
    "a path \\u escaped": (_respelled(b'src/\xc3\xa9', b"src/\\u00e9"), False),
    "a space in the data": (_respelled(b'"data":{', b'"data": {'), False),
    "pid of 18 digits": (_respelled(b'"pid":101', b'"pid":999999999999999999'), True),
    "pid of 19 digits": (_respelled(b'"pid":101', b'"pid":9223372036854775807'), True),
    "pid of 20 digits": (_respelled(b'"pid":101', b'"pid":18446744073709551615'), True),
    "pid past 64 bits": (_respelled(b'"pid":101', b'"pid":18446744073709551616'), False),
    "pid -(2**63)": (_respelled(b'"pid":101', b'"pid":-9223372036854775808'), True),
    "a path of every width": (_respelled(b"src/\xc3\xa9", "src/\x7f\u07ff\uffff\U0010ffff".encode()), True),
    "a path with U+2028": (_respelled(b"src/\xc3\xa9", "src/\u2028".encode()), True),
}  # fmt: skip

_CLI_ALL = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from evidence import cli
    out = []
    for argv in json.loads(sys.argv[1]):
        o, e = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
            rc = cli.main(argv)
        out.append([rc, o.getvalue(), e.getvalue()])
    print(json.dumps(out))
    """
)


@needs_c
def test_lint_and_verify_of_respelled_signed_bundles_are_the_same_with_and_without_the_c(
    tmp_path: Path,
) -> None:
    """The signer's own key on a bundle whose events are written another way (so that the signature
    holds and only the reader's checks stand between the lines and a pass): `evidence lint` and
    `evidence verify` say the same, exit code and words, with the C and with
    EVIDENCE_PURE_PYTHON=1; and pass exactly the bundles still valid."""
    if _SO:
        pytest.skip("the CLI imports the built module, not EVIDENCE_RED_VERIFY_SO")
    private, public, _ = signing.generate(tmp_path / "key")
    recs = [*records(), *(open_(10_000 + i, f"{WS}/src/é{i}.c", ["read"]) for i in range(3))]
    manifest, lines = members(write(tmp_path / "a.tar.gz", recs))
    argvs = []
    for k, name in enumerate(_SPELLINGS):
        damaged = list(lines)
        _SPELLINGS[name][0](damaged)
        unsigned = rebuild(tmp_path / f"u{k}.tar.gz", manifest, damaged, fix_root=True, fix_counts=True)
        with tarfile.open(unsigned, "r:gz") as tar:
            got = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
        m, body = got[fmt.MANIFEST_NAME], got[fmt.EVENTS_NAME]
        st = attestation.statement(
            orjson.loads(m), hashlib.sha256(m).hexdigest(), hashlib.sha256(body).hexdigest()
        )
        envelope = attestation.envelope(canonical.dumps(st), [signing.load_signer(private)])
        path = pack(tmp_path / f"s{k}.tar.gz", [(fmt.MANIFEST_NAME, m), (fmt.EVENTS_NAME, body),
                                                 (fmt.ATTESTATION_NAME, envelope)])  # fmt: skip
        argvs += [["lint", str(path)], ["verify", str(path), "--key", str(public)]]
    env = {**os.environ, "PYTHONPATH": str(_ROOT)}
    env.pop("EVIDENCE_PURE_PYTHON", None)
    run = [sys.executable, "-c", _CLI_ALL, json.dumps(argvs)]
    c = json.loads(subprocess.run(run, env=env, capture_output=True, text=True, check=True).stdout)
    pure = {**env, "EVIDENCE_PURE_PYTHON": "1"}
    python = json.loads(subprocess.run(run, env=pure, capture_output=True, text=True, check=True).stdout)
    assert c == python
    for k, (name, (_, still_valid)) in enumerate(_SPELLINGS.items()):
        (lint_rc, _, lint_err), (verify_rc, _, verify_err) = c[2 * k], c[2 * k + 1]
        assert "Traceback" not in lint_err + verify_err
        assert (lint_rc == 0) == (verify_rc == 0) == still_valid, (name, lint_err, verify_err)


@needs_c
@pytest.mark.parametrize("size", [1, 1 << 16, 16 << 20])
def test_huge_lines_of_every_width(size: int) -> None:
    """A line of `size` bytes of non-ASCII with nothing to escape, and the same with one needless
    escape at its very end: the C and the Python loop agree, and pass the first only."""
    ctx = _ctx(False)
    subject = ("é\u2028\U0010ffff\x7f" * size)[:size]
    good = _dumps(_event(ctx, 1, fmt.LOSS, {"count": 1, "kind": subject}, subject, TIME))
    slash = _dumps(_event(ctx, 1, fmt.LOSS, {"count": 1, "kind": subject + "/"}, subject, TIME))
    escaped = slash.replace(b'/"},"datacontenttype"', b'\\/"},"datacontenttype"', 1)
    assert escaped != slash and orjson.loads(escaped) == orjson.loads(slash)
    for line in (good, slash, escaped, good[:-2] + b'\\"}'):
        c = _run(True, [line], 1, ctx)
        assert c == _run(False, [line], 1, ctx)
        assert c[1] == (line in (good, slash))
    assert _run(True, [good], 1, ctx)[2] == [_careful(good, 1, ctx)]
