"""The exec supervisor in a process of its own (issue 24's cost): one per run with command rules.

Every exec of a supervised job waits in the kernel until the supervisor answers, so the
supervisor's own latency is the job's. In the recorder's process it shared the GIL with the
ring-buffer consumer, which is busiest exactly when the job execs most: a notification could wait
for the consumer's thread to let go of the interpreter (up to the 5 ms switch interval) before a
line of the supervisor ran. Here it has an interpreter to itself: `SupervisorProcess` (the
recorder's or the agent's handle, command_rules.py) starts `python -I -m
evidence.agent.recorder.exec_process`, hands it the listener, the rules and the exec check's pin
map, and the child runs exec_supervisor.ExecSupervisor on them.

What stays with the parent: the records (a refused exec, an audited one: `on_decision`), the
approvals (the broker, the terminal, the agent's API: the child asks, the parent answers), the
lines the job is told (`tell`). They cross a private socket pair (SOCK_SEQPACKET: one message a
datagram), JSON from the child (what the job's execs say is data, never code), the rules pickled
from the parent. Only what a record needs crosses per exec; an exec the rules allow without
auditing crosses nothing.

Fail closed, as in one process: the parent never keeps a copy of the listener, so the child's
death (a crash, a kill) fails the job's waiting and later execs (ENOSYS) and the parent says so;
the parent's death closes the socket and the child stops (its listener closed with it: the same
ENOSYS), whichever thread of the parent started it (no PR_SET_PDEATHSIG, which follows a thread).
The child decides in the command's mount namespace (`joinable_mount_namespace`, launch.py): when
the run's first process has one of its own that only root could have made (evidence's launcher
gives every command its own /dev/shm), the child joins it before it reads a request, so the names a
job passes mean for the supervisor what they mean for the job (a program in the job's /dev/shm is
that file, not the host's of the same name) and a caller whose root is the job's is taken as ours
(the usual path, in C). Nothing else moves: the child is a process of its own.

The child runs in a session of its own (a Ctrl-C at the terminal is the job's and `evidence
run`'s to handle, not the supervisor's), as root, outside the run's cgroup: the job can neither
signal nor trace it. Its pins go into the kernel's map with bpf(2) on the map's descriptor,
passed over the socket (SCM_RIGHTS) like the listener.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from evidence.agent.recorder import exec_resolve
from evidence.agent.recorder.approvals import Asked
from evidence.agent.recorder.exec_resolve import ExecRequest
from evidence.agent.recorder.exec_supervisor import ExecDecision, ExecSupervisor, RoundTrips
from evidence.agent.recorder.launch import joinable_mount_namespace
from evidence.policy.commands import CommandDecision
from evidence.policy.governance import CommandsPolicy
from evidence.probes import abi

logger = logging.getLogger(__name__)

_SYS_BPF = 321  # x86_64
_BPF_MAP_UPDATE_ELEM = 2
MESSAGE_MAX = 1 << 20  # bytes of one message (an argv is at most 64 KiB, JSON-escaped 6x)
_SO_SNDBUFFORCE = 32  # root may set a send buffer past net.core.wmem_max
READY_S = 60.0  # how long the parent waits for the child to take the rules (a loaded machine)


def _decision_json(d: CommandDecision) -> dict[str, Any]:
    return {
        "decision": d.decision,
        "rule_index": d.rule_index,
        "rule_name": d.rule_name,
        "message": d.message,
    }


def _decision(d: dict[str, Any]) -> CommandDecision:
    return CommandDecision(d["decision"], d["rule_index"], d["rule_name"], d["message"])


def result_json(result: ExecDecision, mono_ns: int) -> dict[str, Any]:
    """What the parent needs of an exec answered (its records' fields), as JSON. Strings keep the
    job's undecodable bytes as surrogates (json's \\udcXX escapes): the records say what it said."""
    req = result.request
    return {
        "t": "decision",
        "mono_ns": mono_ns,
        "request": None
        if req is None
        else {
            "pid": req.pid,
            "path": req.path,
            "program": req.program,
            "argv": list(req.argv),
            "truncated": req.truncated,
        },
        "decision": _decision_json(result.decision),
        "depth": result.depth,
        "allowed": result.allowed,
        "error": result.error,
        "dry_run": result.dry_run,
    }


def result_of(msg: dict[str, Any]) -> ExecDecision:
    r = msg["request"]
    req = None
    if r is not None:
        req = ExecRequest(r["pid"], r["path"], r["program"], tuple(r["argv"]), bool(r["truncated"]))
    return ExecDecision(
        req,
        _decision(msg["decision"]),
        int(msg["depth"]),
        bool(msg["allowed"]),
        msg["error"],
        bool(msg["dry_run"]),
        int(msg["mono_ns"]),
    )


_spare: tuple[subprocess.Popen[bytes], socket.socket] | None = None
_spare_lock = threading.Lock()


def _spawn() -> tuple[subprocess.Popen[bytes], socket.socket]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for end in (ours, theirs):  # one message is one datagram: room for the largest (MESSAGE_MAX)
        try:
            end.setsockopt(socket.SOL_SOCKET, _SO_SNDBUFFORCE, 2 * MESSAGE_MAX)
        except OSError:
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2 * MESSAGE_MAX)
    try:
        process = subprocess.Popen(
            [sys.executable, "-I", "-m", "evidence.agent.recorder.exec_process", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return process, ours


def prespawn() -> None:
    """Start a supervisor's process now, for the next SupervisorProcess to take: its interpreter
    starts and imports (~0.1-0.3 s) while the caller does other work (`evidence run`: while the
    probes load), not while the command's first exec waits. Unused, it exits when this process
    does (its socket closes)."""
    global _spare
    with _spare_lock:
        if _spare is None:
            _spare = _spawn()


def _take() -> tuple[subprocess.Popen[bytes], socket.socket]:
    global _spare
    with _spare_lock:
        spare, _spare = _spare, None
    if spare is not None:
        if spare[0].poll() is None:
            return spare
        spare[1].close()
    return _spawn()


def _send(sock: socket.socket, lock: threading.Lock, msg: dict[str, Any]) -> None:
    data = json.dumps(msg, separators=(",", ":")).encode()
    with lock:
        sock.sendall(data)


@dataclass
class SupervisorProcess:
    """One run's exec supervisor, in its own process (this module's docstring). The same callbacks
    as ExecSupervisor, called in this process: `on_decision` with each exec that makes a record
    (`recordable`), from a reader thread; `approver` on a thread per request; `tell` from the
    reader thread. `pins_fd`: the kernel's pin map (exec_check.ExecPins.pins_fd), None without the
    exec check; `check_key` its key."""

    listener: int
    commands: CommandsPolicy
    root_pid: int
    approver: Callable[[Asked], bool] = lambda _asked: False
    on_decision: Callable[[ExecDecision], None] = lambda _d: None
    tell: Callable[[str], None] = lambda _line: None
    pins_fd: int | None = None
    check_key: bytes = b""
    dry_run: bool = False
    max_waiting: int = 64
    # when the child is gone before stop(): why (it died: the job's execs fail from then on)
    on_death: Callable[[str], None] = lambda _why: None
    process: subprocess.Popen[bytes] | None = field(init=False, default=None)
    round_trips: dict[str, float] = field(init=False, default_factory=dict)  # the child's, at stop
    _sock: socket.socket | None = field(init=False, default=None)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    _reader: threading.Thread | None = field(init=False, default=None)
    _ready: threading.Event = field(init=False, default_factory=threading.Event)
    _stopping: bool = field(init=False, default=False)
    _gone: set[int] = field(init=False, default_factory=set)  # asks whose exec no longer waits

    def start(self) -> None:
        """Start the child and hand it the listener (this process's copy is closed, whatever
        happens: nothing here could answer for it). Raises OSError when the child does not take
        the rules (the listener closed: the job's execs fail)."""
        ours: socket.socket | None = None
        try:
            self.process, ours = _take()
            config = {
                "commands": self.commands,
                "root_pid": self.root_pid,
                "dry_run": self.dry_run,
                "key": self.check_key,
                "pins": self.pins_fd is not None,
                "max_waiting": self.max_waiting,
                "log_level": logging.getLogger("evidence").getEffectiveLevel(),
            }
            mount_ns = joinable_mount_namespace(self.root_pid)
            config["join"] = mount_ns is not None
            fds = [self.listener] + ([self.pins_fd] if self.pins_fd is not None else [])
            try:
                socket.send_fds(
                    ours, [pickle.dumps(config)], fds + ([mount_ns] if mount_ns is not None else [])
                )
            finally:
                if mount_ns is not None:
                    os.close(mount_ns)
        except BaseException:
            if ours is not None:
                ours.close()
            if self.process is not None:
                self.process.kill()
                self.process.wait()
            raise
        finally:
            with contextlib.suppress(OSError):
                os.close(self.listener)
            self.listener = -1
        self._sock = ours
        self._reader = threading.Thread(target=self._read, name="exec-supervisor-reader", daemon=True)
        self._reader.start()
        if not self._ready.wait(READY_S) or self._sock is None:
            self.stop()
            raise OSError("the exec supervisor's process did not start")

    def stop(self) -> None:
        """Stop the child (the job's waiting and later execs fail: ENOSYS) and wait for it."""
        self._stopping = True
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                _send(sock, self._lock, {"t": "stop"})
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=10)
        if self.process is not None:
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if sock is not None:
            sock.close()
        self._sock = None
        if self.round_trips.get("count"):
            logger.info("%s", RoundTrips.line_of(self.round_trips))

    def _read(self) -> None:
        sock = self._sock
        assert sock is not None
        why = "it exited"
        while True:
            try:
                data = sock.recv(MESSAGE_MAX)
            except OSError as e:
                why = e.strerror or str(e)
                break
            if not data:
                break
            try:
                self._handle(json.loads(data))
            except Exception:  # a message this side cannot take: said, and the next one read
                logger.exception("exec supervisor: a message from its process was not taken")
        if not self._ready.is_set():
            self._sock = None
            self._ready.set()
        if not self._stopping and not self.round_trips:  # no stats: it did not end by itself
            logger.error("exec supervisor: its process is gone (%s): the job's execs fail from now on", why)
            self.on_death(why)

    def _handle(self, msg: dict[str, Any]) -> None:
        kind = msg["t"]
        if kind == "ready":
            self._ready.set()
        elif kind == "decision":
            self.on_decision(result_of(msg))
        elif kind == "tell":
            self.tell(str(msg["line"]))
        elif kind == "ask":
            threading.Thread(target=self._ask, args=(msg,), name="exec-approval", daemon=True).start()
        elif kind == "gone":
            self._gone.add(int(msg["id"]))
        elif kind == "stats":
            self.round_trips = dict(msg["round_trips"])

    def _ask(self, msg: dict[str, Any]) -> None:
        ask_id = int(msg["id"])
        asked = Asked(
            pid=int(msg["pid"]),
            program=str(msg["program"]),
            argv=tuple(msg["argv"]),
            truncated=bool(msg["truncated"]),
            depth=int(msg["depth"]),
            decision=_decision(msg["decision"]),
            pending=lambda: ask_id not in self._gone and not self._stopping,
        )
        try:
            allowed = bool(self.approver(asked))
        except Exception:  # an approver that fails says no
            logger.exception("exec supervisor: the approver failed")
            allowed = False
        self._gone.discard(ask_id)
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                _send(sock, self._lock, {"t": "answer", "id": ask_id, "allowed": allowed})


