"""Normalisation of what differs between runs without meaning anything.

Used for the content-addressed run id and by `evidence diff`. Documented in docs/bundle-format.md
("Normalisation"); extend it with `evidence diff --ignore PATTERN`.

Rules, applied in order:
1. the run's own roots are replaced by placeholders: its private tmp by ${TMPDIR}, its workspace by
   ${WORKSPACE} (longest root first, only on a path-component boundary);
2. /proc/<number>/ and /proc/<number> become /proc/<pid>/;
3. random temp names become <rand>: Python's tempfile (tmp + 8 of [a-z0-9_]), mktemp's tmp.XXXXXXXXXX,
   and a 32-hex or longer run inside a name (content hashes used as temp names);
4. extra patterns (regular expressions) given by the user are replaced by <ignored>.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping

_BUILTIN = [
    (re.compile(r"/proc/\d+(?=/|$)"), "/proc/<pid>"),
    (re.compile(r"(?<![A-Za-z0-9])tmp[a-z0-9_]{8}(?![A-Za-z0-9_])"), "tmp<rand>"),
    (re.compile(r"(?<![A-Za-z0-9])tmp\.[A-Za-z0-9]{10}(?![A-Za-z0-9])"), "tmp.<rand>"),
    (re.compile(r"[0-9a-f]{32,}"), "<rand>"),
]
# whether any builtin rule can apply: one search, where most paths need no substitution at all
_ANY = re.compile("|".join(rx.pattern for rx, _ in _BUILTIN))
# ... and before it what each rule needs ("/proc/", "tmp", 32 hex digits): _ANY's lookbehinds make it
# try every position (1.3 us a path), these tell most paths apart in a fifth of that
_HEX = re.compile("[0-9a-f]{32}")


class Normalizer:
    def __init__(self, roots: Mapping[str, str] | None = None, ignore: Iterable[str] = ()) -> None:
        # placeholder -> root; longest root first so nested roots map to the most specific one
        items = [(p, r.rstrip("/")) for p, r in (roots or {}).items() if r and r.rstrip("/")]
        self._roots = sorted(items, key=lambda pr: len(pr[1]), reverse=True)
        self._ignore = [re.compile(p) for p in ignore]

    def roots(self) -> list[str] | None:
        """The roots text() replaces (longest first); None when it also applies user patterns."""
        return None if self._ignore else [root for _, root in self._roots]

    def text(self, value: str) -> str:
        for placeholder, root in self._roots:
            if value == root or value.startswith(root + "/"):
                value = placeholder + value[len(root) :]
                break
        if ("/proc/" in value or "tmp" in value or _HEX.search(value)) and _ANY.search(value):
            for rx, repl in _BUILTIN:
                value = rx.sub(repl, value)
        for rx in self._ignore:
            value = rx.sub("<ignored>", value)
        return value

    def argv(self, argv: Iterable[str]) -> list[str]:
        return [self.text(a) for a in argv]


def ip_of(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An address without its zone, an IPv4-mapped IPv6 one as its IPv4 address; None: not one."""
    try:
        addr = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def canonical_address(address: str) -> str:
    """An address as the tables of names key it (ip_of), or as it is when it is not one."""
    addr = ip_of(address)
    return address if addr is None else str(addr)
