"""The attestation of a signed bundle: an in-toto Statement v1 about the bundle and what the run
produced, in a DSSE envelope.

A signed bundle's third member, `attestation.intoto.json`, is a DSSE envelope (payloadType
`application/vnd.in-toto+json`, docs/bundle-format.md "Signatures") whose payload is a Statement:

- subjects: `manifest.json` and `events.ndjson` with the sha256 of their bytes, the run itself,
  named by its run id, with the root hash as its sha256 digest, then the run's artifacts
  (manifest.artifacts.files, named relative to the workspace: bundle/subjects.py);
- predicate: in-toto's Runtime Trace v0.2 (RUNTIME_TRACE_TYPE, bundle/runtime_trace.py), whose
  extension field `evidenceRun` is this tool's run predicate (RUN_PREDICATE, schema
  bundle/schemas/run-predicate.schema.json): what the run was, taken from the manifest by
  `predicate(manifest)`, so that a verifier can check it agrees with the manifest field by field.
  Bundles signed before the runtime trace carry the run predicate itself (predicateType
  PREDICATE_TYPE) and still verify.

Everything here is pure: building the statement and the envelope (given a `Signer`), and checking
an envelope's structure and statement against the members. The signature itself (ed25519 keys, the
keyid, checking a signature with a public key) is bundle/signing.py's.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import re
from typing import Any, Literal, Protocol, TypedDict

from pydantic import BaseModel, ConfigDict

from evidence.bundle import canonical, runtime_trace
from evidence.bundle import format as fmt
from evidence.bundle.read_types import ManifestJSON

PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://evidence.dev/attestation/run/v1"  # the run predicate's own type (older bundles)
RUNTIME_TRACE_TYPE = runtime_trace.PREDICATE_TYPE  # what the writer signs now
PREDICATE_TYPES = (RUNTIME_TRACE_TYPE, PREDICATE_TYPE)
_TRACE_KEYS = frozenset(("monitor", "monitoredProcess", "monitorLog", "metadata", "evidenceRun"))
MAX_SIGNATURES = 16
SIGNATURE_SIZE = 64  # ed25519
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_B64 = re.compile(r"[A-Za-z0-9+/]*={0,2}\Z")


class AttestationError(ValueError):
    """The attestation is malformed or disagrees with the bundle (the message says how)."""


class Signer(Protocol):
    """What signs an envelope: the keyid it puts beside its signature, and the signature over the
    DSSE pre-authentication encoding (bundle/signing.py: KeySigner, an ed25519 key)."""

    @property
    def keyid(self) -> str: ...

    def sign(self, data: bytes) -> bytes: ...


# --- the predicate -------------------------------------------------------------------------------

_FROZEN = ConfigDict(extra="forbid", frozen=True)


class PolicySummary(BaseModel):
    """The policy in force: its mode and the sha256 of the canonical JSON of manifest.policy."""

    model_config = _FROZEN
    mode: str | None
    sha256: str


class EnforcementSummary(BaseModel):
    """How the run was confined (the manifest's capabilities), and what was refused or degraded."""

    model_config = _FROZEN
    enforcement: str | None
    isolation: str | None
    denials: int
    degradations: int


class LostSummary(BaseModel):
    model_config = _FROZEN
    total: int
    byKind: dict[str, int]  # in-toto predicates use lowerCamelCase


class RunPredicate(BaseModel):
    """The predicate of a bundle's statement (PREDICATE_TYPE): the run, as its manifest says."""

    model_config = _FROZEN
    runId: str
    sessionId: str
    command: list[str]
    # the manifest's claimed_command: absent when the manifest has none (a bundle made before it)
    claimedCommand: list[str] | None = None
    cwd: str
    startedAt: str
    finishedAt: str
    exitCode: int | None
    signal: str | None
    cutShort: bool
    attachedLate: bool
    detail: Literal["summary", "full"]
    labels: dict[str, str]
    host: dict[str, str]
    kernel: str | None
    producer: dict[str, str]
    capabilities: dict[str, Any]
    lost: LostSummary
    policy: PolicySummary | None
    enforcement: EnforcementSummary
    events: int
    counts: dict[str, int]
    rootHash: str


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _list_or_none(value: Any) -> list[str] | None:
    return list(value) if isinstance(value, list) else None


class SubjectJSON(TypedDict):
    """A subject of the in-toto statement: a member or the run, with its digest."""

    name: str
    digest: dict[str, str]  # "sha256" -> lowercase hex


def predicate(manifest: ManifestJSON) -> dict[str, Any]:
    """The predicate for a (checked) manifest: a pure function of it. `claimedCommand` only when the
    manifest has `claimed_command` (null or not): a bundle signed before that field existed still
    agrees with its predicate."""
    m = manifest
    caps = m["capabilities"]
    policy = m.get("policy")
    claimed = {"claimedCommand": _list_or_none(m["claimed_command"])} if "claimed_command" in m else {}
    return {
        **claimed,
        "runId": m["run_id"],
        "sessionId": m["session_id"],
        "command": list(m["command"]),
        "cwd": m["cwd"],
        "startedAt": m["started_at"],
        "finishedAt": m["finished_at"],
        "exitCode": m["exit_code"],
        "signal": m.get("signal"),
        "cutShort": m.get("cut_short", False),
        "attachedLate": m.get("attached_late", False),
        "detail": m["detail"],
        "labels": dict(m.get("labels", {})),
        "host": dict(m["host"]),
        "kernel": _str_or_none(m["host"].get("kernel")),
        "producer": dict(m["producer"]),
        "capabilities": dict(caps),
        "lost": {"total": m["lost"]["total"], "byKind": dict(m["lost"]["by_kind"])},
        "policy": None
        if policy is None
        else {
            "mode": _str_or_none(policy.get("mode")),
            "sha256": hashlib.sha256(canonical.dumps(policy, check=False)).hexdigest(),
        },
        "enforcement": {
            "enforcement": _str_or_none(caps.get("enforcement")),
            "isolation": _str_or_none(caps.get("isolation")),
            "denials": m["counts"].get(fmt.POLICY_DENIAL, 0),
            "degradations": m["counts"].get(fmt.DEGRADATION, 0),
        },
        "events": m["events"],
        "counts": dict(m["counts"]),
        "rootHash": m["root_hash"],
    }


# --- the statement and the envelope ---------------------------------------------------------------


def subjects(
    manifest: ManifestJSON, manifest_sha256: str, events_sha256: str, *, artifacts: bool = True
) -> list[SubjectJSON]:
    """The statement's subjects, in this order: the two other members, the run, then its artifacts
    (`artifacts=False`: not them, as a statement of PREDICATE_TYPE has none)."""
    found = manifest.get("artifacts") if artifacts else None
    out: list[SubjectJSON] = [
        {"name": fmt.MANIFEST_NAME, "digest": {"sha256": manifest_sha256}},
        {"name": fmt.EVENTS_NAME, "digest": {"sha256": events_sha256}},
        {"name": manifest["run_id"], "digest": {"sha256": manifest["root_hash"]}},
    ]
    for f in found["files"] if found else ():
        out.append({"name": f["name"], "digest": {"sha256": f["sha256"]}})
    return out


def statement(
    manifest: ManifestJSON,
    manifest_sha256: str,
    events_sha256: str,
    trace: runtime_trace.Trace | None = None,
) -> dict[str, Any]:
    """The statement the writer signs: the runtime trace of the run (`trace`: fed its events; None:
    an empty monitorLog)."""
    trace = runtime_trace.Trace() if trace is None else trace
    return {
        "_type": STATEMENT_TYPE,
        "subject": subjects(manifest, manifest_sha256, events_sha256),
        "predicateType": RUNTIME_TRACE_TYPE,
        "predicate": runtime_trace.predicate(manifest, predicate(manifest), trace),
    }


def run_statement(manifest: ManifestJSON, manifest_sha256: str, events_sha256: str) -> dict[str, Any]:
    """The statement of a bundle signed before the runtime trace (PREDICATE_TYPE): still verified."""
    return {
        "_type": STATEMENT_TYPE,
        "subject": subjects(manifest, manifest_sha256, events_sha256, artifacts=False),
        "predicateType": PREDICATE_TYPE,
        "predicate": predicate(manifest),
    }


def pae(payload_type: str, body: bytes) -> bytes:
    """DSSE v1 pre-authentication encoding: what is signed."""
    t = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(body), body)


