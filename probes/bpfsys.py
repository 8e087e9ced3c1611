"""The bpf(2) layer of the compiled-probe cache: a compiled object as data (maps and instructions,
`CompiledObject`), its map references relocated, and `LoadedObject`, which creates its maps and
loads and attaches its programs with the bpf(2) and perf_event_open(2) system calls themselves,
offering the part of BCC's `BPF` interface the loaders use (`obj[b"map"]`, here a `Map` of raw
bytes, `load_func`, `attach_tracepoint`, `attach_cgroup`, `cleanup`). No BCC: objcache.py
compiles with it (once) and keeps the objects.

(About 600 lines: the bpf(2) and perf_event_open(2) calls, their attribute layouts and the map
and program objects over them are one system-call layer.)
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import ctypes
import errno
import hashlib
import json
import logging
import os
import platform
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)
FORMAT = 1  # of a CompiledObject as JSON (a cache entry)
_SYS_BPF = 321 if platform.machine() == "x86_64" else 280  # aarch64: 280
_BPF_MAP_CREATE = 0
_BPF_MAP_LOOKUP_ELEM = 1
_BPF_MAP_UPDATE_ELEM = 2
_BPF_MAP_DELETE_ELEM = 3
_BPF_MAP_GET_NEXT_KEY = 4
_BPF_PROG_LOAD = 5
_BPF_OBJ_GET_INFO_BY_FD = 15
_BPF_RAW_TRACEPOINT_OPEN = 17
_BPF_MAP_LOOKUP_BATCH = 24
_BPF_MAP_DELETE_BATCH = 27
_BPF_LINK_CREATE = 28
_BPF_PERF_EVENT = 41  # attach type: a program on a perf event, through a link (Linux 5.15)
_PROG_TYPE_TRACEPOINT = 5
_PROG_TYPE_RAW_TRACEPOINT = 17
_BPF_PROG_ATTACH = 8
_BPF_PROG_DETACH = 9
_MAP_TYPE_PERCPU = (5, 6, 10)  # per-CPU hash, array, LRU hash: one value per possible CPU
_SYS_PERF_EVENT_OPEN = 298 if platform.machine() == "x86_64" else 241
_PERF_TYPE_TRACEPOINT = 2
_PERF_FLAG_FD_CLOEXEC = 8
_PERF_EVENT_IOC_ENABLE = 0x2400
_PERF_EVENT_IOC_SET_BPF = 0x40042408
_PERF_ATTR = struct.Struct("<IIQQQQQII")  # type, size, config, sample_period, sample_type,
# read_format, flags, wakeup_events, bp_type: the head of struct perf_event_attr (the rest zero)
_PERF_ATTR_SIZE = 128
_ELEM = struct.Struct("<IIQQQ")  # map_fd, pad, key, value (or next_key), flags
_BATCH = struct.Struct("<QQQQIIQQ")  # in_batch, out_batch, keys, values, count, map_fd, elem_flags, flags
TRACEFS = Path("/sys/kernel/tracing")  # where tracepoints are named (the recorder mounts it)
_LD_IMM64 = 0x18
_PSEUDO_MAP_FD = 1
_INSN = struct.Struct("<BBhi")  # code, dst:4|src:4, off, imm
_MAP_INFO = struct.Struct("<IIIIII16s")  # type, id, key_size, value_size, max_entries, flags, name

# The verifier gives up with EAGAIN when a signal is pending for the loading thread (a SIGCHLD, a
# terminal resized, a profiler): tried again, as libbpf does, rather than failing the run and
# forgetting a good cache entry.
_LOAD_ATTEMPTS = 10
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class ObjectError(Exception):
    """The kernel refused a map or a program of the object (its message says which, and why)."""


class LoadInterrupted(ObjectError):
    """Signals kept interrupting a program's verification: not a refusal of the cached object."""


def _bpf(cmd: int, attr: ctypes.Array[ctypes.c_char]) -> int:
    ret = int(_libc.syscall(ctypes.c_long(_SYS_BPF), ctypes.c_int(cmd), attr, ctypes.c_uint(len(attr))))
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


@dataclass(frozen=True)
class MapDef:
    name: str
    type: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    key_desc: str
    leaf_desc: str


