"""A cache of the compiled probes: compiled once with BCC, then loaded from the cache without it.

BCC compiles probes/record.bpf.c with clang on every start (1.5-2 s on a small VM, most of what
`evidence run -- true` costs). BCC 0.26 cannot load a compiled object, but what it compiles is
plain data: each function's BPF instructions and each map's definition. `compile_object` compiles
once with BCC and takes those out of it; `LoadedObject` creates the maps and loads the programs
with the bpf(2) system call itself, and offers the part of BCC's `BPF` interface the loader uses
(`obj[b"map"]`, here a `Map` of raw bytes, `load_func`, `attach_tracepoint`, `cleanup`). A start
from the cache does not load BCC at all (libbcc maps LLVM: ~60 MB of RSS).

Every start loads through `LoadedObject`, cache hit or not, so there is one way programs get into
the kernel. The only relocation is the map references: BCC writes each map's descriptor into its
`ld_imm64` instructions (BPF_PSEUDO_MAP_FD); the cache stores the map's index there instead, and
loading writes this process's descriptor back. An object with anything else to relocate (global
data) is not cached.

The cache is root's (`CACHE_DIR`, 0700, in directories only root can change), keyed by the sha256 of everything the compile depends on
(the rendered source, which holds this kernel's BTF offsets; BCC's version; the kernel release and
build; the headers BCC compiled against), and each entry carries the sha256 of its own content: an
entry that does not match, or that the kernel refuses, is removed and the probes are compiled
again. A directory that is not root's alone is not used.

The bpf(2) layer (the object as data, its relocation, maps, program loads and attachments) is
probes/bpfsys.py; this module is the cache and the one place that compiles with BCC.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import logging
import os
import stat
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from evidence.probes.bpfsys import (
    FORMAT,
    CompiledObject,
    LoadedObject,
    MapDef,
    ObjectError,
    map_info,
    relocate,
)

# the bpf(2) layer's names that users of the cache read here too
from evidence.probes.bpfsys import TRACEFS as TRACEFS
from evidence.probes.bpfsys import possible_cpus as possible_cpus

logger = logging.getLogger(__name__)

CACHE_DIR = Path("/var/cache/evidence/probes")
CACHE_ENV = "EVIDENCE_PROBE_CACHE"  # "0": never read nor write the cache
KEEP = 32  # entries kept in the cache (the recorder's, and a connect guard's per rule count)


def compile_object(source: str) -> CompiledObject:
    """Compile with BCC (the slow part) and take out the maps and functions; BCC's own copy is
    released before this returns."""
    from bcc import BPF, lib

    lib.bpf_num_tables.restype = ctypes.c_size_t
    lib.bpf_num_tables.argtypes = [ctypes.c_void_p]
    lib.bpf_table_name.restype = ctypes.c_char_p
    lib.bpf_table_name.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    for attempt in range(3):
        try:
            bpf = BPF(text=source.encode())
            break
        except Exception as e:  # BCC raises plain Exceptions; a signal in its loads: compiled again
            if attempt == 2 or os.strerror(errno.EAGAIN) not in str(e):
                raise
    try:
        module = bpf.module
        maps: list[MapDef] = []
        fd_to_index: dict[int, int] = {}
        for i in range(lib.bpf_num_tables(module)):
            name = lib.bpf_table_name(module, i)
            fd = lib.bpf_table_fd(module, name)
            mtype, key, value, entries, flags = map_info(fd)
            fd_to_index[fd] = len(maps)
            maps.append(
                MapDef(
                    name=name.decode(),
                    type=mtype,
                    key_size=key,
                    value_size=value,
                    max_entries=entries,
                    flags=flags,
                    key_desc=(lib.bpf_table_key_desc(module, name) or b"").decode(),
                    leaf_desc=(lib.bpf_table_leaf_desc(module, name) or b"").decode(),
                )
            )
        functions = {}
        for i in range(lib.bpf_num_functions(module)):
            fname = lib.bpf_function_name(module, i)
            start = lib.bpf_function_start(module, fname)
            size = lib.bpf_function_size(module, fname)
            functions[fname.decode()] = relocate(ctypes.string_at(start, size), fd_to_index)
        return CompiledObject(
            license=lib.bpf_module_license(module).decode(), maps=tuple(maps), functions=functions
        )
    finally:
        bpf.cleanup()


def _bcc_version() -> str:
    """BCC's version, read from its module's version.py without importing BCC (importing it maps
    libbcc and LLVM: tens of MB of RSS and tens of ms a start would pay for nothing on a hit)."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("bcc")
    if spec is None or not spec.submodule_search_locations:
        raise ObjectError("BCC is not installed (the Debian package python3-bpfcc)")
    for where in spec.submodule_search_locations:
        with contextlib.suppress(OSError):
            found = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", (Path(where) / "version.py").read_text())
            if found:
                return found.group(1)
    raise ObjectError("cannot tell BCC's version")


def cache_key(source: str, headers: str | None) -> str:
    uname = os.uname()
    bcc_version = _bcc_version()
    parts = [f"format {FORMAT}", f"bcc {bcc_version}", uname.release, uname.version, uname.machine]
    parts.append(f"headers {headers or ''}")
    return hashlib.sha256("\n".join([*parts, source]).encode()).hexdigest()


