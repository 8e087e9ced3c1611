"""The kernel/user interface of the recorder probes, defined once: record kinds, record flags,
change and namespace operations, DNS directions and the layout of every struct the BPF C and user
space both read. `render_header()` writes them as the C header record.bpf.c includes (render.py
puts it in place of its `#include "abi.h"` line, with a static assertion of each layout's size);
agent/recorder/decode.py and probes/loader.py unpack records and map entries with `Layout.struct`
and name kinds and operations from here. Pure: no BCC, no root.

A layout's fields are laid out as the C compiler lays them out with no padding of its own:
each field at a multiple of its size (arrays: of their element's), padding written as fields
named `pad*` (C members, Python `x` bytes), the size a multiple of the largest field. A layout's
`tail` is the C array (or union) that follows the fixed part: its length depends on the
configuration, so the decoder reads it from the record's offsets, not through `struct`.

(Over 600 lines on purpose: the ABI is defined once, here, so the C and the decoder cannot
disagree; split, it would be two definitions again.)
"""

from __future__ import annotations

import dataclasses
import functools
import os
import struct
from collections.abc import Sequence
from typing import NamedTuple

# ---- constants ----------------------------------------------------------------------------------


class Const(NamedTuple):
    macro: str  # its name in the C
    value: int
    name: str = ""  # what user space calls it: a record kind's "kind", an operation's "op"
    comment: str = ""  # after its #define
    before: tuple[str, ...] = ()  # comment lines before its #define
    fmt: str = "d"  # how the C writes it: "d", "x" (0x...) or "o" (0...)

    def define(self) -> str:
        value = {"d": str(self.value), "x": f"{self.value:#x}", "o": f"0{self.value:o}"}[self.fmt]
        if self.value < 0:
            value = f"({value})"
        return f"#define {self.macro} {value}" + (f"  // {self.comment}" if self.comment else "")


# the record kinds (hdr.kind) and the kinds loss is counted by (lost[])
EV_EXEC = 1  # an exec attempt, with its argv
EV_EXEC_OK = 2  # an exec that succeeded (sched_process_exec)
EV_FORK = 3
EV_EXIT = 4
EV_OPEN = 5
EV_CONNECT = 6
EV_CHDIR = 7
EV_FCHDIR = 8
EV_DUP = 9
EV_RET = 10  # an exec's result: the only result that is a record of its own
K_OPEN_PAST_CAP = 11  # lost[] only: past the run's cap on distinct summary keys (counted, not kept)
K_CONNECT_PAST_CAP = 12
K_AGG_MAP_FULL = 13  # lost[] only, not loss: recorded one by one because the aggregation map was full
EV_CHANGE = 14
EV_NS = 15
EV_DNS = 16
EV_SIGSYS = 17  # a system call the run's seccomp filter refused: a 32-bit entry (SIGSYS)
EV_EXEC_VIOLATION = 18  # an exec that loaded what the supervisor did not decide: killed (exec check)
EV_KINDS = 19  # one past the last kind: each run slot's row in `lost`

KINDS = (
    Const("EV_EXEC", EV_EXEC, "exec", before=("record kinds (hdr.kind) and loss counts (lost[])",)),
    Const("EV_EXEC_OK", EV_EXEC_OK, "exec_ok"),
    Const("EV_FORK", EV_FORK, "fork"),
    Const("EV_EXIT", EV_EXIT, "exit"),
    Const("EV_OPEN", EV_OPEN, "open"),
    Const("EV_CONNECT", EV_CONNECT, "connect"),
    Const("EV_CHDIR", EV_CHDIR, "chdir"),
    Const("EV_FCHDIR", EV_FCHDIR, "fchdir"),
    Const("EV_DUP", EV_DUP, "dup"),
    Const("EV_RET", EV_RET, "ret"),
    Const(
        "K_OPEN_PAST_CAP",
        K_OPEN_PAST_CAP,
        "open_past_cap",
        before=(
            "lost[] kinds that are not records: what a run did past its cap on distinct summary keys (not",
            "kept, counted), and operations recorded one by one because the aggregation map was full",
        ),
    ),
    Const("K_CONNECT_PAST_CAP", K_CONNECT_PAST_CAP, "connect_past_cap"),
    Const("K_AGG_MAP_FULL", K_AGG_MAP_FULL, "agg_map_full"),
    Const(
        "EV_CHANGE",
        EV_CHANGE,
        "change",
        "a file change that is not an open: rename, unlink, link, chmod, ... (op)",
    ),
    Const(
        "EV_NS",
        EV_NS,
        "namespace",
        "a namespace, mount, chroot or ptrace call (op; see ---- namespaces and mounts)",
    ),
    Const("EV_DNS", EV_DNS, "dns", "a DNS message sent or received (see ---- dns)"),
    Const("EV_SIGSYS", EV_SIGSYS, "sigsys", "a 32-bit system call refused (see ---- refused system calls)"),
    Const(
        "EV_EXEC_VIOLATION",
        EV_EXEC_VIOLATION,
        "exec_violation",
        "an exec not as the supervisor decided it, killed (see ---- exec check)",
    ),
    Const("EV_KINDS", EV_KINDS, comment="one past the last kind: each run slot's row in `lost`"),
)
# kinds that only count (lost[]), never a record in the ring buffer
COUNT_ONLY = frozenset((K_OPEN_PAST_CAP, K_CONNECT_PAST_CAP, K_AGG_MAP_FULL))
# a record's kind -> its name (decode.py)
RECORD_NAMES = {k.value: k.name for k in KINDS if k.name and k.value not in COUNT_ONLY}
# a kind's number -> its name in loss counts (loader.py: index 0 is no kind)
LOSS_NAMES = ["none", *(k.name for k in sorted(KINDS, key=lambda k: k.value) if k.name)]

