"""Compile and load the recorder probes with BCC, once per agent process.

This module and objcache.py (the compiled-probe cache) are the modules of probes/ that need BCC
and root. One `RecorderProbes` serves any number
of concurrent runs: a run is a slot number in the `tracked` map (cgroup id -> slot); nothing is
recompiled per run.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypedDict, Unpack

from evidence.probes import abi, bpfsys, btf, objcache
from evidence.probes.headers import ensure_headers
from evidence.probes.render import ProbeConfig, render
from evidence.probes.ringbuf import RingBuffer

logger = logging.getLogger(__name__)

EV_KINDS = abi.EV_KINDS
# Syscall handlers of record.bpf.c and the syscalls each one is attached to (where they exist: open
# and creat are x86_64 legacy calls). Every one of them also gets `on_exit` on its exit tracepoint,
# or the handler EXIT_HANDLERS names.
SYSCALL_HANDLERS = {
    "on_enter_openat": ("openat",),
    "on_enter_open": ("openat2", "open", "creat"),
    "on_enter_exec": ("execve", "execveat"),
    "on_enter_connect": ("connect",),
    "on_enter_send": ("sendto", "sendmsg", "sendmmsg"),
    "on_enter_chdir": ("chdir",),
    "on_enter_fchdir": ("fchdir",),
    "on_enter_dup": ("dup", "dup2", "dup3"),
    "on_enter_change": (
        "rename",
        "renameat",
        "renameat2",
        "unlink",
        "unlinkat",
        "rmdir",
        "link",
        "linkat",
        "symlink",
        "symlinkat",
        "truncate",
        "chmod",
        "fchmod",
        "fchmodat",
        "fchmodat2",
        "chown",
        "lchown",
        "fchown",
        "fchownat",
        "mkdir",
        "mkdirat",
        "mknod",
        "mknodat",
    ),
    "on_enter_ns": (
        "unshare",
        "setns",
        "clone",
        "clone3",
        "mount",
        "move_mount",
        "open_tree",
        "fsmount",
        "pivot_root",
        "chroot",
        "ptrace",
        "process_vm_writev",
    ),
}
# openat's exit has a program of its own (the hash of the name in it: no tail call on every open)
EXIT_HANDLERS = {"openat": "on_exit_openat"}
# ---- dns: on_enter_dns (record.bpf.c) on these syscalls' enter tracepoints, and on_exit_dns on the
# exits of the receives (their message is read there). None of them has a handler above: BCC keeps
# one program per tracepoint (connect and the sends call the DNS code from their own handlers).
DNS_ENTER = ("read", "write", "writev", "recvfrom", "recvmsg", "recvmmsg")
DNS_EXIT = ("read", "recvfrom", "recvmsg", "recvmmsg")
# ... and on_dns_ingress, a cgroup program attached to each run's cgroup (attach_ingress): what the
# kernel delivered to the run's sockets, which a DNS receive's bytes are checked against
# ---- exec check: exec_check on sched_process_exec's raw tracepoint, and exec_hash_more, which it
# tail-calls (exec_tail 0), loaded when a run's execs are first checked (enforce_execs)
EXEC_CHECK = "exec_check"
EXEC_HASH = "exec_hash_more"
INGRESS = "on_dns_ingress"
START_THREADS = 2  # programs verified side by side at a start (objcache.load_side_by_side)
_PROG_TYPE_CGROUP_SKB = 8
_CGROUP_INET_INGRESS = 0
_F_ALLOW_MULTI = 2  # beside the cgroup's other programs (a policy's, a container runtime's)
# a kind's number -> its name in loss counts (probes/abi.py: the one definition)
KIND_NAMES = abi.LOSS_NAMES
NOT_LOSS = frozenset(("agg_map_full",))
# struct call (refetch, refetch2, size, nr, ...; the record follows), struct akey and struct aval
# (`agg`'s entries), as probes/abi.py lays them out
_CALL = abi.CALL.struct
_AKEY = abi.AKEY.struct  # exe, tok, cgid, run, access, result, kind, ino
_AVAL = abi.AVAL.struct  # count, first, last
_AKEY_RUN = struct.Struct(f"<{abi.AKEY.offset('run')}xI")  # struct akey: run
_TS = struct.Struct("<Q")
_U32 = struct.Struct("<I")  # an array's index, a u32 value
_U64 = struct.Struct("<Q")
_RUN_OFF, _KIND_OFF = abi.HDR.offset("run"), abi.HDR.offset("kind")
_HDR_RUN_KIND = struct.Struct(f"<{_RUN_OFF}xI{_KIND_OFF - _RUN_OFF - 4}xH")  # struct hdr: run and kind


class Sizes(TypedDict, total=False):
    """ProbeConfig's sizes, overridden (tests: a small ring buffer, a small aggregation map)."""

    args_bytes: int
    max_args: int
    max_runs: int
    cgroup_depth: int
    ringbuf_pages: int
    wakeup_every: int
    inflight_max: int
    inflight_per_run: int
    agg_max: int


