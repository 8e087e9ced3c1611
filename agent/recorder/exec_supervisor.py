"""The exec supervisor's core: command rules decided before the program runs, by seccomp user
notification (issue 24; a run starts and stops it through agent/recorder/command_rules.py).

The command's launcher, just before it execs the command, calls `install_exec_filter()`: Debian's
libseccomp binding (python3-seccomp) loads a filter that sends `execve` and `execveat` to a
listener, and the launcher hands the listener's descriptor to the supervisor over a Unix socket
(`send_listener`, SCM_RIGHTS) and closes its own copy (a job holding it could answer for itself).
Every exec of the job and of everything it starts then waits in the kernel until the supervisor
answers. The supervisor (`ExecSupervisor`; in a run, the main thread of a process of its own:
exec_process.py, the recorder or the agent keeping its records and approvals) receives each
notification with the kernel's ioctls (the binding's receive_notify works only in the process that
loaded the filter), reads the path and argv from the caller's memory (process_vm_readv, falling
back to /proc/PID/mem), checks the notification is still pending (so the pid was not reused),
resolves what would run (exec_resolve.py: relative to the caller's cwd or the execveat descriptor,
symlinks resolved through the caller's root, a `#!` line's interpreter) and decides with
policy/commands.py (its `Decider`: what depends on the program alone worked out once):
- deny: the exec fails with EACCES and the caller goes on;
- allow, audit: the kernel goes on with the call (SECCOMP_USER_NOTIF_FLAG_CONTINUE);
- approve: the approver (approvals.py's broker: a person, or the timeout) says yes or no, on a
  thread of its own while the job's other execs are answered; the default says no (fail closed).
A `#!` script is decided on the script and on its interpreter, the dynamic loader run as a program
(`/lib64/ld-linux-x86-64.so.2 /usr/bin/curl`) on itself and on the program it loads, the more
restrictive winning.

The usual exec the rules allow (an execve of an absolute name that src/fast/_exec.c reads whole, of
a program with no `#!` line that the rules allow whatever its argv and depth) is answered wholly in
C once the Python path has met its program (`_serve_usual`): read, checked, pinned and let go on
with no Python between the notification and the answer.

CONTINUE lets the kernel read the path and argv again: another thread of the caller may rewrite
them between the decision and the exec. That race is closed by a check of what the kernel really
loaded: before it answers CONTINUE the supervisor pins what it allowed for the calling thread
(agent/recorder/exec_check.py), and probes/bpf/exec_check.bpf.c kills, at sched_process_exec, an
exec whose file or arguments differ, or that nothing pinned. If the supervisor goes away, the
kernel fails every waiting and later exec of the job with ENOSYS: command rules fail closed.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import functools
import logging
import os
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from evidence.agent.recorder.approvals import Asked
from evidence.agent.recorder.exec_check import Publish, bprm_filename, pin_exec
from evidence.agent.recorder.exec_filter import install_exec_filter as install_exec_filter
from evidence.agent.recorder.exec_resolve import (
    ExecRequest,
    Usual,
    compiled,
    identity,
    is_dynamic_loader,
    loader_payload,
    proc_depth,
    read_request,
    read_usual,
    usual_context,
    usual_request,
)
from evidence.bundle.record_types import AuditRecord, DenialRecord
from evidence.policy.commands import DECISION_PRIORITY, CommandDecision, Decider, exec_notice, notice
from evidence.policy.commands import decide as decide_exec
from evidence.policy.governance import CommandsPolicy
from evidence.probes import abi
from evidence.probes.bpfsys import map_info

logger = logging.getLogger(__name__)
# src/fast/_exec.c: serve's wait and read, `next_usual` (that and the usual allowed exec's answer),
# `allow` (an allowed exec's answer)
_fast = compiled()
OUTRIGHT_MAX = 4096  # names kept in ExecSupervisor._outright (then forgotten, and learnt again)

# The kernel ABI (include/uapi/linux/seccomp.h), x86_64
_NOTIF = struct.Struct("=QII iIQ6Q")  # seccomp_notif: id, pid, flags, seccomp_data{nr, arch, ip, args[6]}
_RESP = struct.Struct("=QqiI")  # seccomp_notif_resp: id, val, error, flags
SECCOMP_USER_NOTIF_FLAG_CONTINUE = 1
SECCOMP_IOCTL_NOTIF_RECV = 0xC0502100  # _IOWR('!', 0, struct seccomp_notif)
SECCOMP_IOCTL_NOTIF_SEND = 0xC0182101  # _IOWR('!', 1, struct seccomp_notif_resp)
SECCOMP_IOCTL_NOTIF_ID_VALID = 0x40082102  # _IOW('!', 2, __u64)
SECCOMP_IOCTL_NOTIF_SET_FLAGS = 0x40082104  # _IOW('!', 4, __u64), Linux 6.6
SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP = 1


# ---------------------------------------------------------------------------------------------------
# The listener (the launcher's side is exec_filter.py)


def receive_listener(sock: socket.socket) -> int:
    """The supervisor's end of send_listener: the listener descriptor."""
    _msg, fds, _flags, _addr = socket.recv_fds(sock, 1, 1)
    if len(fds) != 1:
        raise OSError(errno.EPROTO, "no listener descriptor received")
    return fds[0]