def envelope(payload: bytes, signers: list[Signer]) -> bytes:
    """The DSSE envelope (canonical JSON, standard base64) around `payload`, signed by each signer."""
    message = pae(PAYLOAD_TYPE, payload)
    sigs = [{"keyid": s.keyid, "sig": base64.b64encode(s.sign(message)).decode()} for s in signers]
    doc = {"payload": base64.b64encode(payload).decode(), "payloadType": PAYLOAD_TYPE, "signatures": sigs}
    return canonical.dumps(doc)


def member(
    manifest: ManifestJSON,
    manifest_bytes: bytes,
    events_sha256: str,
    signer: Signer,
    trace: runtime_trace.Trace | None = None,
) -> bytes:
    """The bytes of attestation.intoto.json for a bundle (what the writer adds)."""
    st = statement(manifest, hashlib.sha256(manifest_bytes).hexdigest(), events_sha256, trace)
    return envelope(canonical.dumps(st), [signer])


# --- checking ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Attestation:
    """A structurally valid envelope: its bytes, payload, statement and (keyid, signature) pairs."""

    raw: bytes
    payload_type: str
    payload: bytes
    statement: dict[str, Any]
    signatures: tuple[tuple[str, bytes], ...]

    @property
    def keyids(self) -> list[str]:
        return [k for k, _ in self.signatures]

    def signed_message(self) -> bytes:
        return pae(self.payload_type, self.payload)


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= 80 else text[:77] + "..."


