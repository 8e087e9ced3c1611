"""The fleet publisher's framing in C (src/fast/_wire.c) against the Python path it stands in for
(binding.encode_many, then fleet_wire.build): the same segment, byte for byte, on generated batches
of live events, those the C path takes and those it hands back."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evidence.agent.daemon import fleet_wire as w

needs_c = pytest.mark.skipif(w._wire is None, reason="the compiled module is not built (make setup)")
INBOX = "_INBOX_node.0123abcd"


def event(session: str, seq: int) -> dict[str, Any]:
    """A live event as the recorder hands it over (every header value plain)."""
    return {
        "specversion": "1.0",
        "id": f"{session}:{seq}",
        "source": f"urn:evidence:session:{session}",
        "type": "dev.evidence.file.open",
        "subject": f"/w/src/file-{seq}.py",
        "time": "2026-11-27T20:00:00.000000001Z",
        "datacontenttype": "application/json",
        "sessionid": session,
        "seq": seq,
        "data": {"path": f"/w/src/file-{seq}.py", "access": ["read"], "result": 0, "n": seq},
    }


def test_pure_python_leaves_it_unused() -> None:
    code = "from evidence.agent.daemon import fleet_wire as w; print(w._wire is None)"
    env = {**os.environ, "EVIDENCE_PURE_PYTHON": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def both(no: int, subjects: list[bytes], events: list[dict[str, Any]]) -> tuple[object, object]:
    def seg(fast: bool) -> object:
        try:
            s = w.frame(no, INBOX, subjects, events, fast=fast)
        except Exception as e:  # the same error both ways (the C path hands such a batch back)
            return type(e), str(e)
        return s.data, s.offsets, s.sizes, s.tokens, len(s)

    return seg(True), seg(False)


@needs_c
def test_a_recorders_events_are_taken_in_c() -> None:
    events = [event("s1", i) for i in range(300)]
    subjects = [b"evidence.events.n.s1"] * len(events)
    made = w._wire.frames(subjects, events, w.reply_prefix(INBOX, 7), orjson.dumps, orjson.OPT_SORT_KEYS)
    assert made is not None
    fast, python = both(7, subjects, events)
    assert fast == python
    back, problem = w.parse(w.frame(7, INBOX, subjects, events).data, 7, INBOX)
    assert problem == "" and len(back) == 300


_plain = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=12)
_any = st.text(max_size=12)
_value = (
    _plain
    | _any
    | st.integers()
    | st.integers(min_value=2**63 - 2, max_value=2**80)
    | st.booleans()
    | st.none()
    | st.floats(allow_nan=False)
    | st.lists(st.integers(), max_size=2)
)
_name = st.sampled_from(
    ["poduid", "containerid", "x1", "datacontenttype", "data", "a%b", "é", "a\r\nb", "a\x00"]
)
_data = st.recursive(
    st.none() | st.integers(min_value=-(2**63), max_value=2**63 - 1) | _any | st.booleans(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_any, inner, max_size=3),
    max_leaves=6,
)


@st.composite
def _event(draw: st.DrawFn, plain: bool) -> dict[str, Any]:
    """A live event: with `plain`, one whose header values the C path takes (integers of any size
    among them), else anything."""
    e: dict[str, Any] = event(draw(_plain), draw(st.integers(min_value=0, max_value=10**6)))
    if draw(st.booleans()):
        e["subject"] = draw(_plain if plain else _plain | _any)
    if draw(st.booleans()):
        e["data"] = draw(_data)
    names = st.sampled_from(["poduid", "containerid", "x1", "datacontenttype", "data", "a%b"])
    values = _plain.filter(lambda v: "%" not in v and '"' not in v) | st.integers() if plain else _value
    for name, value in draw(st.dictionaries(names if plain else _name, values, max_size=3)).items():
        e[name] = value
    if not plain and draw(st.integers(0, 20)) == 0:
        e.pop(draw(st.sampled_from(["id", "data", "seq"])), None)
    return e


@needs_c
@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(
    events=st.booleans().flatmap(lambda plain: st.lists(_event(plain), min_size=0, max_size=6)),
    subject=st.binary(min_size=1, max_size=20),
    no=st.integers(min_value=0, max_value=10**12),
)
def test_c_and_python_make_the_same_segment(events: list[dict[str, Any]], subject: bytes, no: int) -> None:
    """Whatever the batch (values to percent-encode, a None, a bool, a float, ints past 64 bits,
    odd attribute names, no id, any data), the segment is the Python path's, or the same error."""
    fast, python = both(no, [subject] * len(events), events)
    assert fast == python