@dataclass(frozen=True)
class Notification:
    id: int
    pid: int
    nr: int
    args: tuple[int, ...]
    received_ns: int = 0  # CLOCK_MONOTONIC when it was read: RoundTrips


def receive(listener: int) -> Notification:
    """Wait for the next notification (ioctl NOTIF_RECV)."""
    buf = bytearray(_NOTIF.size)
    fcntl.ioctl(listener, SECCOMP_IOCTL_NOTIF_RECV, buf, True)
    nid, pid, _flags, nr, _arch, _ip, *args = _NOTIF.unpack(buf)
    return Notification(nid, pid, nr, tuple(args), time.monotonic_ns())


def still_pending(listener: int, nid: int) -> bool:
    """Whether the notification is still waiting (its caller has not died, its pid not reused)."""
    try:
        fcntl.ioctl(listener, SECCOMP_IOCTL_NOTIF_ID_VALID, struct.pack("=Q", nid))
    except OSError:
        return False
    return True


def respond(listener: int, nid: int, *, error: int = 0) -> None:
    """Fail the call with -error, or (error 0) let the kernel go on with it."""
    flags = 0 if error else SECCOMP_USER_NOTIF_FLAG_CONTINUE
    buf = bytearray(_RESP.pack(nid, 0, -error if error else 0, flags))
    try:
        fcntl.ioctl(listener, SECCOMP_IOCTL_NOTIF_SEND, buf, True)
    except OSError as e:
        if e.errno != errno.ENOENT:  # ENOENT: the caller went away meanwhile
            raise


# ---------------------------------------------------------------------------------------------------
# The supervisor


def decide_request(
    commands: CommandsPolicy, req: ExecRequest, depth: int, decider: Decider | None = None
) -> CommandDecision:
    """The program's decision, or its interpreter's when more restrictive (a `#!` script); for a
    name that leads elsewhere for the caller than here (`foreign`), `commands.default` when more
    restrictive: the name says nothing of what runs. `decider`: commands' Decider (the same
    answers as policy/commands.decide, what depends on the program alone kept).

    A depth below 0 is a caller whose depth cannot be told (`proc_depth`: its parent links do not
    lead to the run's first process: an ancestor exited and it was reparented, as a job does on
    purpose with a double fork): it is of the run, below its first process, at a depth nobody can
    say, so the most restrictive decision of any depth from 1 on decides (no rule's depth range
    contains -1: judged at -1 an orphan would escape every rule)."""
    decide = decider or functools.partial(decide_exec, commands)
    if depth < 0:
        return max(
            (decide_request(commands, req, d, decider) for d in _depths_that_differ(commands)),
            key=lambda c: DECISION_PRIORITY[c.decision],
        )
    decision = decide(req.program, req.argv, depth, truncated=req.truncated)
    if req.foreign and DECISION_PRIORITY[commands.default] > DECISION_PRIORITY[decision.decision]:
        decision = CommandDecision(commands.default)
    for payload, foreign in ((req.interpreter, req.interpreter_foreign), (req.loads, req.loads_foreign)):
        if payload is None:
            continue
        # an interpreter is judged with the argv the kernel gives it (the `#!` line's argument
        # first), the loader's payload with its own arguments (what follows it in argv)
        if payload is req.interpreter:
            argv = req.interpreter_argv or req.argv
        else:
            argv = req.loads_argv or _loader_args(req)
        other = decide(payload, argv, depth, truncated=req.truncated)
        if foreign and DECISION_PRIORITY[commands.default] > DECISION_PRIORITY[other.decision]:
            other = CommandDecision(commands.default)  # its name says nothing of what runs
        if DECISION_PRIORITY[other.decision] > DECISION_PRIORITY[decision.decision]:
            decision = other
    return decision


