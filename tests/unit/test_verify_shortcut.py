"""The C fast path's shortcut (src/fast/_verify.c `shortcut`): a line taken apart where its constant
parts are, its data loaded alone, its envelope's values shared instead of parsed. It passes a line
only when the whole-line path (and the Python reference, bundle/fastpath.py `fast_python`) passes
it, with the same event (the same keys in the same order, equal values of the same exact types),
hash and count; on anything else it has no verdict and the whole-line path decides. These tests
aim at the places where it cuts the line: the type's tail, the time, the subject, the seq's digits,
the data's end. (EVIDENCE_RED_VERIFY_SO runs them against another build, as tests/unit/test_red_verify.py
says: under AddressSanitizer, say.)"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evidence.bundle import fastpath
from evidence.bundle import format as fmt
from tests.unit.conftest_bundles import WS, members, open_, records, write
from tests.unit.test_red_verify import (  # the build under test (EVIDENCE_RED_VERIFY_SO: a sanitizer's)
    _C,
    _event,
)

needs_c = pytest.mark.skipif(_C is None, reason="the compiled module is not built (make setup)")
SORT = orjson.OPT_SORT_KEYS
TIME = "2026-11-27T20:00:00.000000001Z"


@functools.cache
def _run_of(labels: bool) -> tuple[fastpath.Context, tuple[bytes, ...]]:
    """A recorded run's context and its event lines (with labels to escape, or none)."""
    with tempfile.TemporaryDirectory() as t:
        recs = [*records(), *(open_(10_000 + i, f"{WS}/src/f{i}.c", ["read"]) for i in range(20))]
        over = {"labels": {"job": "x", "é": '\u2028"'}} if labels else {}
        manifest, lines = members(write(Path(t) / "a.tar.gz", recs, **over))
    ctx = fastpath.Context(
        manifest["run_id"], manifest["source"], fmt.MAX_LINE, fmt.labels_attribute(manifest.get("labels"))
    )
    return ctx, tuple(lines)


def _run(c: bool, lines: list[bytes] | bytes, seq: int, ctx: fastpath.Context, loads: Any = None) -> Any:
    """(events as lists of (key, value, type) in order, n, hashes, counts), or the error raised.
    `lines` a list, or a piece (bytes: the C reads its lines in place)."""
    passed = fastpath.Passed()
    if c:
        it = _C.lines(
            lines, seq, *fastpath._envelope_parts(ctx), fastpath._CORE_MIDDLE, fastpath._TYPES, fastpath._SPECS,
            loads or orjson.loads, orjson.dumps, SORT, fastpath.TIME, passed.hashes, passed.counts,
            fastpath._ERRORS, _envelope(ctx),
        )  # fmt: skip
    else:
        it = fastpath.fast_python(
            fastpath.split(lines) if isinstance(lines, bytes) else lines, seq, ctx, passed
        )
    try:
        got = [[(k, v, type(v)) for k, v in ev.items()] for ev in it]
    except Exception as e:
        return type(e), str(e)
    return got, passed.n, passed.hashes, passed.counts


def _envelope(ctx: fastpath.Context) -> tuple[Any, ...]:
    return (fmt.DATACONTENTTYPE, ctx.id_prefix, ctx.labels, ctx.run_id, ctx.source, fmt.SPECVERSION)


def _same(lines: list[bytes], seq: int, ctx: fastpath.Context) -> Any:
    """The C over the list and over the same lines as a piece, and the Python loop: the same."""
    c = _run(True, lines, seq, ctx)
    assert c == _run(False, lines, seq, ctx)
    if not any(b"\n" in line for line in lines):
        piece = b"".join(line + b"\n" for line in lines)
        assert _run(True, piece, seq, ctx) == c
        assert _run(True, piece + b"no newline after it", seq, ctx) == c  # (no line, as split says)
    return c


def _line(ctx: fastpath.Context, seq: int, **over: Any) -> bytes:
    ev = _event(ctx, seq, fmt.LOSS, {"count": 3, "kind": "ring", "where": "kernel"}, "loss", TIME)
    ev.update(over)
    return orjson.dumps(ev, option=SORT)


