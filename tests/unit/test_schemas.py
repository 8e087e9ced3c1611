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

from bundle import format as fmt
from bundle import schemas
from bundle.writer import write_bundle
from tests.unit.conftest_bundles import connect, denial, members, meta, records, write


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
    recs = [*records(), connect(8500, "::1", 22, family="AF_INET6"), denial(8600, "/etc/shadow")]
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
