"""The no-race check's user-space half (issue 24): what the exec supervisor decided, per thread, for
the BPF program at sched_process_exec (probes/bpf/exec_check.bpf.c) to compare with what the kernel
really loaded. docs/policy-format.md "Closing the race after an allowed exec" is the contract.

When the supervisor lets an exec go on (SECCOMP_USER_NOTIF_FLAG_CONTINUE) the kernel reads the path
and argv again from the caller's memory, which another thread of the caller may have rewritten since
the supervisor read them. So before answering, the supervisor pins, for the calling thread's id, the
file the kernel must load and a keyed hash of the arguments it must copy (`pin_exec`: an
`abi.ExecPin`, the layout and hash of probes/abi.py's reference, the one the BPF program is tested
against, hashed with siphashc's C SipHash-2-4, held equal to the reference by a unit test);
the program kills (SIGKILL before the new image's first instruction) and records an exec of a
checked run whose pin is missing or differs.

The pieces, and who holds them:
- `ExecCheck`: one run's check, held by the run: its SipHash key (random, never shown to the job),
  its run slot, `enforce()` before the run's first supervised exec, `release()` when it ends, and
  `publish`, the supervisor's one call per allowed exec (backed by RecorderProbes.publish).
- `pin_exec`: the pin of one request (what `ExecSupervisor.decided` computes).
- `MemoryPublisher`: the same check in user space (tests: what the supervisor pins against the
  kernel's own view of an exec, /proc/PID/exe and /proc/PID/cmdline).

What the BPF side hashes is the whole arg area (each argument and its NUL, an empty argv counting
as one empty argument), not the recorder's probe's copy cut at ARGS_BYTES: an argv the supervisor
did not read whole, or longer than abi.EXEC_ARGS_MAX, cannot be pinned and its exec is refused.
For a `#!` script the kernel maps the interpreter and rewrites argv (fs/binfmt_script.c:
abi.script_argv); `shebang` and `bprm_filename` say how.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from siphashc import siphash

from evidence.probes import abi

logger = logging.getLogger(__name__)

# (the calling thread's id, what its exec must load) -> whether the kernel holds the pin; an exec
# whose pin is not held is refused (the kernel would kill it: no pin)
Publish = Callable[[int, abi.ExecPin], bool]


def new_key() -> bytes:
    """A run's hash key (16 random bytes), given to the BPF program with `ExecCheck.enforce`."""
    return secrets.token_bytes(16)


BINPRM_BUF_SIZE = 256  # the bytes of a program the kernel reads for its `#!` line


def shebang(head: bytes) -> tuple[bytes, bytes | None] | None:
    """(interpreter, optional argument) of a `#!` line as fs/binfmt_script.c splits it (a port, step
    by step: the line ends at the first newline in the first 256 bytes, unless a NUL comes first;
    without one, at byte 255, and only when a space, tab or NUL ends the interpreter before it;
    spaces and tabs before the end are dropped; the interpreter is the first word (spaces and tabs
    separate, NUL ends); the rest, from its first byte that is no space or tab, is one argument, up
    to a NUL). None: no `#!`, or a line the kernel refuses (ENOEXEC)."""
    if not head.startswith(b"#!"):
        return None
    buf = bytearray(head[:BINPRM_BUF_SIZE].ljust(BINPRM_BUF_SIZE, b"\0"))  # a short file: NULs
    last = BINPRM_BUF_SIZE - 1

    def spacetab(c: int) -> bool:
        return c in (0x20, 0x09)

    def non_spacetab(first: int, end: int) -> int | None:  # [first, end], as the kernel's
        return next((i for i in range(first, end + 1) if not spacetab(buf[i])), None)

    def terminator(first: int, end: int) -> int | None:
        return next((i for i in range(first, end + 1) if spacetab(buf[i]) or buf[i] == 0), None)

    nl = next((i for i in range(BINPRM_BUF_SIZE) if buf[i] in (0x0A, 0)), None)  # strnchr
    i_end = nl if nl is not None and buf[nl] == 0x0A else None
    if i_end is None:
        start = non_spacetab(2, last)
        if start is None or terminator(start, last) is None:
            return None  # the interpreter's name may be cut: the kernel refuses it
        i_end = last
    while spacetab(buf[i_end - 1]):
        i_end -= 1
    i_name = non_spacetab(2, i_end)
    if i_name is None or i_name == i_end:
        return None
    i_sep = terminator(i_name, i_end)
    i_arg = non_spacetab(i_sep, i_end) if i_sep is not None and buf[i_sep] != 0 else None
    buf[i_end] = 0
    if i_sep is not None:
        buf[i_sep] = 0

    def c_string(at: int) -> bytes:
        return bytes(buf[at : buf.index(0, at)])

    name = c_string(i_name)
    if not name:  # `#!` and a NUL: the kernel looks for a program named "" (ENOENT)
        return None
    return name, (c_string(i_arg) if i_arg is not None else None)


def bprm_filename(path: bytes, dirfd: int, empty_path: bool) -> bytes:
    """The name the kernel gives a script's interpreter (fs/exec.c alloc_bprm)."""
    if dirfd == -100 or path.startswith(b"/"):
        return path
    if empty_path and not path:
        return b"/dev/fd/%d" % dirfd
    return b"/dev/fd/%d/%s" % (dirfd, path)


