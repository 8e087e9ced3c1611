"""The C hot path of full detail (src/fast/_fast.c) against the Python path it stands in for: the
same lines, content hashes, counts and caps decisions on generated record streams."""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evidence.bundle import format as fmt
from evidence.bundle import sink
from evidence.bundle.sink import Caps, EventSink

needs_fast = pytest.mark.skipif(sink._fast is None, reason="the compiled module is not built (make setup)")


def test_the_compiled_module_is_built_under_ci() -> None:
    """`make setup` builds it: tests under CI=true run against it, never silently without it."""
    if sink._fast is None:
        if os.environ.get("CI") == "true":
            pytest.fail("evidence.bundle._fast is not importable: `make setup` did not build it")
        pytest.skip("the compiled module is not built (make setup)")
    assert EventSink(_Out(), "run-" + "0" * 32).use_fast


class _Out:
    def __init__(self) -> None:
        self.data: list[bytes] = []

    def feed(self, data: bytes) -> None:
        self.data.append(data)

    def compressed_bound(self) -> int:
        return sum(map(len, self.data)) // 20


class _Root:
    def __init__(self) -> None:
        self.lines: list[bytes] = []

    def add(self, chash: str) -> None:
        self.lines.append(chash.encode() + b"\n")

    def add_many(self, chashes: list[str]) -> None:
        for c in chashes:
            self.add(c)

    def add_lines(self, lines: bytes) -> None:
        self.lines.append(lines)


def _written(items: list[Any], fast: bool, caps: Caps | None = None) -> tuple[object, ...]:
    out, root = _Out(), _Root()
    s = EventSink(out, "run-" + "5" * 32, {"team": "a\u00e9"}, caps, root)
    s.use_fast = fast
    capped: dict[str, int] = {}
    try:
        s.write_full(items, capped)
    except Exception as e:  # the same failure either way (a string that is not UTF-8)
        return (type(e).__name__,)
    return b"".join(out.data), b"".join(root.lines), s.counts, s.seq, s.size, capped


_text = st.text(
    alphabet=st.one_of(
        st.characters(max_codepoint=0x7F),
        st.sampled_from(["\u00e9", "\u2028", "\U0001f600", "\x00", "\x1f", "\x7f", '"', "\\", "/", "\ud800"]),
    ),
    max_size=12,
)
_ints = st.one_of(st.integers(-(2**31), 2**31), st.integers(-(2**70), 2**70))
_value = st.one_of(
    st.none(), st.booleans(), _ints, _text, st.lists(st.one_of(_text, _ints), max_size=3), st.floats(0, 1)
)
# a time: mostly a run's (nanoseconds this century, a few seconds apart), now and then an odd one
_time = st.one_of(
    st.integers(1_700_000_000_000_000_000, 1_700_000_005_000_000_000),
    st.integers(-(2**65), 2**65),
)
_open = st.fixed_dictionaries(
    {
        "k": st.just("open"),
        "t": _time,
        "pid": st.integers(1, 2**22),
        "ppid": st.integers(0, 2**22),
        "exe": st.one_of(st.none(), _text),
        "path": st.one_of(_text, _text.map(lambda s: "/etc/" + s)),
        "raw_path": _text,
        "dirfd": st.one_of(st.none(), st.integers(0, 1000)),
        "flags": st.lists(st.sampled_from(["O_RDONLY", "O_WRONLY", "O_CREAT", "O_CLOEXEC"]), max_size=3),
        "access": st.lists(st.sampled_from(["read", "write", "create"]), max_size=2),
        "mode": st.one_of(st.none(), st.integers(0, 0o7777)),
        "result": st.one_of(st.integers(0, 100), st.sampled_from(["ENOENT", "EACCES"])),
    },
    optional={
        "nlink": st.integers(2, 9),
        "cgroup": _text,
        "container": _text,
        "mntns": st.just("other"),
        "n": st.integers(2, 5),
        "tl": _time,
        "extra": st.one_of(_value, st.dictionaries(_text, _value, max_size=2)),
    },
)
_exit = st.fixed_dictionaries(
    {
        "k": st.just("exit"),
        "t": _time,
        "pid": st.integers(1, 99),
        "ppid": st.integers(0, 99),
        "exe": st.one_of(st.none(), _text),
        "exit_code": st.integers(0, 255),
        "signal": st.none(),
    }
)
_item = st.one_of(_open, _open, _exit, _time, _time, _time)


@needs_fast
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_item, max_size=40))
def test_c_and_python_write_the_same_bytes(items: list[Any]) -> None:
    while items and isinstance(items[0], int):  # a repeat follows a record
        items.pop(0)
    assert _written(items, True) == _written(items, False)


@needs_fast
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_open, st.lists(st.one_of(_time, st.just(None)), min_size=1, max_size=3000))
def test_c_and_python_agree_across_batches_and_caps(rec: dict[str, Any], times: list[int | None]) -> None:
    """Runs longer than a batch (_FULL_BATCH), plain opens among repeats, and caps reached midway."""
    items: list[Any] = [rec]
    for k, t in enumerate(times):
        items.append(t if t is not None else dict(rec, t=1_700_000_000_000_000_000 + k, path=f"/p/{k}"))
    for caps in (None, Caps(events=1500), Caps(decompressed=200_000), Caps(line=300)):
        assert _written(items, True, caps) == _written(items, False, caps)


@needs_fast
def test_c_path_makes_what_the_writer_always_made() -> None:
    """A plain open and its repeats: the C path's line is canonical JSON of the whole event."""
    rec = {
        "k": "open",
        "t": 1_700_000_000_123_456_789,
        "pid": 3,
        "ppid": 1,
        "exe": "/bin/x",
        "path": '/a/"b\x01',
        "raw_path": "a",
        "dirfd": None,
        "flags": ["O_RDONLY"],
        "access": ["read"],
        "mode": None,
        "result": "ENOENT",
    }
    data, _, counts, seq, _, _ = _written([rec, 1_700_000_001_000_000_000], True)
    assert counts == {fmt.FILE_OPEN: 2} and seq == 2
    first = data.split(b"\n")[0]
    assert b'"path":"/a/\\"b\\u0001"' in first
    assert b'"time":"2023-11-14T22:13:20.123456789Z"' in first