@needs_c
def test_anything_but_the_plain_case_is_handed_back() -> None:
    """The C path makes nothing (None) for a batch the template does not take, even when one event
    alone is off: a str subclass, a bool, a value to percent-encode, a mapping that is not a dict."""

    class S(str):
        pass

    def frames(events: list[Any]) -> object:
        subjects = [b"s"] * len(events)
        return w._wire.frames(subjects, events, b"p.", orjson.dumps, orjson.OPT_SORT_KEYS)

    ok = event("s1", 1)
    assert frames([ok]) is not None
    for odd in ({"x": S("a")}, {"x": True}, {"x": "50%"}, {"x": 'a"b'}, {"x": "\n"}, {"x": None}):
        assert frames([ok, {**ok, **odd}]) is None
    assert frames([ok, {k: v for k, v in ok.items() if k != "id"}]) is None
    with pytest.raises(ValueError):
        w._wire.frames([b"s"], [ok, ok], b"p.", orjson.dumps, orjson.OPT_SORT_KEYS)


# --- subjects by session: the publisher's usual batch, its subjects named in C ----------------------


def _namer(known: dict[Any, bytes], asked: list[Any]) -> Any:
    def name(session: Any) -> bytes | None:
        asked.append(session)
        if type(session) is not str or not session.isalnum():
            return None
        known[session] = b"evidence.events.n." + session.encode()
        return known[session]

    return name


@needs_c
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    sessions=st.lists(st.sampled_from(["s1", "s2", "s3", "", "a.b", 7, None]), min_size=0, max_size=8),
    known=st.sets(st.sampled_from(["s1", "s2", "s3"])),
    no=st.integers(min_value=0, max_value=10**6),
)
def test_subjects_by_session_make_the_segment_of_those_subjects(
    sessions: list[Any], known: set[str], no: int
) -> None:
    """frame_known: the segment `frame` makes of the same events with each one's subject given, the
    sessions not known yet named on the way (each once); None, nothing made, when one is not a
    session `name` names or an event has none (the publisher then goes event by event)."""
    events: list[dict[str, Any]] = []
    for k, session in enumerate(sessions):
        e = event("x", k)
        if session is None:
            del e["sessionid"]
        else:
            e["sessionid"] = session
        events.append(e)
    subjects = {s: b"evidence.events.n." + s.encode() for s in known}
    asked: list[Any] = []
    got = w.frame_known(no, INBOX, subjects, events, _namer(subjects, asked))
    usable = all(type(s) is str and s.isalnum() for s in sessions)
    if not usable:
        assert got is None
        return
    assert got is not None
    assert sorted(asked) == sorted(set(sessions) - known)  # each new one named once
    want = w.frame(no, INBOX, [subjects[s] for s in sessions], events, fast=False)
    assert (got.data, got.offsets, got.sizes, len(got)) == (want.data, want.offsets, want.sizes, len(want))


@needs_c
def test_a_batch_of_many_new_sessions_is_handed_back_after_a_few() -> None:
    events = [{**event("x", k), "sessionid": f"s{k}"} for k in range(w._NAMED_AT_ONCE + 1)]
    subjects: dict[Any, bytes] = {}
    assert w.frame_known(1, INBOX, subjects, events, _namer(subjects, [])) is None
    assert w.frame_known(1, INBOX, subjects, events, _namer(subjects, [])) is not None  # all named now
    assert w._wire.frames(subjects, [{**events[0], "sessionid": ["x"]}], b"p.", orjson.dumps, 0) is None


