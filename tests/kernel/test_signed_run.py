"""`evidence run --sign-key`: a real run signed with a key from `evidence keygen`, then verified."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

from tests.kernel.util import evidence

NOBODY = 65534


def test_run_signs_its_bundle_and_verify_checks_it(tmp_path: Path) -> None:
    key = tmp_path / "evidence-key"
    made = evidence("keygen", "--out", str(key))
    assert made.returncode == 0, made.stderr
    bundle = tmp_path / "run.tar.gz"
    proc = evidence("run", "--sign-key", str(key), "--bundle", str(bundle), "--", "/bin/cat", "/etc/hostname")
    assert proc.returncode == 0, proc.stderr
    with tarfile.open(bundle, "r:gz") as tar:
        assert tar.getnames() == ["manifest.json", "events.ndjson", "attestation.intoto.json"]
    verified = evidence("verify", str(bundle), "--key", f"{key}.pub")
    assert verified.returncode == 0, verified.stderr
    assert "verified and signed" in verified.stdout
    linted = evidence("lint", str(bundle), "--key", f"{key}.pub", "--fail-on", "none")
    assert linted.returncode == 0, linted.stderr
    assert "signature verified" in linted.stdout
    other = tmp_path / "other"
    assert evidence("keygen", "--out", str(other)).returncode == 0
    refused = evidence("verify", str(bundle), "--key", f"{other}.pub")
    assert refused.returncode == 2 and "not signed by key" in refused.stderr


def test_a_bad_key_runs_nothing(tmp_path: Path) -> None:
    key = tmp_path / "evidence-key"
    assert evidence("keygen", "--out", str(key)).returncode == 0
    key.chmod(0o644)
    marker = tmp_path / "ran"
    proc = evidence(
        "run", "--sign-key", str(key), "--bundle", str(tmp_path / "b.tar.gz"), "--", "/bin/touch", str(marker)
    )
    assert proc.returncode == 2, proc.stderr
    assert "accessible by others" in proc.stderr and proc.stderr.count("\n") == 1
    assert not marker.exists() and not (tmp_path / "b.tar.gz").exists()


def test_a_key_owned_by_the_jobs_uid_runs_nothing(tmp_path: Path) -> None:
    """A 0600 key that nobody owns is nobody's to read: a job running as nobody could sign anything
    with it. Refused before the command starts (exit 2, one line); root's own key is used."""
    key = tmp_path / "evidence-key"
    assert evidence("keygen", "--out", str(key)).returncode == 0
    os.chown(key, NOBODY, NOBODY)
    marker = tmp_path / "ran"
    proc = evidence(
        "run", "--sign-key", str(key), "--bundle", str(tmp_path / "b.tar.gz"), "--", "/bin/touch", str(marker)
    )
    assert proc.returncode == 2, proc.stderr
    assert f"belongs to uid {NOBODY}" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert not marker.exists() and not (tmp_path / "b.tar.gz").exists()
    agent = evidence("agent", "--socket", str(tmp_path / "s.sock"), "--bundle-dir", str(tmp_path / "b"),
                     env={**os.environ, "EVIDENCE_SIGNING_KEY": str(key)})  # fmt: skip
    assert agent.returncode == 2 and f"belongs to uid {NOBODY}" in agent.stderr, agent.stderr
    assert agent.stderr.count("\n") == 1 and not (tmp_path / "s.sock").exists()
    os.chown(key, 0, 0)
    signed = evidence(
        "run", "--sign-key", str(key), "--bundle", str(tmp_path / "b.tar.gz"), "--", "/bin/true"
    )
    assert signed.returncode == 0, signed.stderr


def test_a_signed_full_detail_run_traces_what_its_events_say(tmp_path: Path) -> None:
    """Full detail, signed: the events' lines made as the run records and the runtime trace fed as
    they are made (the recorder knows at the start that it signs): the bundle verifies with its key,
    and the attestation's trace is what the bundle's own events make, fed in order as a reader
    would, past the trace's budget of files by name (a job as nobody: distinct names, repeats of
    one, a file written)."""
    import base64

    import orjson

    from evidence.bundle import attestation, runtime_trace
    from evidence.bundle.reader import open_bundle

    key = tmp_path / "evidence-key"
    assert evidence("keygen", "--out", str(key)).returncode == 0
    import shutil
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="evidence-signed-"))  # (nobody cannot reach into tmp_path)
    work.chmod(0o777)
    job = (
        "import os\n"
        "for i in range(3000):\n"
        "    try: open(f'/nonexistent/{i}')\n"
        "    except OSError: pass\n"
        "for i in range(200): open('/etc/hostname').close()\n"
        f"for i in range(1500): open('{work}/f%d' % (i % 1200), 'w').close()\n"
    )
    bundle = tmp_path / "run.tar.gz"
    proc = evidence(
        "run", "--detail", "full", "--sign-key", str(key), "--bundle", str(bundle), "--",
        "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--",
        "/usr/bin/python3", "-c", job,
    )  # fmt: skip
    shutil.rmtree(work)
    assert proc.returncode == 0, proc.stderr
    verified = evidence("verify", str(bundle), "--key", f"{key}.pub")
    assert verified.returncode == 0, verified.stderr
    read = open_bundle(bundle)
    manifest = read.manifest
    assert manifest["counts"]["dev.evidence.file.open"] >= 4700
    trace = runtime_trace.Trace()
    trace.feed_events(read.events())
    want = runtime_trace.predicate(manifest, attestation.predicate(manifest), trace)
    with tarfile.open(bundle, "r:gz") as tar:
        member = tar.extractfile("attestation.intoto.json")
        assert member is not None
        statement = orjson.loads(base64.b64decode(orjson.loads(member.read())["payload"]))
    assert statement["predicate"] == orjson.loads(orjson.dumps(want))
    assert statement["predicate"]["metadata"]["evidenceOmitted"]["files"] > 0  # past the budget
