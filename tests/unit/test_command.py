"""The run's command is what the kernel executed (bundle/command.py): the claim is kept beside it, a
difference is a degradation that lint reports as EV014; a bundle made before `claimed_command`
existed still verifies (its signed predicate too) and lints as before."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest

from evidence.bundle import attestation, canonical, lint, lint_rules, reader, signing
from evidence.bundle import format as fmt
from evidence.bundle.command import COMPONENT, judge
from evidence.bundle.writer import write_bundle
from evidence.cli import main
from tests.unit.conftest_bundles import WS, exec_, meta, records, tar_bytes, tarinfo


def ran(argv: list[str], filename: str = "/usr/bin/make", **extra: Any) -> dict[str, Any]:
    """A successful exec record of the run's first process."""
    return {**exec_(1, 100, 1, filename, argv, depth=0), "argv_truncated": False, **extra}


def test_the_claim_made_is_the_claim_kept() -> None:
    assert judge(["make", "test"], ran(["make", "test"])).degradation is None
    v = judge(["make", "test"], ran(["sh", "-c", "cat SECRET; make test"], "/usr/bin/sh"))
    assert v.command == ["sh", "-c", "cat SECRET; make test"]
    assert v.degradation is not None and v.degradation["component"] == COMPONENT
    assert '["sh", "-c", "cat SECRET; make test"]' in v.degradation["reason"]
    assert '["make", "test"]' in v.degradation["reason"]


def test_a_command_that_never_executed_has_no_command() -> None:
    v = judge(["make", "test"], None)
    assert v.command == [] and v.degradation is not None and v.degradation["component"] == COMPONENT
    assert judge([], None).degradation is None  # nothing claimed, nothing contradicted
    assert judge([], ran(["make"])) == judge([], ran(["make"])).__class__(["make"])


@pytest.mark.parametrize(
    ("claim", "argv", "filename", "interpreter"),
    [
        (["./build.sh", "a"], ["/bin/sh", "./build.sh", "a"], f"{WS}/build.sh", "/bin/sh"),
        (
            ["build.sh", "a"],
            ["/bin/sh", "/usr/local/bin/build.sh", "a"],
            "/usr/local/bin/build.sh",
            "/bin/sh",
        ),
        (["tool"], ["/usr/bin/env", "python3", "/opt/bin/tool"], "/opt/bin/tool", "/usr/bin/env"),
        (["/opt/t", "x", ""], ["/bin/bash", "-e", "/opt/t", "x", ""], "/opt/t", "/bin/bash"),
    ],
)
def test_a_script_runs_as_its_interpreter_and_agrees(
    claim: list[str], argv: list[str], filename: str, interpreter: str
) -> None:
    """The kernel runs a `#!` script as its interpreter (and its optional argument) followed by the
    script's name as executed: the same claim."""
    v = judge(claim, ran(argv, filename, interpreter=interpreter))
    assert v.command == argv and v.degradation is None


@pytest.mark.parametrize(
    ("claim", "argv", "filename", "extra"),
    [
        # another program's arguments that end like the claim: not a script
        (["make", "test"], ["python3", "-cimport os", "make", "test"], "/usr/bin/python3", {}),
        (["python3", "test"], ["python3", "-cCODE", "/usr/bin/python3", "test"], "/usr/bin/python3", {}),
        # a script, but the claim names another one, or other arguments
        (["make", "test"], ["/bin/sh", "/tmp/x.sh", "test"], "/tmp/x.sh", {"interpreter": "/bin/sh"}),
        (["x.sh", "test"], ["/bin/sh", "/tmp/x.sh", "all"], "/tmp/x.sh", {"interpreter": "/bin/sh"}),
        # an argv that looks like a script's, of an exec the kernel did not run as one
        (["x.sh", "test"], ["/bin/sh", "/tmp/x.sh", "test"], "/usr/bin/python3", {"interpreter": "/bin/sh"}),
        (["x.sh", "test"], ["/bin/dash", "/tmp/x.sh", "test"], "/tmp/x.sh", {"interpreter": "/bin/sh"}),
        # cut, and different before the cut
        (["make", "test"], ["make", "tx"], "/usr/bin/make", {"argv_truncated": True}),
    ],
)
def test_anything_else_is_a_difference(
    claim: list[str], argv: list[str], filename: str, extra: dict[str, Any]
) -> None:
    v = judge(claim, ran(argv, filename, **extra))
    assert v.command == argv and v.degradation is not None and v.degradation["component"] == COMPONENT


