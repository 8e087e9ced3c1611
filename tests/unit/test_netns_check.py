"""The agent checks a `--net` claim (policy/netns.py private_network_problem) against /proc: a fake
/proc here, where hard links stand for a shared namespace."""

from __future__ import annotations

import os
from pathlib import Path

from evidence.policy.netns import private_network_problem

DEV_HEADER = "Inter-|   Receive\n face |bytes    packets\n"


def _proc(tmp: Path, pid: int, dev: str, same_as: int | None = None) -> None:
    d = tmp / str(pid)
    (d / "ns").mkdir(parents=True)
    (d / "net").mkdir()
    if same_as is None:
        (d / "ns" / "net").write_text("")
    else:
        os.link(tmp / str(same_as) / "ns" / "net", d / "ns" / "net")
    (d / "net" / "dev").write_text(DEV_HEADER + dev)


def test_a_namespace_of_its_own_with_loopback_only_passes(tmp_path: Path) -> None:
    _proc(tmp_path, os.getpid(), "    lo: 0 0\n  eth0: 0 0\n")
    _proc(tmp_path, 20, "    lo: 0 0\n  eth0: 0 0\n")
    _proc(tmp_path, 30, "    lo: 0 0\n")
    assert private_network_problem(30, 20, tmp_path) is None


def test_the_clients_namespace_or_more_interfaces_or_nothing_to_read_fail(tmp_path: Path) -> None:
    _proc(tmp_path, os.getpid(), "    lo: 0 0\n")
    _proc(tmp_path, 20, "    lo: 0 0\n  eth0: 0 0\n")
    _proc(tmp_path, 30, "    lo: 0 0\n  eth0: 0 0\n", same_as=20)
    assert "shares its client" in (private_network_problem(30, 20, tmp_path) or "")
    _proc(tmp_path, 40, "    lo: 0 0\n  veth9: 0 0\n")
    assert "veth9" in (private_network_problem(40, 20, tmp_path) or "")
    assert "cannot be read" in (private_network_problem(50, 20, tmp_path) or "")
    _proc(tmp_path, 60, "    lo: 0 0\n", same_as=os.getpid())  # the agent's own
    assert "shares" in (private_network_problem(60, 20, tmp_path) or "")
