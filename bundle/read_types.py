"""The JSON a verified bundle holds, typed for its readers: `ManifestJSON` (manifest.json) and
`EventJSON` (one line of events.ndjson), TypedDicts, so that mypy checks every key that lint, show,
diff, baseline, the attestation and `evidence profile` read.

The reader hands out plain dicts (parsed by orjson; a million events are not turned into models),
and verification guarantees these shapes first: the manifest is checked against `format.Manifest`
(strict), each event's attributes against the envelope (bundle/verify.py). So these types mirror
those definitions and add nothing: tests/unit/test_read_types.py checks that every field of
`format.Manifest` is here, required exactly when the model has no default, and that `EventJSON`'s
keys are the envelope's. An event's `data` stays a plain dict: its shape depends on the event's
type (bundle/format.py's data models, one per type).
"""

# no `from __future__ import annotations`: the classes are evaluated, so that NotRequired is seen
# at run time too (__required_keys__, which tests/unit/test_read_types.py compares with the models)
import logging
from typing import Any, Literal, NotRequired, TypedDict

logger = logging.getLogger(__name__)


class LostJSON(TypedDict):
    """manifest.lost (format.LossCounts)."""

    total: int
    by_kind: dict[str, int]


class FileJSON(TypedDict):
    """An entry of manifest.files (format.FileEntry)."""

    sha256: str
    size: int


class ArtifactFileJSON(TypedDict):
    """An entry of manifest.artifacts.files (format.ArtifactFile)."""

    name: str
    path: str
    sha256: str
    size: int
    mtime: str
    ctime: str


class ArtifactRefusalJSON(TypedDict):
    name: str
    reason: str


class ArtifactsJSON(TypedDict):
    """manifest.artifacts (format.Artifacts)."""

    workspace: str
    patterns: list[str]
    collected_at: str
    max_files: int
    max_bytes: int
    files: list[ArtifactFileJSON]
    refused: list[ArtifactRefusalJSON]
    refused_more: NotRequired[int]


class ManifestJSON(TypedDict):
    """manifest.json of a verified bundle (format.Manifest: BundleHeader + RunInfo + what the writer
    computes). A field with a default in the model may be absent (a bundle made before it)."""

    # BundleHeader
    format: Literal["evidence-bundle"]
    format_version: int
    producer: dict[str, str]
    run_id: str
    source: str
    # RunInfo
    session_id: str
    command: list[str]
    claimed_command: NotRequired[list[str] | None]
    cwd: str
    exit_code: int | None
    signal: NotRequired[str | None]
    cut_short: NotRequired[bool]
    attached_late: NotRequired[bool]
    detail: Literal["summary", "full"]
    host: dict[str, str]
    capabilities: dict[str, Any]
    headers: dict[str, Any]
    labels: NotRequired[dict[str, str]]
    policy: NotRequired[dict[str, Any] | None]
    network: NotRequired[Literal["none", "loopback"] | None]
    resolvers: NotRequired[list[str] | None]
    artifacts: NotRequired[ArtifactsJSON | None]
    # Manifest
    started_at: str
    finished_at: str
    counts: dict[str, int]
    events: int
    lost: LostJSON
    files: dict[str, FileJSON]
    root_hash: str


class EventJSON(TypedDict):
    """One event of a verified bundle: the CloudEvents envelope (bundle/verify.py checks each event
    has exactly these attributes, `labels` only when the run has labels)."""

    specversion: str
    id: str
    source: str
    type: str
    subject: str
    time: str
    datacontenttype: str
    runid: str
    seq: int
    data: dict[str, Any]  # its shape is the type's (bundle/format.py's data models)
    labels: NotRequired[str]  # the run's labels (format.labels_attribute), when it has some
