"""JSON Schemas for the bundle, and fast data checks, both derived from the models in bundle/format.py.

`python -m bundle.schemas` (re)writes bundle/schemas/*.json:
- manifest.schema.json: manifest.json (format.Manifest);
- event.schema.json: one line of events.ndjson, the CloudEvent envelope with its `runid` and `seq`
  extension attributes, whose `data` must match the schema of its `type`;
- <type>.schema.json (e.g. dev.evidence.file.open.schema.json): the `data` of each event type;
- run-predicate.schema.json: the predicate of a signed bundle's in-toto statement
  (attestation.RunPredicate, predicateType attestation.PREDICATE_TYPE).

A unit test checks that the committed files equal what this module generates.

`compile_checker(model)` turns a data model into a plain function that checks a decoded JSON value
the way the JSON Schema does (strict types: a bool is not an integer, no floats) but some twenty
times faster than pydantic, which matters when a bundle holds a million events. Tests prove it
agrees with jsonschema over generated values.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel

from evidence.bundle import attestation
from evidence.bundle import format as fmt

logger = logging.getLogger(__name__)

SCHEMA_DIR = Path(__file__).with_name("schemas")
DRAFT = "https://json-schema.org/draft/2020-12/schema"
_ID_BASE = "urn:evidence:schema:v1:"

# RFC 3339 UTC with exactly nine fraction digits, as format.format_time writes it.
TIME_PATTERN = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{9}Z$"
HEX64_PATTERN = r"^[0-9a-f]{64}$"
RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
TIME_FIELDS = frozenset({"first_time", "last_time", "requested_at"})  # data fields that hold a time

Checker = Callable[[Any], str | None]


def py_regex(pattern: str) -> re.Pattern[str]:
    """A JSON Schema (ECMA 262) pattern anchored with ^...$ as a Python regex: Python's `$` also
    matches before a final newline, ECMA's does not."""
    return re.compile(pattern.removesuffix("$") + r"\Z" if pattern.endswith("$") else pattern)


# --- JSON Schemas -----------------------------------------------------------------------------


def _data_schema(etype: str, model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema()
    for name in TIME_FIELDS & schema["properties"].keys():
        schema["properties"][name]["pattern"] = TIME_PATTERN
    if "$defs" in schema:  # keeps event.schema.json self-contained; no data model nests another
        raise ValueError(f"{model.__name__} nests models; event.schema.json cannot embed it")
    return {"$schema": DRAFT, "$id": f"{_ID_BASE}{etype}", **schema}


def _envelope_schema(data_schemas: dict[str, dict[str, Any]]) -> dict[str, Any]:
    string = {"type": "string", "minLength": 1}
    defs = {}
    branches = []
    for etype, schema in data_schemas.items():
        name = etype.removeprefix(fmt.TYPE_PREFIX).replace(".", "_")
        defs[name] = {k: v for k, v in schema.items() if k not in ("$schema", "$id")}
        branches.append(
            {
                "if": {"properties": {"type": {"const": etype}}},
                "then": {"properties": {"data": {"$ref": f"#/$defs/{name}"}}},
            }
        )
    return {
        "$schema": DRAFT,
        "$id": f"{_ID_BASE}event",
        "title": "Evidence event (CloudEvents 1.0, structured JSON)",
        "type": "object",
        "additionalProperties": False,
        "required": [
            "specversion",
            "id",
            "source",
            "type",
            "subject",
            "time",
            "datacontenttype",
            "runid",
            "seq",
            "data",
        ],
        "properties": {
            "specversion": {"const": fmt.SPECVERSION},
            "id": {**string, "description": "'{runid}:{seq}'"},
            "source": {**string, "description": "'urn:evidence:run:{runid}'"},
            "type": {"enum": list(data_schemas)},
            "subject": {"type": "string"},
            "time": {"type": "string", "pattern": TIME_PATTERN},
            "datacontenttype": {"const": fmt.DATACONTENTTYPE},
            "runid": {"type": "string", "pattern": RUN_ID_PATTERN},
            "seq": {"type": "integer", "minimum": 0},
            "labels": {
                "type": "string",
                "description": "present when the run has labels: the canonical JSON of the manifest's labels",
            },
            "data": {"type": "object"},
        },
        "allOf": branches,
        "$defs": defs,
    }


def _manifest_schema() -> dict[str, Any]:
    schema = fmt.Manifest.model_json_schema()
    props = schema["properties"]
    props["root_hash"]["pattern"] = HEX64_PATTERN
    props["run_id"]["pattern"] = RUN_ID_PATTERN
    props["started_at"]["pattern"] = TIME_PATTERN
    props["finished_at"]["pattern"] = TIME_PATTERN
    schema["$defs"]["FileEntry"]["properties"]["sha256"]["pattern"] = HEX64_PATTERN
    return {"$schema": DRAFT, "$id": f"{_ID_BASE}manifest", **schema}


def _predicate_schema() -> dict[str, Any]:
    schema = attestation.RunPredicate.model_json_schema()
    props = schema["properties"]
    props["rootHash"]["pattern"] = HEX64_PATTERN
    props["runId"]["pattern"] = RUN_ID_PATTERN
    props["startedAt"]["pattern"] = TIME_PATTERN
    props["finishedAt"]["pattern"] = TIME_PATTERN
    schema["$defs"]["PolicySummary"]["properties"]["sha256"]["pattern"] = HEX64_PATTERN
    return {"$schema": DRAFT, "$id": attestation.PREDICATE_TYPE, **schema}


def generate() -> dict[str, dict[str, Any]]:
    """file name -> schema, for every file under bundle/schemas/."""
    data = {etype: _data_schema(etype, model) for etype, model in fmt.DATA_MODELS.items()}
    out = {
        "manifest.schema.json": _manifest_schema(),
        "event.schema.json": _envelope_schema(data),
        "run-predicate.schema.json": _predicate_schema(),
    }
    out.update({f"{etype}.schema.json": schema for etype, schema in data.items()})
    return out


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def load(name: str) -> dict[str, Any]:
    """A committed schema by file name (e.g. 'event.schema.json')."""
    result: dict[str, Any] = json.loads((SCHEMA_DIR / name).read_text(encoding="utf-8"))
    return result


def write(directory: Path = SCHEMA_DIR) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, schema in generate().items():
        path = directory / name
        path.write_text(render(schema), encoding="utf-8")
        written.append(path)
    return written


# --- fast checks ------------------------------------------------------------------------------


def _describe(ann: Any) -> str:
    origin = get_origin(ann)
    if ann is str:
        return "a string"
    if ann is int:
        return "an integer"
    if ann is bool:
        return "a boolean"
    if ann is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(json.dumps(a) for a in get_args(ann))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(ann))
    if origin is list:
        return f"a list of ({_describe(get_args(ann)[0])})"
    if origin is dict:
        return f"an object of ({_describe(get_args(ann)[1])})"
    raise TypeError(f"no fast check for {ann!r}")


