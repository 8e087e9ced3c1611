"""The no-race check's user-space half (issue 24): what the exec supervisor decided, per thread, for
a BPF program at sched_process_exec to compare with what the kernel really loaded (the BPF half is
the probes' owner's: docs/policy-format.md "Closing the race after an allowed exec" is the contract).

When the supervisor lets an exec go on (SECCOMP_USER_NOTIF_FLAG_CONTINUE) the kernel reads the path
and argv again from the caller's memory, which another thread of the caller may have rewritten since
the supervisor read them. So before answering, the supervisor publishes, for the calling thread's id,
a `DecidedExec`: the identity of the file the kernel is expected to map (st_dev in the kernel's
encoding, st_ino) and a keyed hash of the argument bytes the kernel is expected to copy. The BPF
program reads both at sched_process_exec (mm->exe_file's inode and sb->s_dev; the arg area
mm->arg_start..arg_end, as the recorder's probe already does) for `old_pid`, the thread that called
exec, and on any difference, or no entry, kills the process (bpf_send_signal(SIGKILL)) before its
first instruction and records a violation.

The argv bytes are exactly what the probe copies: every argument followed by its NUL, joined, cut
to the probe's cap (ARGS_BYTES - 1 bytes; probes/render.py). For a `#!` script the kernel maps the
interpreter and rewrites argv (fs/binfmt_script.c): [interpreter as written, its optional argument,
the name it was called by (bprm->filename: the path as passed, or /dev/fd/N[/path] for execveat
relative to a descriptor), argv[1:]...]; the entry says that. The hash is SipHash-2-4 keyed with a
random 128-bit key of the run's (the job cannot compute it, so it cannot make two argvs collide;
FNV and its kin can be collided at will).
"""

from __future__ import annotations

import os
import secrets
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

ARGS_BYTES = 8192  # the probe's default cap (probes/render.py ProbeConfig.args_bytes)
_MASK = 0xFFFFFFFFFFFFFFFF
# the BPF map's value, little-endian: kdev u64, ino u64, argv_hash u64, args_len u32, flags u32
ENTRY = struct.Struct("<QQQII")
FLAG_SCRIPT = 0x1  # the kernel maps a `#!` line's interpreter: identity and argv are the interpreter's


def new_key() -> bytes:
    """A run's hash key (16 random bytes), given to the BPF program (a read-only map) at start-up."""
    return secrets.token_bytes(16)


def _rotl(x: int, b: int) -> int:
    return ((x << b) | (x >> (64 - b))) & _MASK


def siphash24(key: bytes, data: bytes) -> int:
    """SipHash-2-4 (Aumasson and Bernstein) of `data` under a 16-byte key, as a 64-bit integer."""
    if len(key) != 16:
        raise ValueError("a SipHash key is 16 bytes")
    k0, k1 = (int(k) for k in struct.unpack("<QQ", key))
    v0, v1, v2, v3 = (
        k0 ^ 0x736F6D6570736575,
        k1 ^ 0x646F72616E646F6D,
        k0 ^ 0x6C7967656E657261,
        k1 ^ 0x7465646279746573,
    )

    def rounds(n: int) -> None:
        nonlocal v0, v1, v2, v3
        for _ in range(n):
            v0 = (v0 + v1) & _MASK
            v1 = _rotl(v1, 13) ^ v0
            v0 = _rotl(v0, 32)
            v2 = (v2 + v3) & _MASK
            v3 = _rotl(v3, 16) ^ v2
            v0 = (v0 + v3) & _MASK
            v3 = _rotl(v3, 21) ^ v0
            v2 = (v2 + v1) & _MASK
            v1 = _rotl(v1, 17) ^ v2
            v2 = _rotl(v2, 32)

    end = len(data) - len(data) % 8
    for (m,) in struct.iter_unpack("<Q", data[:end]):
        v3 ^= m
        rounds(2)
        v0 ^= m
    last = int.from_bytes(data[end:] + bytes(8 - len(data) % 8 if len(data) % 8 else 8), "little")
    last = (last & ((1 << 56) - 1)) | ((len(data) & 0xFF) << 56)
    v3 ^= last
    rounds(2)
    v0 ^= last
    v2 ^= 0xFF
    rounds(4)
    return v0 ^ v1 ^ v2 ^ v3


