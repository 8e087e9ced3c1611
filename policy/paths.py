"""Paths in a policy: `${VARIABLE}` expansion, canonical paths and globs, and what "beneath" means.

Shared by the file rules (policy/model.py) and the command rules (policy/governance.py); pure.
"""

from __future__ import annotations

import os
import re

VARIABLES = ("WORKSPACE", "HOME", "TMPDIR")
_VAR_RE = re.compile(r"\$\{([^}]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")
_GLOB_CHARS = set("*?[")


def is_glob(text: str) -> bool:
    return any(c in _GLOB_CHARS for c in text)


def expand_variables(text: str, variables: dict[str, str]) -> str:
    """Replace ${NAME} for the known variables; any other variable is an error."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) if m.group(1) is not None else m.group(2)
        if name not in variables:
            known = ", ".join("${" + v + "}" for v in VARIABLES)
            raise ValueError(f"unknown variable ${{{name}}} (known: {known})")
        return variables[name]

    return _VAR_RE.sub(sub, text)


def canonical_path(path: str) -> str:
    """Absolute, normalised, symlinks resolved (for the parts that exist)."""
    return os.path.realpath(path)


def canonical_glob(pattern: str) -> str:
    """Canonicalise the literal directory part of a glob; keep the wildcard part as written."""
    parts = pattern.split("/")
    for i, part in enumerate(parts):
        if is_glob(part):
            head = "/".join(parts[:i]) or "/"
            rest = "/".join(parts[i:])
            return os.path.join(canonical_path(head), rest)
    return canonical_path(pattern)


def glob_regex(pattern: str, *, beneath: bool = True) -> re.Pattern[str]:
    """`*` and `?` stay within one component, `**` spans any number of them, `[...]` is a class.
    A match also covers everything beneath the matched path (unless `beneath` is false)."""
    out = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:[^/]*/)*")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = pattern.find("]", i + 1)
            if j < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1 : j]
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = j + 1
                continue
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("^" + "".join(out) + ("(?:/.*)?$" if beneath else "$"))


def components(path: str) -> int:
    return len([p for p in path.split("/") if p])


def under(path: str, root: str) -> bool:
    """True when path is root or lies beneath it (on a component boundary)."""
    if root == "/":
        return path.startswith("/")
    return path == root or path.startswith(root + "/")