def detect_config(**overrides: Unpack[Sizes]) -> ProbeConfig:
    """A ProbeConfig for the running kernel: BTF offsets and tracepoints that exist here, with
    `overrides` of its sizes (tests: a small ring buffer, a small aggregation map)."""
    events = bpfsys.TRACEFS / "events"
    exit_fmt = (events / "sched/sched_process_exit/format").read_text()
    return ProbeConfig(offsets=btf.probe_offsets(), have_group_dead="group_dead" in exit_fmt, **overrides)


def _syscall_attachments() -> tuple[list[tuple[bytes, bytes]], list[str]]:
    """(tracepoint, program) of each syscall tracepoint a start attaches, in order, and the
    syscalls of SYSCALL_HANDLERS that exist here (open and creat are x86_64's alone)."""
    events = bpfsys.TRACEFS / "events" / "syscalls"
    out: list[tuple[bytes, bytes]] = []
    names: list[str] = []
    for fn, syscalls in SYSCALL_HANDLERS.items():
        for name in syscalls:
            if not (events / f"sys_enter_{name}").is_dir():
                continue
            out.append((f"syscalls:sys_enter_{name}".encode(), fn.encode()))
            out.append((f"syscalls:sys_exit_{name}".encode(), EXIT_HANDLERS.get(name, "on_exit").encode()))
            names.append(name)
    out += [(f"syscalls:sys_enter_{name}".encode(), b"on_enter_dns") for name in DNS_ENTER]
    out += [(f"syscalls:sys_exit_{name}".encode(), b"on_exit_dns") for name in DNS_EXIT]
    return out, names