# hdr.flags
F_PATH_TRUNC = 0x1
F_ARGS_TRUNC = 0x2
F_ARGS_FAULT = 0x4
F_FNAME_FAULT = 0x8
F_SEND = 0x10
F_FIRST = 0x20
F_STATE = 0x40
F_PATH2_FAULT = 0x80
F_PATH2_TRUNC = 0x100
F_OTHER_NS = 0x200
F_IN_ROOT = 0x400
F_KNAME = 0x800

FLAGS = (
    Const("F_PATH_TRUNC", F_PATH_TRUNC, fmt="x", before=("flags in hdr.flags",)),
    Const("F_ARGS_TRUNC", F_ARGS_TRUNC, fmt="x"),
    Const("F_ARGS_FAULT", F_ARGS_FAULT, fmt="x"),
    Const("F_FNAME_FAULT", F_FNAME_FAULT, fmt="x"),
    Const("F_SEND", F_SEND, comment="EV_CONNECT: a send to an explicit address, not a connect()", fmt="x"),
    Const("F_FIRST", F_FIRST, comment="the first occurrence of an aggregated key: its count is in `agg`", fmt="x"),
    Const("F_STATE", F_STATE, comment="already counted in `agg` (or past the cap): only for the cwd/fd tables", fmt="x"),
    Const("F_PATH2_FAULT", F_PATH2_FAULT, comment="EV_CHANGE: the second path could not be read", fmt="x"),
    Const("F_PATH2_TRUNC", F_PATH2_TRUNC, comment="EV_CHANGE: the second path is truncated", fmt="x"),
    Const(
        "F_OTHER_NS",
        F_OTHER_NS,
        comment="by a process that left the run's mount or user namespace, mounted or chrooted",
        fmt="x",
    ),
    Const(
        "F_IN_ROOT",
        F_IN_ROOT,
        comment="EV_OPEN: openat2 with RESOLVE_IN_ROOT: the path, even absolute, is below dfd",
        fmt="x",
    ),
    Const(
        "F_KNAME",
        F_KNAME,
        comment="EV_OPEN, EV_CHDIR, EV_FCHDIR: the kernel's name of the file (the new cwd) follows the path",
        fmt="x",
    ),
)  # fmt: skip

# change_ev.op: what a file change record is
CHANGES = (
    Const("CH_RENAME", 1, "rename", before=("change_ev.op",)),
    Const("CH_UNLINK", 2, "unlink"),
    Const("CH_RMDIR", 3, "rmdir"),
    Const("CH_LINK", 4, "link"),
    Const("CH_SYMLINK", 5, "symlink"),
    Const("CH_TRUNCATE", 6, "truncate"),
    Const("CH_CHMOD", 7, "chmod"),
    Const("CH_CHOWN", 8, "chown"),
    Const("CH_MKDIR", 9, "mkdir"),
    Const("CH_MKNOD", 10, "mknod"),
)
CHANGE_OPS = {c.value: c.name for c in CHANGES}

# ns_ev.op: which namespace, mount, chroot or ptrace call
NAMESPACES = (
    Const("NS_UNSHARE", 1, "unshare", before=("ns_ev.op",)),
    Const("NS_SETNS", 2, "setns"),
    Const("NS_CLONE", 3, "clone"),
    Const("NS_MOUNT", 4, "mount"),
    Const("NS_MOVE_MOUNT", 5, "move_mount"),
    Const("NS_OPEN_TREE", 6, "open_tree"),
    Const("NS_FSMOUNT", 7, "fsmount"),
    Const("NS_PIVOT_ROOT", 8, "pivot_root"),
    Const("NS_CHROOT", 9, "chroot"),
    Const("NS_PTRACE", 10, "ptrace"),
    Const("NS_VM_WRITE", 11, "process_vm_writev"),
)
NS_OPS = {c.value: c.name for c in NAMESPACES}

