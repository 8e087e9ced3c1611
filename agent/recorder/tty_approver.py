"""The terminal approver: a person at the terminal `evidence run` was started from answers the
approval requests of its run (issue 24; approvals.py holds the requests).

It opens the recorder's controlling terminal (/dev/tty: the recorder's, opened by the recorder, not
a descriptor the job handed over) and, one request at a time, shows what waits (program, argv, depth,
rule and message, every string escaped: a name the job chose cannot move the cursor or clear the
screen) and reads the answer: `y` or `yes` allows, anything starting `n`, or an empty line, denies;
words after the first are the reason. The answer is recorded with the terminal's owner as `by_uid`
(the owner of its device node, /dev/pts/N: the user logged in on it, not the recorder's uid, which
sudo makes root).

What the job can and cannot do to it (the job shares the terminal when it was started from it):
- it cannot type an answer: input reaches the terminal's queue only from the keyboard side or by
  the TIOCSTI ioctl, which the seccomp filter of every command evidence launches refuses
  (policy/landlock_syscalls.py TTY_INJECTION: TIOCSTI and TIOCLINUX; tests/kernel/test_escapes.py),
  and this kernel's dev.tty.legacy_tiocsti does not matter then. Type-ahead (keys typed before
  the prompt, meant for the job) is discarded (tcflush) before each prompt;
- it can read the terminal too, when its stdin is the terminal: a line it reads is not an answer,
  so the request goes on waiting, to the timeout at worst (closed under `on_timeout: deny`; under
  `allow` the job can so turn a person's no into a run: docs/policy-format.md);
- it can take the terminal's foreground (tcsetpgrp) at any moment, TOSTOP set: the approver reads
  and writes only in the foreground, and SIGTTIN and SIGTTOU are blocked in its thread, so one that
  falls in the background after the check fails (EIO: read again a moment later) or goes
  through, rather than stopping the whole recorder (tests/kernel/test_red_tty.py);
- it can change the terminal's settings: raw mode (a line ends at CR or NL all the same), or its
  end-of-file character made a key the person types (`n`): an end of file on a terminal that is
  still there is an empty line, a no (tests/kernel/test_red_tty.py);
- it can write to the terminal, escape sequences included, and so draw a misleading screen around
  the prompt. The bundle's policy.approval events say exactly what was approved; where the screen
  cannot be trusted, answer through the agent's API instead.
A request answered elsewhere (the API) or timed out while shown is abandoned with a line saying so.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import select
import shlex
import signal
import termios
import threading
from dataclasses import dataclass, field
from stat import S_ISCHR as stat_is_chr

from evidence.agent.recorder.approvals import AlreadyAnswered, ApprovalBroker, ApprovalRequest, UnknownRequest
from evidence.bundle.text import printable

logger = logging.getLogger(__name__)

ARG_MAX_SHOWN = 200  # characters of one argument shown
ARGS_SHOWN = 64  # arguments shown


def describe(request: ApprovalRequest) -> str:
    """The prompt for a request (lines ending with the question), every string escaped."""

    def arg(a: str) -> str:
        shown = printable(a)
        return shlex.quote(shown if len(shown) <= ARG_MAX_SHOWN else shown[: ARG_MAX_SHOWN - 3] + "...")

    argv = " ".join(arg(a) for a in request.argv[:ARGS_SHOWN])
    if len(request.argv) > ARGS_SHOWN or request.argv_truncated:
        argv += " [more arguments not shown]"
    rule = printable(request.rule)
    if request.message:
        rule += f": {printable(request.message)}"
    timeout = f"{request.timeout_ms / 1000:g}s"
    return (
        f"\r\nevidence: approval {request.id}: exec of {printable(request.program)} "
        f"(pid {request.pid}, depth {request.depth})\r\n"
        f"  argv: {argv}\r\n"
        f"  rule: {rule}\r\n"
        f"  allow? [y/N, a reason may follow] (no answer in {timeout}: {request.on_timeout}) "
    )


def controlling_terminal() -> str | None:
    """The device node of this process's controlling terminal (from /proc/self/stat's tty_nr), or
    None."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        tty_nr = int(stat[stat.rindex(b")") + 2 :].split()[4])
    except (OSError, ValueError, IndexError):
        return None
    if tty_nr == 0:
        return None
    major, minor = os.major(tty_nr), os.minor(tty_nr)
    if 136 <= major <= 143:  # Unix98 pseudo-terminals
        return f"/dev/pts/{(major - 136) * 256 + minor}"
    with contextlib.suppress(OSError):
        for entry in os.scandir("/dev"):
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                if stat_is_chr(st.st_mode) and st.st_rdev == tty_nr:
                    return entry.path
    return None


def parse_answer(line: str) -> tuple[bool, str | None]:
    """(allowed, reason) from a typed line."""
    words = line.strip().split(None, 1)
    if not words:
        return False, None
    reason = words[1] if len(words) > 1 else None
    return words[0].lower() in ("y", "yes"), reason