def _trusted_dir(path: Path) -> bool:
    """Ours (root's, for the recorder), not a symlink, nobody else may write or read it; and nobody
    else can swap it: every directory above is root's or ours, and writable by others only when
    sticky (as /tmp: there, others cannot rename what is not theirs)."""
    try:
        st = os.lstat(path)
        if not (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077):
            return False
        for parent in path.parents:
            pst = os.stat(parent)
            if pst.st_uid not in (0, os.geteuid()):
                return False
            if pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX:
                return False
    except OSError:
        return False
    return True


def _cache_dir(root: Path) -> Path | None:
    with contextlib.suppress(OSError):
        for p in reversed(root.parents[: len(root.parents) - 1]):
            p.mkdir(mode=0o755, exist_ok=True)
        root.mkdir(mode=0o700, exist_ok=True)
    return root if _trusted_dir(root) else None


def cached_object(source: str, headers: str | None, root: Path | None = None) -> tuple[CompiledObject, bool]:
    """The compiled object for `source`, from the cache when it holds it, else compiled (and
    stored, the oldest entries beyond KEEP removed). Returns (object, whether it came from the
    cache)."""
    root = root or CACHE_DIR
    use = os.environ.get(CACHE_ENV, "1") != "0"
    where = _cache_dir(root) if use else None
    entry = where / f"{cache_key(source, headers)}.json" if where is not None else None
    if entry is not None and entry.exists():
        try:
            return CompiledObject.from_json(entry.read_bytes()), True
        except (OSError, ValueError) as e:
            logger.warning("probe cache entry %s unusable (%s): compiling again", entry, e)
            with contextlib.suppress(OSError):
                entry.unlink()
    obj = compile_object(source)
    if entry is not None:
        try:
            fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(obj.to_json())
            os.replace(tmp, entry)
            _prune(entry.parent, keep=entry)
        except OSError as e:
            logger.warning("cannot store the compiled probes in %s: %s", entry.parent, e)
            with contextlib.suppress(OSError, UnboundLocalError):
                os.unlink(tmp)
    return obj, False


def _prune(where: Path, keep: Path) -> None:
    """At most KEEP entries (sources change with every probe edit and test configuration)."""
    entries = sorted(where.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in [p for p in entries if p != keep][KEEP - 1 :]:
        with contextlib.suppress(OSError):
            old.unlink()


def forget(source: str, headers: str | None, root: Path | None = None) -> None:
    """Remove the cache entry of `source` (the kernel refused what it held)."""
    with contextlib.suppress(OSError):
        ((root or CACHE_DIR) / f"{cache_key(source, headers)}.json").unlink()


def load(
    source: str,
    headers: str | None,
    root: Path | None = None,
    programs: Sequence[Program] = (),
    threads: int = 1,
    after: Callable[[LoadedObject, bytes], None] | None = None,
) -> LoadedObject:
    """The probes of `source` in the kernel: maps created, `programs` loaded (on `threads` threads:
    load_side_by_side; `after(object, name)` right after each, on the same thread: attach it), the
    functions BCC attaches by name attached; other programs are loaded as they are asked for."""
    obj, hit = cached_object(source, headers, root)
    loaded = LoadedObject(obj, forget=(lambda: forget(source, headers, root)) if hit else None)
    try:
        if programs:  # with the ones autoload attaches
            named = [
                (n.encode(), _AUTOLOAD[k], 0) for n in obj.functions for k in _AUTOLOAD if n.startswith(k)
            ]
            sizes = {name.encode(): len(code) for name, code in obj.functions.items()}
            load_side_by_side(
                loaded,
                [*programs, *named],
                threads,
                sizes,
                after=(lambda name: after(loaded, name)) if after is not None else None,
            )
        loaded.autoload()
    except BaseException:
        loaded.cleanup()
        raise
    return loaded


# what LoadedObject.autoload attaches by name: the program type of each prefix
_AUTOLOAD = {"tracepoint__": LoadedObject.TRACEPOINT, "raw_tracepoint__": LoadedObject.RAW_TRACEPOINT}
# (function name, program type, expected attach type): a program to load
Program = tuple[bytes, int, int]


def load_side_by_side(
    loaded: LoadedObject,
    programs: Sequence[Program],
    threads: int,
    sizes: Mapping[bytes, int] | None = None,
    after: Callable[[bytes], None] | None = None,
) -> None:
    """Load `programs` on `threads` threads, the largest first (`sizes`: bytes of each's code), and
    call `after(name)` on the same thread once each is loaded. Nearly all of a load is the kernel's
    verifier inside one bpf(2) call, made through ctypes with the GIL released, so on two CPUs two
    programs verify at once. The first error is raised once every thread has stopped (a program
    refused: the cache entry is forgotten, as one by one)."""
    todo = sorted(programs, key=lambda p: (sizes or {}).get(p[0], 0), reverse=True)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work() -> None:
        while True:
            with lock:
                if not todo or errors:
                    return
                name, prog_type, attach_type = todo.pop(0)
            try:
                loaded.load_func(name, prog_type, attach_type)
                if after is not None:
                    after(name)
            except BaseException as e:  # noqa: BLE001 - raised by the caller's thread below
                with lock:
                    errors.append(e)
                return

    helpers = [
        threading.Thread(target=work, name="evidence-verify", daemon=True)
        for _ in range(min(threads, len(todo)) - 1)
    ]
    for t in helpers:
        t.start()
    work()
    for t in helpers:
        t.join()
    if errors:
        raise errors[0]