DNS_SENT, DNS_RECEIVED, DNS_DELIVERED = 0, 1, 2  # dns_ev.dir
SC_EXEC = 2  # ret_ev.sc: exec's result is the only result that is a record of its own
PATH_MAX = 4096  # bytes of a path read from a process (with its NUL)
DNS_MAX = 1024  # bytes of a DNS message kept (a power of two)
# bytes of a change's name the probe scans for a magic link's descriptor number (bpf/changes.bpf.c
# magic_fd; agent/recorder/names.py magic_fd reads a name the same way)
MAGIC_SCAN = 48
CONNECT_ADDR_MAX = 128  # connect_ev.addr: bytes of a sockaddr kept
NO_RESULT = -1_000_000  # the result of a call that never returned while recorded (not a kernel code)
# an open's flag bits that decide its access class (akey.access): O_ACCMODE O_CREAT O_TRUNC O_PATH
# O_TMPFILE
ACCESS_BITS = 0o3 | 0o100 | 0o1000 | 0o10000000 | 0o20200000

OTHERS = (
    Const("DNS_SENT", DNS_SENT, before=("dns_ev.dir",)),
    Const("DNS_RECEIVED", DNS_RECEIVED),
    Const(
        "DNS_DELIVERED",
        DNS_DELIVERED,
        comment="a datagram or segment the kernel delivered to a socket of a run (on_dns_ingress)",
    ),
    Const("SC_EXEC", SC_EXEC, comment="ret_ev.sc: exec is the only call whose result is a record of its own"),
    Const("PATH_MAX_", PATH_MAX),
    Const("DNS_MAX_", DNS_MAX, comment="bytes of a DNS message kept (a power of two)"),
    Const(
        "NO_RESULT_",
        NO_RESULT,
        before=("the result of a call that never returned while recorded (not a kernel code: -1,000,000)",),
    ),
    Const("MAGIC_SCAN_", MAGIC_SCAN, comment="bytes of a change's name magic_fd scans (names.magic_fd too)"),
    Const("ACCESS_BITS", ACCESS_BITS, comment="O_ACCMODE O_CREAT O_TRUNC O_PATH O_TMPFILE", fmt="o"),
)

# ---- exec check (issue 24): an exec of a run whose command rules are enforced must load the file
# and copy the arguments its supervisor decided on; bpf/exec_check.bpf.c kills it otherwise
EXEC_ARGS_MAX = 131072  # bytes of arg area hashed at most: a longer one is killed (XV_TOO_LONG)
EXEC_CHUNK = 8192  # bytes hashed per program run (a tail call each: EXEC_ARGS_MAX / EXEC_CHUNK <= 32)
EXEC_PINS_MAX = 65536  # threads with a decided exec not yet loaded, on the machine
PIN_SCRIPT = 0x1  # exec_pin.flags: a `#!` script (the file is its interpreter, argv rewritten)

VIOLATIONS = (
    Const("XV_NO_PIN", 0x1, "no_pin", "no decision for the thread that called exec", fmt="x",
          before=("exec_violation_ev.reason: what differed from the decision (bits)",)),
    Const("XV_FILE", 0x2, "file", "another file was loaded (dev, ino)", fmt="x"),
    Const("XV_ARGS", 0x4, "args", "other arguments were copied (length or hash)", fmt="x"),
    Const("XV_TOO_LONG", 0x8, "too_long", "an arg area longer than EXEC_ARGS_MAX_ (not hashed)", fmt="x"),
    Const("XV_UNREAD", 0x10, "unread", "what was loaded or copied could not be read", fmt="x"),
)  # fmt: skip
VIOLATION_REASONS = {c.value: c.name for c in VIOLATIONS}
VIOLATION_BIT = {c.name: c.value for c in VIOLATIONS}

EXEC_CONSTANTS = (
    Const("EXEC_ARGS_MAX_", EXEC_ARGS_MAX, before=("---- exec check",), comment="arg area bytes hashed at most"),
    Const("EXEC_CHUNK_", EXEC_CHUNK, comment="bytes hashed per run of a program (tail calls)"),
    Const("EXEC_PINS_MAX_", EXEC_PINS_MAX, comment="entries of exec_pins"),
    Const("PIN_SCRIPT", PIN_SCRIPT, comment="exec_pin.flags: a #! script", fmt="x"),
    *VIOLATIONS,
)  # fmt: skip

CONSTANTS = KINDS + FLAGS + CHANGES + NAMESPACES + OTHERS + EXEC_CONSTANTS


# ---- layouts ------------------------------------------------------------------------------------

