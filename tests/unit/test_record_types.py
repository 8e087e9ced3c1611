"""The record types (agent/recorder/decode.py's raw events, bundle/record_types.py's spool records)
against the data: what the saved raw records (tests/data/raw_records.json) decode to, what the
correlator makes of them, what the spool gives back, and the bundle's data models. mypy checks the
code against the types; these tests keep the types true to what the code makes."""

from __future__ import annotations

import json
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, NotRequired, get_args, get_origin, get_type_hints

import pytest

from evidence.agent.recorder import decode as d
from evidence.agent.recorder import inventory
from evidence.agent.recorder.correlate import Correlator
from evidence.bundle import format as fmt
from evidence.bundle import record_types as rt
from evidence.bundle import records
from evidence.bundle.spool import SpoolWriter, read_spool
from evidence.policy import connect
from evidence.probes import abi

RAW = json.loads((Path(__file__).parent.parent / "data" / "raw_records.json").read_text())


def mismatch(value: Any, ann: Any) -> str | None:
    """None when `value` is of type `ann` (strictly: a bool is no int), else why not."""
    origin, args = get_origin(ann), get_args(ann)
    if ann is object:
        return None
    if ann is type(None):
        return None if value is None else f"{value!r} is not None"
    if ann in (int, str, bool, bytes):
        return None if type(value) is ann else f"{value!r} is not {ann.__name__}"
    if origin is Literal:
        return (
            None if any(type(value) is type(a) and value == a for a in args) else f"{value!r} not in {args}"
        )
    if origin in (typing.Union, types.UnionType):
        return None if any(mismatch(value, a) is None for a in args) else f"{value!r} is not {ann}"
    if origin is list:
        if type(value) is not list:
            return f"{value!r} is not a list"
        return next((m for v in value if (m := mismatch(v, args[0]))), None)
    if origin is tuple:
        if type(value) is not tuple:
            return f"{value!r} is not a tuple"
        each = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(each) != len(value):
            return f"{value!r} has not {len(each)} items"
        return next((m for v, a in zip(value, each, strict=True) if (m := mismatch(v, a))), None)
    raise TypeError(f"no check for {ann!r}")


def required_keys(td: Any) -> set[str]:
    """A TypedDict's required keys. (Its __required_keys__ counts a NotRequired[...] field as
    required when its annotation is a string, as `from __future__ import annotations` makes it.)"""
    hints = get_type_hints(td, include_extras=True)
    return {k for k in td.__required_keys__ if get_origin(hints[k]) is not NotRequired}


def problems(rec: dict[str, Any], td: Any) -> list[str]:
    """What makes `rec` not a `td` (a TypedDict): keys missing or unknown, values of another type."""
    hints = get_type_hints(td)
    out = [f"lacks {k!r}" for k in sorted(required_keys(td) - rec.keys())]
    out += [f"has unknown {k!r}" for k in sorted(rec.keys() - hints.keys())]
    out += [f"{k}: {m}" for k, v in rec.items() if k in hints and (m := mismatch(v, hints[k]))]
    return out


def kind_of(td: Any, field: str) -> str:
    (name,) = get_args(get_type_hints(td)[field])
    return str(name)


DECODED = [d.decode(bytes.fromhex(r["hex"])) for r in RAW]


def correlated() -> list[Any]:
    """The saved raw records through a correlator that names cgroups and hashes programs (so that
    those optional fields are there too), each by feed() and, for opens, by open_record()."""
    hashes = [{"sha256": "ab" * 32, "size": 10, "hash_source": "exe"}, {"not_hashed": "gone"}]

    calls = iter(range(1_000_000))

    def hash_of(pid: int, filename: str, ident: object) -> dict[str, Any]:
        return hashes[next(calls) % 2]  # each kind of answer, whatever the captured names are

    out: list[Any] = []
    for named in (False, True):
        c = Correlator(0, hash_of=hash_of, cgroup_name=(lambda cgid: "sub/job") if named else None)
        c.container_of = lambda name: "c0ffee"
        c.add_root(DECODED[0]["tgid"], 1, "/work/main")
        for ev in DECODED:
            out += c.feed(ev)
        out += c.flush()
    c = Correlator(0)
    c.add_root(DECODED[0]["tgid"], 1, "/work/main")
    for r in RAW:
        raw = bytes.fromhex(r["hex"])
        if raw[d.KIND_OFF : d.KIND_OFF + 2] == d.OPEN_KIND:
            ts, cgid, _, tgid, _, _, flags, ret, _, _, dfd, oflags, mode, _, _, plen, dino, rino = (
                d.OPEN_REC.unpack_from(raw)
            )
            path = raw[d.OPEN_PATH_OFF : d.OPEN_PATH_OFF + plen]
            out += c.open_record(
                ts, cgid, tgid, flags | d.F_OTHER_NS, ret, dfd, oflags, mode, path, dino, rino
            )
        else:
            out += c.feed(d.decode(raw))
    return out