def _expr(ann: Any, var: str, depth: int = 0) -> str:
    """A Python expression that is true when `var` matches `ann` exactly as JSON Schema would."""
    origin = get_origin(ann)
    if ann is str:
        return f"type({var}) is str"
    if ann is int:
        return f"type({var}) is int"
    if ann is bool:
        return f"type({var}) is bool"
    if ann is type(None):
        return f"{var} is None"
    if origin is Literal:
        parts = []
        for a in get_args(ann):
            if type(a) not in (str, int, bool):
                raise TypeError(f"no fast check for literal {a!r}")
            parts.append(f"(type({var}) is {type(a).__name__} and {var} == {a!r})")
        return "(" + " or ".join(parts) + ")"
    if origin in (typing.Union, types.UnionType):
        return "(" + " or ".join(_expr(a, var, depth) for a in get_args(ann)) + ")"
    item = f"_x{depth}"
    if origin is list and get_args(ann)[0] in (str, int, bool):  # the common case, made fast
        return f"(type({var}) is list and ONLY_{get_args(ann)[0].__name__}.issuperset(map(type, {var})))"
    if (
        origin is list
        and get_origin(get_args(ann)[0]) is Literal
        and all(type(a) is str for a in get_args(get_args(ann)[0]))
    ):  # a list of string literals: all strings (hence hashable), and each one of the literals
        name = _constant(frozenset(get_args(get_args(ann)[0])))
        return f"(type({var}) is list and ONLY_str.issuperset(map(type, {var})) and {name}.issuperset({var}))"
    if origin is list:
        inner = _expr(get_args(ann)[0], item, depth + 1)
        return f"(type({var}) is list and all({inner} for {item} in {var}))"
    if origin is dict:
        key, value = get_args(ann)
        if key is not str:
            raise TypeError(f"no fast check for {ann!r}")
        inner = _expr(value, item, depth + 1)
        return (
            f"(type({var}) is dict and all(type(_k{depth}) is str for _k{depth} in {var}) "
            f"and all({inner} for {item} in {var}.values()))"
        )
    raise TypeError(f"no fast check for {ann!r}")


# constants the generated checks name (frozensets built once, not on every call)
_CONSTANTS: dict[str, Any] = {
    "ONLY_str": frozenset((str,)),
    "ONLY_int": frozenset((int,)),
    "ONLY_bool": frozenset((bool,)),
}


def _constant(value: frozenset[Any]) -> str:
    """The name under which the generated checks see `value`."""
    for name, known in _CONSTANTS.items():
        if known == value:
            return name
    name = f"CONST_{len(_CONSTANTS)}"
    _CONSTANTS[name] = value
    return name


MAX_SHAPES = 64  # key tuples remembered per checker (a hostile bundle may show any number)