def b64decode(text: Any, what: str) -> bytes:
    """Standard base64 with padding, in its one canonical form (the member is canonical, as every
    document in a bundle: the same envelope has one encoding)."""
    if not isinstance(text, str) or not _B64.match(text) or len(text) % 4:
        raise AttestationError(f"{what} is not base64")
    try:
        value = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise AttestationError(f"{what} is not base64") from None
    if base64.b64encode(value).decode() != text:
        raise AttestationError(f"{what} is not canonical base64")
    return value


def _keys(doc: Any, expected: set[str], what: str) -> None:
    if type(doc) is not dict:
        raise AttestationError(f"{what} is not a JSON object")
    missing = expected - doc.keys()
    if missing:
        raise AttestationError(f"{what} lacks {sorted(missing)[0]!r}")
    extra = doc.keys() - expected
    if extra:
        raise AttestationError(f"{what} has unknown field {_show(sorted(extra)[0])}")


def parse_envelope(raw: bytes, doc: Any, parse_payload: Any) -> Attestation:
    """Check the envelope `doc` (already parsed from `raw` as canonical JSON) and its statement
    (parsed with `parse_payload(bytes) -> value`, which enforces the JSON limits)."""
    _keys(doc, {"payload", "payloadType", "signatures"}, "the envelope")
    if doc["payloadType"] != PAYLOAD_TYPE:
        raise AttestationError(f"payloadType {_show(doc['payloadType'])} is not {PAYLOAD_TYPE!r}")
    payload = b64decode(doc["payload"], "payload")
    sigs = doc["signatures"]
    if type(sigs) is not list or not sigs:
        raise AttestationError("the envelope has no signatures")
    if len(sigs) > MAX_SIGNATURES:
        raise AttestationError(f"the envelope has more than {MAX_SIGNATURES} signatures")
    pairs: list[tuple[str, bytes]] = []
    for i, sig in enumerate(sigs):
        _keys(sig, {"keyid", "sig"}, f"signature {i}")
        keyid = sig["keyid"]
        if type(keyid) is not str or not _HEX64.match(keyid):
            raise AttestationError(f"signature {i}: keyid {_show(keyid)} is not a lowercase hex sha256")
        if any(keyid == k for k, _ in pairs):
            raise AttestationError(f"two signatures by keyid {keyid}")
        value = b64decode(sig["sig"], f"signature {i}")
        if len(value) != SIGNATURE_SIZE:
            raise AttestationError(f"signature {i} is {len(value)} bytes, not an ed25519 signature")
        pairs.append((keyid, value))
    st = parse_payload(payload)
    _keys(st, {"_type", "subject", "predicateType", "predicate"}, "the statement")
    if st["_type"] != STATEMENT_TYPE:
        raise AttestationError(f"statement _type {_show(st['_type'])} is not {STATEMENT_TYPE!r}")
    if st["predicateType"] not in PREDICATE_TYPES:
        raise AttestationError(f"predicateType {_show(st['predicateType'])} is not {RUNTIME_TRACE_TYPE!r}")
    return Attestation(raw, PAYLOAD_TYPE, payload, st, tuple(pairs))