class RecorderProbes:
    def __init__(
        self, config: ProbeConfig | None = None, *, rendered: Callable[[], None] | None = None
    ) -> None:
        """`rendered`: called once the source is rendered, before the kernel's part of the load
        (maps, the verifier, attachments), which needs the GIL for little: a caller's thread may
        run Python beside it from then on."""
        with attaching():  # an earlier run's evidence-detach closes no perf event meanwhile
            self._load(config, rendered)
        self._ingress_at: dict[int, int] = {}  # cgroup id -> a descriptor of the cgroup it is attached to
        self._tracked = self.bpf[b"tracked"]
        self._cache = self.bpf[b"cgcache"]
        self._lost = self.bpf[b"lost"]
        self._ring: RingBuffer | None = None
        self._exec_checked: set[int] = set()  # run slots whose execs are checked (enforce_execs)
        self._exec_lock = threading.Lock()  # an agent's runs start and end on threads of their own

    def _load(self, config: ProbeConfig | None, rendered: Callable[[], None] | None) -> None:
        headers = ensure_headers()
        self.config = config or detect_config()
        self.source = render(self.config)
        attach, self.attached = _syscall_attachments()
        tails = (b"on_exit_hash", b"on_exit_name", b"on_exit")  # exit_tail 0, 1, 2 (bpf/exit.bpf.c)
        tracepoint = bpfsys.LoadedObject.TRACEPOINT
        programs = [(fn, tracepoint, 0) for fn in dict.fromkeys([*tails, *(fn for _, fn in attach)])]
        programs.append((INGRESS.encode(), _PROG_TYPE_CGROUP_SKB, _CGROUP_INET_INGRESS))
        tracepoints: dict[bytes, list[bytes]] = {}  # program -> the tracepoints it is attached to
        for tp, fn in attach:
            tracepoints.setdefault(fn, []).append(tp)

        def attach_its(loaded: bpfsys.LoadedObject, fn: bytes) -> None:
            for tp in tracepoints.get(fn, ()):
                loaded.attach_tracepoint(tp=tp, fn_name=fn)

        if rendered is not None:
            rendered()
        # compiled once per source, kernel and BCC, then loaded from the cache (probes/objcache.py):
        # every program a run needs is loaded and attached now, START_THREADS at a time (the exec
        # check's when a run first asks for it)
        self.bpf = objcache.load(
            self.source,
            str(headers.path) if headers.path else None,
            programs=programs,
            threads=START_THREADS,
            after=attach_its,
        )
        # on_exit tail-calls on_exit_name and on_exit_hash (bpf/exit.bpf.c); the SipHash key is drawn
        # here, once (nothing is tracked yet: no program records anything before both are set)
        for i, fn in enumerate(tails):
            self.bpf[b"exit_tail"][_U32.pack(i)] = _U32.pack(self.bpf.load_func(fn, tracepoint).fd)
        hkey = self.bpf[b"hkey"]
        for i, word in enumerate(struct.unpack("<QQ", os.urandom(16))):
            hkey[_U32.pack(i)] = _U64.pack(word)
        self._ingress = self.bpf.load_func(INGRESS.encode(), _PROG_TYPE_CGROUP_SKB, _CGROUP_INET_INGRESS)

    # ---- exec check (bpf/exec_check.bpf.c): the supervisor's decisions, held by the kernel

    def enforce_execs(self, slot: int, key: bytes) -> None:
        """Check every exec of run `slot` from now on against its pin (`publish`): one that loads
        another file or copies other arguments, or has no pin, is killed before its first
        instruction and recorded (EV_EXEC_VIOLATION). `key`: the run's 16-byte SipHash key, the one
        its pins are hashed with (abi.exec_pin). The check's program is attached the first time
        (runs without the check pay nothing until then). Call it before the run's first supervised
        exec: from then on an exec of the run without a pin is killed. Raises ObjectError when the
        kernel refuses the program: then nothing closes the race after the decision (a degradation,
        or exit 2 with --fail-closed)."""
        if len(key) != 16:
            raise ValueError("the exec check's key is 16 bytes")
        k0, k1 = struct.unpack("<QQ", key)
        with self._exec_lock:
            self._attach_exec_check()
            self.bpf[b"exec_guard"][_U32.pack(slot)] = abi.EXEC_GUARD.struct.pack(k0, k1, 1)
            self._exec_checked.add(slot)
            self.bpf[b"exec_guarded"][_U32.pack(0)] = _U64.pack(len(self._exec_checked))

    def prepare_execs(self) -> None:
        """Load and attach the exec check's programs now (their verifier's ~0.1 s of CPU), so that
        `enforce_execs` finds them: `evidence run` calls it on a thread of its own while it sets the
        run up, once it knows the run has command rules. Until a run is checked, the program only
        looks its slot up. Raises ObjectError as `enforce_execs` would (which then tries again)."""
        with self._exec_lock:
            self._attach_exec_check()

    def _attach_exec_check(self) -> None:
        """(with _exec_lock) The exec check attached, its two programs verified side by side."""
        if self.bpf.raw_tracepoint_fds.get(b"sched_process_exec"):
            return
        raw = self.bpf.RAW_TRACEPOINT
        objcache.load_side_by_side(self.bpf, [(EXEC_HASH.encode(), raw, 0), (EXEC_CHECK.encode(), raw, 0)], 2)
        self.bpf[b"exec_tail"][_U32.pack(0)] = _U32.pack(self.bpf.load_func(EXEC_HASH.encode(), raw).fd)
        self.bpf.attach_raw_tracepoint(tp=b"sched_process_exec", fn_name=EXEC_CHECK.encode())

    def release_execs(self, slot: int) -> None:
        """Stop checking run `slot`'s execs (its run ended); its key is wiped from the kernel."""
        with self._exec_lock:
            self.bpf[b"exec_guard"][_U32.pack(slot)] = abi.EXEC_GUARD.struct.pack(0, 0, 0)
            self._exec_checked.discard(slot)
            self.bpf[b"exec_guarded"][_U32.pack(0)] = _U64.pack(len(self._exec_checked))

    def publish(self, tid: int, pin: abi.ExecPin) -> None:
        """Pin what thread `tid` (the seccomp notification's pid) must load if its exec goes on:
        call it before answering CONTINUE. The thread's exec takes the pin; a pin of a thread whose
        exec failed stays until its next (which the supervisor pins again) or its exit. Raises
        OSError when the kernel cannot hold it (EXEC_PINS_MAX pins): then refuse the exec."""
        self.bpf[b"exec_pins"][_U32.pack(tid)] = pin.pack()

    def pins_fd(self) -> int:
        """The pin map's descriptor: the exec supervisor's process publishes through it (bpf(2))."""
        return self.bpf[b"exec_pins"].map_fd

    def forget(self, tid: int) -> None:
        """Drop thread `tid`'s pin, if it has one (an exec refused after all)."""
        with contextlib.suppress(KeyError):
            del self.bpf[b"exec_pins"][_U32.pack(tid)]

    def attach_ingress(self, cgroup_id: int, cgroup_path: Path) -> None:
        """---- dns: attach on_dns_ingress to a run's cgroup (before it is tracked), so that what
        the kernel delivers to the run's sockets is recorded; it stays until `untrack` (a window
        that takes over the cgroup keeps it: HandoverProbes). Raises OSError when the kernel
        refuses (then no DNS answer of the run can be credited)."""
        if cgroup_id in self._ingress_at:
            return
        fd = os.open(cgroup_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self.bpf.attach_cgroup(self._ingress, fd, _CGROUP_INET_INGRESS, _F_ALLOW_MULTI)
        except OSError as e:
            if e.errno != errno.EEXIST:  # attached already (a run before this one left it)
                os.close(fd)
                raise
        self._ingress_at[cgroup_id] = fd

    def track(self, cgroup_id: int, slot: int) -> None:
        self._tracked[_U64.pack(cgroup_id)] = _U32.pack(slot)
        self.clear_cache()

    def untrack(self, cgroup_id: int) -> None:
        with contextlib.suppress(KeyError):
            del self._tracked[_U64.pack(cgroup_id)]
        self.clear_cache()
        fd = self._ingress_at.pop(cgroup_id, None)
        if fd is not None:
            # the cgroup may be gone already, and the program's attachment with it
            with contextlib.suppress(OSError):
                self.bpf.detach_cgroup(self._ingress, fd, _CGROUP_INET_INGRESS)
            os.close(fd)

    def clear_cache(self) -> None:
        """Forget cached cgroup -> run lookups (negative ones too), e.g. after attaching to a cgroup
        that already has descendants, or after a run ends."""
        self._cache.clear()

    def reset_lost(self, slot: int) -> None:
        for kind in range(EV_KINDS):
            self._lost[_U32.pack(slot * EV_KINDS + kind)] = _U64.pack(0)

    def read_lost(self, slot: int) -> dict[str, int]:
        """Per kind: records the ring buffer could not take, and operations not kept past the
        run's cap on distinct keys."""
        out = {}
        for kind in range(1, EV_KINDS):
            n = _U64.unpack(self._lost[_U32.pack(slot * EV_KINDS + kind)])[0]
            name = KIND_NAMES[kind]
            if n and name not in NOT_LOSS:
                out[name] = int(n)
        return out

    def read_fallbacks(self, slot: int) -> int:
        """Operations recorded one by one because the aggregation map was full (not loss)."""
        return int(_U64.unpack(self._lost[_U32.pack(slot * EV_KINDS + abi.K_AGG_MAP_FULL)])[0])

    def set_aggregation(self, slot: int, max_distinct: int) -> None:
        """Aggregate the opens and connects of run `slot` in the kernel, keeping at most
        `max_distinct` distinct keys (0: no aggregation, every operation is a record). Called when a
        run takes the slot: its share of the calls-in-flight table starts empty too."""
        self.bpf[b"distinct"][_U32.pack(slot)] = _U32.pack(0)
        self.bpf[b"limits"][_U32.pack(slot)] = _U32.pack(max_distinct)
        self.bpf[b"inflight_n"][_U32.pack(slot)] = _U32.pack(0)  # a new run's share of `inflight`

    def take_aggregates(
        self, slot: int
    ) -> list[tuple[tuple[int, int, int, int, int, int, int], int, int, int]]:
        """The aggregation map's entries of run `slot`, removed from it: (key, count, first, last)
        with key = (exe token, token, cgroup id, kind, access, result) and kernel times."""
        out, keys = self.read_aggregates(slot)
        self.drop_aggregates(slot, keys)
        return out

    def read_aggregates(
        self, slot: int
    ) -> tuple[list[tuple[tuple[int, int, int, int, int, int, int], int, int, int]], bytes]:
        """Stop aggregating run `slot` and read its entries of the aggregation map, as
        take_aggregates gives them, with their keys as one string of bytes: for drop_aggregates,
        which removes them (deleting a hundred thousand entries takes the kernel a few tenths of a
        second: the recorder does it on a thread of its own while the bundle is written)."""
        self.bpf[b"limits"][_U32.pack(slot)] = _U32.pack(0)
        keys, values = self.bpf[b"agg"].items_raw()  # many entries per system call, unpacked in bulk
        out = []
        others = False  # entries of other runs (an agent's concurrent runs) stay in the map
        for (exe, tok, cgid, run, access, result, kind, ino), (count, first, last) in zip(
            _AKEY.iter_unpack(keys), _AVAL.iter_unpack(values), strict=True
        ):
            if run != slot:
                others = True
                continue
            out.append(((exe, tok, cgid, kind, access, result, ino), count, first, last))
        if others:
            size = _AKEY.size
            keys = b"".join(
                keys[i : i + size]
                for i in range(0, len(keys), size)
                if _AKEY_RUN.unpack_from(keys, i)[0] == slot
            )
        return out, keys

    def drop_aggregates(self, slot: int, keys: bytes) -> None:
        """Remove run `slot`'s entries (`keys`, from read_aggregates) from the aggregation map and
        reset its count of distinct keys: the slot is ready for another run."""
        self.bpf[b"agg"].delete_many(keys)
        self.bpf[b"distinct"][_U32.pack(slot)] = _U32.pack(0)

    def in_flight(self, slot: int) -> list[bytes]:
        """The records of the calls of run `slot` that are between their enter and their exit (a
        call in progress when the run ends), taken out of the kernel's map: their result field
        says NO_RESULT. Threads of a finished run are gone, so nothing completes them meanwhile."""
        table = self.bpf[b"inflight"]
        out: list[bytes] = []
        for key, raw in table.items():
            _, _, size, *_ = _CALL.unpack_from(raw, 0)
            rec = raw[_CALL.size : _CALL.size + size]
            run, kind = _HDR_RUN_KIND.unpack_from(rec, 0) if len(rec) >= abi.HDR_SIZE else (0, 0)
            if run == slot and kind != 0:
                out.append(rec)
                with contextlib.suppress(KeyError):
                    del table[key]
        out.sort(key=lambda r: _TS.unpack_from(r, 0)[0])
        return out

    def ring(self) -> RingBuffer:
        """The events ring buffer, read in bulk over mmap (see probes/ringbuf.py)."""
        if self._ring is None:
            self._ring = RingBuffer(self.bpf[b"events"].map_fd, self.config.ringbuf_pages * mmap.PAGESIZE)
        return self._ring

    def close(self, background: bool = False) -> None:
        """Detach and unload. Closing a tracepoint's program (its link) waits for a grace period,
        and its perf event for an RCU grace period (~40 ms each here, 4 s in all, one after the
        other). With `background=True` the caller waits for neither: a child process,
        `evidence-detach`, inherits every descriptor; this process closes its own copies of the
        links first (not the last: nothing waits) and says so, then the child closes the last ones,
        side by side (objcache.detach_programs: no program runs after that, on any process, ~40 ms
        later), and the perf events one by one once this process is gone (close_yielding)."""
        for cgroup_id in list(self._ingress_at):  # runs not finished: nothing to deliver to any more
            self.untrack(cgroup_id)
        if background:
            r, w = os.pipe()  # the write end stays open in this process until it exits
            pid = os.fork()
            if pid == 0:  # pragma: no cover - child
                try:
                    os.close(w)
                    _name_self(b"evidence-detach")  # what `ps` shows for it (bench/bench.py waits for it)
                    devnull = os.open(os.devnull, os.O_RDWR)
                    for fd in (0, 1, 2):
                        os.dup2(devnull, fd)
                    os.setsid()
                    # nothing of the parent's but the probes' attachments: a pipe another process
                    # waits on for EOF (a launcher's helper, the watchdog), a lock, a run's files
                    keep = {r, *self.bpf.tracepoint_fds.values(), *self.bpf.links}
                    _close_all_but(keep | set(self.bpf.raw_tracepoint_fds.values()))
                    # b"L": the parent closed its copies of the links (else it is gone: EOF)
                    if os.read(r, 1):
                        self.bpf.detach_programs()  # the last ones: no program runs from here on
                        os.read(r, 1)  # returns at EOF: the parent is gone, its references with it
                    else:
                        self.bpf.detach_programs()
                    close_yielding(self.bpf.tracepoint_fds.values())
                finally:
                    os._exit(0)
            os.close(r)
            links = [*self.bpf.links, *self.bpf.raw_tracepoint_fds.values()]
            self.bpf.links, self.bpf.raw_tracepoint_fds = [], {}
            for fd in links:  # the child holds them: closing ours waits for nothing
                with contextlib.suppress(OSError):
                    os.close(fd)
            with contextlib.suppress(OSError):
                os.write(w, b"L")  # now the child's are the last: its closes detach them
            self._keepalive = w
            return
        self.bpf.cleanup()


# ---- a start beside an earlier run's teardown (issue 27)
#
# Closing the last perf event of a tracepoint unregisters it and waits for RCU grace periods while
# holding the kernel's event_mutex (perf_trace_destroy: ~40 ms each here, 4 s for the recorder's
# 112), and attaching one takes that mutex too (perf_trace_init, and reading a tracepoint's format).
# So a run started while an earlier run's `evidence-detach` was closing its perf events waited
# behind it, tracepoint after tracepoint (a user's second run, or one right after `make demo`: 0.3
# s more than the bench, which waits for the detach to end). Now a start holds ATTACH_LOCK shared
# while it loads and attaches, and the detach takes it exclusive for each close: a start waits for
# one close at most, then attaches to tracepoints the detach still holds (no registration: the
# tracepoint is enabled), and the detach's later closes are not the last (no grace period).
ATTACH_LOCK = Path("/run/evidence/attach.lock")  # root's tmpfs (probes.btf keeps its offsets there)
_ATTACH_WAIT = 1.0  # s a start waits for the lock at most (one close is ~40 ms), then goes on


def _attach_lock() -> int:
    ATTACH_LOCK.parent.mkdir(mode=0o755, exist_ok=True)
    return os.open(ATTACH_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)


@contextlib.contextmanager
def attaching(wait: float = _ATTACH_WAIT) -> Iterator[None]:
    """Held while probes load and attach: no evidence-detach closes a perf event meanwhile. Never
    fails a start: without the lock (not root, no /run, held past `wait`) the start goes on."""
    try:
        fd = _attach_lock()
    except OSError:
        yield
        return
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.002)
        yield
    finally:
        os.close(fd)  # the lock goes with it


