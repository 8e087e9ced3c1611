"""The CloudEvents NATS binding (bundle/fleet/binding.py), pure: the fast path for plain string
values gives what the general encoding gives, and every event comes back from its message."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from hypothesis import given
from hypothesis import strategies as st

from evidence.bundle.fleet import binding

_text = st.text(max_size=40)
_attr = st.from_regex(r"[a-z][a-z0-9]{0,15}", fullmatch=True).filter(
    lambda n: n not in {"data", "datacontenttype", "id", "specversion", "source", "type", "seq"}
)


def reference(value: Any) -> str:
    """The encoding without the fast path: the binding's rule as written in its docstring."""
    text = value if isinstance(value, str) else binding._header_value(value)
    return quote(text, safe=binding._SAFE)


@given(
    id_=_text.filter(bool),
    subject=_text,
    extra=st.dictionaries(_attr, _text | st.integers() | st.booleans(), max_size=4),
    data=st.dictionaries(st.text(max_size=8), st.integers(-(2**63), 2**64 - 1) | _text, max_size=4),
)
def test_headers_as_the_general_encoding_and_back(
    id_: str, subject: str, extra: dict[str, Any], data: dict[str, Any]
) -> None:
    event = {
        "specversion": "1.0",
        "id": id_,
        "source": "urn:evidence:session:s1",
        "type": "dev.evidence.file.open",
        "subject": subject,
        "datacontenttype": "application/json",
        "seq": 7,
        **extra,
        "data": data,
    }
    headers, payload = binding.to_message(event)
    assert headers[binding.MSG_ID] == reference(id_)
    assert headers["Content-Type"] == "application/json"
    for name, value in event.items():
        if name not in {"data", "datacontenttype"}:
            assert headers["ce-" + name] == reference(value), name
    for value in headers.values():
        assert value.isascii() and value.isprintable() and '"' not in value
    back = binding.from_message(headers, payload)
    assert back["id"] == id_ and back["subject"] == subject and back["seq"] == 7
    assert back["data"] == data
    for name, value in extra.items():
        want = value if isinstance(value, str) else binding._header_value(value)
        assert back[name] == want
