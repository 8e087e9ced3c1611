"""The run index: one small entry per run, so that listing a fleet's runs never downloads a bundle.

The entry is made from the bundle itself (its manifest, its lint counts, its digest) by the node that
recorded the run, and stored under `<node>.<session>` (bundle/fleet/names.py). `written_by` is not
the entry's word: a reader fills it from the subject the server stored the entry under, whose node
token only that node's credentials may publish (docs/deploy.md, "A fleet"), and an entry whose
`node` differs from it is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from evidence.bundle import format as fmt
from evidence.bundle.fleet import names
from evidence.errors import BundleError

ENTRY_VERSION = 1


class LintCounts(BaseModel):
    """Distinct findings by severity (bundle/lint_output.py SEVERITIES)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    error: int = Field(0, ge=0)
    warning: int = Field(0, ge=0)
    note: int = Field(0, ge=0)


class IndexEntry(BaseModel):
    """What the index says about one run: where it ran, what, when, how it ended, what lint found,
    what was lost, who signed it, and the digest its bundle must have."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    version: int = ENTRY_VERSION
    node: str
    session_id: str
    run_id: str
    labels: dict[str, str] = Field(default_factory=dict)
    command: list[str]
    started_at: str
    finished_at: str
    exit_code: int | None
    signal: str | None = None
    cut_short: bool = False
    events: int = Field(ge=0)
    lost: int = Field(ge=0)
    lint: LintCounts | None  # None: lint could not read the bundle (lint_problem says why)
    lint_problem: str | None = None
    signer_keyid: str | None = None
    bundle_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    bundle_size: int = Field(ge=0)
    # filled by the reader from the entry's subject, never stored
    written_by: str | None = None

    @model_validator(mode="after")
    def _check(self) -> IndexEntry:
        names.check_node(self.node)
        names.check_session(self.session_id)
        fmt.parse_time(self.started_at)
        fmt.parse_time(self.finished_at)
        return self

    @property
    def key(self) -> str:
        return names.run_key(self.node, self.session_id)

    @property
    def failed(self) -> bool:
        """The command did not exit 0, was killed, or the run was cut short."""
        return self.cut_short or self.signal is not None or self.exit_code != 0

    @property
    def finished_ns(self) -> int:
        return fmt.parse_time(self.finished_at)

    def to_json(self) -> bytes:
        """Canonical JSON (sorted keys, no whitespace), without `written_by`."""
        return orjson.dumps(self.model_dump(exclude={"written_by"}), option=orjson.OPT_SORT_KEYS)

    @classmethod
    def from_json(cls, data: bytes, *, key: str, written_by: str | None = None) -> IndexEntry:
        """An entry read from the index under `key`; BundleError when it is not one, or names
        another run or node than its key, or another node than the credentials that wrote it."""
        try:
            entry = cls.model_validate({**orjson.loads(data), "written_by": written_by})
        except (orjson.JSONDecodeError, ValidationError, TypeError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise BundleError(f"index entry {key}: not an index entry ({first})") from None
        if entry.key != key:
            raise BundleError(f"index entry {key}: names another run ({entry.key})")
        if written_by is not None and written_by != entry.node:
            raise BundleError(f"index entry {key}: written by node {written_by}, says node {entry.node}")
        return entry


def entry_from_manifest(
    manifest: Mapping[str, Any],
    *,
    node: str,
    sha256: str,
    size: int,
    lint: LintCounts | None,
    lint_problem: str | None = None,
    signer_keyid: str | None = None,
) -> IndexEntry:
    """The index entry of a bundle, from its manifest (read by the recorder that wrote it)."""
    lost = manifest.get("lost") or {}
    return IndexEntry(
        node=node,
        session_id=str(manifest["session_id"]),
        run_id=str(manifest["run_id"]),
        labels=dict(manifest.get("labels") or {}),
        command=list(manifest.get("command") or []),
        started_at=str(manifest["started_at"]),
        finished_at=str(manifest["finished_at"]),
        exit_code=manifest.get("exit_code"),
        signal=manifest.get("signal"),
        cut_short=bool(manifest.get("cut_short", False)),
        events=int(manifest.get("events", 0)),
        lost=int(lost.get("total", 0)) if isinstance(lost, Mapping) else 0,
        lint=lint,
        lint_problem=lint_problem,
        signer_keyid=signer_keyid,
        bundle_sha256=sha256,
        bundle_size=size,
    )