def _depths_that_differ(commands: CommandsPolicy) -> list[int]:
    """Depths from 1 on at which some rule's depth range starts or ends: between two of them (and
    past the last) every rule matches alike, so these stand for every depth from 1 on."""
    edges = {1}
    for rule in commands.rules:
        for d in (rule.depth.min, rule.depth.max, None if rule.depth.max is None else rule.depth.max + 1):
            if d is not None and d >= 1:
                edges.add(d)
    return sorted(edges)


def _loader_args(req: ExecRequest) -> tuple[str, ...]:
    """The loader's program's arguments in a request made without them: from its own argv."""
    payload = loader_payload(req.argv)
    assert payload is not None
    return req.argv[req.argv.index(payload) :]


@dataclass(frozen=True)
class ExecDecision:
    """One exec the supervisor answered: what it read, the decision, and whether it ran."""

    request: ExecRequest | None
    decision: CommandDecision
    depth: int
    allowed: bool
    error: str | None = None  # why the request could not be read (then refused)
    # --dry-run: refused by the rules (allowed False) but let run; an `approve` was not asked
    dry_run: bool = False
    answered_ns: int = 0  # CLOCK_MONOTONIC when it was answered, when known (from its process)


def record_text(name: str) -> str:
    """A name or argument as the supervisor read it (bytes that are not UTF-8 kept as surrogates, to
    match and pin them exactly) in the form records and people get, the kernel's names' form:
    such bytes as \\xNN (decode.path_text). A surrogate in a record fails its JSON encoding, and
    with it the run's bundle: a job picks its argv."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def recordable(result: ExecDecision) -> bool:
    """Whether an exec makes a record: refused (or in a dry run one the rules would refuse or ask
    about), or audited; not one the rules simply allowed."""
    return not result.allowed or result.decision.decision == "audit"


def denial_record(result: ExecDecision, t: int) -> DenialRecord | None:
    """The policy.denial record of an exec the supervisor refused (or, in a dry run, would have:
    `enforced` false), or None for one it let run. An exec whose request could not be read is
    named `<unreadable>`, its rule saying why."""
    if result.allowed:
        return None
    req = result.request
    refused = not result.dry_run
    return {
        "k": "denial",
        "t": t,
        "pid": req.pid if req is not None else 0,
        "exe": None,
        "operation": "exec",
        "target": record_text(req.program) if req is not None else "<unreadable>",
        "rule": result.decision.label if result.error is None else f"{result.decision.label}: {result.error}",
        "enforced": refused,
        "result": "EACCES" if refused else 0,
    }


def audit_record(result: ExecDecision, t: int) -> AuditRecord | None:
    """The policy.audit record of an exec an `audit` rule matched and that ran (in a dry run, one
    the rules let run), or None."""
    req, d = result.request, result.decision
    if d.decision != "audit" or req is None or d.rule_index is None or not (result.allowed or result.dry_run):
        return None
    return {
        "k": "audit",
        "t": t,
        "pid": req.pid,
        "program": record_text(req.program),
        "argv": [record_text(a) for a in req.argv],
        "argv_truncated": req.truncated,
        "depth": result.depth,
        "rule": d.label,
        "rule_index": d.rule_index,
        "rule_name": d.rule_name or "",
        "message": d.message,
    }


@dataclass
class RoundTrips:
    """How long the supervisor takes per exec, from reading the notification to issuing the
    response (the exec's caller is woken then; an exec held for approval is not counted: that is a
    person's time): all execs counted, the last `keep` timed one by one for the median and the 99th
    percentile. Added to on the supervisor's thread only."""

    keep: int = 65536
    count: int = 0
    total_ns: int = 0
    max_ns: int = 0
    recent: collections.deque[int] = field(default_factory=collections.deque)

    def add(self, ns: int) -> None:
        self.count += 1
        self.total_ns += ns
        self.max_ns = max(self.max_ns, ns)
        self.recent.append(ns)
        if len(self.recent) > self.keep:
            self.recent.popleft()

    def summary(self) -> dict[str, float]:
        """count, and mean/median/p99/max in microseconds."""
        ordered = sorted(self.recent)
        if not ordered:
            return {"count": 0}
        return {
            "count": self.count,
            "mean_us": self.total_ns / self.count / 1000,
            "median_us": ordered[len(ordered) // 2] / 1000,
            "p99_us": ordered[min(len(ordered) - 1, len(ordered) * 99 // 100)] / 1000,
            "max_us": self.max_ns / 1000,
        }

    def line(self) -> str:
        return self.line_of(self.summary())

    @staticmethod
    def line_of(s: dict[str, float]) -> str:
        """The line of a `summary()` (the one bench/bench.py reads)."""
        if not s.get("count"):
            return "exec supervisor: no exec decided"
        return (
            f"exec supervisor: {int(s['count'])} execs decided, notification read to response sent: median "
            f"{s['median_us']:.1f} us, p99 {s['p99_us']:.1f} us, mean {s['mean_us']:.1f} us, max {s['max_us']:.1f} us"
        )


@dataclass
class ExecSupervisor:
    """Answers a listener's exec notifications by the policy's command rules, on a thread."""

    listener: int
    commands: CommandsPolicy
    root_pid: int
    depth_of: Callable[[int, int], int] = proc_depth
    # says whether an `approve` decision's exec runs (approvals.ApprovalBroker.approver); called on
    # a thread of its own, several at once; the default says no (fail closed)
    approver: Callable[[Asked], bool] = lambda _asked: False
    # called with each exec answered, from the supervisor's thread or an approval's
    on_decision: Callable[[ExecDecision], None] = lambda _d: None
    tell: Callable[[str], None] = lambda _line: None
    # the no-race check (exec_check.py): before an exec goes on, what the kernel must load is
    # published for the calling thread; an exec whose entry cannot be made is refused
    publish: Publish | None = None
    check_key: bytes = b""
    # the kernel's pin map that `publish` writes into, when known: an allowed exec is then pinned and
    # answered in one call of the compiled module (`_fast.allow`), `publish` kept for the rest
    pins_fd: int = -1
    _stop_r: int = field(init=False, default=-1)
    _stop_w: int = field(init=False, default=-1)
    _thread: threading.Thread | None = field(init=False, default=None)
    # guards the listener: an approval's thread answers through it, stop() closes it
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    # execs waiting for approval at once; more are refused at once
    max_waiting: int = 64
    # --dry-run: every exec goes on; what the rules would refuse or ask is only recorded
    dry_run: bool = False
    # `on_decision` is told only of execs that make a record (`recordable`: refused, audited, a
    # dry run's would-be refusals); an exec the rules simply allow may then have no depth (0)
    record_only: bool = False
    _waiting: threading.BoundedSemaphore = field(init=False)
    # read to response issued, per exec decided on the supervisor's thread (bench/bench.py reads
    # the line stop() logs at INFO)
    round_trips: RoundTrips = field(init=False, default_factory=RoundTrips)
    # execs `_serve_usual` left wholly to C (src/fast/_exec.c next_usual), answered or gone
    answered_in_c: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._waiting = threading.BoundedSemaphore(self.max_waiting)
        self._decider = Decider(self.commands)
        if self.pins_fd >= 0 and _fast is not None:
            # `_fast.allow` writes a key and a value of these sizes: a map of others would read
            # past them (a map that is no map only fails each exec: refused)
            with contextlib.suppress(OSError):
                _kind, key_size, value_size, _entries, _flags = map_info(self.pins_fd)
                if (key_size, value_size) != (4, abi.EXEC_PIN.struct.size):
                    raise ValueError("the pin map is not exec_pins")

    def prepare(self) -> None:
        """Ready to `serve` (on the caller's thread; `start` serves on a thread of its own)."""
        # the caller an answer wakes runs on this CPU at once, while this thread goes back to wait
        # for the next notification (Linux 6.6): a fork+exec loop ran ~30% faster with the Python
        # supervisor (bench/bench.py); with its C path (src/fast/_exec.c) no difference was measurable
        with contextlib.suppress(OSError):
            fcntl.ioctl(self.listener, SECCOMP_IOCTL_NOTIF_SET_FLAGS, SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP)
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)

    def start(self) -> None:
        self.prepare()
        self._thread = threading.Thread(target=self.serve, name="exec-supervisor", daemon=True)
        self._thread.start()

    def interrupt(self) -> None:
        """Make `serve` return (thread-safe)."""
        with contextlib.suppress(OSError):
            if self._stop_w >= 0:
                os.write(self._stop_w, b"x")

    def stop(self) -> None:
        """Stop answering and close the listener: the job's waiting and later execs fail (ENOSYS)."""
        self.interrupt()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.round_trips.count:
            logger.info("%s", self.round_trips.line())
        with self._lock:  # no approval's thread answers through a descriptor closed (or reused)
            for fd in (self._stop_r, self._stop_w, self.listener):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._stop_r = self._stop_w = self.listener = -1

    def serve(self) -> None:
        if _fast is not None and self._quick and len(self.check_key) == 16:  # the usual allowed exec in C
            self._serve_usual()
            return
        if _fast is not None:  # the wait and the read in C: no Python runs while a caller waits
            while True:
                try:
                    got = _fast.next_notification(self.listener, self._stop_r)
                except OSError as e:
                    logger.error("exec supervisor: %s", e.strerror)
                    return
                if got is None:  # stopped, or every process of the filter is gone
                    return
                self.answer(Notification(*got))
        poller = select.poll()
        poller.register(self.listener, select.POLLIN)
        if self._stop_r >= 0:
            poller.register(self._stop_r, select.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._stop_r in ready:
                return
            if (
                ready.get(self.listener, 0) & (select.POLLHUP | select.POLLERR)
                and not ready[self.listener] & select.POLLIN
            ):
                return  # every process of the filter is gone
            try:
                note = receive(self.listener)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.EINTR):  # the caller went away before we read it
                    continue
                logger.error("exec supervisor: %s", e.strerror)
                return
            self.answer(note)

    def _serve_usual(self) -> None:
        """`serve` with src/fast/_exec.c next_usual: an exec whose name is in `_outright` (allowed
        whatever its argv and depth), read whole, no `#!` line, the same file by its name here, is
        pinned and let go on in C as `_allow_outright` would (no Python object made for it before
        it is answered); every other one comes here read (`usual`) and is decided as `answer`
        decides it, or refused when the rules allow it but its pin was not held."""
        assert _fast is not None
        outright, add = self._outright, self.round_trips.add
        while True:
            try:
                got = _fast.next_usual(
                    self.listener, self._stop_r, self.pins_fd, self.check_key, outright, *usual_context()
                )
            except OSError as e:
                logger.error("exec supervisor: %s", e.strerror)
                return
            if got is None:  # stopped, or every process of the filter is gone
                return
            if type(got) is int:  # answered in C: its round trip, or -1 (nothing to answer any more)
                self.answered_in_c += 1
                if got >= 0:
                    add(got)
                continue
            fields, usual, status = got
            note = Notification(*fields)
            if status == 1:  # C could not read it (out of memory, say): read again, its errors handled
                self.answer(note)
            elif status < 0:  # allowed outright in C, but the kernel's map did not take its pin
                logger.warning(
                    "exec check: the pin of thread %d is not held: %s", note.pid, os.strerror(-status)
                )
                self._refuse_unpinned(note, usual, None)
            else:
                self._answer(note, usual)

    @functools.cached_property
    def _outright(self) -> set[bytes]:
        """The names (read_usual's `named`) of plain programs the rules allow whatever the argv and
        the depth (`Decider.allows_outright`), not the dynamic loader: `_allowed_outright` adds
        each it meets, and C's `next_usual` answers the next exec of one without Python."""
        return set()

    def answer(self, note: Notification) -> ExecDecision | None:
        """Decide one notification. An `approve` decision waits for its approver on a thread of
        its own (the job's other execs are answered meanwhile): None is returned for it."""
        return self._answer(note, None, read=self._quick)

    def _answer(self, note: Notification, usual: Usual | None, *, read: bool = False) -> ExecDecision | None:
        """`answer` with read_usual's `usual` when read already (None: not the usual request), or
        (`read`) reading it first."""
        outright = None
        try:
            if read:
                usual = read_usual(note.pid, note.nr, note.args)
            if usual is not None:
                outright = self._allowed_outright(note, usual)
                req = usual_request(note.pid, usual) if outright is None else None
            else:
                req = read_request(note.pid, note.nr, note.args)
        except (OSError, ValueError) as e:  # ValueError: a name no system call takes (a NUL in it)
            depth = self.depth_of(note.pid, self.root_pid)
            why = (e.strerror if isinstance(e, OSError) else None) or str(e)
            return self._finish(note, ExecDecision(None, CommandDecision("deny"), depth, False, why))
        except Exception:  # a fault of ours on what the job passed: this exec refused, not the run's
            logger.exception("exec supervisor: the request of thread %d could not be read", note.pid)
            depth = self.depth_of(note.pid, self.root_pid)
            refused = ExecDecision(
                None, CommandDecision("deny"), depth, False, "the request could not be read"
            )
            return self._finish(note, refused)
        if outright is not None:
            assert usual is not None
            done = self._allow_outright(note, usual, *outright)
            if done is not None:
                return done
            return self._refuse_unpinned(note, usual, outright)
        assert req is not None
        if req.identity is None and identity(req.program) is None:
            # the name leads to no file for the caller (a shell's PATH search tries each directory):
            # failed as the kernel would fail it, undecided: nobody is asked or told, nothing recorded
            with self._lock:
                if self.listener >= 0 and still_pending(self.listener, note.id):
                    respond(self.listener, note.id, error=0 if self.dry_run else errno.ENOENT)
            return None
        # the caller's depth (a /proc walk) is read when the decision can depend on it, or when it
        # goes into a record; told only of records (`record_only`), an exec the rules allow at
        # every depth needs none
        lazy = self.record_only and not any(
            self._decider.needs_depth(p) for p in (req.program, req.interpreter, req.loads) if p is not None
        )
        depth = 0 if lazy else self.depth_of(note.pid, self.root_pid)
        decision = decide_request(self.commands, req, depth, self._decider)
        if lazy and decision.decision != "allow":
            depth = self.depth_of(note.pid, self.root_pid)  # for the record: the decision is the same
        if self.dry_run:  # decide, record, let it run; nobody is asked
            return self._finish(note, ExecDecision(req, decision, depth, bool(decision.runs), dry_run=True))
        if decision.runs is not None:
            return self._finish(note, ExecDecision(req, decision, depth, decision.runs))
        if not self._waiting.acquire(blocking=False):  # a job asking without end holds no more threads
            return self._finish(
                note, ExecDecision(req, decision, depth, False, "too many execs wait for approval")
            )
        threading.Thread(
            target=self._ask, args=(note, req, decision, depth), name=f"exec-approval-{note.pid}", daemon=True
        ).start()
        return None

    # -- the usual exec the rules simply allow, answered without the whole request (issue 24: each
    # microsecond the job waits costs it about two here, an idle virtual CPU being slow to wake)

    @functools.cached_property
    def _quick(self) -> bool:
        """Whether `_allow_outright` may answer: pinned and answered in C, told only of records."""
        return _fast is not None and self.pins_fd >= 0 and self.record_only and not self.dry_run

    def _allowed_outright(self, note: Notification, usual: Usual) -> tuple[str, CommandDecision, int] | None:
        """(program, decision, depth) when `usual` names a plain program (no `#!` line, not the
        dynamic loader, the same file by its name here as for the caller) that the rules simply
        allow: what `answer` would decide from its whole request (no interpreter, nothing loaded,
        not foreign: decide_request is the program's decision); else None, and `answer` decides
        from the whole request."""
        _raw_path, raw_argv, named, dev, ino, head = usual
        if head.startswith(b"#!"):
            return None
        program = named.decode("utf-8", "surrogateescape")
        if is_dynamic_loader(program) or identity(program) != (dev, ino):
            return None
        decider = self._decider
        depth = self.depth_of(note.pid, self.root_pid) if decider.needs_depth(program) else 0
        if depth < 0:  # a depth nobody can say: decide_request's way
            return None
        decision = decider(program, tuple(a.decode("utf-8", "surrogateescape") for a in raw_argv), depth)
        if decision.decision != "allow":
            return None
        if named not in self._outright and decider.allows_outright(program):
            if len(self._outright) >= OUTRIGHT_MAX:
                self._outright.clear()
            self._outright.add(named)  # its next exec is answered in C (`_serve_usual`)
        return program, decision, depth

    def _refuse_unpinned(
        self, note: Notification, usual: Usual, outright: tuple[str, CommandDecision, int] | None
    ) -> ExecDecision:
        """Refuse an exec `_allowed_outright` allowed (`outright`; None: allowed by C's
        `next_usual`, which takes only programs allowed whatever the argv and the depth) whose pin
        could not be made or held: without a pin the kernel would kill it."""
        if outright is None:
            program = usual[2].decode("utf-8", "surrogateescape")
            argv = tuple(a.decode("utf-8", "surrogateescape") for a in usual[1])
            outright = (program, self._decider(program, argv, 0), 0)
        _program, decision, depth = outright
        try:
            req = usual_request(note.pid, usual)
        except Exception:  # for the record only: the exec is refused either way
            req = None
        refused = ExecDecision(req, decision, depth, False, "what would run cannot be pinned")
        return self._finish(note, refused)

    def _allow_outright(
        self, note: Notification, usual: Usual, program: str, decision: CommandDecision, depth: int
    ) -> ExecDecision | None:
        """`_allow_at_once` for an `_allowed_outright` exec: pinned and let go on in one call; the
        result, or None when it cannot be pinned or the pin was not held (`answer` then refuses it
        from the whole request)."""
        _raw_path, raw_argv, _named, dev, ino, _head = usual
        pin = pin_exec(self.check_key, (dev, ino), raw_argv, script=None, truncated=False)
        if pin is None:  # an arg area past what the check holds: refused there
            return None
        if self._pin_and_go(note, pin, timed=True) < 0:
            return None
        return ExecDecision(None, decision, depth, True)  # nothing recorded: not `recordable`

    def _pin_and_go(self, note: Notification, pin: abi.ExecPin, *, timed: bool) -> int:
        """src/fast/_exec.c allow: while `note` is pending, `pin` into the map for its thread,
        then CONTINUE. Its status (0 answered, 1 not pending any more, 2 answered as its caller went
        away, -errno the pin not held: nothing answered), 1 when the listener is closed."""
        assert _fast is not None
        with self._lock:
            if self.listener < 0:
                return 1
            status: int
            status, sent = _fast.allow(
                self.listener, note.id, self.pins_fd, note.pid.to_bytes(4, sys.byteorder), pin.pack()
            )
            if status == 0 and timed and note.received_ns:
                self.round_trips.add(sent - note.received_ns)  # read to response sent
        if status < 0:  # fail closed: it could not be checked
            logger.warning("exec check: the pin of thread %d is not held: %s", note.pid, os.strerror(-status))
        return status

    def _finish(self, note: Notification, result: ExecDecision, timed: bool = True) -> ExecDecision:
        at_once = self._allow_at_once(note, result, timed)
        if at_once is not None:
            if at_once.allowed:
                return at_once  # answered, or not pending any more
            result = at_once  # refused below: its pin was not held
        # what was read is the caller's only while its notification is pending: answer nothing else
        if not self.pending(note.id):
            return result
        req = result.request
        if result.dry_run:
            with self._lock:
                if self.listener >= 0:
                    if timed and note.received_ns:
                        self.round_trips.add(time.monotonic_ns() - note.received_ns)
                    respond(self.listener, note.id)
            if not self.record_only or recordable(result):
                self.on_decision(result)
            return result
        if result.allowed and self.publish is not None and req is not None:
            pin = self.decided(req)
            if pin is None or not self.publish(req.pid, pin):  # fail closed: it could not be checked
                result = ExecDecision(
                    req, result.decision, result.depth, False, "what would run cannot be pinned"
                )
        if result.request is not None and not result.allowed:
            # told before the answer, so the line usually comes before the job's own complaint
            message = result.error or (
                "not approved" if result.decision.runs is None else result.decision.message
            )
            self.tell(
                notice("exec", record_text(result.request.program), result.decision.label, message=message)
            )
        with self._lock:
            if self.listener < 0:
                return result
            if timed and note.received_ns:
                self.round_trips.add(time.monotonic_ns() - note.received_ns)
            respond(self.listener, note.id, error=0 if result.allowed else errno.EACCES)
        if not self.record_only or recordable(result):
            self.on_decision(result)
        return result

    def _allow_at_once(self, note: Notification, result: ExecDecision, timed: bool) -> ExecDecision | None:
        """An allowed exec, pinned and let go on in one call (src/fast/_exec.c allow: still
        pending? the pin into the map, then CONTINUE), as the rest of `_finish` would do it in
        four: `result` when that is done (answered, or not pending any more: nothing to answer);
        the refusal `_finish` then answers when the map did not take the pin; None leaves it all
        to `_finish` (no compiled module or map, a dry run, a refusal, nothing to pin)."""
        req = result.request
        if _fast is None or self.pins_fd < 0 or result.dry_run or not result.allowed or req is None:
            return None
        pin = self.decided(req)
        if pin is None:
            return None
        status = self._pin_and_go(note, pin, timed=timed)
        if status < 0:
            return ExecDecision(req, result.decision, result.depth, False, "what would run cannot be pinned")
        # 2: answered as its caller went away, which `_finish` records too (1: not pending: nothing)
        if status != 1 and (not self.record_only or recordable(result)):
            self.on_decision(result)
        return result

    def decided(self, req: ExecRequest) -> abi.ExecPin | None:
        """What the kernel must load for `req` (exec_check.pin_exec), or None when that cannot be
        said: the file named nothing for the caller, or argv was not read whole."""
        raw = [a.encode("utf-8", "surrogateescape") for a in req.argv]
        script = None
        file_id = req.identity
        if req.shebang is not None:
            file_id = req.interpreter_identity
            filename = bprm_filename(req.path.encode("utf-8", "surrogateescape"), req.dirfd, req.empty_path)
            script = (req.shebang[0], req.shebang[1], filename)
        if file_id is None:
            return None
        return pin_exec(self.check_key, file_id, raw, script=script, truncated=req.truncated)

    def pending(self, nid: int) -> bool:
        """Whether the notification still waits for an answer from this supervisor."""
        with self._lock:
            return self.listener >= 0 and still_pending(self.listener, nid)

    def _ask(self, note: Notification, req: ExecRequest, decision: CommandDecision, depth: int) -> None:
        line = exec_notice(record_text(req.program), decision)
        if line:
            self.tell(line)
        asked = Asked(
            pid=req.pid,
            program=record_text(req.program),
            argv=tuple(record_text(a) for a in req.argv),
            truncated=req.truncated,
            depth=depth,
            decision=decision,
            pending=lambda: self.pending(note.id),
        )
        try:
            allowed = bool(self.approver(asked))
        except Exception:  # an approver that fails says no
            logger.exception("exec supervisor: the approver failed")
            allowed = False
        finally:
            self._waiting.release()
        self._finish(note, ExecDecision(req, decision, depth, allowed), timed=False)