def check_statement(
    att: Attestation, manifest: ManifestJSON, manifest_sha256: str, events_sha256: str
) -> None:
    """The statement names exactly the bundle's members, run and artifacts with their digests, and
    its predicate agrees with the manifest; raises AttestationError saying what differs. The
    runtime trace's monitorLog (made from the events by the writer) is checked for its shape only:
    `evidence verify --artifact` ties a subject to the run from the events themselves."""
    trace = att.statement["predicateType"] == RUNTIME_TRACE_TYPE
    found = att.statement["subject"]
    if type(found) is not list:
        raise AttestationError("the statement's subject is not a list")
    expected = {s["name"]: s for s in subjects(manifest, manifest_sha256, events_sha256, artifacts=trace)}
    members = {fmt.MANIFEST_NAME, fmt.EVENTS_NAME, manifest["run_id"]}
    seen: set[str] = set()
    for i, subject in enumerate(found):
        _keys(subject, {"name", "digest"}, f"subject {i}")
        name = subject["name"]
        if type(name) is not str:
            raise AttestationError(f"subject {i}: name is not a string")
        if name in seen:
            raise AttestationError(f"subject {_show(name)} is named twice")
        seen.add(name)
        want = expected.get(name)
        if want is None:
            raise AttestationError(
                f"subject {_show(name)} is not a member of the bundle, its run id or an artifact"
            )
        if subject["digest"] != want["digest"]:
            what = (
                "the run's root hash"
                if name == manifest["run_id"]
                else "the member"
                if name in members
                else "the manifest's artifact"
            )
            raise AttestationError(f"subject {_show(name)}: digest does not match {what} (tampered?)")
    missing = [n for n in expected if n not in seen]
    if missing:
        raise AttestationError(f"no subject for {_show(missing[0])}")
    got = att.statement["predicate"]
    if type(got) is not dict:
        raise AttestationError("the predicate is not a JSON object")
    run_p = predicate(manifest)
    if not trace:
        _agree(got, run_p, "")
        return
    _keys(got, set(_TRACE_KEYS), "the predicate")
    if type(got["evidenceRun"]) is not dict:
        raise AttestationError("the predicate's evidenceRun is not a JSON object")
    _agree(got["evidenceRun"], run_p, "evidenceRun.")
    for key, value in runtime_trace.from_manifest(manifest, run_p).items():
        if canonical.dumps(got[key], check=False) != canonical.dumps(value, check=False):
            raise AttestationError(f"the predicate's {key} disagrees with the manifest")
    meta = got["metadata"]
    _keys(meta, {"buildStartedOn", "buildFinishedOn", "evidenceOmitted"}, "the predicate's metadata")
    if meta["buildStartedOn"] != manifest["started_at"] or meta["buildFinishedOn"] != manifest["finished_at"]:
        raise AttestationError("the predicate's metadata disagrees with the manifest's times")
    omitted = meta["evidenceOmitted"]
    if type(omitted) is not dict or any(type(v) is not int for v in omitted.values()):
        raise AttestationError("the predicate's metadata.evidenceOmitted is not counts")
    log = got["monitorLog"]
    _keys(log, {"process", "network", "fileAccess"}, "the predicate's monitorLog")
    for key in ("process", "network", "fileAccess"):
        if type(log[key]) is not list or any(type(e) is not dict for e in log[key]):
            raise AttestationError(f"the predicate's monitorLog.{key} is not a list of objects")


def _agree(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    for key in sorted(want.keys() | got.keys()):
        if key not in got:
            raise AttestationError(f"the predicate lacks {where + key!r}")
        if key not in want:
            raise AttestationError(f"the predicate has unknown field {_show(where + key)}")
        if canonical.dumps(got[key], check=False) != canonical.dumps(want[key], check=False):
            raise AttestationError(f"the predicate's {where}{key} disagrees with the manifest")
