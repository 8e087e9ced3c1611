"""The kernel/user ABI is defined once (probes/abi.py): every layout is what a C compiler makes of
its fields with no padding of its own, the generated header declares exactly the module's
constants and structs, the BPF C declares none of them again, and the decoder and the loader read
their formats from the module."""

from __future__ import annotations

import re
import struct

import pytest

from evidence.agent.recorder import decode
from evidence.probes import abi, loader
from evidence.probes.render import ProbeConfig, join_parts, render, template
from tests.unit.test_probes_render import OFFSETS

_DEFINE = re.compile(r"^#define ([A-Z][A-Z0-9_]*) (\(?-?(?:0x[0-9a-f]+|\d+)\)?)(?:\s|$)", re.MULTILINE)
_NATIVE = {"u8": "B", "u16": "H", "u32": "I", "s32": "i", "u64": "Q", "s64": "q", "char": "c"}


def _c_int(text: str) -> int:
    text = text.strip("()")
    neg = text.startswith("-")
    text = text.lstrip("-")
    value = (
        int(text, 16)
        if text.startswith("0x")
        else int(text, 8)
        if text.startswith("0") and text != "0"
        else int(text)
    )
    return -value if neg else value


def _native(fields: tuple[abi.Field, ...]) -> list[str]:
    """The fields as native `struct` codes (the C compiler's alignment on this machine), padding
    typed as C declares it."""
    return [f"{f.length}{_NATIVE[f.ctype]}" for f in fields]


@pytest.mark.parametrize("layout", abi.LAYOUTS, ids=lambda lay: lay.name)
def test_every_layout_is_what_the_c_compiler_makes_of_it(layout: abi.Layout) -> None:
    fields = (*abi.HDR.fields, *layout.fields) if layout.header else layout.fields
    codes = _native(fields)
    widest = max((f for f in fields), key=lambda f: f.align).ctype
    # no padding of the compiler's own: the packed size is the naturally aligned size ...
    assert struct.calcsize("@" + "".join(codes) + "0" + _NATIVE[widest]) == layout.size
    # ... and every field is where the compiler would put it
    for i, f in enumerate(fields):
        if layout.header and i < len(abi.HDR.fields):
            continue
        assert struct.calcsize("@" + "".join(codes[:i]) + "0" + _NATIVE[f.ctype]) == layout.offset(f.name)
    # the Python format unpacks the named fields, padding skipped
    assert len(layout.struct.unpack(bytes(layout.struct.size))) == len(
        [f for f in layout.fields if not f.name.startswith("pad")]
    )


def test_a_layout_with_implicit_padding_is_refused() -> None:
    with pytest.raises(ValueError, match="not aligned"):
        abi.Layout("bad", (abi.Field("a", "u32"), abi.Field("b", "u64")), header=False)
    with pytest.raises(ValueError, match="multiple of its alignment"):
        abi.Layout("bad", (abi.Field("a", "u64"), abi.Field("b", "u32")), header=False)


def test_the_header_declares_exactly_the_modules_constants() -> None:
    header = abi.render_header()
    defined = {name: _c_int(value) for name, value in _DEFINE.findall(header)}
    assert len(_DEFINE.findall(header)) == len(defined)  # none twice
    assert defined == {c.macro: c.value for c in abi.CONSTANTS}
    assert len(abi.CONSTANTS) == len({c.macro for c in abi.CONSTANTS})
    for c in abi.KINDS + abi.FLAGS + abi.OTHERS:  # the module's constant of that name (PATH_MAX_: PATH_MAX)
        assert getattr(abi, c.macro.rstrip("_")) == c.value, c.macro
    assert {c.value: c.name for c in abi.CHANGES} == abi.CHANGE_OPS
    assert {c.value: c.name for c in abi.NAMESPACES} == abi.NS_OPS


def test_the_header_declares_every_layout_once_with_its_size_asserted() -> None:
    header = abi.render_header()
    assert re.findall(r"^struct (\w+) \{", header, re.MULTILINE) == [lay.name for lay in abi.LAYOUTS]
    for lay in abi.LAYOUTS:
        assert re.search(
            rf"_Static_assert\((sizeof|offsetof)\(struct {lay.name}\b[^)]*\) == {lay.size},", header
        )


def test_the_bpf_c_declares_no_abi_constant_or_struct_of_its_own() -> None:
    parts = join_parts(template()).replace(abi.render_header(), "")
    macros = {c.macro for c in abi.CONSTANTS}
    assert not [name for name, _ in _DEFINE.findall(parts) if name in macros]
    assert not [
        n
        for n in re.findall(r"^struct (\w+) \{", parts, re.MULTILINE)
        if n in {lay.name for lay in abi.LAYOUTS}
    ]
    rendered = render(ProbeConfig(offsets=OFFSETS))
    assert rendered.count(abi.render_header()) == 1


def test_kinds_are_numbered_one_to_ev_kinds_without_gaps() -> None:
    numbered = [k for k in abi.KINDS if k.name]
    assert sorted(k.value for k in numbered) == list(range(1, abi.EV_KINDS))
    assert len({k.name for k in numbered}) == len(numbered)
    assert sorted(abi.CHANGE_OPS) == list(range(1, len(abi.CHANGE_OPS) + 1))
    assert sorted(abi.NS_OPS) == list(range(1, len(abi.NS_OPS) + 1))


