"""A job's failed execs, as nobody, at the edges of the argv loop the verifier now walks once
(issue 27: its offset and the name's length go through the record): every argument up to the
128th, every byte up to the 8,191st, the rest marked truncated, never a byte of another argument,
and a name as long as the probe reads with its arguments after it."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.kernel.util import PY, as_user, of_type, record

pytestmark = pytest.mark.kernel

NOBODY = 65534

_SCRIPT = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
def attempt(path, args):
    argv = (ctypes.c_char_p * (len(args) + 1))(*args, None)
    assert libc.execve(path, argv, None) == -1 and ctypes.get_errno() == 2  # ENOENT: recorded, returns
attempt(b"/nonexistent/many", [b"a%d" % i for i in range(130)])
attempt(b"/nonexistent/full", [b"full", b"x" * 5000, b"y" * 3190, b"z"])
attempt(b"/nonexistent/fits", [b"fits", b"q" * 10])
attempt(b"/nonexistent/" + b"n" * 4000, [b"long", b"arg"])
"""


def test_failed_execs_keep_their_arguments_to_the_limits_and_mark_the_rest(tmp_path: Path) -> None:
    proc, manifest, events = record(tmp_path, *as_user(NOBODY, PY, "-c", textwrap.dedent(_SCRIPT)))
    assert proc.returncode == 0, proc.stderr
    assert manifest["lost"]["total"] == 0
    execs = {e["data"]["filename"]: e["data"] for e in of_type(events, "process.exec")}
    many = execs["/nonexistent/many"]
    assert many["result"] == "ENOENT" and many["argv"] == [f"a{i}" for i in range(128)]
    assert many["argv_truncated"] is True
    full = execs["/nonexistent/full"]
    # 5 + 5001 bytes, then 3,185 of the third argument's 3,191: 8,191 in all, the last one's NUL
    assert full["argv"][:2] == ["full", "x" * 5000] and full["argv_truncated"] is True
    assert set(full["argv"][2]) == {"y"} and len(full["argv"]) == 3 and len(full["argv"][2]) < 3190
    fits = execs["/nonexistent/fits"]
    assert fits["argv"] == ["fits", "q" * 10] and not fits["argv_truncated"]
    (long,) = [d for name, d in execs.items() if name.startswith("/nonexistent/nnn")]
    assert long["filename"] == "/nonexistent/" + "n" * 4000 and long["argv"] == ["long", "arg"]
    assert not long["argv_truncated"]