@needs_c
@pytest.mark.parametrize("labels", [True, False])
def test_a_runs_lines_pass_without_loads_of_the_whole_line(labels: bool) -> None:
    """Every event of a real run's body is passed by the shortcut (loads sees only the data), as
    the reference passes it: the same keys in the same order, the same values and types."""
    ctx, lines = _run_of(labels)
    body = list(lines[1:-1])
    seen: list[bytes] = []

    def loads(b: bytes) -> Any:
        seen.append(b)
        return orjson.loads(b)

    got = _run(True, body, 1, ctx, loads=loads)
    assert got == _run(False, body, 1, ctx) == _run(True, b"".join(line + b"\n" for line in body), 1, ctx)
    assert got[1] == len(body)
    assert len(seen) == len(body) and not any(b.startswith(b'{"data":') for b in seen)
    for ev, line in zip(got[0], body, strict=True):  # what loads makes of the whole line
        assert ev == [(k, v, type(v)) for k, v in orjson.loads(line).items()]


def _odd_lines(ctx: fastpath.Context) -> list[bytes]:
    """Lines made to mislead where the shortcut cuts: each one is either passed by the reference
    or not, and the C must say the same."""
    good = _line(ctx, 1)
    text = good.decode()
    out = [
        _line(ctx, 1, subject=s)
        for s in ["", '"', "\\", "a\"b", "\x00", "\x1f", "\x7f", "é", "\u2028", "😀", "a\\u0022b",
                  '","time":"' + TIME, '","type":"' + fmt.LOSS + '"}', "\ud7ff", "\ue000", "\U0010ffff"]
    ]  # fmt: skip
    out += [_line(ctx, 1, time=t) for t in [TIME[:-1], TIME + "Z", TIME.replace("T", " "), "", '"', "é" * 30]]
    out += [
        good.replace(b'"subject":"loss"', b'"subject":"lo\\u0073s"'),
        good.replace(b'"subject":"loss"', b'"subject":"lo\\/ss"'),
        good.replace(b'"time":"2026', b'"time":"\\u0032026'),
        good.replace(b'"type":"dev', b'"type":"\\u0064ev'),
        good.replace(b'"type":"' + fmt.LOSS.encode(), b'"type":"' + fmt.LOSS.encode() + b"x"),
        good.replace(b'"subject":"loss"', b'"subject":"lo\xffss"'),  # not UTF-8
        good.replace(b'"subject":"loss"', b'"subject":"lo\xc0\xafss"'),  # overlong
        good.replace(b'"subject":"loss"', b'"subject":"lo\xed\xa0\x80ss"'),  # a surrogate
        good.replace(b'"subject":"loss"', b'"subject":"lo\xf4\x90\x80\x80ss"'),  # past U+10FFFF
        good.replace(b'"subject":"loss"', b'"subject":"lo\xf4\x8f\xbf\xbfss"'),  # U+10FFFF
        good.replace(b'"subject":"loss"', b'"subject":"lo\tss"'),  # a raw control byte
        good.replace(b'"subject":"loss"', b'"subject":1'),
        good.replace(b'"subject":"loss"', b'"subject":"loss","subject":"loss"'),
        good.replace(b'"seq":1,', b'"seq":01,'),
        good.replace(b'"seq":1,', b'"seq":1.0,'),
        good.replace(b'"seq":1,', b'"seq":2,'),
        good.replace(b":1,", b":2,", 1),  # the id's seq
        good.replace(b'"data":{', b'"data":{"x":{"a":1},', 1),
        good.replace(b'"data":{', b'"data": {', 1),
        good.replace(b',"datacontenttype"', b',"datacontenttype":1,"datacontenttype"', 1),
        good[:-1],
        good + b" ",
        good + b"}",
        b'{"data":' + good[8:].replace(b"}", b"", 1),
        good.replace(b'"time":"', b'"time": "'),
        good.replace(b',"time":"', b',"time":"' + b'"', 1),
        good.replace(b'"specversion":"1.0"', b'"specversion":"1.1"'),
        text.replace(ctx.source, ctx.source + "x").encode(),
        text.replace('"runid":"', '"runid":"x').encode(),
        b'{"data":{"count":3,"kind":"ring","where":"kernel","time":"' + TIME.encode() + b'"}}',
        b'{"data":',
        b'{"data":"',
        b'{"data":' + b'"' * 40,
        b"",
    ]
    if ctx.labels is not None:  # the labels' value left out, or another
        out.append(text.replace(',"labels":' + orjson.dumps(ctx.labels).decode(), "").encode())
        out.append(text.replace(orjson.dumps(ctx.labels).decode(), '"{}"').encode())
    return out


