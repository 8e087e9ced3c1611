"""The compiled-probe cache's pure parts: map relocation in BPF instructions, the entry format and
its checksum, when the cache is used, refused and pruned (the compiler is a fake here; the real
compile and load are in tests/kernel/test_probe_cache.py)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from evidence.probes import objcache
from evidence.probes.bpfsys import CompiledObject, MapDef, relocate

INSN = struct.Struct("<BBhi")


def ld_map(fd: int, src: int = 1) -> bytes:
    """ld_imm64 r1, map: two slots, the source register field says what the immediate is."""
    return INSN.pack(0x18, (src << 4) | 1, 0, fd) + INSN.pack(0, 0, 0, 0)


MOV = INSN.pack(0xB7, 0, 0, 7)  # r0 = 7 (imm 7 is not a map: not touched)
EXIT = INSN.pack(0x95, 0, 0, 0)


def test_relocate_rewrites_map_references_only() -> None:
    code = ld_map(7) + MOV + ld_map(9) + ld_map(123, src=0) + EXIT
    stored = relocate(code, {7: 0, 9: 1})
    slots = [INSN.unpack_from(stored, i) for i in range(0, len(stored), 8)]
    assert slots[0][3] == 0 and slots[3][3] == 1  # the two map references became indexes
    assert slots[2] == INSN.unpack(MOV)  # an immediate 7 that is not a map stays
    assert slots[5][3] == 123  # a plain 64-bit constant stays
    assert relocate(stored, {0: 40, 1: 41}) == ld_map(40) + MOV + ld_map(41) + ld_map(123, src=0) + EXIT


def test_relocate_refuses_what_it_cannot_relocate() -> None:
    with pytest.raises(ValueError, match="not in the object"):
        relocate(ld_map(5), {7: 0})
    with pytest.raises(ValueError, match="not cacheable"):
        relocate(ld_map(0, src=2), {})  # BPF_PSEUDO_MAP_VALUE: global data
    with pytest.raises(ValueError, match="8-byte"):
        relocate(b"\0" * 12, {})


def _object(tag: str = "a") -> CompiledObject:
    m = MapDef(
        name="tracked",
        type=1,
        key_size=8,
        value_size=4,
        max_entries=4,
        flags=0,
        key_desc='"unsigned long long"',
        leaf_desc='"unsigned int"',
    )
    return CompiledObject(license="GPL", maps=(m,), functions={f"on_{tag}": ld_map(0) + EXIT})


def test_entry_round_trip_and_checksum() -> None:
    obj = _object()
    assert CompiledObject.from_json(obj.to_json()) == obj
    tampered = obj.to_json().replace(b'"GPL"', b'"MIT"')
    with pytest.raises(ValueError, match="checksum"):
        CompiledObject.from_json(tampered)
    with pytest.raises(ValueError):
        CompiledObject.from_json(b"{}")


class FakeCompiler:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, source: str) -> CompiledObject:
        self.calls.append(source)
        return _object(str(len(self.calls)))


@pytest.fixture
def compiler(monkeypatch: pytest.MonkeyPatch) -> FakeCompiler:
    fake = FakeCompiler()
    monkeypatch.setattr(objcache, "compile_object", fake)
    monkeypatch.setattr(objcache, "_bcc_version", lambda: "0.26.0")
    monkeypatch.delenv(objcache.CACHE_ENV, raising=False)
    return fake


def test_compiled_once_then_from_the_cache(tmp_path: Path, compiler: FakeCompiler) -> None:
    root = tmp_path / "cache" / "probes"
    first, hit1 = objcache.cached_object("SRC", "/h", root)
    second, hit2 = objcache.cached_object("SRC", "/h", root)
    assert (hit1, hit2) == (False, True)
    assert first == second and compiler.calls == ["SRC"]
    assert root.stat().st_mode & 0o777 == 0o700
    # another source, other headers: compiled again
    objcache.cached_object("SRC2", "/h", root)
    objcache.cached_object("SRC", "/other", root)
    assert len(compiler.calls) == 3


def test_a_bad_entry_is_replaced(tmp_path: Path, compiler: FakeCompiler) -> None:
    root = tmp_path / "probes"
    objcache.cached_object("SRC", None, root)
    (entry,) = root.glob("*.json")
    entry.write_bytes(entry.read_bytes().replace(b"GPL", b"XYZ"))
    obj, hit = objcache.cached_object("SRC", None, root)
    assert not hit and len(compiler.calls) == 2
    assert CompiledObject.from_json(entry.read_bytes()) == obj  # stored afresh
    objcache.forget("SRC", None, root)  # what a load the kernel refused does
    assert not entry.exists()


def test_not_used_when_others_can_reach_it_or_when_disabled(
    tmp_path: Path, compiler: FakeCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "open"
    root.mkdir(mode=0o700)
    os.chmod(root, 0o777)  # a directory others can write: a planted entry would be loaded as BPF
    objcache.cached_object("SRC", None, root)
    objcache.cached_object("SRC", None, root)
    assert len(compiler.calls) == 2 and not list(root.iterdir())
    shared = tmp_path / "shared"  # ours and private, but in a directory others may rename it from
    shared.mkdir()
    os.chmod(shared, 0o777)
    objcache.cached_object("SRC", None, shared / "probes")
    objcache.cached_object("SRC", None, shared / "probes")
    assert len(compiler.calls) == 4 and not list((shared / "probes").glob("*.json"))
    private = tmp_path / "private"
    monkeypatch.setenv(objcache.CACHE_ENV, "0")
    objcache.cached_object("SRC", None, private)
    assert not private.exists()


def test_pruned_to_the_newest(tmp_path: Path, compiler: FakeCompiler) -> None:
    root = tmp_path / "probes"
    for i in range(objcache.KEEP + 3):
        objcache.cached_object(f"SRC{i}", None, root)
        for n, p in enumerate(sorted(root.glob("*.json"), key=lambda p: p.stat().st_mtime)):
            os.utime(p, (n, n))  # distinct times, oldest first
        os.utime(root / f"{objcache.cache_key(f'SRC{i}', None)}.json")
    assert len(list(root.glob("*.json"))) == objcache.KEEP
    assert (root / f"{objcache.cache_key(f'SRC{objcache.KEEP + 2}', None)}.json").exists()
    assert not (root / f"{objcache.cache_key('SRC0', None)}.json").exists()


class _Loads:
    """A LoadedObject's load_func, recorded: which thread loaded what, in which order; `refuse`
    raises ObjectError for that program, as the kernel's refusal does."""

    def __init__(self, refuse: bytes | None = None) -> None:
        import threading

        self.order: list[bytes] = []
        self.threads: dict[bytes, str] = {}
        self.refuse = refuse
        self._lock = threading.Lock()

    def load_func(self, name: bytes, prog_type: int, attach_type: int = 0) -> None:
        import threading

        if name == self.refuse:
            raise objcache.ObjectError(f"cannot load {name.decode()}")
        with self._lock:
            self.order.append(name)
            self.threads[name] = threading.current_thread().name


