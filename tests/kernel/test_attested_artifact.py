"""`evidence run --subject`: a real artifact (a C program built with `cc` inside the run) attested in
the signed bundle, and `evidence verify --artifact` checking it; tampering with the artifact or the
bundle, a subject the run did not write, and one replaced by a process outside the run while the
run lasted each fail with one line. The statement validates with the in-toto-attestation package's
models and the envelope with securesystemslib (independent implementations)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

from google.protobuf import json_format
from in_toto_attestation.v1 import statement_pb2
from in_toto_attestation.v1.statement import Statement
from securesystemslib.dsse import Envelope
from securesystemslib.signer import SSlibKey

from evidence.bundle import signing
from tests.kernel.util import evidence

HELLO = b'#include <stdio.h>\nint main(void) { puts("hello"); return 0; }\n'


def _workspace(tmp_path: Path) -> tuple[Path, Path]:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "hello.c").write_bytes(HELLO)
    key = tmp_path / "key"
    made = evidence("keygen", "--out", str(key))
    assert made.returncode == 0, made.stderr
    return ws, key


def _statement(bundle: Path) -> tuple[dict[str, object], dict[str, object]]:
    with tarfile.open(bundle, "r:gz") as tar:
        f = tar.extractfile("attestation.intoto.json")
        assert f is not None
        env = json.loads(f.read())
    return env, json.loads(base64.b64decode(env["payload"]))


def test_a_built_program_is_attested_and_verified_and_tampering_fails(tmp_path: Path) -> None:
    ws, key = _workspace(tmp_path)
    bundle = tmp_path / "run.tar.gz"
    proc = evidence(
        "run", "--sign-key", str(key), "--subject", "app", "--subject", "*.missing", "--bundle", str(bundle),
        "--", "/bin/sh", "-c", "cc -o app hello.c", cwd=ws,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    ok = evidence("verify", "--artifact", str(ws / "app"), str(bundle), "--key", f"{key}.pub")
    assert ok.returncode == 0, ok.stderr
    assert "written by the run: pid" in ok.stdout and "subjects: 1 (1 refused)" in ok.stdout, ok.stdout
    # the statement: in-toto's models and securesystemslib accept it
    env, st = _statement(bundle)
    Statement.copy_from_pb(json_format.ParseDict(st, statement_pb2.Statement())).validate()
    public = signing.load_public_key(f"{key}.pub")
    assert list(
        Envelope.from_dict(env).verify([SSlibKey.from_crypto(public, keyid=signing.keyid(public))], 1)
    )
    assert st["predicateType"] == "https://in-toto.io/attestation/runtime-trace/v0.2"
    p = st["predicate"]
    assert isinstance(p, dict)
    app = p["monitorLog"]["fileAccess"][0]["annotations"]
    assert app["subject"] == "app" and app["writtenByRun"] is True
    assert app["writer"]["sha256"], app  # the linker, by its digest
    assert any(
        e["processBinary"].endswith("/cc") or e["processBinary"].endswith("gcc")
        for e in p["monitorLog"]["process"]
    )
    # the artifact changed: its digest is no subject
    changed = tmp_path / "app.changed"
    changed.write_bytes((ws / "app").read_bytes() + b"\0")
    bad = evidence("verify", "--artifact", str(changed), str(bundle), "--key", f"{key}.pub")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "is not a subject of" in bad.stderr, (
        bad.stderr
    )
    # the bundle changed: it does not verify
    raw = bytearray(bundle.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    tampered = tmp_path / "tampered.tar.gz"
    tampered.write_bytes(bytes(raw))
    bad = evidence("verify", "--artifact", str(ws / "app"), str(tampered), "--key", f"{key}.pub")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "verification failed" in bad.stderr, (
        bad.stderr
    )


def test_a_subject_the_run_did_not_write_is_refused(tmp_path: Path) -> None:
    ws, key = _workspace(tmp_path)
    (ws / "old.bin").write_bytes(b"made before the run")
    bundle = tmp_path / "run.tar.gz"
    args = ["run", "--sign-key", str(key), "--subject", "old.bin", "--bundle", str(bundle)]
    proc = evidence(*args, "--", "/bin/cat", "old.bin", cwd=ws)
    assert proc.returncode == 0, proc.stderr
    bad = evidence("verify", "--artifact", str(ws / "old.bin"), str(bundle), "--key", f"{key}.pub")
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1, bad.stderr
    assert "was not written by the run: the run did not write" in bad.stderr
    linted = evidence("lint", str(bundle), "--fail-on", "error")
    assert linted.returncode == 1 and "EV017" in linted.stdout, linted.stdout
    # --subject-must-be-written: the command's own exit code gives way to 2
    must = evidence(*args, "--subject-must-be-written", "--", "/bin/cat", "old.bin", cwd=ws)
    assert must.returncode == 2 and "not written by the run" in must.stderr, must.stderr


def test_a_subject_replaced_by_a_process_outside_the_run_is_not_the_runs(tmp_path: Path) -> None:
    """The job builds `app`, says so, and waits; meanwhile this test (outside the run's cgroup)
    replaces `app` with other bytes, well after the linker exited: the tie says so."""
    ws, key = _workspace(tmp_path)
    bundle = tmp_path / "run.tar.gz"
    ready = ws / "ready"

    def replace() -> None:
        for _ in range(600):
            if ready.exists():
                break
            time.sleep(0.05)
        time.sleep(1.5)  # past the slack the tie allows after the writer's exit
        new = ws / "app.new"
        new.write_bytes(b"not the program the run built")
        os.rename(new, ws / "app")
        (ws / "replaced").touch()

    outsider = threading.Thread(target=replace)
    outsider.start()
    script = "cc -o app hello.c && touch ready && while [ ! -e replaced ]; do sleep 0.1; done"
    proc = evidence(
        "run", "--sign-key", str(key), "--subject", "app", "--bundle", str(bundle), "--", "/bin/sh", "-c", script,
        cwd=ws,
    )  # fmt: skip
    outsider.join()
    assert proc.returncode == 0, proc.stderr
    bad = evidence("verify", "--artifact", str(ws / "app"), str(bundle), "--key", f"{key}.pub")
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1, bad.stderr
    assert "replaced by a process outside the run" in bad.stderr, bad.stderr


def test_the_job_cannot_make_root_hash_a_file_outside_the_workspace(tmp_path: Path) -> None:
    """The job (nobody) links a root-only file into the workspace (a symlink, and a hard link where
    the kernel allows it): refused as subjects, never read, listed with the reason."""
    ws, key = _workspace(tmp_path)
    secret = tmp_path / "secret"
    secret.write_bytes(b"root only")
    secret.chmod(0o600)
    os.chown(ws, 65534, 65534)
    bundle = tmp_path / "run.tar.gz"
    script = f"ln -s {secret} dist-link; ln {secret} dist-hard 2>/dev/null; mkfifo dist-fifo; true"
    proc = evidence(
        "run", "--sign-key", str(key), "--subject", "dist-*", "--bundle", str(bundle), "--",
        "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", "/bin/sh", "-c", script,
        cwd=ws,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    with tarfile.open(bundle, "r:gz") as tar:
        f = tar.extractfile("manifest.json")
        assert f is not None
        artifacts = json.loads(f.read())["artifacts"]
    assert artifacts["files"] == []
    refused = {r["name"]: r["reason"] for r in artifacts["refused"]}
    assert refused["dist-link"].startswith("leads out of the workspace"), refused
    assert refused["dist-fifo"] == "a FIFO", refused
    assert "dist-hard" not in refused or "hard link" in refused["dist-hard"], refused
    linted = evidence("lint", str(bundle), "--fail-on", "none")
    assert "EV018" in linted.stdout, linted.stdout


def test_through_an_agent_the_subjects_are_read_as_the_client(tmp_path: Path) -> None:
    """`run --agent --subject` by an unprivileged client: the agent (root) signs, and reads the
    subjects with the client's rights: a root-only file the pattern matches is refused, unread."""
    import shutil
    import tempfile

    from tests.kernel.test_daemon import Agent
    from tests.kernel.util import as_user

    top = Path(tempfile.mkdtemp(prefix="evidence-subj-"))
    try:
        top.chmod(0o755)
        key = top / "key"
        assert evidence("keygen", "--out", str(key)).returncode == 0
        agent = Agent(
            top,
            env={
                "EVIDENCE_SIGNING_KEY": str(key),
                "EVIDENCE_ALLOWED_UIDS": "65534",
                "EVIDENCE_SOCKET_GID": "65534",
            },
        )
        try:
            ws = top / "ws"
            ws.mkdir()
            (ws / "hello.c").write_bytes(HELLO)
            (ws / "root.bin").write_bytes(b"root only")
            (ws / "root.bin").chmod(0o600)
            os.chown(ws, 65534, 65534)
            bundle = ws / "run.tar.gz"
            argv = [sys.executable, "-m", "evidence", "run", "--agent", str(agent.socket), "--bundle", str(bundle),
                    "--subject", "*.bin", "--", "/bin/sh", "-c", "cc -o app.bin hello.c"]  # fmt: skip
            proc = subprocess.run(as_user(65534, *argv), cwd=ws, capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, proc.stderr + agent.output()
            # --subject-must-be-written through the agent: judged on the downloaded, verified bundle
            (ws / "old.txt").write_bytes(b"made before the run")
            os.chown(ws / "old.txt", 65534, 65534)
            must = [sys.executable, "-m", "evidence", "run", "--agent", str(agent.socket), "--bundle",
                    str(ws / "must.tar.gz"), "--subject", "old.txt", "--subject-must-be-written", "--",
                    "/bin/cat", "old.txt"]  # fmt: skip
            proc = subprocess.run(as_user(65534, *must), cwd=ws, capture_output=True, text=True, timeout=120)
            assert proc.returncode == 2, proc.stderr + agent.output()
            assert "evidence: subject old.txt was not written by the run:" in proc.stderr, proc.stderr
            assert (ws / "must.tar.gz").exists()  # the bundle is written first
        finally:
            assert agent.stop() == 0, agent.output()
        ok = evidence("verify", "--artifact", str(ws / "app.bin"), str(bundle), "--key", f"{key}.pub")
        assert ok.returncode == 0, ok.stderr
        with tarfile.open(bundle, "r:gz") as tar:
            f = tar.extractfile("manifest.json")
            assert f is not None
            artifacts = json.loads(f.read())["artifacts"]
        assert [f["name"] for f in artifacts["files"]] == ["app.bin"]
        assert artifacts["refused"] == [{"name": "root.bin", "reason": "cannot be opened: Permission denied"}]
    finally:
        shutil.rmtree(top, ignore_errors=True)