# C type -> (struct code, size)
_CTYPES = {
    "u8": ("B", 1),
    "u16": ("H", 2),
    "u32": ("I", 4),
    "s32": ("i", 4),
    "u64": ("Q", 8),
    "s64": ("q", 8),
    "char": ("s", 1),
}


class Field(NamedTuple):
    name: str
    ctype: str  # u8, u16, u32, s32, u64, s64, char (char and u8 arrays unpack as bytes)
    length: int = 1  # an array's
    comment: str = ""

    @property
    def size(self) -> int:
        return _CTYPES[self.ctype][1] * self.length

    @property
    def align(self) -> int:
        return _CTYPES[self.ctype][1]

    @property
    def code(self) -> str:
        code, size = _CTYPES[self.ctype]
        if self.name.startswith("pad"):
            return f"{self.size}x"
        if self.length > 1:
            if code not in "sB":
                raise ValueError(f"{self.name}: only byte arrays")
            return f"{self.length}s"
        return code


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str  # struct <name>
    fields: tuple[Field, ...]
    header: bool = True  # starts with `struct hdr h` (a ring-buffer record)
    tail: tuple[str, ...] = ()  # C members after the fixed part (their size is the config's)
    comment: tuple[str, ...] = ()  # lines before the struct

    def __post_init__(self) -> None:
        off = HDR_SIZE if self.header else 0
        for f in self.fields:
            if off % f.align:
                raise ValueError(f"struct {self.name}: {f.name} at {off} is not aligned: pad it")
            off += f.size
        if self.fields and off % max(f.align for f in self.fields):
            raise ValueError(f"struct {self.name}: {off} bytes, not a multiple of its alignment: pad it")

    @functools.cached_property
    def struct(self) -> struct.Struct:
        """The fixed part after the header (the whole struct when it has none), little-endian;
        padding skipped: a tuple of the named fields (made once: packed on every allowed exec)."""
        return struct.Struct("<" + "".join(f.code for f in self.fields))

    @property
    def size(self) -> int:
        """Bytes of the fixed part, the header included: where the tail starts."""
        return (HDR_SIZE if self.header else 0) + self.struct.size

    def offset(self, name: str) -> int:
        """A field's offset from the start of the struct (past the header, when it has one)."""
        off = HDR_SIZE if self.header else 0
        for f in self.fields:
            if f.name == name:
                return off
            off += f.size
        raise KeyError(f"struct {self.name} has no field {name}")

    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def c(self) -> str:
        lines = [f"// {c}" if c else "//" for c in self.comment]
        lines.append(f"struct {self.name} {{")
        if self.header:
            lines.append("    struct hdr h;")
        for f in self.fields:
            decl = f"    {f.ctype} {f.name}" + (f"[{f.length}]" if f.length > 1 else "") + ";"
            lines.append((decl + " ").ljust(18) + f"// {f.comment}" if f.comment else decl)
        lines += [f"    {t}" for t in self.tail]
        lines.append("};")
        return "\n".join(lines)


def _f(name: str, ctype: str, comment: str = "", length: int = 1) -> Field:
    return Field(name, ctype, length, comment)


HDR = Layout(
    "hdr",
    (
        _f("ts", "u64"),
        _f("cgid", "u64", "the task's own cgroup (a descendant of the run's, e.g. a container)"),
        _f("run", "u32"),
        _f("tgid", "u32"),
        _f("tid", "u32"),
        _f("kind", "u16"),
        _f("flags", "u16"),
    ),
    header=False,
    comment=("Every record in the ring buffer starts with it.",),
)
HDR_SIZE = HDR.struct.size

OPEN_EV = Layout(
    "open_ev",
    (
        _f("ret", "s64", "the result (NO_RESULT: the call never returned while recorded)"),
        _f("exe", "u64", "F_FIRST: the aggregation key's program token ..."),
        _f("tok", "u64", "... and path token (see `agg`)"),
        _f("dfd", "s32", "openat's dirfd; chdir: AT_FDCWD; fchdir: the descriptor"),
        _f("flags", "u32"),
        _f("mode", "u16", "the mode given (the kernel uses its low 12 bits: S_IALLUGO)"),
        _f("nlink", "u16", "a write open's record: the file's link count (inode_nlink), else 0"),
        _f("sc", "u16", "which syscall: 0 openat, 1 openat2, 2 open, 3 creat"),
        _f("path_len", "u16", "bytes of path that follow, including the NUL"),
        _f("dino", "u64", "what dfd names at entry (its struct inode's address, fd_inode), 0: not read"),
        _f("rino", "u64", "what the descriptor returned names (read at exit), 0: none"),
    ),
    tail=("char path[PATH_MAX_];",),
    comment=(
        "A paired call's record: the header, the result, then what the call was given. Opens, chdir and",
        "fchdir share this layout (the path is at the same offset).",
    ),
)