def test_the_decoder_and_the_loader_read_the_abi() -> None:
    for k in abi.KINDS:
        if k.name and k.value not in abi.COUNT_ONLY:
            assert getattr(decode, k.macro) == k.value and decode.KIND_NAMES[k.value] == k.name
    assert set(decode.KIND_NAMES) == {k.value for k in abi.KINDS if k.name} - abi.COUNT_ONLY
    assert decode.EV_KINDS == loader.EV_KINDS == abi.EV_KINDS
    assert loader.KIND_NAMES == abi.LOSS_NAMES
    assert decode.HDR.size == abi.HDR_SIZE and abi.OPEN_EV.size == decode.OPEN_PATH_OFF
    assert decode.CHANGE_OPS is abi.CHANGE_OPS and decode.NS_OPS is abi.NS_OPS
    assert decode.OPEN_REC.size == abi.OPEN_EV.size
    assert loader._CALL is not None and loader._CALL.size == abi.CALL.size
    assert loader._AKEY.size == abi.AKEY.size and loader._AVAL.size == abi.AVAL.size
    # the header's run and kind, where the loader reads them in a call's record
    ts, cgid, run, tgid, tid, kind, flags = range(1, 8)
    raw = abi.HDR.struct.pack(ts, cgid, run, tgid, tid, kind, flags)
    assert loader._HDR_RUN_KIND.unpack_from(raw, 0) == (run, kind)
    assert loader._AKEY_RUN.unpack_from(abi.AKEY.struct.pack(1, 2, 3, 44, 5, 6, 7, 8), 0) == (44,)


# ---- the exec check's reference (the BPF side is checked against it on real execs:
# tests/kernel/test_exec_check.py)

# SipHash-2-4 under the key 00..0f of the messages 00..(n-1): the reference implementation's
# vectors.h (Aumasson and Bernstein), its bytes as it lists them
SIPHASH_VECTORS = {
    0: "310e0edd47db6f72",
    1: "fd67dc93c539f874",
    8: "6224939a79f5f593",
    15: "e545be4961ca29a1",
    63: "724506eb4c328a95",
}


@pytest.mark.parametrize("n", sorted(SIPHASH_VECTORS))
def test_siphash24_gives_the_reference_vectors(n: int) -> None:
    got = abi.siphash24(bytes(range(16)), bytes(range(n)))
    assert got.to_bytes(8, "little").hex() == SIPHASH_VECTORS[n]


def test_siphash24_refuses_a_key_that_is_not_16_bytes() -> None:
    with pytest.raises(ValueError):
        abi.siphash24(b"short", b"")


def test_the_arg_area_is_every_argument_with_its_nul_and_an_empty_argv_gets_one() -> None:
    assert abi.arg_area([b"/bin/sh", b"-c", b""]) == b"/bin/sh\0-c\0\0"
    assert abi.arg_area([]) == b"\0"  # fs/exec.c: an empty argv is given one empty argument


def test_a_scripts_argv_is_the_kernels_rewrite() -> None:
    argv = [b"./s.sh", b"a", b"b"]
    assert abi.script_argv(b"/bin/sh", None, b"./s.sh", argv) == [b"/bin/sh", b"./s.sh", b"a", b"b"]
    assert abi.script_argv(b"/usr/bin/env", b"python3 -u", b"/dev/fd/3", argv) == [
        b"/usr/bin/env",
        b"python3 -u",
        b"/dev/fd/3",
        b"a",
        b"b",
    ]


def test_an_exec_pin_packs_as_struct_exec_pin() -> None:
    key = bytes(16)
    pin = abi.exec_pin(key, (0x801, 42), [b"/bin/true"], script=True)
    assert pin.dev == (8 << 20) | 1  # stat's 8:1 in the kernel's encoding
    assert pin.args_len == len(b"/bin/true\0")
    assert pin.argv_hash == abi.siphash24(key, b"/bin/true\0")
    assert pin.flags == abi.PIN_SCRIPT
    raw = pin.pack()
    assert len(raw) == abi.EXEC_PIN.struct.size == 32
    assert abi.EXEC_PIN.struct.unpack(raw) == (pin.dev, 42, pin.argv_hash, pin.args_len, abi.PIN_SCRIPT)


def test_an_arg_area_past_the_limit_cannot_be_pinned() -> None:
    at_limit = [b"x" * (abi.EXEC_ARGS_MAX - 1)]
    assert abi.exec_pin(bytes(16), (1, 1), at_limit).args_len == abi.EXEC_ARGS_MAX
    with pytest.raises(ValueError):
        abi.exec_pin(bytes(16), (1, 1), [b"x" * abi.EXEC_ARGS_MAX])


def test_the_hash_is_chunked_so_that_the_tail_calls_fit() -> None:
    # exec_hash_more hashes EXEC_CHUNK bytes per run, whole words, and tail-calls itself: at most
    # 33 tail calls on a chain, one spent by exec_check
    assert abi.EXEC_CHUNK % 8 == 0 and abi.EXEC_CHUNK & (abi.EXEC_CHUNK - 1) == 0
    assert abi.EXEC_ARGS_MAX % abi.EXEC_CHUNK == 0
    assert abi.EXEC_ARGS_MAX // abi.EXEC_CHUNK + 1 <= 33


def test_violation_reasons_are_bits_decoded_by_name() -> None:
    bits = list(abi.VIOLATION_REASONS)
    assert all(b & (b - 1) == 0 for b in bits) and len(set(bits)) == len(bits)
    assert {abi.VIOLATION_BIT[n] for n in abi.VIOLATION_REASONS.values()} == set(bits)