# ---------------------------------------------------------------------------------------------------
# The child


class _Parent:
    """The child's side of the socket: what the supervisor's callbacks send, and the answers to
    its approval requests."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.asks: dict[int, tuple[threading.Event, list[bool]]] = {}
        self.next_id = 0
        self.closed = threading.Event()

    def send(self, msg: dict[str, Any]) -> None:
        try:
            _send(self.sock, self.lock, msg)
        except OSError:  # the parent is gone: stopping
            self.closed.set()

    def decided(self, result: ExecDecision) -> None:  # the supervisor's are `record_only`
        self.send(result_json(result, time.monotonic_ns()))

    def tell(self, line: str) -> None:
        self.send({"t": "tell", "line": line})

    def approve(self, asked: Asked) -> bool:
        """Ask the parent (its broker decides: a person, or the timeout) and wait; while waiting,
        say so if the exec stops waiting (its caller died), so that the request is withdrawn."""
        done = threading.Event()
        answer: list[bool] = []
        with self.lock:
            ask_id = self.next_id = self.next_id + 1
            self.asks[ask_id] = (done, answer)
        self.send(
            {
                "t": "ask",
                "id": ask_id,
                "pid": asked.pid,
                "program": asked.program,
                "argv": list(asked.argv),
                "truncated": asked.truncated,
                "depth": asked.depth,
                "decision": _decision_json(asked.decision),
            }
        )
        try:
            while not done.wait(0.25):
                if self.closed.is_set():
                    return False
                if not asked.pending():
                    self.send({"t": "gone", "id": ask_id})
                    done.wait(5)  # the parent withdraws it and answers no
                    return False
            return bool(answer and answer[0])
        finally:
            with self.lock:
                self.asks.pop(ask_id, None)

    def read(self, stop: Callable[[], None]) -> None:
        """The parent's messages, until it says stop or goes away; then `stop`."""
        while True:
            try:
                data = self.sock.recv(MESSAGE_MAX)
            except OSError:
                data = b""
            if not data:
                break
            msg = json.loads(data)
            if msg["t"] == "stop":
                break
            if msg["t"] == "answer":
                with self.lock:
                    waiting = self.asks.get(int(msg["id"]))
                if waiting is not None:
                    waiting[1].append(bool(msg["allowed"]))
                    waiting[0].set()
        self.closed.set()
        stop()