def test_an_argv_too_long_to_read_whole_is_checked_as_far_as_it_was_read() -> None:
    long = "x" * 9000
    v = judge(["sh", "-c", long], ran(["sh", "-c", long[:8000]], "/usr/bin/sh", argv_truncated=True))
    assert v.command == ["sh", "-c", long[:8000]]
    assert v.degradation is not None and v.degradation["component"] == "recorder"  # a warning, not EV014
    v = judge(["sh", "-c", "a", long], ran(["sh", "-c", "a"], "/usr/bin/sh", argv_truncated=True))
    assert v.degradation is not None and v.degradation["component"] == "recorder"


def test_bytes_that_are_not_utf8_compare_as_the_kernels_text() -> None:
    claim = [os.fsdecode(b"/bin/echo"), os.fsdecode(b"caf\xe9")]  # as Python's argv holds them
    assert judge(claim, ran(["/bin/echo", "caf\\xe9"], "/bin/echo")).degradation is None


# --- in the bundle -----------------------------------------------------------------------------


def _lint(path: Path) -> list[str]:
    _, findings, _ = lint.lint(str(path))
    return [f.rule.code for f in findings]


def test_a_bundle_says_what_ran_keeps_the_claim_and_lint_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    v = judge(["make", "test"], ran(["sh", "-c", "cat SECRET"], "/usr/bin/sh"))
    assert v.degradation is not None
    path = tmp_path / "b.tar.gz"
    m = write_bundle(
        path,
        meta(command=v.command, claimed_command=["make", "test"], degradations=[v.degradation]),
        lambda: iter(records()),
    )
    assert m["command"] == ["sh", "-c", "cat SECRET"] and m["claimed_command"] == ["make", "test"]
    assert "EV014" in _lint(path) and "EV002" not in _lint(path)
    assert lint.exit_code(lint.lint(str(path))[1], "error") == 1
    assert "command-not-as-claimed" in lint_rules.explain("EV014")
    assert main(["show", str(path)]) == 0
    shown = capsys.readouterr().out
    assert "command: sh -c 'cat SECRET'" in shown, shown
    assert "claimed: make test" in shown, shown
    ok = tmp_path / "ok.tar.gz"
    write_bundle(ok, meta(claimed_command=["make", "test"]), lambda: iter(records()))
    assert "EV014" not in _lint(ok)


def _without_claim(path: Path, key: Path) -> Path:
    """The bundle as the writer made it before `claimed_command` existed: no such manifest field, a
    predicate without `claimedCommand`, signed."""
    with tarfile.open(path, "r:gz") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    manifest = json.loads(members[fmt.MANIFEST_NAME])
    del manifest["claimed_command"]
    raw = canonical.dumps(manifest)
    events_sha = hashlib.sha256(members[fmt.EVENTS_NAME]).hexdigest()
    old = attestation.run_statement(manifest, hashlib.sha256(raw).hexdigest(), events_sha)  # as then
    signed = attestation.envelope(canonical.dumps(old), [signing.load_signer(key)])
    assert b"claimedCommand" not in signed
    parts = [
        (fmt.MANIFEST_NAME, raw),
        (fmt.EVENTS_NAME, members[fmt.EVENTS_NAME]),
        (fmt.ATTESTATION_NAME, signed),
    ]
    path.write_bytes(gzip.compress(tar_bytes([(tarinfo(n, len(d)), d) for n, d in parts]), mtime=0))
    return path


def test_a_bundle_made_before_the_claim_was_kept_still_verifies_and_lints(tmp_path: Path) -> None:
    private, public, keyid = signing.generate(tmp_path / "key")
    path = tmp_path / "old.tar.gz"
    write_bundle(path, meta(), lambda: iter(records()), signer=signing.load_signer(private))
    _without_claim(path, private)
    b = reader.open_bundle(path)
    b.verify()
    assert "claimed_command" not in b.manifest
    assert b.check_signature(signing.load_public_key(public)) == keyid
    assert "EV014" not in _lint(path)
    # a new bundle's predicate carries the claim (null for a run that made none), checked as the rest
    new = tmp_path / "new.tar.gz"
    write_bundle(
        new, meta(claimed_command=["make"]), lambda: iter(records()), signer=signing.load_signer(private)
    )
    nb = reader.open_bundle(new)
    nb.verify()
    assert nb.attestation is not None
    assert nb.attestation.statement["predicate"]["evidenceRun"]["claimedCommand"] == ["make"]