def compile_checker(model: type[BaseModel]) -> Checker:
    """A function data -> None when `data` is a valid instance of `model`, else a one-line reason.

    Supported field types: str, int, bool, None, Literal of those, unions, list[...] and
    dict[str, ...] of supported types. Anything else raises TypeError when compiling.

    The general check looks the fields up one by one. As the keys of canonical JSON come sorted,
    the objects of one type come in few shapes (exact key tuples): for each shape seen (up to
    MAX_SHAPES) a function is generated that unpacks the values in that order and tests them all in
    one expression (no set operations on the keys, no lookups). It only says "valid": whenever it
    does not, or the shape is not a valid one, the general check runs and gives the reason."""
    fields = model.model_fields
    required = [n for n, f in fields.items() if f.is_required()]
    optional = [n for n, f in fields.items() if not f.is_required()]
    lines = [
        "def general(d):",
        "    if type(d) is not dict:",
        "        return 'is not an object'",
        "    keys = d.keys()",
        "    if not (REQUIRED <= keys):",
        "        return 'lacks field ' + repr(sorted(REQUIRED - keys)[0])",
        "    if not (keys <= ALLOWED):",
        "        return 'has unknown field ' + repr(sorted(keys - ALLOWED)[0])",
    ]
    for name, field in fields.items():
        ann = field.annotation
        why = f"{name}: expected {_describe(ann)}"
        test = _field_test(name, ann, "v")
        if name in TIME_FIELDS:
            why = f"{name}: expected an RFC 3339 UTC time with nine fraction digits"
        if name in required:
            lines.append(f"    v = d[{name!r}]")
            lines.append(f"    if not {test}:")
        else:
            lines.append(f"    v = d.get({name!r}, MISSING)")
            lines.append(f"    if v is not MISSING and not {test}:")
        lines.append(f"        return {why!r}")
    lines.append("    return None")
    lines += [
        "def check(d):",
        "    if type(d) is dict:",
        "        shape = tuple(d)",
        "        valid = SHAPES.get(shape)",
        "        if valid is None:",
        "            valid = learn(shape)",
        "        if valid(d):",
        "            return None",
        "    return general(d)",
    ]
    namespace: dict[str, Any] = {
        "REQUIRED": frozenset(required),
        "ALLOWED": frozenset(required + optional),
        "MISSING": object(),
        "TIME": py_regex(TIME_PATTERN).match,
    }
    shapes: dict[tuple[Any, ...], Callable[[dict[str, Any]], bool]] = {}

    def never(d: dict[str, Any]) -> bool:
        return False

    def learn(shape: tuple[Any, ...]) -> Callable[[dict[str, Any]], bool]:
        """The "valid" test for dicts whose keys are exactly `shape`, in this order."""
        if len(shapes) >= MAX_SHAPES:  # no room: the general check, no code compiled for a shape not kept
            return never
        if not (namespace["REQUIRED"] <= set(shape) <= namespace["ALLOWED"]):
            valid = never  # the general check says what is wrong
        else:
            names = [f"v{i}" for i in range(len(shape))]
            var = dict(zip(shape, names, strict=True))
            terms = []
            known_time = None  # a time field tested before (true by then, as `and` goes left to right)
            for k, f in fields.items():
                if k not in var:
                    continue
                if k in TIME_FIELDS and known_time is not None:  # often the same time again
                    v = var[k]
                    terms.append(f"(type({v}) is str and ({v} == {known_time} or TIME({v}) is not None))")
                else:
                    terms.append(_field_test(k, f.annotation, var[k]))
                if k in TIME_FIELDS:
                    known_time = var[k]
            unpack = f"    ({', '.join(names)},) = d.values()\n" if names else ""
            src = f"def valid(d):\n{unpack}    return {' and '.join(terms) or 'True'}\n"
            ns = {"TIME": namespace["TIME"], **_CONSTANTS}
            exec(compile(src, f"<check {model.__name__} {shape!r}>", "exec"), ns)  # noqa: S102
            valid = ns["valid"]
        if len(shapes) < MAX_SHAPES:
            shapes[shape] = valid
        return valid

    namespace["SHAPES"] = shapes
    namespace["learn"] = learn
    namespace.update(_CONSTANTS)
    exec(compile("\n".join(lines), f"<check {model.__name__}>", "exec"), namespace)  # noqa: S102
    checker: Checker = namespace["check"]
    return checker


def _field_test(name: str, ann: Any, var: str) -> str:
    """An expression that is true when `var`, the value of field `name`, is valid."""
    test = _expr(ann, var)
    if name in TIME_FIELDS:
        if ann is not str:
            raise TypeError(f"time field {name} is not a string")
        test = f"({test} and TIME({var}) is not None)"
    return test


DATA_CHECKERS: dict[str, Checker] = {etype: compile_checker(m) for etype, m in fmt.DATA_MODELS.items()}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    directory = Path(args[0]) if args else SCHEMA_DIR
    for path in write(directory):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