def argv_bytes(argv: Sequence[bytes], cap: int = ARGS_BYTES) -> bytes:
    """The bytes the probe copies from the new image's arg area: each argument and its NUL, cut to
    `cap` - 1 bytes."""
    return b"".join(a + b"\0" for a in argv)[: cap - 1]


def kernel_dev(st_dev: int) -> int:
    """stat(2)'s st_dev in the kernel's encoding (sb->s_dev: major << 20 | minor), which the BPF
    side reads (the inverse of agent/recorder/decode.py's)."""
    return (os.major(st_dev) << 20) | os.minor(st_dev)


def shebang(head: bytes) -> tuple[bytes, bytes | None] | None:
    """(interpreter, optional argument) of a `#!` line as fs/binfmt_script.c splits it: the line ends
    at the first newline in the first 256 bytes; the interpreter is the first word (spaces and tabs
    separate, NUL ends); the rest, less spaces and tabs around it, is one argument. None: no `#!`."""
    if not head.startswith(b"#!"):
        return None
    line = head[2:256].split(b"\n", 1)[0].split(b"\0", 1)[0].strip(b" \t")
    if not line:
        return None
    cut = min((i for i in (line.find(b" "), line.find(b"\t")) if i >= 0), default=len(line))
    rest = line[cut:].strip(b" \t")
    return line[:cut], (rest or None)


def bprm_filename(path: bytes, dirfd: int, empty_path: bool) -> bytes:
    """The name the kernel gives a script's interpreter (fs/exec.c alloc_bprm)."""
    if dirfd == -100 or path.startswith(b"/"):
        return path
    if empty_path and not path:
        return b"/dev/fd/%d" % dirfd
    return b"/dev/fd/%d/%s" % (dirfd, path)


@dataclass(frozen=True)
class DecidedExec:
    """What the kernel must load for an exec the supervisor let go on."""

    dev: int  # st_dev as stat(2) gives it
    ino: int
    argv_hash: int
    args_len: int
    script: bool = False

    def pack(self) -> bytes:
        """The BPF map's value (ENTRY)."""
        return ENTRY.pack(
            kernel_dev(self.dev), self.ino, self.argv_hash, self.args_len, FLAG_SCRIPT * self.script
        )


def decided_exec(
    key: bytes,
    identity: tuple[int, int],
    argv: Sequence[bytes],
    *,
    script: tuple[bytes, bytes | None, bytes] | None = None,
    cap: int = ARGS_BYTES,
) -> DecidedExec:
    """The entry for an exec of the file `identity` (st_dev, st_ino: for a script, its
    interpreter's) with `argv`; `script`: (interpreter, its argument, bprm filename)."""
    if script is not None:
        interp, arg, filename = script
        argv = [interp, *([arg] if arg is not None else []), filename, *argv[1:]]
    data = argv_bytes(argv, cap)
    return DecidedExec(identity[0], identity[1], siphash24(key, data), len(data), script is not None)


Publish = Callable[[int, DecidedExec], None]  # (the calling thread's id, what it must load)


@dataclass
class MemoryPublisher:
    """A stand-in for the BPF map (tests, and a dry run): tid -> entry, and the check the BPF side
    makes, so the contract is tested in user space against the kernel's own view of an exec."""

    key: bytes
    cap: int = ARGS_BYTES

    def __post_init__(self) -> None:
        self.entries: dict[int, DecidedExec] = {}

    def __call__(self, tid: int, decided: DecidedExec) -> None:
        self.entries[tid] = decided

    def check(self, old_tid: int, st_dev: int, st_ino: int, arg_area: bytes) -> bool:
        """The BPF check at sched_process_exec: the entry of the thread that called exec (taken:
        one entry, one exec) against the file mapped and the arg area copied."""
        decided = self.entries.pop(old_tid, None)
        if decided is None:
            return False
        data = arg_area[: self.cap - 1]
        return (decided.dev, decided.ino, decided.args_len, decided.argv_hash) == (
            st_dev,
            st_ino,
            len(data),
            siphash24(self.key, data),
        )