CHANGE_EV = Layout(
    "change_ev",
    (
        _f("ret", "s64"),
        _f("mino", "u64", "path 1 through a magic link of the process's descriptors (magic_fd): what"),
        _f("mino2", "u64", "that descriptor named at entry and still at exit (fd_inode), else 0; path 2's"),
        _f("dfd", "s32", "what path 1 is resolved against (AT_FDCWD, a dirfd, or fchmod/fchown's fd)"),
        _f("dfd2", "s32", "the same for path 2 (rename, link, symlink's link path)"),
        _f("dino", "u64", "what dfd names at entry (fd_inode), 0: not read (AT_FDCWD)"),
        _f("dino2", "u64", "the same for dfd2"),
        _f("mode", "u16", "chmod, mkdir, mknod (S_IFMT and S_IALLUGO: 16 bits)"),
        _f("nlink", "u16", "the link count of the file changed when a descriptor names it (inode_nlink), else 0"),
        _f("uid", "u32", "chown"),
        _f("gid", "u32", "chown"),
        _f("at_flags", "u32", "renameat2's, linkat's, unlinkat's, fchownat's or fchmodat2's flags"),
        _f("op", "u16", "CH_*"),
        _f("len1", "u16"),
        _f("len2", "u16"),
        _f("pad", "u16"),
    ),
    tail=("char buf[2 * PATH_MAX_];",),
    comment=(
        "A file change that is not an open (rename, unlink, rmdir, link, symlink, truncate, chmod, chown,",
        "mkdir, mknod), paired in the kernel like an open: the result first, then what the call was given",
        "and up to two paths, one after the other (len1 and len2 bytes with their NUL; len1 = 0: no path,",
        "the call names a descriptor: dfd).",
    ),
)  # fmt: skip

NS_EV = Layout(
    "ns_ev",
    (
        _f("ret", "s64"),
        _f("flags", "u64", "clone/unshare: CLONE_*; setns: nstype; mount, move_mount, open_tree, fsmount: flags; ptrace: request"),
        _f("target", "u64", "ptrace, process_vm_writev: the target pid; setns: the fd; fsmount: the fs fd"),
        _f("dfd", "s32", "move_mount's from_dfd, open_tree's dfd"),
        _f("dfd2", "s32", "move_mount's to_dfd"),
        _f("dino", "u64", "what dfd names at entry (fd_inode), 0: not read"),
        _f("dino2", "u64", "the same for dfd2"),
        _f("fstype", "char", "mount: the filesystem type (at most 15 bytes)", 16),
        _f("op", "u16", "NS_*"),
        _f("len1", "u16"),
        _f("len2", "u16"),
        _f("pad", "u16"),
    ),
    tail=("char buf[2 * PATH_MAX_];",),
    comment=(
        "A namespace, mount, chroot or ptrace call (EV_NS), paired like a change and laid out like one",
        "up to its paths (read_change_paths fills both): ret, then what the call was given.",
    ),
)  # fmt: skip

EXEC_EV = Layout(
    "exec_ev",
    (
        _f("dfd", "s32"),
        _f("at_flags", "u32"),
        _f("old_tid", "u32", "EV_EXEC_OK: the thread id before exec (de_thread)"),
        _f("fname_len", "u16"),
        _f("args_len", "u16", "bytes of NUL-separated argv that follow the filename"),
        _f("argc", "u32", "arguments seen (may exceed the number captured)"),
        _f("dev", "u32", "EV_EXEC_OK: the file the new image was mapped from (mm->exe_file; for a #!"),
        _f("ino", "u64", "script, its interpreter): s_dev (kernel encoding), inode number, size and"),
        _f("size", "u64", "ctime. ino 0: not read."),
        _f("ctime_sec", "s64"),
        _f("ctime_nsec", "u32"),
        _f("pad", "u32"),
        _f("dino", "u64", "EV_EXEC: what dfd names at entry (fd_inode), 0: not read"),
    ),
    tail=("char buf[4 * PATH_MAX_ + ARGS_MAX_];",),
)

FORK_EV = Layout("fork_ev", (_f("child_tgid", "u32"), _f("pad", "u32")))
EXIT_EV = Layout(
    "exit_ev", (_f("exit_code", "s32", "wait status layout: (code << 8) | signal"), _f("pad", "u32"))
)

CONNECT_EV = Layout(
    "connect_ev",
    (
        _f("ret", "s64"),
        _f("exe", "u64"),
        _f("tok", "u64"),
        _f("fd", "s32"),
        _f("addrlen", "u32"),
        _f("pad", "u64", "the address at the offset of open_ev.path: one hash for both"),
        _f("dino", "u64", "an AF_UNIX path that is relative: the cwd at entry (cwd_inode), else 0"),
        _f("pad2", "u64"),
    ),
    tail=(f"u8 addr[{CONNECT_ADDR_MAX}];",),
)

