"""lint's reports: text (one line per finding), JSON, and SARIF 2.1.0 for GitHub code scanning
(GitHub workflow commands are in bundle/workflow.py). Pure: findings in, text out."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, NotRequired, TypedDict

from evidence import __version__
from evidence.bundle.text import join_lines

if TYPE_CHECKING:  # the types only: lint imports this module, not the other way round
    from evidence.bundle.lint_rules import Finding, Rule, Signature
    from evidence.bundle.read_types import ManifestJSON

SEVERITIES = ("error", "warning", "note")  # SARIF levels, most severe first
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
HELP_URI = "https://github.com/evidence-dev/evidence/blob/main/docs/bundle-format.md"


def render_text(
    path: str, manifest: ManifestJSON, findings: list[Finding], dropped: int, signature: Signature
) -> str:
    out = [
        f"{path}: verified: run {manifest['run_id']}, {manifest['events']} events, root hash {manifest['root_hash'][:16]}",
        signature.text(),
    ]
    for f in findings:
        where = f" [event {f.seq}]" if f.seq is not None else ""
        times = f" (x{f.count})" if f.count > 1 else ""
        out.append(f"{f.rule.severity:7} {f.rule.code} {f.rule.name}: {f.message}{times}{where}")
    counts = {s: sum(1 for f in findings if f.rule.severity == s) for s in SEVERITIES}
    summary = ", ".join(f"{n} {s}{'s' if n != 1 else ''}" for s, n in counts.items())
    out.append(f"{len(findings)} findings: {summary}" + (f" ({dropped} more not listed)" if dropped else ""))
    return join_lines(out)


def render_json(
    path: str,
    manifest: ManifestJSON | None,
    findings: list[Finding],
    dropped: int,
    problems: list[str],
    code: int,
    signature: Signature | None = None,
) -> str:
    doc = {
        "bundle": path,
        "verified": not problems,
        "problems": problems,
        "run_id": manifest["run_id"] if manifest else None,
        "events": manifest["events"] if manifest else None,
        "findings": [f.as_dict() for f in findings],
        "findings_not_listed": dropped,
        "exit_code": code,
        "signature": signature.as_dict() if signature is not None else None,
    }
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


# --- SARIF 2.1.0, the parts lint writes -----------------------------------------------------------


class SarifText(TypedDict):
    text: str


class SarifHelp(TypedDict):
    text: str
    markdown: str


class SarifConfiguration(TypedDict):
    level: str  # a severity (SEVERITIES)


class SarifProperties(TypedDict):
    tags: list[str]


class SarifRule(TypedDict):
    """A reportingDescriptor of the driver's rules: one lint rule."""

    id: str
    name: str
    shortDescription: SarifText
    fullDescription: SarifText
    help: SarifHelp
    helpUri: str
    defaultConfiguration: SarifConfiguration
    properties: SarifProperties


class SarifArtifactLocation(TypedDict):
    uri: str


class SarifPhysicalLocation(TypedDict):
    artifactLocation: SarifArtifactLocation


class SarifLogicalLocation(TypedDict):
    name: str  # the event's id
    fullyQualifiedName: str
    kind: str


class SarifLocation(TypedDict):
    """Where a finding is: the bundle, and the event when it is about one."""

    physicalLocation: SarifPhysicalLocation
    logicalLocations: NotRequired[list[SarifLogicalLocation]]


class SarifNotification(TypedDict):
    level: str
    message: SarifText


class SarifInvocation(TypedDict):
    executionSuccessful: bool  # the bundle verified
    toolExecutionNotifications: NotRequired[list[SarifNotification]]  # why it did not


def sarif_rules(rules: Mapping[str, Rule]) -> list[SarifRule]:
    return [
        {
            "id": r.code,
            "name": r.name,
            "shortDescription": {"text": r.short},
            "fullDescription": {"text": r.explain},
            "help": {"text": r.explain, "markdown": f"**{r.code} {r.name}**\n\n{r.explain}"},
            "helpUri": f"{HELP_URI}#lint-rules",
            "defaultConfiguration": {"level": r.severity},
            "properties": {"tags": ["evidence", "security"] if r.severity == "error" else ["evidence"]},
        }
        for r in rules.values()
    ]


def render_sarif(path: str, findings: list[Finding], problems: list[str], rules: Mapping[str, Rule]) -> str:
    uri = path.lstrip("/") if path.startswith("/") else path
    results = []
    for f in findings:
        loc: SarifLocation = {"physicalLocation": {"artifactLocation": {"uri": uri}}}
        if f.event_id is not None:
            loc["logicalLocations"] = [
                {"name": f.event_id, "fullyQualifiedName": f"{path}#{f.event_id}", "kind": "object"}
            ]
        results.append(
            {
                "ruleId": f.rule.code,
                "ruleIndex": list(rules).index(f.rule.code),
                "level": f.rule.severity,
                "message": {"text": f.message + (f" (x{f.count})" if f.count > 1 else "")},
                "locations": [loc],
                "partialFingerprints": {"evidenceFinding/v1": f.fingerprint},
            }
        )
    invocation: SarifInvocation = {"executionSuccessful": not problems}
    if problems:
        invocation["toolExecutionNotifications"] = [
            {"level": "error", "message": {"text": p}} for p in problems
        ]
    doc = {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "evidence-lint",
                        "version": __version__,
                        "semanticVersion": __version__,
                        "informationUri": HELP_URI,
                        "rules": sarif_rules(rules),
                    }
                },
                "invocations": [invocation],
                "results": results,
            }
        ],
    }
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
