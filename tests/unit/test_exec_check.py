"""The no-race check's user-space half (agent/recorder/exec_check.py): the keyed hash is SipHash-2-4
(the reference vector, and OpenSSL's over generated inputs), the argv bytes are what the probe
copies, a `#!` line splits as the kernel splits it, and the entry's layout is fixed."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evidence.agent.recorder.exec_check import (
    ENTRY,
    MemoryPublisher,
    argv_bytes,
    bprm_filename,
    decided_exec,
    kernel_dev,
    shebang,
    siphash24,
)

KEY = bytes(range(16))


def test_siphash_matches_the_papers_vector() -> None:
    assert siphash24(KEY, bytes(range(15))) == 0xA129CA6149BE45E5  # SipHash paper, appendix A
    assert siphash24(KEY, b"") == 0x726FDB47DD0E0E31
    with pytest.raises(ValueError):
        siphash24(b"short", b"")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is in the base image")
@settings(max_examples=25, deadline=None)
@given(st.binary(min_size=16, max_size=16), st.binary(max_size=300))
def test_siphash_agrees_with_openssl(key: bytes, data: bytes) -> None:
    out = subprocess.run(
        ["openssl", "mac", "-macopt", f"hexkey:{key.hex()}", "-macopt", "size:8", "SIPHASH"],
        input=data,
        capture_output=True,
        check=True,
    ).stdout
    assert siphash24(key, data).to_bytes(8, "little").hex().upper() == out.decode().strip()


def test_argv_bytes_are_the_probes_copy_of_the_arg_area() -> None:
    assert argv_bytes([b"git", b"push", b""]) == b"git\0push\0\0"
    assert argv_bytes([b"x" * 10_000]) == b"x" * 8191  # cut at ARGS_BYTES - 1, as the probe cuts
    assert argv_bytes([b"ab", b"cd"], cap=4) == b"ab\0"


def test_a_shebang_splits_as_the_kernel_splits_it() -> None:
    assert shebang(b"#!/bin/sh\nexit 0\n") == (b"/bin/sh", None)
    assert shebang(b"#!  /usr/bin/env   -S python3 -u \t\nx") == (b"/usr/bin/env", b"-S python3 -u")
    assert shebang(b"#!/bin/tail\t-f\n") == (b"/bin/tail", b"-f")
    assert shebang(b"#!/bin/sh\0 ignored\n") == (b"/bin/sh", None)
    assert shebang(b"\x7fELF") is None and shebang(b"#!\n") is None
    assert bprm_filename(b"./s", -100, False) == b"./s"
    assert bprm_filename(b"s", 5, False) == b"/dev/fd/5/s"
    assert bprm_filename(b"", 5, True) == b"/dev/fd/5"
    assert bprm_filename(b"/abs", 5, False) == b"/abs"


def test_an_entry_matches_only_the_file_and_argv_it_was_made_for() -> None:
    st_ = os.stat("/bin/sh")
    pub = MemoryPublisher(KEY)
    pub(7, decided_exec(KEY, (st_.st_dev, st_.st_ino), [b"sh", b"-c", b"true"]))
    assert pub.check(7, st_.st_dev, st_.st_ino, b"sh\0-c\0true\0")
    assert not pub.check(7, st_.st_dev, st_.st_ino, b"sh\0-c\0true\0")  # one entry, one exec
    pub(7, decided_exec(KEY, (st_.st_dev, st_.st_ino), [b"sh", b"-c", b"true"]))
    assert not pub.check(7, st_.st_dev, st_.st_ino, b"sh\0-c\0rm -rf /\0")  # argv rewritten
    pub(7, decided_exec(KEY, (st_.st_dev, st_.st_ino), [b"sh"]))
    assert not pub.check(7, st_.st_dev, st_.st_ino + 1, b"sh\0")  # another file
    assert not pub.check(8, st_.st_dev, st_.st_ino, b"sh\0")  # no entry for that thread
    # a script: the interpreter's file, the kernel's argv
    d = decided_exec(KEY, (1, 2), [b"./s", b"a"], script=(b"/bin/tail", b"-f", b"./s"))
    assert d.script and d.args_len == len(b"/bin/tail\0-f\0./s\0a\0")
    kdev, ino, h, n, flags = ENTRY.unpack(d.pack())
    assert (kdev, ino, h, n, flags) == (kernel_dev(1), 2, d.argv_hash, d.args_len, 1)
    assert kernel_dev(os.makedev(259, 3)) == (259 << 20) | 3