DUP_EV = Layout(
    "dup_ev",
    (
        _f("ret", "s64"),
        _f("oldfd", "s32"),
        _f("newfd", "s32"),
        _f("rino", "u64", "what the descriptor returned names (read at exit), 0: none"),
    ),
)

RET_EV = Layout("ret_ev", (_f("sc", "u32"), _f("pad", "u32"), _f("ret", "s64")))

SIGSYS_EV = Layout(
    "sigsys_ev",
    (
        _f("nr", "s32", "si_syscall: the call's number in its architecture's table"),
        _f("arch", "u32", "si_arch: AUDIT_ARCH_*"),
        _f("ip", "u64", "si_call_addr: the address of the instruction after the call"),
    ),
    comment=("A system call through a 32-bit entry, refused by the run's seccomp filter (SIGSYS).",),
)

DNS_EV = Layout(
    "dns_ev",
    (
        _f("ret", "s64", "sent: the length given; received: the call's result; delivered: the payload's length"),
        _f("fd", "s32", "delivered: -1"),
        _f("dir", "u16", "DNS_SENT, DNS_RECEIVED or DNS_DELIVERED"),
        _f("len", "u16", "bytes of message that follow (at most DNS_MAX_; delivered: 2 * DNS_MAX_ - 1)"),
        _f("addr", "u8", "sent, received: the server (delivered: the source), sockaddr_in(6); family 0: not known", 28),
        _f("seq", "u32", "delivered over TCP: the segment's sequence number"),
        _f("sock", "u64", "sent, received: the socket (the inode's address dnsfds keeps for it)"),
        _f("cookie", "u64", "received: the socket's cookie (0: none yet, or not a socket); delivered: the receiving socket's"),
        _f("proto", "u8", "delivered: IPPROTO_UDP or IPPROTO_TCP"),
        _f("tcp", "u8", "delivered over TCP: the segment's flags (SYN: seq is the stream's start - 1)"),
        _f("pad", "u16"),
        _f("pad2", "u32"),
    ),
    tail=("u8 data[2 * DNS_MAX_];  // twice the bound, so the verifier can check a masked length",),
    comment=("A DNS message sent, received or delivered (see ---- dns).",),
)  # fmt: skip

CALL = Layout(
    "call",
    (
        _f("refetch", "u64", "EV_CHANGE: path 1's pointer (0: none), kept for a second read at exit"),
        _f("refetch2", "u64", "EV_CHANGE: path 2's pointer (0: none)"),
        _f("size", "u32", "bytes of the record to emit"),
        _f("nr", "s32", "the syscall it waits for"),
        _f("hbase", "u64", "at exit: the token the name is resolved against, ..."),
        _f("hlen", "u32", "... the name's length (path or address, at the same offset) ..."),
        _f("hskip", "u32", "... and whether there is nothing to hash (1) or no known base (2)"),
        _f("htok", "u64", "the name's token, 0 when none"),
        _f("koff", "u32", "kernel_name: where the name built backward starts (kept here, not in a register)"),
        _f("hoff", "u32", "where in the path buffer the hashed name starts: 0, or past the path (a kernel name)"),
        _f("owner", "u32", "the run slot the entry is counted in (inflight_n) since its thread's first call"),
        _f("walked", "u32", "on_exit_name ran for the call (the kernel's name, if it could be had, is in it)"),
        _f("mfd", "s32", "EV_CHANGE: the descriptor path 1 names through a magic link (magic_fd), -1: none"),
        _f("mfd2", "s32", "the same for path 2"),
    ),
    header=False,
    tail=(
        "union {",
        "    struct hdr h;  // h.kind == 0: no call in flight",
        "    struct open_ev open;",
        "    struct change_ev change;",
        "    struct ns_ev ns;",
        "    struct connect_ev conn;",
        "    struct dup_ev dup;",
        "} ev;",
    ),
    comment=(
        "A call between its enter and its exit, one per thread (`inflight`; the loader reads the records of",
        "calls still in flight when a run ends). `refetch` is the user pointer of a path whose page was not",
        "resident at entry (bpf_probe_read_user cannot fault it in): it is read again at exit, after the",
        "kernel has paged it in.",
    ),
)  # fmt: skip

AKEY = Layout(
    "akey",
    (
        _f("exe", "u64"),
        _f("tok", "u64"),
        _f("cgid", "u64"),
        _f("run", "u32"),
        _f("access", "u32", "open: the flag bits that decide the access class; connect: F_SEND, F_FNAME_FAULT"),
        _f("result", "s32", "0 or -errno"),
        _f("kind", "u16"),
        _f("pad", "u16"),
        _f("ino", "u64", "open: what it opened (its inode's address, rino), 0 when it failed; connect: 0"),
    ),
    header=False,
    comment=("`agg`'s key: what an open or connect counted in the kernel was (see ---- in-kernel aggregation).",),
)  # fmt: skip

