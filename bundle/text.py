"""Human output that a hostile name cannot spoof: control and bidirectional characters escaped.

A file name, an argv element or a label may hold a newline, a carriage return, an ANSI escape or a
right-to-left override. Printed as they are, they would forge lines in `show`, `lint` and `diff`
text (a fake "0 findings" line, a path that reads backwards). Every human output is built as a list
of lines and joined here, each line with such characters written as `\\n`, `\\r`, `\\t`, `\\xNN` or
`\\uNNNN`. JSON output stays exact.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_SUSPECT = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2066-\u2069\ufeff]")


def _escape(m: re.Match[str]) -> str:
    ch = m.group(0)
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(s: str) -> str:
    """s with every control, format (bidi) or line-separating character escaped."""
    out = _SUSPECT.sub(_escape, s)
    if out.isprintable():
        return out
    return "".join(
        c
        if c.isprintable() or c == " " or unicodedata.category(c) not in ("Cc", "Cf", "Zl", "Zp")
        else _escape_char(c)
        for c in out
    )


def _escape_char(c: str) -> str:
    code = ord(c)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def join_lines(lines: Iterable[str]) -> str:
    """The lines of a human output, each made printable, one per line."""
    return "".join(printable(line) + "\n" for line in lines)
