"""The run's configured resolvers: /etc/resolv.conf's nameservers, as the run's process sees it."""

from __future__ import annotations

import os
from pathlib import Path

from evidence.agent.recorder import resolvconf
from evidence.agent.recorder.resolvconf import nameservers, read_resolvers


def test_nameservers_as_glibc_reads_them() -> None:
    text = (
        "# generated\n"
        "search example.org\n"
        "nameserver 10.0.0.2\n"
        "; nameserver 10.9.9.9\n"
        "nameserver   fe80::1%eth0\n"
        "nameserver not-an-address\n"
        "nameserver 10.0.0.2\n"
        "options ndots:2\n"
        "nameserverX 10.1.1.1\n"
    )
    assert nameservers(text) == ["10.0.0.2", "fe80::1"]
    assert nameservers("search x\n") == ["127.0.0.1"]  # none: the local machine, as glibc asks
    assert len(nameservers("".join(f"nameserver 10.0.0.{i}\n" for i in range(40)))) == resolvconf.MAX_SERVERS


def test_a_symlink_in_the_processs_root_resolves_below_it(tmp_path: Path) -> None:
    """/etc/resolv.conf -> /run/resolv.conf in a container's root is that root's /run, not ours."""
    (tmp_path / "etc").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "resolv.conf").write_text("nameserver 192.0.2.53\n")
    (tmp_path / "etc" / "resolv.conf").symlink_to("/run/resolv.conf")
    root = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    try:
        fd = resolvconf._open_in_root(root, "etc/resolv.conf")
    finally:
        os.close(root)
    with os.fdopen(fd) as f:
        assert nameservers(f.read()) == ["192.0.2.53"]


def test_read_resolvers_of_a_live_process_and_of_none() -> None:
    mine = read_resolvers(os.getpid())
    try:
        expected = nameservers(Path("/etc/resolv.conf").read_text())
    except FileNotFoundError:
        expected = ["127.0.0.1"]
    assert mine == expected
    assert read_resolvers(0x3FFFFFFF) is None  # no such process