@dataclass
class TtyApprover:
    """Prompts on `fd` (an open terminal, owned by the approver) for one run's requests."""

    broker: ApprovalBroker
    fd: int
    run: str | None = None  # only this run's requests (None: all the broker has)
    poll_s: float = 0.2
    _queue: queue.Queue[ApprovalRequest | None] = field(init=False, default_factory=queue.Queue)
    _thread: threading.Thread | None = field(init=False, default=None)

    @classmethod
    def open(
        cls, broker: ApprovalBroker, run: str | None = None, path: str = "/dev/tty"
    ) -> TtyApprover | None:
        """The approver on the recorder's controlling terminal, or None when it has none."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError:
            return None
        if not os.isatty(fd):
            os.close(fd)
            return None
        return cls(broker, fd, run)

    @property
    def terminal_uid(self) -> int:
        """The owner of the recorder's terminal's device node (/dev/pts/N): /dev/tty itself is
        root's, whoever the terminal is."""
        st = os.fstat(self.fd)
        if st.st_rdev != os.makedev(5, 0):  # a terminal's own node (/dev/pts/N)
            return st.st_uid
        node = controlling_terminal()
        try:
            return os.stat(node).st_uid if node else st.st_uid
        except OSError:
            return st.st_uid

    def start(self) -> None:
        self.broker.subscribe(self._offer)
        self._thread = threading.Thread(target=self._serve, name="tty-approver", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            os.close(self.fd)

    def _offer(self, request: ApprovalRequest) -> None:
        if self.run is None or request.run == self.run:
            self._queue.put(request)

    def _serve(self) -> None:
        # the job shares the terminal and can take its foreground (tcsetpgrp) between our check
        # and a read or a write: with SIGTTIN and SIGTTOU blocked in this thread (and only here:
        # a mask is inherited by what a thread starts), the kernel fails such a read with EIO and
        # lets such a write through, rather than stopping the whole recorder
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTTIN, signal.SIGTTOU})
        while True:
            request = self._queue.get()
            if request is None:
                return
            if self.broker.get(request.id) is None:
                continue  # answered elsewhere, or timed out, while others were shown
            try:
                self.ask(request)
            except OSError as e:  # the terminal went away (hangup): the API or the timeout decides
                logger.warning("terminal approver: %s", e.strerror)
                return

    def _write(self, text: str) -> None:
        data = text.encode("utf-8", "backslashreplace")
        while data:
            data = data[os.write(self.fd, data) :]

    def foreground(self) -> bool:
        """Whether the recorder is in its terminal's foreground process group: reading the terminal
        from the background would stop the whole recorder (SIGTTIN), and with the job's exec held
        meanwhile. (Not the controlling terminal: no such risk.)"""
        try:
            return os.tcgetpgrp(self.fd) == os.getpgrp()
        except OSError:
            return True

    def ask(self, request: ApprovalRequest) -> bool | None:
        """Prompt for one request until it is answered here (True/False) or resolved elsewhere (None).
        While the recorder is in the background of its terminal, it waits to be in the foreground."""
        while not self.foreground():
            if self.broker.get(request.id) is None:
                return None
            select.select([], [], [], self.poll_s)
        with contextlib.suppress(termios.error):
            termios.tcflush(self.fd, termios.TCIFLUSH)  # keys typed before the question answer nothing
        self._write(describe(request))
        typed = b""
        while True:
            foreground = self.foreground()  # in the background: neither read nor write (TOSTOP)
            if self.broker.get(request.id) is None:
                if foreground:
                    self._write("\r\nevidence: that request was answered elsewhere or timed out\r\n")
                return None
            if not foreground:
                select.select([], [], [], self.poll_s)
                continue
            ready, _, _ = select.select([self.fd], [], [], self.poll_s)
            if not ready:
                continue
            try:
                chunk = os.read(self.fd, 1024)
            except OSError as e:
                if e.errno != errno.EIO:
                    raise
                # the job took the foreground after our check (and may have given it back since:
                # asking again races too): wait, and read again; a terminal that hung up for good
                # fails every read, until the request is resolved elsewhere or times out
                select.select([], [], [], self.poll_s)
                continue
            if not chunk:
                try:
                    termios.tcgetattr(self.fd)  # a terminal that hung up fails it (EIO)
                except termios.error:
                    raise OSError(5, "the terminal hung up") from None
                # not hung up: its end-of-file character, which the job can make any key (`n`: read
                # as a hang-up, the person's no left the request to its timeout, which may allow
                # it): an answer that is no yes, so a no
                typed, chunk = b"", b"\n"
            typed += chunk
            if b"\n" not in typed and b"\r" not in typed:
                continue  # not canonical mode (the job set it raw): wait for the end of the line
            line = typed.replace(b"\r", b"\n").split(b"\n", 1)[0].decode("utf-8", "replace")
            allowed, reason = parse_answer(line)
            try:
                self.broker.answer(request.id, allowed, uid=self.terminal_uid, via="terminal", reason=reason)
            except (AlreadyAnswered, UnknownRequest):
                self._write("evidence: that request was answered elsewhere or timed out\r\n")
                return None
            self._write(f"evidence: {'allowed' if allowed else 'denied'}\r\n")
            return allowed
