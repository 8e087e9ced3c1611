"""The lines the job is told on its stderr (agent/recorder/notices.py): from denial records, rate
limited, never blocking its caller when the job stops reading, silent with --quiet-denials."""

from __future__ import annotations

import fcntl
import os
from typing import Any

from evidence.agent.recorder.notices import NoticeWriter, denial_notice
from evidence.bundle.record_types import DenialRecord
from evidence.policy.commands import NoticeLimiter


def _denial(operation: str, target: str, rule: str, enforced: bool = True) -> DenialRecord:
    return {
        "k": "denial",
        "t": 1,
        "pid": 7,
        "exe": "/bin/sh",
        "operation": operation,
        "target": target,
        "rule": rule,
        "enforced": enforced,
        "result": "EACCES" if enforced else 0,
    }


def test_a_denial_record_becomes_one_line_when_it_was_enforced() -> None:
    assert (
        denial_notice(_denial("write", "/etc/passwd", "fs.deny[0] /etc/**"))
        == "evidence: write of /etc/passwd refused by fs.deny[0] /etc/**"
    )
    assert (
        denial_notice(_denial("connect", "203.0.113.9:443", "net.default: deny"))
        == "evidence: connect of 203.0.113.9:443 refused by net.default: deny"
    )
    assert denial_notice(_denial("write", "/etc/passwd", "r", enforced=False)) is None  # audit: it went on
    # the supervisor told the job of its own refusal when it made it
    assert denial_notice(_denial("exec", "/usr/bin/curl", "commands.rules[2] (no-curl)")) is None
    # a file rule refusing an exec is told
    assert (
        denial_notice(_denial("exec", "/tmp/x", "fs: exec outside"))
        == "evidence: exec of /tmp/x refused by fs: exec outside"
    )
    # a name the job chose cannot draw on the terminal
    line = denial_notice(_denial("read", "/w/\x1b[2J\nfake", "r"))
    assert line is not None and "\x1b" not in line and "\n" not in line


def _read_all(fd: int) -> str:
    chunks: list[bytes] = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks).decode()


def test_lines_are_written_rate_limited_and_the_held_back_ones_counted() -> None:
    r, w = os.pipe()
    now = [0.0]
    writer = NoticeWriter(w, limiter=NoticeLimiter(rate=1.0, burst=2, clock=lambda: now[0]))
    writer.start()
    for i in range(5):
        writer.tell(f"evidence: line {i}")
    now[0] = 10.0
    writer.tell("evidence: later")
    writer.close()
    assert _read_all(r).splitlines() == [
        "evidence: line 0",
        "evidence: line 1",
        "evidence: later (3 earlier lines not shown)",
    ]
    os.close(r)


def test_quiet_denials_tell_nothing() -> None:
    r, w = os.pipe()
    writer = NoticeWriter(w, quiet=True)
    writer.start()
    writer.tell("evidence: x")
    writer.denial(_denial("write", "/etc/passwd", "r"))
    writer.close()
    assert _read_all(r) == ""
    os.close(r)


def test_a_job_that_stops_reading_does_not_block_the_teller_and_a_closed_reader_ends_the_writer() -> None:
    r, w = os.pipe()
    fcntl.fcntl(w, 1031, 4096)  # F_SETPIPE_SZ: a small pipe, full at once
    writer = NoticeWriter(w, limiter=NoticeLimiter(rate=1e9, burst=10**9, clock=lambda: 0.0), queue_max=8)
    writer.start()
    line = "evidence: " + "x" * 1000
    for _ in range(100):  # returns although nothing reads: the writer thread is blocked on the pipe
        writer.tell(line)
    assert writer.dropped > 0
    os.close(r)  # the job closes its end: the blocked write fails (EPIPE) and the writer ends
    writer.close(timeout=10)
    assert writer.fd == -1
    writer.tell("evidence: after")  # nothing to write to: ignored


def test_lines_from_many_threads_arrive_whole() -> None:
    import threading

    r, w = os.pipe()
    writer = NoticeWriter(
        w, limiter=NoticeLimiter(rate=1e9, burst=10**9, clock=lambda: 0.0), queue_max=10_000
    )
    writer.start()
    threads = [
        threading.Thread(target=lambda n=n: [writer.tell(f"evidence: t{n} {i}") for i in range(50)])
        for n in range(8)
    ]
    out: list[Any] = []
    reader = threading.Thread(target=lambda: out.append(_read_all(r)))
    reader.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writer.close(timeout=10)
    reader.join(10)
    lines = out[0].splitlines()
    assert sorted(lines) == sorted(f"evidence: t{n} {i}" for n in range(8) for i in range(50))
    os.close(r)