def test_programs_load_side_by_side_largest_first_each_attached_by_its_loader() -> None:
    """Every program loaded once, whichever thread is free taking the largest left (one thread:
    exactly largest first), and `after` called on the thread that loaded it."""
    loads = _Loads()
    sizes = {b"a": 10, b"b": 300, b"c": 20, b"d": 200}
    attached: dict[bytes, str] = {}

    def after(name: bytes) -> None:
        import threading

        attached[name] = threading.current_thread().name

    programs = [(n, 5, 0) for n in sizes]
    objcache.load_side_by_side(loads, programs, 2, sizes, after=after)  # type: ignore[arg-type]
    assert sorted(loads.order) == sorted(sizes)
    assert attached == loads.threads  # each attached on the thread that loaded it
    one = _Loads()
    objcache.load_side_by_side(one, programs, 1, sizes)  # type: ignore[arg-type]
    assert one.order == [b"b", b"d", b"c", b"a"] and set(one.threads.values()) == {"MainThread"}


def test_a_refused_program_is_raised_once_every_thread_stopped() -> None:
    loads = _Loads(refuse=b"d")
    sizes = {b"a": 10, b"b": 300, b"c": 20, b"d": 200}
    with pytest.raises(objcache.ObjectError, match="cannot load d"):
        objcache.load_side_by_side(loads, [(n, 5, 0) for n in sizes], 2, sizes)  # type: ignore[arg-type]
    assert b"d" not in loads.order
