"""The job is told: one line on the job's stderr for each operation a policy refused or holds for
approval (issue 24), e.g. `evidence: exec of /usr/bin/curl refused by commands.rules[2]
(no-network-tools)`, so a coding agent learns why instead of seeing a bare EACCES.

The recorder keeps a dup of the job's stderr from before the launch and gives it to a
`NoticeWriter`; `tell(line)` is what the exec supervisor is given (`ExecSupervisor.tell`), and
`denial(rec)` takes the file and connect denials the recorder makes (enforce.py, the connect guard)
as records. Lines are rate-limited by policy/commands.py's NoticeLimiter (a line after some were
held back says how many) and `--quiet-denials` turns the whole thing off (`quiet`).

Never blocking the caller: the job owns the other end of its stderr and may stop reading it (a full
pipe), so lines go through a bounded queue to a writer thread; when the queue is full a line is
dropped and counted. A write that fails (the job closed the reader: EPIPE) ends the writer. The
writer's descriptor is its own dup: setting it non-blocking would change the job's open file too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field

from evidence.bundle.record_types import DenialRecord
from evidence.policy.commands import NoticeLimiter, notice

logger = logging.getLogger(__name__)

QUEUE_MAX = 256  # lines waiting for the writer thread before more are dropped


def denial_notice(rec: DenialRecord) -> str | None:
    """The line for a denial record, or None: a denial that was not enforced (audit, dry run: the
    operation went on) tells nothing, nor an exec refused by a command rule (`commands.*`: the
    supervisor told the job when it refused it)."""
    if not rec["enforced"]:
        return None
    rule = rec["rule"]
    if rec["operation"] == "exec" and rule.startswith("commands."):
        return None
    return notice(rec["operation"], rec["target"], rule)


@dataclass
class NoticeWriter:
    """Writes notice lines to `fd` (the recorder's dup of the job's stderr, owned by the writer)."""

    fd: int
    quiet: bool = False
    limiter: NoticeLimiter = field(default_factory=lambda: NoticeLimiter(clock=time.monotonic))
    queue_max: int = QUEUE_MAX
    dropped: int = field(init=False, default=0)  # lines lost to a full queue
    _queue: queue.Queue[str | None] = field(init=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    _thread: threading.Thread | None = field(init=False, default=None)
    _broken: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self._queue = queue.Queue(self.queue_max)

    def start(self) -> None:
        if self.quiet:
            return
        self._thread = threading.Thread(target=self._write_all, name="notices", daemon=True)
        self._thread.start()

    def tell(self, line: str) -> None:
        """Queue one line (thread-safe, never blocks)."""
        if self.quiet or self._broken:
            return
        with self._lock:  # the limiter is not thread-safe; callers are the supervisor's threads
            shown = self.limiter(line)
        if shown is not None:
            self._put(shown)

    def denial(self, rec: DenialRecord) -> None:
        line = denial_notice(rec)
        if line is not None:
            self.tell(line)

    def close(self, timeout: float = 2.0) -> None:
        """The run ended: say what the limiter held back, write what is queued (waiting at most
        `timeout` for a job that does not read), and close the descriptor."""
        if self._thread is not None:
            with self._lock:
                last = self.limiter.flush()
            if last is not None:
                self._put(last)
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(None)
            self._thread.join(timeout)
            if self._thread.is_alive():  # blocked on a full pipe: leave it (a daemon thread)
                return
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = -1

    def _put(self, line: str) -> None:
        try:
            self._queue.put_nowait(line)
        except queue.Full:
            self.dropped += 1

    def _write_all(self) -> None:
        while True:
            line = self._queue.get()
            if line is None:
                return
            data = (line + "\n").encode("utf-8", "backslashreplace")
            try:
                while data:
                    data = data[os.write(self.fd, data) :]
            except OSError as e:  # EPIPE: the job closed its stderr's reader; EBADF: closed
                logger.debug("notices: stopped writing to the job's stderr: %s", e.strerror)
                self._broken = True
                return