def pin_exec(
    key: bytes,
    identity: tuple[int, int] | None,
    argv: Sequence[bytes],
    *,
    script: tuple[bytes, bytes | None, bytes] | None = None,
    truncated: bool = False,
) -> abi.ExecPin | None:
    """The pin of an exec of the file `identity` (stat(2)'s st_dev, st_ino; for a script, its
    interpreter's) with `argv` as the caller passed it; `script`: (interpreter, its argument, bprm
    filename) of a `#!` line. None when it cannot be pinned, and the exec must be refused: no file
    (`identity` None), an argv not read whole (`truncated`), an arg area past abi.EXEC_ARGS_MAX."""
    if identity is None or truncated:
        return None
    if script is not None:
        argv = abi.script_argv(script[0], script[1], script[2], argv)
    data = abi.arg_area(argv)
    if len(data) > abi.EXEC_ARGS_MAX:
        return None
    # abi.exec_pin with siphashc's SipHash-2-4 (C, ~0.1 us) for abi.siphash24 (the pure reference,
    # ~25 us an exec): tests/unit/test_exec_pin_fast.py holds the two equal
    return abi.ExecPin(
        abi.kernel_dev(identity[0]),
        identity[1],
        siphash(key, data),
        len(data),
        abi.PIN_SCRIPT if script is not None else 0,
    )


class ExecPins(Protocol):
    """What the check needs of the recorder's probes (probes/loader.py RecorderProbes)."""

    def enforce_execs(self, slot: int, key: bytes) -> None: ...
    def release_execs(self, slot: int) -> None: ...
    def publish(self, tid: int, pin: abi.ExecPin) -> None: ...
    def forget(self, tid: int) -> None: ...
    def pins_fd(self) -> int | None: ...


@dataclass
class ExecCheck:
    """One run's exec check. The run makes it once its recording has a slot, calls `enforce()`
    before the command can exec (from then on an exec of the run without a pin is killed), gives
    `key` and `publish` to its ExecSupervisor, and calls `release()` when the run ends (before its
    slot is another run's). `enforce` raises probes' ObjectError when the kernel refuses the
    check's program: then nothing closes the race (a degradation, or exit 2 with --fail-closed)."""

    probes: ExecPins
    slot: int
    key: bytes = field(default_factory=new_key, repr=False)
    enforced: bool = field(init=False, default=False)

    def enforce(self) -> None:
        self.probes.enforce_execs(self.slot, self.key)
        self.enforced = True

    def release(self) -> None:
        """Stop checking the run's execs; its key is wiped from the kernel. Idempotent."""
        if self.enforced:
            self.enforced = False
            self.probes.release_execs(self.slot)

    def publish(self, tid: int, pin: abi.ExecPin) -> bool:
        """The supervisor's call before it answers CONTINUE for thread `tid` (the notification's
        pid). False when the kernel cannot hold the pin (abi.EXEC_PINS_MAX on the machine): refuse
        the exec then (without a pin the kernel would kill it)."""
        try:
            self.probes.publish(tid, pin)
        except OSError as e:
            logger.warning("exec check: the pin of thread %d is not held: %s", tid, e.strerror or e)
            return False
        return True

    def forget(self, tid: int) -> None:
        """Drop thread `tid`'s pin (an exec refused after it was pinned)."""
        self.probes.forget(tid)


@dataclass
class MemoryPublisher:
    """A stand-in for the kernel's half (tests): tid -> pin, and the comparison the BPF program
    makes, so the supervisor's pins are tested in user space against the kernel's own view of an
    exec. It is an `ExecPins` (and a `Publish`, called directly)."""

    key: bytes
    entries: dict[int, abi.ExecPin] = field(default_factory=dict)
    enforced: set[int] = field(default_factory=set)

    def __call__(self, tid: int, pin: abi.ExecPin) -> bool:
        self.entries[tid] = pin
        return True

    def enforce_execs(self, slot: int, key: bytes) -> None:
        self.enforced.add(slot)

    def release_execs(self, slot: int) -> None:
        self.enforced.discard(slot)

    def publish(self, tid: int, pin: abi.ExecPin) -> None:
        self.entries[tid] = pin

    def forget(self, tid: int) -> None:
        self.entries.pop(tid, None)

    def pins_fd(self) -> int | None:
        return None  # no kernel map: a supervisor in its own process has nothing to publish into

    def check(self, old_tid: int, st_dev: int, st_ino: int, arg_area: bytes) -> bool:
        """The BPF check at sched_process_exec: the pin of the thread that called exec (taken: one
        pin, one exec) against the file mapped (stat of /proc/PID/exe) and the whole arg area."""
        pin = self.entries.pop(old_tid, None)
        if pin is None or len(arg_area) > abi.EXEC_ARGS_MAX:
            return False
        return (pin.dev, pin.ino, pin.args_len, pin.argv_hash) == (
            abi.kernel_dev(st_dev),
            st_ino,
            len(arg_area),
            abi.siphash24(self.key, arg_area),
        )
