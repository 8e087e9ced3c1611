"""The record kinds are defined once (probes/kinds.py): the rendered C, the decoder and the loader's
loss counts all agree with it, and the C template defines none of its own."""

from __future__ import annotations

import re

import pytest

from evidence.agent.recorder import decode
from evidence.probes import kinds, loader
from evidence.probes.render import ProbeConfig, RenderError, join_parts, render, template
from tests.unit.test_probes_render import OFFSETS

_DEFINE = re.compile(r"^#define ((?:EV|K)_[A-Z_]+) (\d+)\b", re.MULTILINE)


def test_the_template_defines_no_kind_of_its_own() -> None:
    assert _DEFINE.findall(join_parts(template())) == []
    assert join_parts(template()).count("\nRECORD_KINDS\n") == 1


def test_the_rendered_c_defines_each_kind_as_kinds_py_does() -> None:
    defined = {name: int(value) for name, value in _DEFINE.findall(render(ProbeConfig(offsets=OFFSETS)))}
    assert defined == {**{k.macro: k.value for k in kinds.KINDS}, "EV_KINDS": kinds.EV_KINDS}
    assert all(getattr(kinds, name) == value for name, value in defined.items())


def test_kinds_are_numbered_one_to_ev_kinds_without_gaps() -> None:
    assert sorted(k.value for k in kinds.KINDS) == list(range(1, kinds.EV_KINDS))
    assert len({k.name for k in kinds.KINDS}) == len(kinds.KINDS)


def test_the_decoder_and_the_loader_name_kinds_as_kinds_py_does() -> None:
    for k in kinds.KINDS:
        if k.value not in kinds.COUNT_ONLY:
            assert getattr(decode, k.macro) == k.value and decode.KIND_NAMES[k.value] == k.name
    assert set(decode.KIND_NAMES) == {k.value for k in kinds.KINDS} - kinds.COUNT_ONLY
    assert decode.EV_KINDS == loader.EV_KINDS == kinds.EV_KINDS
    assert loader.KIND_NAMES == kinds.LOSS_NAMES


def test_a_left_kinds_line_is_refused() -> None:
    source = join_parts(template()).replace("\nRECORD_KINDS\n", "\nRECORD_KINDS\nRECORD_KINDS\n", 1)
    with pytest.raises(RenderError, match="RECORD_KINDS"):
        render(ProbeConfig(offsets=OFFSETS), source)