def close_yielding(fds: Iterable[int], pause: float = 0.005) -> None:
    """Close perf events one by one, each while no start is attaching (ATTACH_LOCK exclusive), with
    a pause after each so that a start waiting for the lock takes it before the next close."""
    try:
        lock = _attach_lock()
    except OSError:
        lock = -1
    for fd in list(fds):
        if lock >= 0:
            with contextlib.suppress(OSError):
                fcntl.flock(lock, fcntl.LOCK_EX)
        with contextlib.suppress(OSError):
            os.close(fd)
        if lock >= 0:
            with contextlib.suppress(OSError):
                fcntl.flock(lock, fcntl.LOCK_UN)
            time.sleep(pause)


def _close_all_but(keep: set[int]) -> None:
    """Close every descriptor above 2 but `keep` (a forked child's inheritance)."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)


def _name_self(name: bytes) -> None:
    """Set this process's name (its comm, up to 15 bytes), as `ps` and /proc/PID/comm show it."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)  # PR_SET_NAME


def load_probes(rendered: Callable[[], None] | None = None) -> RecorderProbes:
    """Load the recorder's probes (from the compiled-probe cache: a few tenths of a second; compiled
    by BCC on a first start: a few seconds), or raise SetupError. `rendered`: RecorderProbes'."""
    from evidence.errors import SetupError

    try:
        return RecorderProbes(rendered=rendered)
    except Exception as e:  # BCC raises bare Exception on compile/load failures
        raise SetupError(
            f"cannot load the probes: {e}", "run `evidence doctor` to see what is missing"
        ) from e