def _publisher(pins_fd: int) -> Callable[[int, abi.ExecPin], bool]:
    """The exec check's publish (exec_check.ExecCheck.publish), straight into the kernel's pin map
    by bpf(2) on its descriptor: False when the kernel cannot hold the pin (refuse the exec). The
    call's attributes are built once; each pin is copied into their key and value."""
    import ctypes

    from evidence.probes.bpfsys import map_info

    _kind, key_size, value_size, _entries, _flags = map_info(pins_fd)
    if key_size != 4 or value_size != abi.EXEC_PIN.struct.size:
        raise OSError(errno.EINVAL, "the pin map is not exec_pins")
    key = ctypes.create_string_buffer(4)
    value = ctypes.create_string_buffer(value_size)
    attr = ctypes.create_string_buffer(
        struct.pack("<IIQQQ", pins_fd, 0, ctypes.addressof(key), ctypes.addressof(value), 0), 32
    )
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    lock = threading.Lock()  # the supervisor's thread and an approval's may publish at once

    def publish(tid: int, pin: abi.ExecPin) -> bool:
        with lock:
            ctypes.memmove(key, tid.to_bytes(4, sys.byteorder), 4)
            ctypes.memmove(value, pin.pack(), value_size)
            ret = libc.syscall(_SYS_BPF, _BPF_MAP_UPDATE_ELEM, attr, len(attr))
            err = ctypes.get_errno() if ret < 0 else 0
        if err:
            logger.warning("exec check: the pin of thread %d is not held: %s", tid, os.strerror(err))
            return False
        return True

    return publish