AVAL = Layout("aval", (_f("count", "u64"), _f("first", "u64"), _f("last", "u64")), header=False)

EXEC_PIN = Layout(
    "exec_pin",
    (
        _f("dev", "u64", "the file the exec must load: s_dev (kernel encoding: major << 20 | minor)"),
        _f("ino", "u64", "and inode number (a #! script: its interpreter's)"),
        _f("argv_hash", "u64", "SipHash-2-4 under the run's key of the arg area (argv_digest)"),
        _f("args_len", "u32", "bytes of the arg area (each argument and its NUL)"),
        _f("flags", "u32", "PIN_SCRIPT"),
    ),
    header=False,
    comment=(
        "`exec_pins`' value (key: the id of the thread that calls exec, sched_process_exec's old_pid): what",
        "the supervisor decided, written before it lets the exec go on (see ---- exec check).",
    ),
)

EXEC_GUARD = Layout(
    "exec_guard",
    (_f("k0", "u64", "the run's SipHash key"), _f("k1", "u64"), _f("on", "u32", "1: execs are checked"), _f("pad", "u32")),
    header=False,
    comment=("`exec_guard`'s value, per run slot: whether its execs are checked, and the key of its hashes.",),
)  # fmt: skip

EXEC_VIOLATION_EV = Layout(
    "exec_violation_ev",
    (
        _f("old_tid", "u32", "the thread that called exec"),
        _f("reason", "u32", "XV_*"),
        _f("ino", "u64", "what the kernel loaded (mm->exe_file): inode number, ..."),
        _f("dev", "u32", "... s_dev (kernel encoding), ..."),
        _f("args_len", "u32", "... and the arg area's length ..."),
        _f("argv_hash", "u64", "... and hash (0: not hashed)"),
        _f("want_ino", "u64", "the decision (exec_pin), 0 with XV_NO_PIN"),
        _f("want_hash", "u64"),
        _f("want_dev", "u32"),
        _f("want_args_len", "u32"),
        _f("want_flags", "u32"),
        _f("kill", "s32", "bpf_send_signal(SIGKILL)'s result: 0, the process dies before its first instruction"),
    ),
    comment=("An exec of a checked run that loaded or copied what its supervisor did not decide (EV_EXEC_VIOLATION).",),
)  # fmt: skip

# in the order the C declares them (a struct before the structs that contain it)
LAYOUTS = (
    *(HDR, OPEN_EV, CHANGE_EV, NS_EV, EXEC_EV, FORK_EV, EXIT_EV, CONNECT_EV, DUP_EV, CALL, RET_EV),
    *(SIGSYS_EV, DNS_EV, AKEY, AVAL, EXEC_PIN, EXEC_GUARD, EXEC_VIOLATION_EV),
)


def _assertion(layout: Layout) -> str:
    what = f"struct {layout.name} is laid out as probes/abi.py says"
    if layout.tail:  # the fixed part ends where the tail's first member starts
        first = layout.tail[0].split("[")[0].split()[-1].rstrip(";") if "[" in layout.tail[0] else "ev"
        return f'_Static_assert(offsetof(struct {layout.name}, {first}) == {layout.size}, "{what}");'
    return f'_Static_assert(sizeof(struct {layout.name}) == {layout.size}, "{what}");'


def render_header() -> str:
    """The C header of the ABI (render.py puts it where record.bpf.c includes "abi.h")."""
    out = [
        "// ---- the kernel/user ABI, generated by probes/abi.py (render_header): the one definition of the",
        "// record kinds, flags, operations and layouts; the decoder and the loader read the same module",
        "",
    ]
    for group in (KINDS, FLAGS, CHANGES, NAMESPACES, OTHERS, EXEC_CONSTANTS):
        for c in group:
            out += [f"// {line}" for line in c.before]
            out.append(c.define())
        out.append("")
    for layout in LAYOUTS:
        out += [layout.c(), ""]
    out += [_assertion(layout) for layout in LAYOUTS]
    return "\n".join(out) + "\n"


# ---- the exec check's reference (issue 24): what the supervisor pins, computed as the BPF does --------
#
# The supervisor (agent/recorder/exec_supervisor.py) decides an exec on the path and argv it read
# from the caller's memory; if it lets it go on, the kernel reads them again, and another thread of
# the caller may have rewritten them meanwhile. So before answering it pins, for the calling thread,
# the file the kernel must load and a keyed hash of the arguments the kernel must copy
# (`exec_pin`), and the probe compares them at sched_process_exec with what the kernel did load
# (mm->exe_file) and copy (the new image's arg area, mm->arg_start..arg_end: every argument with its
# NUL; all of it, however long, up to EXEC_ARGS_MAX). The hash is SipHash-2-4 under a random key of
# the run's that the job never sees: with an unkeyed hash the job could make an allowed and a refused
# argv collide.

