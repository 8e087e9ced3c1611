"""The no-race check's user-space half (agent/recorder/exec_check.py): its pins are probes/abi.py's
(the reference the BPF program is tested against in tests/kernel/test_exec_check.py), hashed over
the whole arg area (not the recorder probe's 8191-byte copy; an empty argv is one empty argument);
what cannot be pinned is None (the supervisor refuses it); a `#!` line splits as the kernel splits
it; a run's check enforces, publishes and releases through the probes."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evidence.agent.recorder.exec_check import (
    ExecCheck,
    MemoryPublisher,
    bprm_filename,
    pin_exec,
    shebang,
)
from evidence.probes import abi

KEY = bytes(range(16))


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
    assert abi.siphash24(key, data).to_bytes(8, "little").hex().upper() == out.decode().strip()


@settings(max_examples=200, deadline=None)
@given(
    st.binary(min_size=16, max_size=16),
    st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\0", b"")), max_size=12),
    st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)),
    st.one_of(st.none(), st.tuples(st.binary(min_size=1, max_size=20), st.none() | st.binary(max_size=9))),
)
def test_the_supervisors_fast_pin_is_abis_reference(
    key: bytes, argv: list[bytes], ident: tuple[int, int], script: tuple[bytes, bytes | None] | None
) -> None:
    """pin_exec hashes with siphashc (C); what it pins is what abi.exec_pin, the reference the BPF
    program is tested against, pins for the same exec, hash and all."""
    dev = os.makedev(ident[0] >> 20 & 0xFFF, ident[0] & 0xFFFFF)
    if script is None:
        want = abi.exec_pin(key, (dev, ident[1]), argv)
        assert pin_exec(key, (dev, ident[1]), argv) == want
    else:
        kernel_argv = abi.script_argv(script[0], script[1], b"/s", argv)
        want = abi.exec_pin(key, (dev, ident[1]), kernel_argv, script=True)
        assert pin_exec(key, (dev, ident[1]), argv, script=(script[0], script[1], b"/s")) == want


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


def test_a_pin_is_abis_over_the_whole_arg_area() -> None:
    st_ = os.stat("/bin/sh")
    ident = (st_.st_dev, st_.st_ino)
    long = [b"sh", b"x" * 20_000]  # past the recorder probe's ARGS_BYTES: still hashed whole
    pin = pin_exec(KEY, ident, long)
    assert pin == abi.exec_pin(KEY, ident, long)
    assert pin is not None and pin.args_len == 20_004 and pin.dev == abi.kernel_dev(st_.st_dev)
    # an empty argv is one empty argument in the new image (fs/exec.c since 5.18)
    empty = pin_exec(KEY, ident, [])
    assert empty is not None and (empty.args_len, empty.argv_hash) == (1, abi.siphash24(KEY, b"\0"))


def test_what_cannot_be_pinned_is_none() -> None:
    assert pin_exec(KEY, None, [b"sh"]) is None  # the name leads to no file
    assert pin_exec(KEY, (1, 2), [b"sh"], truncated=True) is None  # argv not read whole
    assert pin_exec(KEY, (1, 2), [b"x" * abi.EXEC_ARGS_MAX]) is None  # past the BPF side's limit
    assert pin_exec(KEY, (1, 2), [b"x" * (abi.EXEC_ARGS_MAX - 1)]) is not None


def test_a_scripts_pin_is_its_interpreters_file_with_the_kernels_argv() -> None:
    pin = pin_exec(KEY, (1, 2), [b"./s", b"a"], script=(b"/bin/tail", b"-f", b"./s"))
    assert pin == abi.exec_pin(KEY, (1, 2), [b"/bin/tail", b"-f", b"./s", b"a"], script=True)
    assert pin is not None and pin.flags == abi.PIN_SCRIPT


def test_a_pin_matches_only_the_file_and_arg_area_it_was_made_for() -> None:
    st_ = os.stat("/bin/sh")
    ident = (st_.st_dev, st_.st_ino)
    pub = MemoryPublisher(KEY)

    def pin(argv: list[bytes]) -> abi.ExecPin:
        p = pin_exec(KEY, ident, argv)
        assert p is not None
        return p

    pub(7, pin([b"sh", b"-c", b"true"]))
    assert pub.check(7, st_.st_dev, st_.st_ino, b"sh\0-c\0true\0")
    assert not pub.check(7, st_.st_dev, st_.st_ino, b"sh\0-c\0true\0")  # one pin, one exec
    pub(7, pin([b"sh", b"-c", b"true"]))
    assert not pub.check(7, st_.st_dev, st_.st_ino, b"sh\0-c\0rm -rf /\0")  # argv rewritten
    pub(7, pin([b"sh"]))
    assert not pub.check(7, st_.st_dev, st_.st_ino + 1, b"sh\0")  # another file
    assert not pub.check(8, st_.st_dev, st_.st_ino, b"sh\0")  # no pin for that thread
    # a rewrite past the first 8191 bytes is a difference too
    head = [b"sh", b"-c", b"true", b"x" * 9000]
    pub(7, pin(head))
    assert not pub.check(7, st_.st_dev, st_.st_ino, b"sh\0-c\0true\0" + b"x" * 8999 + b"y\0")


def test_a_runs_check_enforces_publishes_and_releases_through_the_probes() -> None:
    probes = MemoryPublisher(KEY)
    check = ExecCheck(probes, slot=3)
    assert len(check.key) == 16 and check.key != ExecCheck(probes, slot=4).key  # a key per run
    assert repr(check.key) not in repr(check)  # a log line never shows it
    check.enforce()
    assert probes.enforced == {3}
    p = pin_exec(check.key, (1, 2), [b"true"])
    assert p is not None and check.publish(11, p) and probes.entries == {11: p}
    check.forget(11)
    assert probes.entries == {}
    check.release()
    check.release()  # once
    assert probes.enforced == set() and not check.enforced


def test_a_pin_the_kernel_cannot_hold_is_refused() -> None:
    class Full(MemoryPublisher):
        def publish(self, tid: int, pin: abi.ExecPin) -> None:
            raise OSError(7, "Argument list too long")

    check = ExecCheck(Full(KEY), slot=1)
    p = pin_exec(check.key, (1, 2), [b"true"])
    assert p is not None and check.publish(5, p) is False
