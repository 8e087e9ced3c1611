"""The committed JSON Schemas are current; writer output validates against them and parses with the
CloudEvents SDK; the fast data checks agree with jsonschema."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import orjson
import pydantic
import pytest
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent
from hypothesis import given, settings
from hypothesis import strategies as st

from evidence.bundle import format as fmt
from evidence.bundle import schemas
from evidence.bundle.writer import write_bundle
from tests.unit.conftest_bundles import (
    approval,
    audit,
    change,
    connect,
    denial,
    dns,
    limit,
    members,
    meta,
    namespace,
    records,
    violation,
    write,
)


def test_committed_schemas_are_up_to_date() -> None:
    generated = schemas.generate()
    committed = {p.name for p in schemas.SCHEMA_DIR.glob("*.json")}
    assert committed == set(generated), "run: python -m bundle.schemas"
    for name, schema in generated.items():
        assert (schemas.SCHEMA_DIR / name).read_text(encoding="utf-8") == schemas.render(schema), (
            f"{name} is stale: run python -m bundle.schemas"
        )


def test_every_schema_is_a_valid_draft_2020_12_schema() -> None:
    for name in schemas.generate():
        jsonschema.Draft202012Validator.check_schema(schemas.load(name))


@pytest.mark.parametrize(
    ("detail", "labels"), [("summary", {}), ("full", {}), ("summary", {"job": "7", "k8s/pod": "web"})]
)
def test_writer_output_validates_and_parses_with_the_sdk(tmp_path: Path, detail: str, labels: dict) -> None:
    recs = [
        *records(),
        connect(8500, "::1", 22, family="AF_INET6"),
        denial(8600, "/etc/shadow"),
        approval(8650, "denied", via="timeout", by_uid=None, reason="no answer in 60s"),
        limit(8660),
        violation(8670, "file", "args"),
        audit(8680),
        change(8700, "rename", "/ws/a", "/ws/b"),
        change(8800, "chmod", "/ws/b", mode=0o600),
        dns(8900, "example.org", ["192.0.2.7"]),
        dict(connect(9000, "192.0.2.7"), names=["example.org"]),
        namespace(8900, "unshare", ["CLONE_NEWNS", "CLONE_NEWUSER"]),
        namespace(8950, "mount", ["MS_BIND"], ["/ws/x", "/etc/hostname"], fstype="none", mntns="other"),
        {**change(8960, "unlink", "/ws/c"), "mntns": "other"},
        namespace(8970, "ptrace", ["PTRACE_ATTACH"], target_pid=4242, target_in_run=False, result="EPERM"),
    ]
    path = tmp_path / "a.tar.gz"
    write_bundle(
        path,
        meta(
            detail=detail,
            labels=labels,
            lost={"ringbuf": 2},
            degradations=[{"component": "landlock", "reason": "ABI 1", "impact": "no truncate"}],
        ),
        lambda: iter(recs),
    )
    manifest, lines = members(path)
    jsonschema.validate(manifest, schemas.load("manifest.schema.json"), cls=jsonschema.Draft202012Validator)
    fmt.Manifest.model_validate(manifest, strict=True)
    envelope = jsonschema.Draft202012Validator(schemas.load("event.schema.json"))
    seen = set()
    for raw in lines:
        ev = orjson.loads(raw)
        envelope.validate(ev)
        jsonschema.validate(
            ev["data"], schemas.load(f"{ev['type']}.schema.json"), cls=jsonschema.Draft202012Validator
        )
        assert schemas.DATA_CHECKERS[ev["type"]](ev["data"]) is None
        sdk = JSONFormat().read(CloudEvent, raw)
        assert sdk.get_id() == ev["id"] and sdk.get_type() == ev["type"] and sdk.get_source() == ev["source"]
        assert sdk.get_data() == ev["data"]
        assert sdk.get_extension("runid") == ev["runid"] and sdk.get_extension("seq") == ev["seq"]
        if labels:  # labels ride on every event, as one extension attribute
            assert orjson.loads(sdk.get_extension("labels")) == labels == manifest["labels"]
        else:
            assert "labels" not in ev
        seen.add(ev["type"])
    assert seen == set(fmt.DATA_MODELS) - {fmt.INVENTORY}  # the writer emits no inventory without records


def test_envelope_schema_rejects_what_the_reader_rejects(tmp_path: Path) -> None:
    _, lines = members(write(tmp_path / "a.tar.gz"))
    ev = orjson.loads(lines[1])
    v = jsonschema.Draft202012Validator(schemas.load("event.schema.json"))
    for bad in (
        {**ev, "evil": 1},
        {**ev, "seq": "1"},
        {**ev, "time": "now"},
        {**ev, "data": {**ev["data"], "pid": "x"}},
    ):
        assert not v.is_valid(bad)


# --- fast checks == jsonschema ---------------------------------------------------------------------

_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.sampled_from(
        [
            "",
            "read",
            "write",
            "AF_INET",
            "summary",
            "full",
            "kernel",
            "connect",
            "2023-11-14T22:13:20.000000000Z",
            "x",
        ]
    )
)
_value = st.recursive(
    _leaf,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.sampled_from(["a", "k"]), kids, max_size=2),
    max_leaves=6,
)


def _example(model: type[pydantic.BaseModel], data: st.DataObject) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        if not field.is_required() and data.draw(st.booleans()):
            continue
        out[name] = data.draw(_value)
    if data.draw(st.booleans()):
        out[data.draw(st.sampled_from(["extra", "pid"]))] = data.draw(_value)
    return out


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(fmt.DATA_MODELS)), st.data())
def test_fast_checks_agree_with_jsonschema_and_pydantic(etype: str, data: st.DataObject) -> None:
    model = fmt.DATA_MODELS[etype]
    value = _example(model, data)
    fast_ok = schemas.DATA_CHECKERS[etype](value) is None
    schema_ok = jsonschema.Draft202012Validator(schemas.load(f"{etype}.schema.json")).is_valid(value)
    assert fast_ok == schema_ok, value
    if fast_ok:  # pydantic (strict) accepts everything the schema does; it is laxer only on false-for-0
        model.model_validate(value, strict=True)


@pytest.mark.parametrize("etype", sorted(fmt.DATA_MODELS))
def test_fast_checks_accept_valid_examples(etype: str, tmp_path: Path) -> None:
    recs = [*records(), denial(8600, "/etc/shadow")]
    path = tmp_path / "a.tar.gz"
    write_bundle(
        path,
        meta(lost={"x": 1}, degradations=[{"component": "c", "reason": "r", "impact": "i"}]),
        lambda: iter(recs),
    )
    for raw in members(path)[1]:
        ev = orjson.loads(raw)
        if ev["type"] == etype:
            assert schemas.DATA_CHECKERS[etype](ev["data"]) is None
            assert schemas.DATA_CHECKERS[etype]({**ev["data"], "zzz": 1}) is not None


def test_python_regex_matches_ecma_end_anchor() -> None:
    rx = schemas.py_regex(schemas.TIME_PATTERN)
    assert rx.match("2023-11-14T22:13:20.000000000Z")
    assert not rx.match("2023-11-14T22:13:20.000000000Z\n")


# --- the checks specialised by shape ------------------------------------------------------------------

_TIME_OK = "2023-11-14T22:13:20.000000000Z"
_times = st.one_of(
    st.from_regex(schemas.py_regex(schemas.TIME_PATTERN)),
    st.sampled_from([_TIME_OK, _TIME_OK + "\n", _TIME_OK[:-1], "2023-11-14T22:13:20.00000000\u0663Z", ""]),
    st.builds(
        lambda i, c: _TIME_OK[:i] + c + _TIME_OK[i + 1 :],
        st.integers(min_value=0, max_value=29),
        st.characters(),
    ),
    st.integers(),
    st.none(),
)


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(
        sorted(e for e, m in fmt.DATA_MODELS.items() if schemas.TIME_FIELDS & m.model_fields.keys())
    ),
    st.data(),
    _times,
    _times,
    st.booleans(),
)
def test_time_fields_agree_with_jsonschema(
    etype: str, data: st.DataObject, first: Any, last: Any, same: bool
) -> None:
    """The second time field of a shape is accepted without the regex when it equals the first (by
    then checked): that changes nothing. Times from the pattern, near misses, equal or not."""
    value = _example(fmt.DATA_MODELS[etype], data)
    value.update(first_time=first, last_time=first if same else last)
    fast_ok = schemas.DATA_CHECKERS[etype](value) is None
    schema_ok = jsonschema.Draft202012Validator(schemas.load(f"{etype}.schema.json")).is_valid(value)
    assert fast_ok == schema_ok, value


def test_shape_checks_give_the_general_reasons() -> None:
    check = schemas.compile_checker(fmt.FileOpen)
    good = {
        "access": ["read"],
        "exe": None,
        "first_time": _TIME_OK,
        "flags": [],
        "last_time": _TIME_OK,
        "path": "/a",
        "pid": 1,
        "ppid": 0,
        "raw_path": "a",
        "result": 0,
    }
    for _ in range(2):  # the shape is learnt, then known
        assert check(good) is None
        assert check({**good, "pid": True}) == "pid: expected an integer"
        assert check({**good, "last_time": _TIME_OK + "\n"}) is not None
        assert check({**good, "first_time": "x", "last_time": "x"}) is not None
        assert check({**good, "access": ["read", 1]}) is not None
        assert check({**good, "access": [["read"]]}) is not None  # unhashable: no error, just no
        assert check({**good, "access": ["read", "bogus"]}) is not None
        assert check({**good, "access": []}) is None
        assert check(list(good)) == "is not an object"  # a list of the keys is not that shape
        assert check({k: v for k, v in good.items() if k != "pid"}) == "lacks field 'pid'"
        assert check({**good, "zzz": 1}) == "has unknown field 'zzz'"
        assert check(dict(reversed(good.items()))) is None  # any key order


def test_shapes_beyond_the_cap_are_checked_alike() -> None:
    check = schemas.compile_checker(fmt.Loss)
    for i in range(3 * schemas.MAX_SHAPES):
        assert check({"kind": "k", "count": 1, f"x{i}": 1}) == f"has unknown field 'x{i}'"
        assert check(dict(kind="k", count=i)) is None
        assert check({"count": i, "kind": i}) == "kind: expected a string"


def test_a_model_without_required_fields_accepts_the_empty_shape() -> None:
    class Optional(pydantic.BaseModel):
        a: int = 1

    check = schemas.compile_checker(Optional)
    for _ in range(2):
        assert check({}) is None
        assert check({"a": 2}) is None
        assert check({"a": "x"}) == "a: expected an integer"
        assert check({"b": 1}) == "has unknown field 'b'"
