"""The CloudEvents NATS protocol binding (binary content mode) of a live event, pure.

An event dict (agent/daemon/delivery.py `live_event`: the bundle's event shape) becomes NATS headers
and a payload: each attribute but `data` and `datacontenttype` as a `ce-<name>` header,
`datacontenttype` as `Content-Type`, `data` as the payload (canonical JSON), and `Nats-Msg-Id` set to
the event's id, so that JetStream drops a retry of a message it already stored (within the stream's
duplicate window). Header values are percent-encoded outside printable ASCII, and `%` and `"` too,
as the HTTP binding does: a file name of a job's may hold a newline, which no header may.

`encode` gives the same message as the bytes a NATS `HPUB` carries (the header block and the
payload), made from a template a shape of event (its attribute names in order) rather than header
by header: the agent's publisher frames every live event with it (agent/daemon/fleet_wire.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from itertools import chain
from operator import itemgetter
from typing import Any
from urllib.parse import quote, unquote

import orjson

CE_PREFIX = "ce-"
MSG_ID = "Nats-Msg-Id"
CONTENT_TYPE = "Content-Type"
_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) not in '%"')


def _header_value(value: Any) -> str:
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, int | float | str):
        text = str(value)
    else:
        text = orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    if text.isascii() and text.isprintable() and "%" not in text and '"' not in text:
        return text  # the common case, as quote() would return it, without its cost
    return quote(text, safe=_SAFE)


_HEADER_NAMES: dict[str, str] = {"datacontenttype": CONTENT_TYPE}


def _header_name(name: str) -> str:
    got = _HEADER_NAMES.get(name)
    if got is None:
        got = CE_PREFIX + name
        if len(_HEADER_NAMES) < 256:  # attribute names are few; a flood of odd ones is not cached
            _HEADER_NAMES[name] = got
    return got


def to_message(event: Mapping[str, Any]) -> tuple[dict[str, str], bytes]:
    """(headers, payload) of an event in binary content mode."""
    headers: dict[str, str] = {MSG_ID: _header_value(event["id"])}
    for name, value in event.items():
        if name == "data" or value is None:
            continue
        if (
            type(value) is str
            and value.isascii()
            and value.isprintable()
            and "%" not in value
            and '"' not in value
        ):
            headers[_header_name(name)] = value  # most values: as _header_value returns them
        else:
            headers[_header_name(name)] = _header_value(value)
    payload = orjson.dumps(event.get("data"), option=orjson.OPT_SORT_KEYS)
    return headers, payload


def from_message(headers: Mapping[str, str] | None, payload: bytes) -> dict[str, Any]:
    """The event of a message in binary content mode (header values are strings: `seq` an int
    again). ValueError when the message is not a CloudEvent."""
    event: dict[str, Any] = {}
    for name, value in (headers or {}).items():
        low = name.lower()
        if low.startswith(CE_PREFIX):
            event[low[len(CE_PREFIX) :]] = unquote(value)
        elif low == CONTENT_TYPE.lower():
            event["datacontenttype"] = unquote(value)
    for required in ("specversion", "id", "source", "type"):
        if required not in event:
            raise ValueError(f"not a CloudEvent: no ce-{required} header")
    if "seq" in event and event["seq"].isdigit():
        event["seq"] = int(event["seq"])
    try:
        event["data"] = orjson.loads(payload) if payload else None
    except orjson.JSONDecodeError as e:
        raise ValueError(f"the payload is not JSON: {e}") from None
    return event


HEADER_LINE = b"NATS/1.0\r\n"
_PLAIN_TYPES = frozenset({str, int})


class _Shape:
    """The header block of events with these attribute names, in this order, as one `%` format
    (`Nats-Msg-Id`, then every attribute but `data` as `to_message` names it), for values that
    need no encoding."""

    __slots__ = ("get", "template")

    def __init__(self, names: tuple[str, ...]) -> None:
        attrs = [n for n in names if n != "data"]
        self.get: Callable[[Mapping[str, Any]], tuple[Any, ...]] = itemgetter("id", *attrs)
        lines = ["NATS/1.0", MSG_ID + ": \x00"] + [_header_name(n) + ": \x00" for n in attrs]
        self.template = "\r\n".join(lines).replace("%", "%%").replace("\x00", "%s") + "\r\n\r\n"


_SHAPES: dict[tuple[str, ...], _Shape] = {}


def _shape(event: Mapping[str, Any]) -> _Shape:
    names = tuple(event)
    shape = _SHAPES.get(names)
    if shape is None:
        shape = _Shape(names)
        if len(_SHAPES) < 64:  # a few shapes (with or without extensions); a flood is not cached
            _SHAPES[names] = shape
    return shape


def encode(event: Mapping[str, Any]) -> tuple[bytes, bytes]:
    """(header block, payload) of an event: `to_message`'s headers as NATS writes them
    (`NATS/1.0`, a `Name: value` line each, an empty line) and its payload."""
    return encode_many([event])[0]


def encode_many(events: Sequence[Mapping[str, Any]]) -> list[tuple[bytes, bytes]]:
    """`encode` of each event. The header blocks come from a template a shape of event, checked a
    batch at a time: plain values only (str or int: no None to skip, no bool, list or dict to
    encode), all printable ASCII, no `%` or `"` (nothing to percent-encode). A batch that fails the
    check is encoded event by event, as `to_message` does."""
    shapes = [_shape(e) for e in events]
    values = [shape.get(e) for shape, e in zip(shapes, events, strict=True)]
    flat = list(chain.from_iterable(values))
    if _PLAIN_TYPES.issuperset(map(type, flat)):
        text = "".join(map(str, flat))
        if text.isascii() and text.isprintable() and "%" not in text and '"' not in text:
            dumps, sort = orjson.dumps, orjson.OPT_SORT_KEYS
            return [
                ((shape.template % v).encode(), dumps(e.get("data"), option=sort))
                for shape, v, e in zip(shapes, values, events, strict=True)
            ]
    return [_encode_one(e) for e in events]


def _encode_one(event: Mapping[str, Any]) -> tuple[bytes, bytes]:
    headers, payload = to_message(event)
    block = "NATS/1.0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    return block.encode(), payload


def parse_header_block(block: bytes) -> dict[str, str]:
    """The headers of a block `encode` made (for tests and readers of raw frames)."""
    lines = block.decode().split("\r\n")
    if lines[0] != "NATS/1.0":
        raise ValueError("not a NATS header block")
    out = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(": ")
            out[name] = value
    return out
