"""`evidence run`'s early guess that a policy has command rules (agent/commands/run_standalone.py
_names_commands): it only starts the exec supervisor's process sooner, so it may be wrong, but it
must never consume or block on what `--policy` names."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from evidence.agent.commands.run_standalone import _names_commands


def test_a_policy_with_a_commands_section_is_guessed(tmp_path: Path) -> None:
    p = tmp_path / "p.yaml"
    p.write_text("version: 1\ncommands:\n  default: allow\n")
    assert _names_commands(str(p))


def test_a_policy_without_one_is_not(tmp_path: Path) -> None:
    p = tmp_path / "p.yaml"
    p.write_text("version: 1\nfiles:\n  commands: x\n# commands:\n")
    assert not _names_commands(str(p))
    assert not _names_commands(str(tmp_path / "missing.yaml"))
    assert not _names_commands("default")


def test_a_pipe_is_neither_read_nor_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "policy"
    os.mkfifo(fifo)
    got: list[bytes] = []
    writer = threading.Thread(target=lambda: fifo.write_bytes(b"commands:\n"))
    reader_fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # so that the writer's open returns
    writer.start()
    try:
        assert not _names_commands(str(fifo))
        writer.join(timeout=10)
        got.append(os.read(reader_fd, 100))
    finally:
        os.close(reader_fd)
    assert got == [b"commands:\n"]  # all of it still there for the real reader
