"""Which names of the dynamic loader's program the job cannot move after its exec is decided
(exec_resolve.stable_name), and `#!` lines split as the kernel splits them for the rules, not as
str.split would (issue 24's red team, round two)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from evidence.agent.recorder import exec_resolve
from evidence.agent.recorder.exec_check import shebang


@pytest.mark.parametrize("name", ["/usr/bin/true", "/usr/lib/x86_64-linux-gnu/../../bin/true"])
def test_a_name_in_roots_own_directories_is_stable(name: str) -> None:
    if os.stat("/usr/bin").st_uid != 0:
        pytest.skip("/usr/bin is not root's here")
    assert exec_resolve.stable_name(name, os.path.realpath(name))


@pytest.mark.parametrize(
    "name",
    [
        "true",  # relative: the cwd can move
        "./true",
        "/proc/self/fd/3",  # a descriptor another thread can point elsewhere
        "//proc/self/fd/3",  # the same for the kernel (normpath keeps two leading slashes)
        "/proc/./self/fd/3",
        "/proc/1/root/usr/bin/true",
        "/dev/fd/3",
        "/dev/stdin",
    ],
)
def test_names_the_job_can_change_are_not_stable(name: str) -> None:
    assert not exec_resolve.stable_name(name, "/usr/bin/true")


def test_a_name_in_a_directory_others_can_write_is_not_stable(tmp_path: Path) -> None:
    sticky = tmp_path / "sticky"
    sticky.mkdir(mode=0o1777)
    sticky.chmod(0o1777)
    assert not exec_resolve.stable_name(f"{sticky}/p", "/usr/bin/true")
    # where it leads counts too: a root link to a place others can write
    assert not exec_resolve.stable_name("/usr/bin/true", f"{sticky}/p")


def test_a_name_in_a_directory_of_another_user_is_not_stable(tmp_path: Path) -> None:
    if os.getuid() == 0:
        os.chown(tmp_path, 65534, 65534)
    assert not exec_resolve.stable_name(f"{tmp_path}/p", "/usr/bin/true")


@pytest.mark.parametrize(
    ("line", "interpreter"),
    [
        (b"#!/w/ok\r\n", b"/w/ok\r"),
        (b"#!/w/ok\x0b -x\n", b"/w/ok\x0b"),
        (b"#!/usr/bin/true\x00/x\n", b"/usr/bin/true"),
        (b"#! \t/bin/sh -e -u\n", b"/bin/sh"),
    ],
)
def test_a_shebang_is_split_only_at_spaces_tabs_and_nul(line: bytes, interpreter: bytes) -> None:
    bang = shebang(line)
    assert bang is not None and bang[0] == interpreter
    assert exec_resolve._interpreter(os.getpid(), bang, "/") == os.path.realpath(os.fsdecode(interpreter))


@pytest.mark.parametrize(
    ("head", "want"),
    [
        # no newline in 256 bytes: the line ends at byte 255, which the kernel drops, then spaces
        (b"#!/usr/bin/id -u" + b" " * 239 + b"Z\n", (b"/usr/bin/id", b"-u")),
        (b"#!/usr/bin/id -u" + b" " * 238 + b"YZ\n", (b"/usr/bin/id", b"-u" + b" " * 238 + b"Y")),
        (b"#!" + b"x" * 300, None),  # the name may be cut: the kernel refuses it (ENOEXEC)
        (b"#!/bin/sh \t\n", (b"/bin/sh", None)),
        (b"#!/usr/bin/id -u\x00 -g\n", (b"/usr/bin/id", b"-u")),  # a NUL ends the argument
        (b"#!/usr/bin/id\x00 -g\n", (b"/usr/bin/id", None)),  # a NUL before the newline ends the line
        (b"#!", None),
        (b"#!\n", None),
        (b"#!/bin/sh", (b"/bin/sh", None)),  # a short file: NULs after it
    ],
)
def test_a_shebang_is_cut_where_the_kernel_cuts_it(
    head: bytes, want: tuple[bytes, bytes | None] | None
) -> None:
    assert shebang(head) == want
