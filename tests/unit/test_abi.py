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
