"""The agent signs every bundle it writes with its own key (`signing_key`): a job, and the client that
runs it, never hold the key. A key others can read stops the agent before it records anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from evidence.bundle.reader import open_bundle
from evidence.bundle.signing import generate, load_public_key
from tests.kernel.test_daemon import Agent
from tests.kernel.util import evidence


def test_the_agent_signs_what_it_writes_and_the_client_holds_no_key(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    key, pub, keyid = generate(keys / "agent-key")
    agent = Agent(tmp_path, env={"EVIDENCE_SIGNING_KEY": str(key)})
    try:
        bundle = tmp_path / "run.tar.gz"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "evidence",
                "run",
                "--agent",
                str(agent.socket),
                "--bundle",
                str(bundle),
                "--",
                "true",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={k: v for k, v in os.environ.items() if k != "EVIDENCE_SIGNING_KEY"},
        )
        assert proc.returncode == 0, proc.stderr + agent.output()
        b = open_bundle(bundle)
        b.verify()
        assert b.check_signature(load_public_key(pub)) == keyid
        verify = evidence("verify", str(bundle), "--key", str(pub))
        assert verify.returncode == 0, verify.stdout + verify.stderr
    finally:
        agent.stop()


def test_a_key_others_can_read_stops_the_agent(tmp_path: Path) -> None:
    key, _, _ = generate(tmp_path / "k")
    key.chmod(0o644)
    proc = evidence("agent", "--socket", str(tmp_path / "s.sock"), "--bundle-dir", str(tmp_path / "b"),
                    env={**os.environ, "EVIDENCE_SIGNING_KEY": str(key)})  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert not (tmp_path / "s.sock").exists()