@dataclass(frozen=True)
class CompiledObject:
    """What BCC compiled: maps in order, and per function its instructions with map indexes."""

    license: str
    maps: tuple[MapDef, ...]
    functions: dict[str, bytes]

    def to_json(self) -> bytes:
        body = {
            "format": FORMAT,
            "license": self.license,
            "maps": [m.__dict__ for m in self.maps],
            "functions": {k: base64.b64encode(v).decode() for k, v in sorted(self.functions.items())},
        }
        payload = json.dumps(body, sort_keys=True, separators=(",", ":"))
        digest = hashlib.sha256(payload.encode()).hexdigest()
        return json.dumps({"sha256": digest, "object": body}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> CompiledObject:
        """Raises ValueError when the entry is not one this version wrote, whole."""
        try:
            doc = json.loads(raw)
            body = doc["object"]
            payload = json.dumps(body, sort_keys=True, separators=(",", ":"))
            if hashlib.sha256(payload.encode()).hexdigest() != doc["sha256"] or body["format"] != FORMAT:
                raise ValueError("checksum or format mismatch")
            return cls(
                license=str(body["license"]),
                maps=tuple(MapDef(**m) for m in body["maps"]),
                functions={str(k): base64.b64decode(v) for k, v in body["functions"].items()},
            )
        except (KeyError, TypeError, json.JSONDecodeError, binascii.Error) as e:
            raise ValueError(f"not a cache entry: {e}") from e


def relocate(insns: bytes, mapping: dict[int, int]) -> bytes:
    """Rewrite the immediate of every `ld_imm64` map reference (BPF_PSEUDO_MAP_FD) through
    `mapping` (descriptor -> index when storing, index -> descriptor when loading). Raises
    ValueError for a reference the mapping does not know, or any other kind of 64-bit load with a
    source (global data, BTF ids): those are not cached."""
    if len(insns) % _INSN.size:
        raise ValueError("instructions are not a whole number of 8-byte slots")
    out = bytearray(insns)
    i = 0
    n = len(insns) // _INSN.size
    while i < n:
        code, regs, off, imm = _INSN.unpack_from(out, i * _INSN.size)
        if code == _LD_IMM64:
            src = regs >> 4
            if src == _PSEUDO_MAP_FD:
                if imm not in mapping:
                    raise ValueError(f"instruction {i}: a map reference {imm} that is not in the object")
                _INSN.pack_into(out, i * _INSN.size, code, regs, off, mapping[imm])
            elif src != 0:
                raise ValueError(f"instruction {i}: a 64-bit load of kind {src}, not cacheable")
            i += 2  # ld_imm64 takes two slots
        else:
            i += 1
    return bytes(out)


def map_info(fd: int) -> tuple[int, int, int, int, int]:
    buf = ctypes.create_string_buffer(96)
    attr = ctypes.create_string_buffer(struct.pack("<IIQ", fd, len(buf), ctypes.addressof(buf)), 16)
    _bpf(_BPF_OBJ_GET_INFO_BY_FD, attr)
    mtype, _id, key, value, entries, flags, _name = _MAP_INFO.unpack_from(buf.raw, 0)
    return mtype, key, value, entries, flags


def possible_cpus() -> int:
    """How many CPUs the kernel may ever bring up (a per-CPU map holds a value for each)."""
    n = 0
    for part in Path("/sys/devices/system/cpu/possible").read_text().strip().split(","):
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return n


def _buf(data: bytes | int) -> ctypes.Array[ctypes.c_char]:
    return (
        ctypes.create_string_buffer(data)
        if isinstance(data, int)
        else ctypes.create_string_buffer(data, len(data))
    )


class Map:
    """One BPF map, read and written with bpf(2) as raw bytes (struct-packed by the caller): what
    the recorder needs of BCC's table classes, without loading BCC. For a per-CPU map, a value is
    the values of every possible CPU, each padded to 8 bytes."""

    def __init__(self, fd: int, m: MapDef) -> None:
        self.map_fd = fd
        self.name = m.name
        self.type = m.type
        self.key_size = m.key_size
        self.max_entries = m.max_entries
        percpu = m.type in _MAP_TYPE_PERCPU
        self.cpus = possible_cpus() if percpu else 1
        self.cpu_value_size = (m.value_size + 7) & ~7 if percpu else m.value_size
        self.value_size = self.cpu_value_size * self.cpus

    def _elem(
        self, cmd: int, key: bytes | None, value: ctypes.Array[ctypes.c_char] | None, flags: int = 0
    ) -> int:
        kbuf = _buf(key) if key is not None else None
        attr = _buf(
            _ELEM.pack(
                self.map_fd,
                0,
                ctypes.addressof(kbuf) if kbuf is not None else 0,
                ctypes.addressof(value) if value is not None else 0,
                flags,
            )
        )
        return _bpf(cmd, attr)

    def lookup(self, key: bytes) -> bytes | None:
        value = _buf(self.value_size)
        try:
            self._elem(_BPF_MAP_LOOKUP_ELEM, key, value)
        except FileNotFoundError:
            return None
        return value.raw[: self.value_size]

    def __getitem__(self, key: bytes) -> bytes:
        value = self.lookup(key)
        if value is None:
            raise KeyError(key)
        return value

    def __setitem__(self, key: bytes, value: bytes) -> None:
        if len(value) != self.value_size or len(key) != self.key_size:
            raise ValueError(f"map {self.name}: key or value of the wrong size")
        self._elem(_BPF_MAP_UPDATE_ELEM, key, _buf(value))

    def __delitem__(self, key: bytes) -> None:
        try:
            self._elem(_BPF_MAP_DELETE_ELEM, key, None)
        except FileNotFoundError:
            raise KeyError(key) from None

    def keys(self) -> list[bytes]:
        out: list[bytes] = []
        key: bytes | None = None
        nxt = _buf(self.key_size)
        while True:
            try:
                self._elem(_BPF_MAP_GET_NEXT_KEY, key, nxt)
            except FileNotFoundError:
                return out
            key = nxt.raw[: self.key_size]
            out.append(key)
            if len(out) > self.max_entries:  # entries deleted meanwhile can restart the walk
                return out

    def items(self) -> list[tuple[bytes, bytes]]:
        """Every (key, value), many per system call where the kernel offers batches."""
        keys, values = self.items_raw()
        ks, vs = self.key_size, self.value_size
        return [(keys[i * ks : (i + 1) * ks], values[i * vs : (i + 1) * vs]) for i in range(len(keys) // ks)]

    def items_raw(self) -> tuple[bytes, bytes]:
        """Every key and every value, each set as one string of bytes (entry i's key at i * key_size,
        its value at i * value_size), for struct.iter_unpack: many entries per system call where
        the kernel offers batches, and no bytes object per entry."""
        with contextlib.suppress(OSError):
            return self._lookup_batch()
        keys, values = [], []
        for k in self.keys():
            v = self.lookup(k)
            if v is not None:
                keys.append(k)
                values.append(v)
        return b"".join(keys), b"".join(values)

    def _lookup_batch(self) -> tuple[bytes, bytes]:
        n = max(1, min(self.max_entries, 4096, (1 << 20) // self.value_size))  # at most ~1 MiB of values
        keys, values = _buf(self.key_size * n), _buf(self.value_size * n)
        token_in, token_out = _buf(max(self.key_size, 8)), _buf(max(self.key_size, 8))
        kparts: list[bytes] = []
        vparts: list[bytes] = []
        first = True
        while True:
            attr = _buf(
                _BATCH.pack(
                    0 if first else ctypes.addressof(token_in),
                    ctypes.addressof(token_out),
                    ctypes.addressof(keys),
                    ctypes.addressof(values),
                    n,
                    self.map_fd,
                    0,
                    0,
                )
            )
            done = False
            try:
                _bpf(_BPF_MAP_LOOKUP_BATCH, attr)
            except FileNotFoundError:
                done = True  # the last batch (its count may be > 0)
            count = _BATCH.unpack_from(attr.raw, 0)[4]
            kparts.append(ctypes.string_at(keys, count * self.key_size))
            vparts.append(ctypes.string_at(values, count * self.value_size))
            if done:
                return b"".join(kparts), b"".join(vparts)
            ctypes.memmove(token_in, token_out, len(token_out))
            first = False

    def delete_many(self, keys: list[bytes] | bytes) -> None:
        """Delete `keys` (missing ones are ignored), many per system call where the kernel can:
        a list of keys, or keys one after the other in one string of bytes (as items_raw gives)."""
        raw = keys if isinstance(keys, bytes) else b"".join(keys)
        n = len(raw) // self.key_size
        if not n:
            return
        try:
            buf = _buf(raw)
            attr = _buf(_BATCH.pack(0, 0, ctypes.addressof(buf), 0, n, self.map_fd, 0, 0))
            _bpf(_BPF_MAP_DELETE_BATCH, attr)
        except OSError:
            for i in range(n):
                with contextlib.suppress(KeyError):
                    del self[raw[i * self.key_size : (i + 1) * self.key_size]]

    def clear(self) -> None:
        self.delete_many(self.keys())

    def per_cpu(self, value: bytes) -> list[bytes]:
        """A per-CPU map's value as the value of each CPU."""
        size = self.cpu_value_size
        return [value[i * size : (i + 1) * size] for i in range(self.cpus)]


@dataclass(frozen=True)
class Function:
    """A loaded program: its name and descriptor."""

    name: bytes
    fd: int


class LoadedObject:
    """The maps of a CompiledObject created in the kernel; programs loaded on demand. Offers what
    probes/loader.py uses of BCC's `BPF`: `obj[b"name"]` (a `Map`), `load_func`,
    `attach_tracepoint` and `cleanup`; BCC itself is not loaded."""

    TRACEPOINT = _PROG_TYPE_TRACEPOINT
    RAW_TRACEPOINT = _PROG_TYPE_RAW_TRACEPOINT

    def __init__(self, obj: CompiledObject, forget: Callable[[], None] | None = None) -> None:
        """`forget`: removes the cache entry `obj` came from, called when the kernel refuses it."""
        self._forget = forget
        self.raw_tracepoint_fds: dict[bytes, int] = {}
        self._obj = obj
        self._map_fds: list[int] = []
        self._tables: dict[bytes, Map] = {}
        self.funcs: dict[bytes, Function] = {}
        self.tracepoint_fds: dict[bytes, int] = {}
        self.links: list[int] = []  # a program's link to each tracepoint's perf event (detach_programs)
        try:
            for m in obj.maps:
                self._map_fds.append(self._create_map(m))
        except BaseException:
            self.cleanup()
            self._refused()
            raise
        self._index_to_fd = dict(enumerate(self._map_fds))

    @staticmethod
    def _create_map(m: MapDef) -> int:
        raw = struct.pack(
            "<IIIIIII16s",
            m.type,
            m.key_size,
            m.value_size,
            m.max_entries,
            m.flags,
            0,
            0,
            m.name[:15].encode(),
        )
        attr = ctypes.create_string_buffer(raw, 72)
        try:
            return _bpf(_BPF_MAP_CREATE, attr)
        except OSError as e:
            raise ObjectError(f"cannot create map {m.name}: {e.strerror}") from e

    def load_func(self, func_name: bytes, prog_type: int, expected_attach_type: int = 0) -> Function:
        if func_name in self.funcs:
            return self.funcs[func_name]
        code = self._obj.functions.get(func_name.decode())
        if code is None:
            raise ObjectError(f"unknown program {func_name.decode()}")
        insns = ctypes.create_string_buffer(relocate(code, self._index_to_fd), len(code))
        license = ctypes.create_string_buffer(self._obj.license.encode())
        try:
            fd = self._prog_load(func_name, prog_type, insns, license, None, expected_attach_type)
        except LoadInterrupted:
            raise  # the entry is good: kept
        except ObjectError:
            self._refused()
            raise
        fn = Function(func_name, fd)
        self.funcs[func_name] = fn
        return fn

    @staticmethod
    def _prog_load(
        name: bytes,
        prog_type: int,
        insns: ctypes.Array[ctypes.c_char],
        license: ctypes.Array[ctypes.c_char],
        log: ctypes.Array[ctypes.c_char] | None,
        expected_attach_type: int = 0,
    ) -> int:
        raw = struct.pack(
            "<IIQQIIQII16sII",
            prog_type,
            len(insns) // _INSN.size,
            ctypes.addressof(insns),
            ctypes.addressof(license),
            1 if log is not None else 0,
            len(log) if log is not None else 0,
            ctypes.addressof(log) if log is not None else 0,
            0,
            0,
            name[:15],
            0,  # prog_ifindex
            expected_attach_type,  # what a cgroup program is for (connect4, sendmsg6, ...)
        )
        attr = ctypes.create_string_buffer(raw, 128)
        try:
            for _ in range(_LOAD_ATTEMPTS):
                try:
                    return _bpf(_BPF_PROG_LOAD, attr)
                except OSError as e:
                    if e.errno != errno.EAGAIN:
                        raise
            raise LoadInterrupted(
                f"cannot load {name.decode()}: interrupted by signals {_LOAD_ATTEMPTS} times in a row"
            )
        except OSError as e:
            if log is None:  # again, with the verifier's log, to say why
                return LoadedObject._prog_load(
                    name,
                    prog_type,
                    insns,
                    license,
                    ctypes.create_string_buffer(1 << 20),
                    expected_attach_type,
                )
            tail = log.value.decode(errors="replace").strip().splitlines()[-3:]
            raise ObjectError(f"cannot load {name.decode()}: {e.strerror}: {' / '.join(tail)}") from e

    def attach_tracepoint(self, tp: bytes, fn_name: bytes) -> None:
        """Attach as BCC does: a perf event on the tracepoint (its id from tracefs), with the
        program set on it."""
        fn = self.load_func(fn_name, self.TRACEPOINT)
        category, name = tp.decode().split(":")
        try:
            tp_id = int((TRACEFS / "events" / category / name / "id").read_text())
        except (OSError, ValueError) as e:
            raise ObjectError(f"cannot attach {fn_name.decode()}: no tracepoint {tp.decode()}") from e
        attr = ctypes.create_string_buffer(
            _PERF_ATTR.pack(_PERF_TYPE_TRACEPOINT, _PERF_ATTR_SIZE, tp_id, 1, 0, 0, 0, 1, 0), _PERF_ATTR_SIZE
        )
        fd = int(
            _libc.syscall(
                ctypes.c_long(_SYS_PERF_EVENT_OPEN),
                attr,
                ctypes.c_int(-1),  # any process
                ctypes.c_int(0),  # a tracepoint's program runs on every CPU whichever is named
                ctypes.c_int(-1),
                ctypes.c_ulong(_PERF_FLAG_FD_CLOEXEC),
            )
        )
        if fd < 0:
            err = ctypes.get_errno()
            raise ObjectError(f"cannot attach {fn_name.decode()} to {tp.decode()}: {os.strerror(err)}")
        link = -1
        try:
            # the program through a link when the kernel has them: closing the link detaches it at
            # once, while closing the perf event waits for an RCU grace period (detach_programs)
            with contextlib.suppress(OSError):
                link = _bpf(
                    _BPF_LINK_CREATE,
                    ctypes.create_string_buffer(struct.pack("<IIIIQ", fn.fd, fd, _BPF_PERF_EVENT, 0, 0), 24),
                )
            requests = ((_PERF_EVENT_IOC_SET_BPF, fn.fd),) if link < 0 else ()
            for request, arg in (*requests, (_PERF_EVENT_IOC_ENABLE, 0)):
                if _libc.ioctl(ctypes.c_int(fd), ctypes.c_ulong(request), ctypes.c_int(arg)) < 0:
                    err = ctypes.get_errno()
                    raise ObjectError(
                        f"cannot attach {fn_name.decode()} to {tp.decode()}: {os.strerror(err)}"
                    )
        except BaseException:
            if link >= 0:  # the program would stay attached through it (the event is enabled)
                os.close(link)
            os.close(fd)
            raise
        if link >= 0:
            self.links.append(link)
        self.tracepoint_fds[tp] = fd

    def autoload(self) -> None:
        """Attach what BCC attaches by name when it compiles (its `_trace_autoload`):
        `tracepoint__CATEGORY__NAME` and `raw_tracepoint__NAME` functions."""
        for name in self._obj.functions:
            fn = name.encode()
            if name.startswith("tracepoint__"):
                self.attach_tracepoint(tp=fn[len(b"tracepoint__") :].replace(b"__", b":"), fn_name=fn)
            elif name.startswith("raw_tracepoint__"):
                self.attach_raw_tracepoint(tp=fn[len(b"raw_tracepoint__") :], fn_name=fn)
            elif name.split("__", 1)[0] in ("kprobe", "kretprobe", "kfunc", "kretfunc", "lsm"):
                raise ObjectError(f"{name}: the probe cache attaches tracepoints only")

    def attach_raw_tracepoint(self, tp: bytes, fn_name: bytes) -> None:
        fn = self.load_func(fn_name, _PROG_TYPE_RAW_TRACEPOINT)
        name = ctypes.create_string_buffer(tp)
        attr = ctypes.create_string_buffer(struct.pack("<QI", ctypes.addressof(name), fn.fd), 16)
        try:
            self.raw_tracepoint_fds[tp] = _bpf(_BPF_RAW_TRACEPOINT_OPEN, attr)
        except OSError as e:
            raise ObjectError(
                f"cannot attach {fn_name.decode()} to raw tracepoint {tp.decode()}: {e.strerror}"
            ) from e

    @staticmethod
    def attach_cgroup(fn: Function, cgroup_fd: int, attach_type: int, flags: int = 0) -> None:
        """Attach a cgroup program (BPF_PROG_ATTACH); it applies to the cgroup's descendants too."""
        attr = ctypes.create_string_buffer(struct.pack("<IIIII", cgroup_fd, fn.fd, attach_type, flags, 0), 20)
        _bpf(_BPF_PROG_ATTACH, attr)

    @staticmethod
    def detach_cgroup(fn: Function, cgroup_fd: int, attach_type: int) -> None:
        attr = ctypes.create_string_buffer(struct.pack("<IIIII", cgroup_fd, fn.fd, attach_type, 0, 0), 20)
        _bpf(_BPF_PROG_DETACH, attr)

    def _refused(self) -> None:
        """The kernel refused what the cache held: the next start compiles afresh."""
        if self._forget is not None:
            self._forget()
            self._forget = None

    def __getitem__(self, name: bytes) -> Map:
        if name not in self._tables:
            names = [m.name.encode() for m in self._obj.maps]
            if name not in names:
                raise KeyError(name)
            index = names.index(name)
            self._tables[name] = Map(self._map_fds[index], self._obj.maps[index])
        return self._tables[name]

    def detach_programs(self) -> None:
        """Detach the programs from their tracepoints without waiting for one grace period each:
        they stop running on every CPU within about 40 ms. The perf events stay open until
        cleanup, which waits for an RCU grace period per tracepoint, one after the other (4 s for
        the recorder's hundred and twelve here). Meanwhile no process on the machine pays for a
        program any more: in the seconds after `evidence run` exited, a loop of opens ran 30%
        slower while its probes were released, and 13% with the programs detached (what a
        registered syscall tracepoint costs every system call). Raw tracepoints (the fork
        handler) are closed here too. Without links (a kernel before 5.15) the tracepoint programs
        go with their perf events, in cleanup."""
        # raw tracepoints (the fork handler) are links of their own: closed at once as well
        links = [*self.links, *self.raw_tracepoint_fds.values()]
        self.links, self.raw_tracepoint_fds = [], {}

        def close(fd: int) -> None:
            with contextlib.suppress(OSError):
                os.close(fd)

        # each close waits for a grace period too, but not under a lock the others need: closed side
        # by side they share one (a hundred links: 40 ms, against 4 s one after the other)
        started: list[threading.Thread] = []
        try:
            for fd in links:
                thread = threading.Thread(target=close, args=(fd,), name="evidence-detach")
                thread.start()
                started.append(thread)
        finally:
            for fd in links[len(started) :]:  # no thread for it (none could be started): here
                close(fd)
            for thread in started:
                thread.join()

    def cleanup(self) -> None:
        """Detach and close everything (each detached tracepoint waits for an RCU grace period)."""
        self.detach_programs()  # the links and raw tracepoints; the perf events are left
        for fd in self.tracepoint_fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.tracepoint_fds = {}
        for fn in self.funcs.values():
            with contextlib.suppress(OSError):
                os.close(fn.fd)
        self.funcs = {}
        self._tables = {}
        for fd in self._map_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._map_fds = []