CORRELATED = correlated()


def test_every_record_kind_has_a_raw_event_type_named_as_probes_kinds_names_it() -> None:
    assert set(d.EVENT_TYPES) == set(abi.RECORD_NAMES)
    for value, td in d.EVENT_TYPES.items():
        assert kind_of(td, "kind") == abi.RECORD_NAMES[value]


@pytest.mark.parametrize("ev", DECODED, ids=lambda ev: str(ev["kind"]))
def test_saved_raw_records_decode_to_their_kinds_type(ev: dict[str, Any]) -> None:
    (td,) = [t for t in d.EVENT_TYPES.values() if kind_of(t, "kind") == ev["kind"]]
    assert problems(ev, td) == []


def test_the_saved_raw_records_cover_the_raw_event_types() -> None:
    # fork, sigsys (a refused 32-bit call: the capture runs no seccomp filter) and exec_violation (it
    # checks no exec) are the kinds the capture has no record of: the other types are checked on real
    # data (exec_violation's in tests/kernel/test_exec_check.py)
    missing = {kind_of(t, "kind") for t in d.EVENT_TYPES.values()} - {ev["kind"] for ev in DECODED}
    assert missing == {"fork", "sigsys", "exec_violation"}
    for reason in (abi.VIOLATION_BIT["no_pin"], abi.VIOLATION_BIT["args"] | abi.VIOLATION_BIT["file"]):
        body = d._VIOLATION.pack(7, reason, 11, (8 << 20) | 1, 12, 13, 14, 15, (8 << 20) | 2, 16, 1, 0)
        violation = d.decode(d.HDR.pack(1, 2, 3, 4, 4, d.EV_EXEC_VIOLATION, 0) + body)
        assert problems(violation, d.ExecViolationEvent) == []
    fork = d.decode(d.HDR.pack(1, 2, 3, 4, 4, d.EV_FORK, 0) + d._FORK.pack(5))
    assert problems(fork, d.ForkEvent) == []
    sigsys = d.decode(d.HDR.pack(1, 2, 3, 4, 4, d.EV_SIGSYS, 0) + d._SIGSYS.pack(5, d.AUDIT_ARCH_I386, 9))
    assert problems(sigsys, d.SigsysEvent) == []


def test_correlated_records_are_of_their_kinds_type() -> None:
    assert {r["k"] for r in CORRELATED} >= {"exec", "exit", "open", "change", "connect", "dns", "namespace"}
    for rec in CORRELATED:
        assert problems(rec, rt.RECORD_TYPES[rec["k"]]) == [], rec
    # the optional fields the correlator adds were there to check
    seen = {k for r in CORRELATED for k in r}
    assert {"cgroup", "container", "mntns", "sha256", "not_hashed", "target", "target_pid", "written"} <= seen


def test_records_read_back_from_the_spool_are_of_their_kinds_type(tmp_path: Path) -> None:
    with SpoolWriter(tmp_path / "s.spool.zst") as w:
        w.write_many(CORRELATED)
    back = list(read_spool(tmp_path / "s.spool.zst"))
    assert len(back) == len(CORRELATED)
    for rec in back:  # tuples come back as lists: the types allow both
        assert problems(rec, rt.RECORD_TYPES[rec["k"]]) == [], rec


def test_a_guard_denial_and_an_inventory_record_are_of_their_types() -> None:
    guard = connect.GuardRecord(5, 1, 42, 42, 0, 443, 2, 6, 0, True, False, bytes([10, 0, 0, 1]) + bytes(12))
    assert problems(connect.to_denial(guard, ["net.allow[0]"], "deny", 7), rt.DenialRecord) == []
    info = inventory.read_process(os.getpid())
    assert info is not None and problems(dict(info), inventory.ProcessInfo) == []


def test_record_types_match_the_bundles_data_models() -> None:
    """Each record kind is its event's data (bundle/format.py) without what the writer computes,
    with `k`, `t`, the kernel's count and the fields removed before spooling."""
    assert set(rt.RECORD_TYPES) == set(records.KIND_TYPE)
    not_data = {"k", "t", "n", "tl", "_hash", "_cgid"}
    computed = {"count", "first_time", "last_time"}
    for kind, td in rt.RECORD_TYPES.items():
        model = fmt.DATA_MODELS[records.KIND_TYPE[kind]]
        fields = set(get_type_hints(td)) - not_data
        extra = fields - set(model.model_fields)
        assert extra == set(), kind
        required = {n for n, f in model.model_fields.items() if f.is_required()} - computed
        assert required <= required_keys(td), kind