_MASK64 = (1 << 64) - 1


def _rotl(x: int, b: int) -> int:
    return ((x << b) | (x >> (64 - b))) & _MASK64


def siphash24(key: bytes, data: bytes) -> int:
    """SipHash-2-4 (Aumasson and Bernstein) of `data` under a 16-byte key, as a 64-bit integer: the
    reference bpf/exec_check.bpf.c computes too."""
    if len(key) != 16:
        raise ValueError("a SipHash key is 16 bytes")
    k0, k1 = (int(k) for k in struct.unpack("<QQ", key))
    v = [k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D, k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573]

    def rounds(n: int) -> None:
        v0, v1, v2, v3 = v
        for _ in range(n):
            v0 = (v0 + v1) & _MASK64
            v1 = _rotl(v1, 13) ^ v0
            v0 = _rotl(v0, 32)
            v2 = (v2 + v3) & _MASK64
            v3 = _rotl(v3, 16) ^ v2
            v0 = (v0 + v3) & _MASK64
            v3 = _rotl(v3, 21) ^ v0
            v2 = (v2 + v1) & _MASK64
            v1 = _rotl(v1, 17) ^ v2
            v2 = _rotl(v2, 32)
        v[:] = [v0, v1, v2, v3]

    end = len(data) - len(data) % 8
    for (word,) in struct.iter_unpack("<Q", data[:end]):
        m = int(word)
        v[3] ^= m
        rounds(2)
        v[0] ^= m
    last = int.from_bytes(data[end:], "little") | ((len(data) & 0xFF) << 56)
    v[3] ^= last
    rounds(2)
    v[0] ^= last
    v[2] ^= 0xFF
    rounds(4)
    return v[0] ^ v[1] ^ v[2] ^ v[3]


def arg_area(argv: Sequence[bytes]) -> bytes:
    """The new image's arg area for `argv` as the kernel copies it: every argument followed by its
    NUL. An empty argv gets one empty argument (fs/exec.c, since 5.18)."""
    return b"".join(a + b"\0" for a in (argv or [b""]))


def script_argv(
    interpreter: bytes, argument: bytes | None, filename: bytes, argv: Sequence[bytes]
) -> list[bytes]:
    """The argv the kernel gives a `#!` script's interpreter (fs/binfmt_script.c): the interpreter
    as the line names it, its one optional argument, the name the script was called by
    (bprm->filename: the path as passed, or /dev/fd/N[/path] for execveat relative to a descriptor),
    then argv[1:]."""
    return [interpreter, *([argument] if argument is not None else []), filename, *argv[1:]]


def argv_digest(key: bytes, argv: Sequence[bytes]) -> int:
    """The hash an exec pin carries for `argv` (for a script, script_argv's), under the run's key.
    Raises ValueError past EXEC_ARGS_MAX bytes: such an exec cannot be pinned (refuse it)."""
    data = arg_area(argv)
    if len(data) > EXEC_ARGS_MAX:
        raise ValueError(f"an arg area of {len(data)} bytes is longer than {EXEC_ARGS_MAX}")
    return siphash24(key, data)


def kernel_dev(st_dev: int) -> int:
    """stat(2)'s st_dev in the kernel's encoding (sb->s_dev: major << 20 | minor)."""
    return (os.major(st_dev) << 20) | os.minor(st_dev)


@dataclasses.dataclass(frozen=True)
class ExecPin:
    """An exec the supervisor let go on: `exec_pins`' value (struct exec_pin)."""

    dev: int  # kernel encoding (kernel_dev)
    ino: int
    argv_hash: int
    args_len: int
    flags: int = 0  # PIN_SCRIPT

    def pack(self) -> bytes:
        return EXEC_PIN.struct.pack(self.dev, self.ino, self.argv_hash, self.args_len, self.flags)


def exec_pin(
    key: bytes, identity: tuple[int, int], argv: Sequence[bytes], *, script: bool = False
) -> ExecPin:
    """The pin of an exec that must load the file `identity` (stat(2)'s st_dev, st_ino; a `#!`
    script's interpreter) with `argv` (a script's: script_argv). Raises ValueError when it cannot be
    pinned (an arg area past EXEC_ARGS_MAX)."""
    return ExecPin(
        kernel_dev(identity[0]),
        identity[1],
        argv_digest(key, argv),
        len(arg_area(argv)),
        PIN_SCRIPT if script else 0,
    )