_CLONE_NEWNS = 0x00020000


def join_mount_namespace(fd: int) -> None:
    """Move this process (single-threaded: setns refuses a mount namespace to a process whose
    threads share its root) into the mount namespace `fd` names, and take its root as ours from
    then on (exec_resolve caches this process's root and namespace). Raises OSError."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    try:
        if libc.setns(fd, _CLONE_NEWNS) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns(CLONE_NEWNS): {os.strerror(err)}")
    finally:
        os.close(fd)
    os.chdir("/")
    exec_resolve.forget_own_root()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(args[0]))
    msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, 3)
    if not msg or not fds:
        return 2
    config = pickle.loads(msg)  # from the parent that started this process: the run's own rules
    logging.basicConfig(format="evidence: exec supervisor: %(message)s", level=logging.WARNING)
    if config.get("join"):  # the job's mount namespace, before anything resolves a name
        try:
            join_mount_namespace(fds.pop())
        except OSError as e:  # nothing decided: the listener closes with this process (ENOSYS)
            logger.error("cannot decide in the command's mount namespace: %s", e.strerror or e)
            return 2
    logging.getLogger("evidence").setLevel(max(int(config["log_level"]), logging.WARNING))
    parent = _Parent(sock)
    sup = ExecSupervisor(
        fds[0],
        config["commands"],
        int(config["root_pid"]),
        approver=parent.approve,
        on_decision=parent.decided,
        tell=parent.tell,
        publish=_publisher(fds[1]) if config["pins"] else None,
        pins_fd=fds[1] if config["pins"] else -1,
        check_key=config["key"],
        dry_run=bool(config["dry_run"]),
        max_waiting=int(config["max_waiting"]),
        record_only=True,
    )
    sup.prepare()
    reader = threading.Thread(target=parent.read, args=(sup.interrupt,), name="parent", daemon=True)
    reader.start()
    parent.send({"t": "ready"})
    sup.serve()
    sup.stop()
    parent.send({"t": "stats", "round_trips": sup.round_trips.summary()})
    # nothing is left to do (the listener is closed, the stats sent): gone at once, not after the
    # interpreter's teardown (~0.1 s the run's end waited for)
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
