"""Canonical JSON (RFC 8785, JCS) for everything that is hashed or written into a bundle.

orjson with sorted keys produces exactly the JCS serialisation for the values a bundle holds:
strings (escaping only '"', '\\' and control characters, with lowercase \\u00xx), integers,
booleans, null, lists and objects. JCS number formatting of non-integers is not needed: bundles hold
no floats, and `dumps` refuses them so that a float can never make two producers disagree.
Keys are sorted by code point, which equals JCS's UTF-16 order for every key without characters
above U+FFFF; `dumps` refuses such keys rather than risk a different order.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import orjson

_OPTS = orjson.OPT_SORT_KEYS


class CanonicalError(ValueError):
    pass


def _check(value: Any, depth: int = 0) -> None:
    if depth > 64:
        raise CanonicalError("nested deeper than 64 levels")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise CanonicalError(f"non-string key {k!r}")
            if any(ord(c) > 0xFFFF for c in k):
                raise CanonicalError(f"key {k!r} has characters above U+FFFF")
            _check(v, depth + 1)
    elif isinstance(value, list | tuple):
        for v in value:
            _check(v, depth + 1)
    elif isinstance(value, float):
        raise CanonicalError("floats are not allowed in canonical documents")


def dumps(value: Any, *, check: bool = True) -> bytes:
    """Canonical bytes of `value`. `check=False` skips the recursive check for hot paths whose
    values are built by this package from ints and strings only."""
    if check:
        _check(value)
    return orjson.dumps(value, option=_OPTS)


# canonical.dumps(value, check=False) without a Python call of its own, for the writer's hottest lines
dumps_unchecked = functools.partial(orjson.dumps, option=_OPTS)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