@needs_c
@pytest.mark.parametrize("labels", [True, False])
def test_lines_made_to_mislead_the_shortcut_pass_or_stop_as_python_does(labels: bool) -> None:
    ctx, _ = _run_of(labels)
    passed = 0
    for odd in _odd_lines(ctx):
        got = _same([odd], 1, ctx)
        passed += got[1]
        _same([_line(ctx, 1), odd, _line(ctx, 3)], 1, ctx)  # in the middle, at its own seq (2) or not
        _same([_line(ctx, 1), odd.replace(b":1,", b":2,").replace(b":1}", b":2}")], 1, ctx)
    assert passed >= 10  # the subjects to escape, the odd but valid ones: passed, by the whole line


_SUBJECTS = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=40)


@needs_c
@settings(max_examples=400, deadline=None)
@given(subject=_SUBJECTS, time=st.sampled_from([TIME, TIME[:-1], "x", "é", ""]), seq=st.integers(1, 10**12))
def test_any_subject_and_time_pass_as_python_passes_them(subject: str, time: str, seq: int) -> None:
    for labels in (True, False):
        ctx, _ = _run_of(labels)
        line = _line(ctx, seq, subject=subject, time=time)
        got = _same([line], seq, ctx)
        assert got[1] == (time == TIME)


@needs_c
@settings(max_examples=600, deadline=None)
@given(which=st.integers(0, 5), at=st.integers(-3, 3), byte=st.sampled_from(b'"\\:,{}0a\x00\xff '))
def test_a_byte_changed_where_the_line_is_cut(which: int, at: int, byte: int) -> None:
    """A byte replaced near each place the shortcut cuts the line: the data's start and end, the
    subject's quotes, the time's quotes, the type's."""
    ctx, _ = _run_of(True)
    line = _line(ctx, 7, subject="/a/b")
    marks = [8, line.index(b',"datacontenttype"'), line.index(b'"/a/b"'), line.index(b'"/a/b"') + 5,
             line.index(b',"time":"') + 8, line.index(b'","type":"')]  # fmt: skip
    k = max(0, min(len(line) - 1, marks[which] + at))
    _same([line[:k] + bytes([byte]) + line[k + 1 :]], 7, ctx)
    _same([line[:k] + bytes([byte]) + line[k:]], 7, ctx)  # inserted
    _same([line[:k] + line[k + 1 :]], 7, ctx)  # dropped


@needs_c
def test_an_envelope_that_is_not_one_is_refused() -> None:
    ctx, lines = _run_of(False)
    args = (
        list(lines[1:2]), 1, *fastpath._envelope_parts(ctx), fastpath._CORE_MIDDLE, fastpath._TYPES,
        fastpath._SPECS, orjson.loads, orjson.dumps, SORT, fastpath.TIME, [], {}, fastpath._ERRORS,
    )  # fmt: skip
    for bad in [
        (),
        ("a",) * 5,
        ("a",) * 7,
        (1, "a", None, "a", "a", "a"),
        ("a", "a", "a", "a", None, "a"),
        [],
    ]:
        with pytest.raises(TypeError):
            _C.lines(*args, bad)
    assert len(list(_C.lines(*args, None))) == 1  # None: no shortcut, the whole line


@needs_c
@settings(max_examples=400, deadline=None)
@given(
    piece=st.binary(max_size=64) | st.lists(st.sampled_from([b"\n", b"a", b"\n\n", b"xyz" * 9])).map(b"".join)
)
def test_a_pieces_shape_is_its_split_lines(piece: bytes) -> None:
    lines = fastpath.split(piece)
    assert _C.shape(piece) == (len(lines), max(map(len, lines), default=0))
    with pytest.raises(TypeError):
        _C.shape(bytearray(piece))


@needs_c
def test_a_piece_that_is_not_bytes_is_refused() -> None:
    ctx, lines = _run_of(False)
    for odd in (bytearray(b"".join(line + b"\n" for line in lines[1:3])), "x\n", 1, (lines[1],)):
        with pytest.raises(TypeError):
            _C.lines(
                odd, 1, *fastpath._envelope_parts(ctx), fastpath._CORE_MIDDLE, fastpath._TYPES, fastpath._SPECS,
                orjson.loads, orjson.dumps, SORT, fastpath.TIME, [], {}, fastpath._ERRORS, _envelope(ctx),
            )  # fmt: skip
