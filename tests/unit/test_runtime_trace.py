"""The signed statement is an in-toto Runtime Trace v0.2 (bundle/runtime_trace.py) whose subjects
include the run's artifacts, each tied to the writes that made it (bundle/provenance.py): checked
with the in-toto-attestation package's models (an independent implementation) and a JSON Schema of
the v0.2 predicate written from the spec; bounded in size for a run that read 100k files; a subject
the run did not write is marked so, is a lint finding, and `verify --artifact` refuses it."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any

import jsonschema
import orjson
import pytest
from google.protobuf import json_format
from in_toto_attestation.v1 import resource_descriptor_pb2, statement_pb2
from in_toto_attestation.v1.resource_descriptor import ResourceDescriptor
from in_toto_attestation.v1.statement import Statement

from evidence.bundle import attestation, provenance, runtime_trace, signing
from evidence.bundle import format as fmt
from evidence.bundle.writer import write_bundle
from evidence.cli import main
from tests.unit.conftest_bundles import T0, WS, change, connect, dns, exec_, meta, open_

# https://github.com/in-toto/attestation/blob/main/spec/predicates/runtime-trace.md (v0.2), as a
# JSON Schema: required fields, the recommended network entry shape, ResourceDescriptors
_RD = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "uri": {"type": "string"},
        "digest": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object"},
    },
    "anyOf": [{"required": ["name"]}, {"required": ["uri"]}, {"required": ["digest"]}],
}
RUNTIME_TRACE_V0_2 = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["monitor", "monitoredProcess", "monitorLog"],
    "properties": {
        "monitor": {
            "type": "object",
            "required": ["type"],
            "properties": {
                "type": {"type": "string", "format": "uri"},
                "configSource": _RD,
                "tracePolicy": {"type": "object"},
            },
        },
        "monitoredProcess": {
            "type": "object",
            "required": ["hostID", "type", "event"],
            "properties": {
                "hostID": {"type": "string"},
                "type": {"type": "string"},
                "event": {"type": "string"},
            },
        },
        "monitorLog": {
            "type": "object",
            "anyOf": [{"required": ["process"]}, {"required": ["network"]}, {"required": ["fileAccess"]}],
            "properties": {
                "process": {"type": "array", "items": {"type": "object"}},
                "network": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "anyOf": [{"required": ["ip"]}, {"required": ["hostname"]}],
                        "properties": {
                            "ip": {"type": "string"},
                            "hostname": {"type": "string"},
                            "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                            "protocol": {"type": "string", "pattern": "^[a-z]+$"},
                            "invokingProcess": {"type": "object"},
                        },
                    },
                },
                "fileAccess": {"type": "array", "items": _RD},
            },
        },
        "metadata": {
            "type": "object",
            "properties": {
                "buildStartedOn": {"type": "string", "format": "date-time"},
                "buildFinishedOn": {"type": "string", "format": "date-time"},
            },
        },
    },
}

CC_SHA = "c" * 64
APP = f"{WS}/app"


def artifact(name: str, ctime_s: float = 3.0, sha: str = "a" * 64) -> fmt.ArtifactFile:
    t = fmt.format_time(T0 + int(ctime_s * 1e9))
    return fmt.ArtifactFile(name=name, path=f"{WS}/{name}", sha256=sha, size=10, mtime=t, ctime=t)


def artifacts(*files: fmt.ArtifactFile, refused: list[fmt.ArtifactRefusal] | None = None) -> fmt.Artifacts:
    return fmt.Artifacts(
        workspace=WS,
        patterns=["*"],
        collected_at=fmt.format_time(T0 + 5_000_000_000),
        max_files=1000,
        max_bytes=1 << 32,
        files=list(files),
        refused=refused or [],
    )


def build_records() -> list[dict[str, Any]]:
    cc = exec_(100, 101, 100, "/usr/bin/cc", ["cc", "-o", "app", "app.c"])
    cc["sha256"] = CC_SHA
    ld = exec_(200, 102, 101, "/usr/bin/ld", ["ld", "-o", "/tmp/x"])
    ld["sha256"] = "d" * 64
    return [
        cc,
        open_(150, f"{WS}/app.c", ["read"], pid=101, exe="/usr/bin/cc"),
        open_(300, APP, ["write", "create"], pid=101, exe="/usr/bin/cc"),
        ld,
        open_(400, "/tmp/x", ["write", "create"], pid=102, exe="/usr/bin/ld"),
        change(500, "rename", "/tmp/x", f"{WS}/moved", pid=102, exe="/usr/bin/ld"),
        change(600, "rename", "/etc/hostname", f"{WS}/stolen", pid=101),
        dns(700, "example.org", ["93.184.216.34"]),
        {**connect(800, "93.184.216.34"), "names": ["example.org"]},
    ]


def signed(
    tmp_path: Path, recs: list[dict[str, Any]], arts: fmt.Artifacts | None, **over: Any
) -> tuple[Path, Path]:
    private, public, _ = signing.generate(tmp_path / "key")
    path = tmp_path / "run.tar.gz"
    write_bundle(path, meta(artifacts=arts, **over), lambda: iter(recs), signer=signing.load_signer(private))
    return path, public


def statement_of(path: Path) -> dict[str, Any]:
    import tarfile

    with tarfile.open(path, "r:gz") as tar:
        f = tar.extractfile(fmt.ATTESTATION_NAME)
        assert f is not None
        env = orjson.loads(f.read())
    st: dict[str, Any] = orjson.loads(base64.b64decode(env["payload"]))
    return st


def test_the_statement_is_a_runtime_trace_with_the_artifacts_as_subjects(tmp_path: Path) -> None:
    arts = artifacts(artifact("app"), artifact("moved"), artifact("stolen"), artifact("old.txt"))
    path, _ = signed(
        tmp_path, build_records(), arts, labels={"github/repository": "o/r", "github/run": "42.2"}
    )
    st = statement_of(path)
    assert st["predicateType"] == "https://in-toto.io/attestation/runtime-trace/v0.2"
    assert [s["name"] for s in st["subject"]][3:] == ["app", "moved", "stolen", "old.txt"]
    # the in-toto-attestation package's own models accept it
    pb = json_format.ParseDict(st, statement_pb2.Statement())
    Statement.copy_from_pb(pb).validate()
    p = st["predicate"]
    jsonschema.validate(p, RUNTIME_TRACE_V0_2, cls=jsonschema.Draft202012Validator)
    for rd in p["monitorLog"]["fileAccess"]:
        ResourceDescriptor.copy_from_pb(
            json_format.ParseDict(rd, resource_descriptor_pb2.ResourceDescriptor())
        ).validate()
    assert p["monitoredProcess"] == {
        "hostID": "https://github.com",
        "type": "https://actions.github.io/buildtypes/workflow/v1",
        "event": "https://github.com/o/r/actions/runs/42/attempts/2",
    }
    assert p["monitor"]["type"].startswith(runtime_trace.MONITOR_URI)
    assert p["monitor"]["tracePolicy"]["detail"] == "summary"
    assert [e["processBinary"] for e in p["monitorLog"]["process"]] == ["/usr/bin/cc", "/usr/bin/ld"]
    net = p["monitorLog"]["network"]
    assert {"ip": "93.184.216.34", "port": 443, "hostname": "example.org"}.items() <= net[-1].items()
    assert net[-1]["invokingProcess"]["pid"] == 102
    subjects = {rd["annotations"]["subject"]: rd["annotations"] for rd in p["monitorLog"]["fileAccess"][:4]}
    app = subjects["app"]
    assert app["writtenByRun"] and app["how"] == "written"
    assert app["writer"] == {"pid": 101, "program": "/usr/bin/cc", "sha256": CC_SHA}
    moved = subjects["moved"]
    assert moved["writtenByRun"] and moved["how"] == "renamed" and moved["renamedFrom"] == "/tmp/x"
    assert moved["writer"]["program"] == "/usr/bin/ld"
    assert (
        not subjects["stolen"]["writtenByRun"]
        and "which the run did not write" in subjects["stolen"]["reason"]
    )
    assert not subjects["old.txt"]["writtenByRun"] and "did not write" in subjects["old.txt"]["reason"]
    programs = [rd for rd in p["monitorLog"]["fileAccess"] if rd["annotations"].get("access") == ["exec"]]
    assert programs[0] == {
        "name": "/usr/bin/cc",
        "uri": "file:///usr/bin/cc",
        "digest": {"sha256": CC_SHA},
        "annotations": {"access": ["exec"]},
    }
    assert {"name": f"{WS}/app.c", "uri": f"file://{WS}/app.c", "annotations": {"access": ["read"]}} in p[
        "monitorLog"
    ]["fileAccess"]
    assert p["metadata"]["buildStartedOn"] == fmt.format_time(T0)
    assert p["evidenceRun"]["runId"] == orjson.loads(_member(path, fmt.MANIFEST_NAME))["run_id"]


def _member(path: Path, name: str) -> bytes:
    import tarfile

    with tarfile.open(path, "r:gz") as tar:
        f = tar.extractfile(name)
        assert f is not None
        return f.read()


def test_a_run_that_read_100k_files_has_a_bounded_attestation(tmp_path: Path) -> None:
    recs = [exec_(1, 101, 100, "/usr/bin/find", ["find", "/"])]
    recs += [open_(2 + i, f"/usr/share/f{i:06d}", ["read"]) for i in range(100_000)]
    path, _ = signed(tmp_path, recs, artifacts(artifact("app")))
    raw = _member(path, fmt.ATTESTATION_NAME)
    assert len(raw) < 2 * 1024 * 1024
    p = statement_of(path)["predicate"]
    names = [rd for rd in p["monitorLog"]["fileAccess"] if rd["annotations"].get("access") == ["read"]]
    assert len(names) <= runtime_trace.MAX_FILES_BY_NAME
    assert p["metadata"]["evidenceOmitted"]["files"] == 100_000 - len(names)
    # the full list stays in the events
    manifest = orjson.loads(_member(path, fmt.MANIFEST_NAME))
    assert manifest["counts"][fmt.FILE_OPEN] == 100_000


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_verify_artifact_passes_for_what_the_run_wrote_and_refuses_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "app").write_bytes(b"the app")
    (tmp_path / "old.txt").write_bytes(b"old")
    sha = {n: hashlib.sha256((tmp_path / n).read_bytes()).hexdigest() for n in ("app", "old.txt")}
    arts = artifacts(artifact("app", sha=sha["app"]), artifact("old.txt", sha=sha["old.txt"]))
    path, public = signed(tmp_path, build_records(), arts)
    code, out, err = _cli(
        capsys, "verify", "--artifact", str(tmp_path / "app"), str(path), "--key", str(public)
    )
    assert code == 0, err
    assert "written by the run: pid 101 /usr/bin/cc" in out and "command: make test" in out
    assert "subjects: 2" in out and f"app  sha256 {sha['app']}" in out
    # a subject the run did not write: one line, exit 1
    code, out, err = _cli(
        capsys, "verify", "--artifact", str(tmp_path / "old.txt"), str(path), "--key", str(public)
    )
    assert code == 1 and err.count("\n") == 1 and "was not written by the run" in err
    # the artifact changed: its digest is no subject (exit 2)
    (tmp_path / "app").write_bytes(b"the app, changed")
    code, out, err = _cli(
        capsys, "verify", "--artifact", str(tmp_path / "app"), str(path), "--key", str(public)
    )
    assert code == 2 and err.count("\n") == 1 and "is not a subject of" in err


def test_a_subject_the_run_did_not_write_is_a_lint_finding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    refused = [fmt.ArtifactRefusal(name="dist/*", reason="the pattern matched nothing")]
    path, _ = signed(
        tmp_path, build_records(), artifacts(artifact("app"), artifact("old.txt"), refused=refused)
    )
    code, out, _ = _cli(capsys, "lint", "--format", "json", str(path))
    findings = orjson.loads(out)["findings"]
    by_code = {f["rule"]: f for f in findings}
    assert "subject old.txt: the run did not write" in by_code["EV017"]["message"]
    assert "dist/*: the pattern matched nothing" in by_code["EV018"]["message"]
    assert [f["message"].split(":")[0] for f in findings if f["rule"] == "EV017"] == ["subject old.txt"]
    assert code == 1  # an error-level finding
    assert _cli(capsys, "lint", "--explain", "EV017")[0] == 0


# --- the tie, rule by rule -----------------------------------------------------------------------


def _events(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from evidence.bundle.records import to_event

    out = []
    for r in recs:
        etype, _, t, data = to_event(r)
        out.append({"type": etype, "time": fmt.format_time(t), "data": data})
    return out


def _tie(recs: list[dict[str, Any]], f: fmt.ArtifactFile) -> provenance.Tie:
    tracker = provenance.Tracker()
    tracker.feed_events(_events(recs))
    return tracker.tie(f.model_dump(), fmt.format_time(T0), fmt.format_time(T0 + 5_000_000_000))


def test_a_subject_replaced_after_the_run_ended_is_not_the_runs() -> None:
    recs = [open_(300, APP, ["write", "create"], pid=101)]
    assert _tie(recs, artifact("app", ctime_s=3)).written
    late = _tie(recs, artifact("app", ctime_s=6))  # ctime after the run ended
    assert not late.written and "changed after the run ended" in (late.reason or "")
    early = _tie(recs, artifact("app", ctime_s=-1))
    assert not early.written and "before the run started" in (early.reason or "")
    # replaced during the run, well after the run's last write of it
    stale = _tie([open_(4_000_000_000, APP, ["write"], pid=101)], artifact("app", ctime_s=1))
    assert not stale.written and "before the run's last write" in (stale.reason or "")


def test_a_subject_changed_after_its_writers_exited_was_replaced_from_outside() -> None:
    from tests.unit.conftest_bundles import exit_

    ld = exec_(100, 102, 101, "/usr/bin/ld", ["ld"])
    fork = exec_(150, 103, 102, "/usr/bin/strip", ["strip"])  # forked from the writer after it
    strip_exit = {**exit_(300_000_000, 103), "ppid": 102}
    recs = [
        ld,
        open_(200, APP, ["write", "create"], pid=102),
        fork,
        strip_exit,
        {**exit_(500_000_000, 102), "ppid": 101},
    ]
    assert _tie(recs, artifact("app", ctime_s=1.2)).written  # within 1 s of the last exit
    t = _tie(recs, artifact("app", ctime_s=3))
    assert not t.written and "after every process of the run that could have written it" in (t.reason or "")
    # a process forked from the writer and not known to have exited: nothing can be said
    held = [ld, open_(200, APP, ["write", "create"], pid=102), fork, {**exit_(500_000_000, 102), "ppid": 101}]
    assert _tie(held, artifact("app", ctime_s=3)).written


def test_removed_after_the_last_write_and_writes_in_another_mount_namespace_do_not_count() -> None:
    recs = [open_(300, APP, ["write", "create"]), change(400, "unlink", APP)]
    t = _tie(recs, artifact("app"))
    assert not t.written and "removed or moved" in (t.reason or "")
    other = {**open_(300, APP, ["write", "create"]), "mntns": "other"}
    assert not _tie([other], artifact("app")).written
    failed = open_(300, APP, ["write", "create"], result="EACCES")
    assert not _tie([failed], artifact("app")).written


def test_a_forked_child_that_did_not_exec_is_named_by_its_parents_program() -> None:
    cc = exec_(100, 100, 1, "/usr/bin/make", ["make"])
    cc["sha256"] = "e" * 64
    t = _tie([cc, open_(300, APP, ["write"], pid=555)], artifact("app"))  # ppid 100 (open_'s)
    assert t.written and t.writer == {"pid": 555, "program": "/usr/bin/make", "sha256": "e" * 64}


def _repack(tmp_path: Path, path: Path, st: dict[str, Any], manifest: bytes | None = None) -> Path:
    from evidence.bundle import canonical
    from tests.unit.test_signing import repack

    signer = signing.load_signer(tmp_path / "key")
    att = attestation.envelope(canonical.dumps(st), [signer])
    m = manifest if manifest is not None else _member(path, fmt.MANIFEST_NAME)
    return repack(
        tmp_path / "hostile.tar.gz",
        [
            (fmt.MANIFEST_NAME, m),
            (fmt.EVENTS_NAME, _member(path, fmt.EVENTS_NAME)),
            (fmt.ATTESTATION_NAME, att),
        ],
    )


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("artifact-digest", 'subject "app": digest does not match the manifest\'s artifact'),
        ("artifact-dropped", 'no subject for "app"'),
        ("artifact-added", 'subject "evil" is not a member of the bundle, its run id or an artifact'),
        ("monitored-process", "the predicate's monitoredProcess disagrees with the manifest"),
        ("evidence-run", "the predicate's evidenceRun.exitCode disagrees with the manifest"),
        ("times", "the predicate's metadata disagrees with the manifest's times"),
        ("no-monitor-log", "the predicate lacks 'monitorLog'"),
        ("bad-monitor-log", "the predicate's monitorLog.process is not a list of objects"),
        ("old-type-with-artifacts", 'subject "app" is not a member'),
    ],
)
def test_a_runtime_trace_that_disagrees_with_the_manifest_is_refused_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, reason: str
) -> None:
    path, public = signed(tmp_path, build_records(), artifacts(artifact("app")))
    st = statement_of(path)
    p = st["predicate"]
    changed = {
        "artifact-digest": {
            **st,
            "subject": [*st["subject"][:3], {"name": "app", "digest": {"sha256": "0" * 64}}],
        },
        "artifact-dropped": {**st, "subject": st["subject"][:3]},
        "artifact-added": {
            **st,
            "subject": [*st["subject"], {"name": "evil", "digest": {"sha256": "0" * 64}}],
        },
        "monitored-process": {
            **st,
            "predicate": {**p, "monitoredProcess": {**p["monitoredProcess"], "event": "x"}},
        },
        "evidence-run": {**st, "predicate": {**p, "evidenceRun": {**p["evidenceRun"], "exitCode": 3}}},
        "times": {
            **st,
            "predicate": {**p, "metadata": {**p["metadata"], "buildFinishedOn": fmt.format_time(T0)}},
        },
        "no-monitor-log": {**st, "predicate": {k: v for k, v in p.items() if k != "monitorLog"}},
        "bad-monitor-log": {**st, "predicate": {**p, "monitorLog": {**p["monitorLog"], "process": [1]}}},
        "old-type-with-artifacts": {
            **st,
            "predicateType": attestation.PREDICATE_TYPE,
            "predicate": p["evidenceRun"],
        },
    }[case]
    hostile = _repack(tmp_path, path, changed)
    code, _, err = _cli(capsys, "verify", str(hostile), "--key", str(public))
    assert code == 2 and err.count("\n") == 1 and reason in err, err


def test_a_signed_tie_that_disagrees_with_the_events_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The signer's statement says old.txt was written by the run; its events say it was not:
    verify --artifact believes neither the claim nor the file, and says so."""
    (tmp_path / "old.txt").write_bytes(b"old")
    sha = hashlib.sha256(b"old").hexdigest()
    path, public = signed(tmp_path, build_records(), artifacts(artifact("old.txt", sha=sha)))
    st = statement_of(path)
    access = st["predicate"]["monitorLog"]["fileAccess"]
    access[0]["annotations"] = {**access[0]["annotations"], "writtenByRun": True, "reason": None}
    hostile = _repack(tmp_path, path, st)
    code, _, err = _cli(
        capsys, "verify", "--artifact", str(tmp_path / "old.txt"), str(hostile), "--key", str(public)
    )
    assert code == 2 and err.count("\n") == 1 and "tie of subject old.txt disagrees with its events" in err, (
        err
    )
