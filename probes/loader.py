"""Compile and load the recorder probes with BCC, once per agent process.

This is the only module of probes/ that needs BCC and root. One `RecorderProbes` serves any number
of concurrent runs: a run is a slot number in the `tracked` map (cgroup id -> slot); nothing is
recompiled per run.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
from pathlib import Path
from typing import Any

from probes import btf
from probes.render import ProbeConfig, render
from probes.ringbuf import RingBuffer

logger = logging.getLogger(__name__)

TRACEFS = Path("/sys/kernel/tracing")
EV_KINDS = 12
# Syscall handlers of record.bpf.c and the syscalls each one is attached to (where they exist: open
# and creat are x86_64 legacy calls). Every one of them also gets `on_exit` on its exit tracepoint.
SYSCALL_HANDLERS = {
    "on_enter_open": ("openat", "openat2", "open", "creat"),
    "on_enter_exec": ("execve", "execveat"),
    "on_enter_connect": ("connect",),
    "on_enter_send": ("sendto", "sendmsg", "sendmmsg"),
    "on_enter_chdir": ("chdir",),
    "on_enter_fchdir": ("fchdir",),
    "on_enter_dup": ("dup", "dup2", "dup3"),
}
KIND_NAMES = [
    "none",
    "exec",
    "exec_ok",
    "fork",
    "exit",
    "open",
    "connect",
    "chdir",
    "fchdir",
    "dup",
    "ret",
    "pathfix",
]


def detect_config(**overrides: Any) -> ProbeConfig:
    """A ProbeConfig for the running kernel: BTF offsets and tracepoints that exist here."""
    events = TRACEFS / "events"
    exit_fmt = (events / "sched/sched_process_exit/format").read_text()
    values: dict[str, Any] = {
        "offsets": btf.probe_offsets(),
        "have_group_dead": "group_dead" in exit_fmt,
    }
    values.update(overrides)
    return ProbeConfig(**values)


class RecorderProbes:
    def __init__(self, config: ProbeConfig | None = None) -> None:
        from bcc import BPF  # imported here: only the recorder needs BCC

        self.config = config or detect_config()
        self.source = render(self.config)
        self.bpf = BPF(text=self.source.encode())
        self.attached: list[str] = []
        for fn, syscalls in SYSCALL_HANDLERS.items():
            for name in syscalls:
                if not (TRACEFS / "events" / "syscalls" / f"sys_enter_{name}").is_dir():
                    continue
                self.bpf.attach_tracepoint(tp=f"syscalls:sys_enter_{name}".encode(), fn_name=fn.encode())
                self.bpf.attach_tracepoint(tp=f"syscalls:sys_exit_{name}".encode(), fn_name=b"on_exit")
                self.attached.append(name)
        self._tracked = self.bpf[b"tracked"]
        self._cache = self.bpf[b"cgcache"]
        self._lost = self.bpf[b"lost"]
        self._ring: RingBuffer | None = None

    def track(self, cgroup_id: int, slot: int) -> None:
        self._tracked[ctypes.c_uint64(cgroup_id)] = ctypes.c_uint32(slot)
        self.clear_cache()

    def untrack(self, cgroup_id: int) -> None:
        with contextlib.suppress(KeyError):
            del self._tracked[ctypes.c_uint64(cgroup_id)]
        self.clear_cache()

    def clear_cache(self) -> None:
        """Forget cached cgroup -> run lookups (negative ones too), e.g. after attaching to a cgroup
        that already has descendants, or after a run ends."""
        self._cache.clear()

    def reset_lost(self, slot: int) -> None:
        for kind in range(EV_KINDS):
            self._lost[ctypes.c_int(slot * EV_KINDS + kind)] = ctypes.c_uint64(0)

    def read_lost(self, slot: int) -> dict[str, int]:
        out = {}
        for kind in range(1, EV_KINDS):
            n = self._lost[ctypes.c_int(slot * EV_KINDS + kind)].value
            if n:
                out[KIND_NAMES[kind]] = int(n)
        return out

    def ring(self) -> RingBuffer:
        """The events ring buffer, read in bulk over mmap (see probes/ringbuf.py)."""
        if self._ring is None:
            self._ring = RingBuffer(self.bpf[b"events"].map_fd, self.config.ringbuf_pages * mmap.PAGESIZE)
        return self._ring

    def close(self, background: bool = False) -> None:
        """Detach and unload. Detaching a tracepoint waits for an RCU grace period (~80 ms each here,
        about 2 s in all); with `background=True` a child process inherits the BPF descriptors and
        releases them after we are gone, so the caller does not wait (the programs do nothing
        meanwhile: no cgroup is tracked any more)."""
        if background:
            import os

            r, w = os.pipe()  # the write end stays open in this process until it exits
            pid = os.fork()
            if pid == 0:  # pragma: no cover - child
                try:
                    os.close(w)
                    devnull = os.open(os.devnull, os.O_RDWR)
                    for fd in (0, 1, 2):
                        os.dup2(devnull, fd)
                    os.setsid()
                    os.read(r, 1)  # returns at EOF: the parent is gone, its references with it
                finally:
                    os._exit(0)
            os.close(r)
            self._keepalive = w
            return
        self.bpf.cleanup()


def load_probes() -> RecorderProbes:
    """Compile and load the recorder's probes (about a second), or raise SetupError."""
    from evidence.errors import SetupError

    try:
        return RecorderProbes()
    except Exception as e:  # BCC raises bare Exception on compile/load failures
        raise SetupError(
            f"cannot load the probes: {e}", "run `evidence doctor` to see what is missing"
        ) from e
