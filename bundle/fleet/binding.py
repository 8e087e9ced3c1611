"""The CloudEvents NATS protocol binding (binary content mode) of a live event, pure.

An event dict (agent/daemon/delivery.py `live_event`: the bundle's event shape) becomes NATS headers
and a payload: each attribute but `data` and `datacontenttype` as a `ce-<name>` header,
`datacontenttype` as `Content-Type`, `data` as the payload (canonical JSON), and `Nats-Msg-Id` set to
the event's id, so that JetStream drops a retry of a message it already stored (within the stream's
duplicate window). Header values are percent-encoded outside printable ASCII, and `%` and `"` too,
as the HTTP binding does: a file name of a job's may hold a newline, which no header may.
"""

from __future__ import annotations

from collections.abc import Mapping
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