def test_without_the_compiled_module_nothing_is_made_by_session(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(w, "_wire", None)
    assert w.frame_known(1, INBOX, {"x": b"s"}, [event("x", 1)], lambda s: None) is None


# --- JetStream's answers: a read of plain PubAcks marked in C, as the regular expressions do ---------

_INBOX_ACKS = "_INBOX_node.0123abcd"


def _ack(
    seg: bytes, token: bytes, *, domain: bytes | None = None, stream: bytes = b"EVIDENCE_EVENTS"
) -> bytes:
    body = b'{"stream":"' + stream + b'",' + (b'"domain":"' + domain + b'",' if domain is not None else b"")
    body += b'"seq":42}'
    return b"MSG %s.%s.%s 1 %d\r\n%s\r\n" % (_INBOX_ACKS.encode(), seg, token, len(body), body)


def _read(data: bytes, c: bool, n: int, tokens: list[int] | None) -> tuple[object, ...]:
    """What a wire in flight with segment 7 (n events) makes of `data`: its answers, how many it
    counted, the bytes it left unread."""
    wire = w.EventWire(["nats://127.0.0.1:1"], inbox=_INBOX_ACKS, name="t")
    wire.c_acks = c
    wire._seg, wire._prefix, wire.fast = b"7", w.reply_prefix(_INBOX_ACKS, 7), wire._fast
    wire._place = None if tokens is None else {t: k for k, t in enumerate(tokens)}
    wire._answers = [None] * n
    conn = w._Conn(wire)
    wire.conn = conn
    errors: list[str] = []
    wire.on_error = lambda what, message: errors.append(message)
    try:
        conn._parse(data)
    except (ValueError, IndexError) as e:
        return ("raised", type(e))
    return wire._answers, wire._answered, bytes(conn.buf), errors


_seg = st.sampled_from([b"7", b"07", b"8", b"77"])
_token = st.integers(min_value=0, max_value=12).map(lambda k: b"%d" % k) | st.sampled_from(
    [b"0003", b"99999999999999999999", b"x", b""]
)
_one = st.builds(
    _ack,
    _seg,
    _token,
    domain=st.none() | st.sampled_from([b"hub", b"", b'a"b']),
    stream=st.sampled_from([b"EVIDENCE_EVENTS", b"", b"a}b", b"a\r\nb"]),
)


@needs_c
@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(
    acks=st.lists(_one, min_size=1, max_size=12),
    cut=st.integers(min_value=0, max_value=40),
    junk=st.sampled_from([b"", b"PING\r\n", b"+OK\r\n", b"MSG x 1 2\r\n{}\r\n"]),
    at=st.integers(min_value=0, max_value=12),
    n=st.integers(min_value=0, max_value=12),
    tokens=st.none() | st.lists(st.integers(min_value=0, max_value=20), max_size=12, unique=True),
)
def test_c_and_python_read_the_same_acks(
    acks: list[bytes], cut: int, junk: bytes, at: int, n: int, tokens: list[int] | None
) -> None:
    """Runs of PubAcks (to this segment or another, tokens in and out of range, with a domain, a
    stream name with a brace or a line break, a message cut short, something else among them): the
    same answers marked, the same count, the same bytes left for the next read."""
    parts = acks[:at] + [junk] + acks[at:]
    data = b"".join(parts)
    data = data[: len(data) - cut] if cut < len(data) else data
    assert _read(data, True, n, tokens) == _read(data, False, n, tokens)


@needs_c
def test_a_read_of_plain_acks_is_marked_in_c() -> None:
    data = b"".join(_ack(b"7", b"%d" % k) for k in range(5)) + _ack(b"6", b"1")
    answers, answered, rest, errors = _read(data, True, 5, None)  # type: ignore[misc]
    assert answers == [w.STORED] * 5 and answered == 5 and rest == b"" and errors == []
    assert w._wire.stored(data, len(data), _INBOX_ACKS.encode(), b"7", [None] * 5, None, w.STORED) == 5
    assert w._wire.stored(data + b"PING\r\n", len(data) + 6, _INBOX_ACKS.encode(), b"7", [], None, 1) == -1
