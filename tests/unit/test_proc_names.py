"""Names the recorder reads from /proc as str (os.readlink: bytes that are not UTF-8 become lone
surrogates) reach records only as the kernel's names do, with such bytes as \\xNN: a surrogate made
the spool's JSON encoder raise and killed the recorder's consumer (red team; a job picks its cwd's
name, and a process first seen mid-life, or found by a late attach, is read from /proc)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import orjson

from evidence.agent.recorder.decode import path_text
from evidence.agent.recorder.inventory import read_process
from evidence.agent.recorder.recording import proc_lookup


def test_path_text_keeps_utf8_and_escapes_the_rest() -> None:
    assert path_text("/tmp/é") == "/tmp/é"
    assert path_text(os.fsdecode(b"/tmp/bad\xff\xfe")) == "/tmp/bad\\xff\\xfe"


def test_a_live_process_in_a_cwd_that_is_not_utf8_is_read_as_text(tmp_path: Path) -> None:
    bad = os.fsencode(tmp_path) + b"/bad\xffdir"
    os.mkdir(bad)
    child = subprocess.Popen(["sleep", "30"], cwd=bad)
    try:
        found = proc_lookup(child.pid)
        assert found is not None
        _, cwd, _ = found
        assert cwd == f"{tmp_path}/bad\\xffdir"
        info = read_process(child.pid)
        assert info is not None and info["cwd"] == cwd
        orjson.dumps({"cwd": cwd, "info": info})  # encodable
    finally:
        child.kill()
        child.wait()
