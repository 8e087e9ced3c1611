"""`evidence run --agent --policy`: the client applies Landlock, a private tmp and the scrubbed
environment to its command; the agent guards its connects and matches denials. The same attempts
as tests/kernel/test_policy_run.py, by an unprivileged client (uid 65534) through an agent, must
end as they do in a standalone run: the same results, denials and exit codes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kernel import test_policy_run
from tests.kernel.test_daemon import Agent
from tests.kernel.util import PY, read_bundle, record

pytestmark = pytest.mark.kernel

NOBODY = 65534
world = test_policy_run.world  # the same world, made in the tmp_path below


@pytest.fixture(scope="module")
def agent() -> Iterator[Agent]:
    d = Path(tempfile.mkdtemp(prefix="evidence-pva-"))
    d.chmod(0o755)
    a = Agent(d, env={"EVIDENCE_ALLOWED_UIDS": str(NOBODY), "EVIDENCE_SOCKET_GID": str(NOBODY)})
    yield a
    assert a.stop() == 0, a.output()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def tmp_path() -> Iterator[Path]:  # the world's: uid 65534 must reach it (pytest's is 0700)
    d = Path(tempfile.mkdtemp(prefix="evidence-pva-world-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def through_agent(
    agent: Agent,
    w: dict[str, Any],
    *extra: str,
    code: str | None = None,
    env: dict[str, str] | None = None,
    command: tuple[str, ...] = (),
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], list[dict[str, Any]]]:
    os.chown(w["ws"], NOBODY, NOBODY)
    out = Path(tempfile.mkdtemp(dir=w["ws"].parent))
    out.chmod(0o777)
    bundle = out / "agent.tar.gz"
    proc = subprocess.run(
        [sys.executable, "-m", "evidence", "run", "--agent", str(agent.socket), "--bundle", str(bundle),
         "--policy", str(w["policy"]), "--workspace", str(w["ws"]), *extra, "--",
         *(command or (PY, "-c", code or test_policy_run._attempts(w)))],
        user=NOBODY, group=NOBODY, extra_groups=[], cwd=w["ws"], capture_output=True, text=True, timeout=120,
        env=env or dict(os.environ),
    )  # fmt: skip
    assert bundle.exists(), proc.stderr + agent.output()
    manifest, events = read_bundle(bundle)
    return proc, manifest, events


def _same(den: list[dict[str, Any]]) -> set[tuple[str, str, str, bool]]:
    return {(d["operation"], d["target"], d["rule"], d["enforced"]) for d in den}


def test_enforced_through_the_agent_as_standalone(
    agent: Agent, world: dict[str, Any], tmp_path: Path
) -> None:
    proc, manifest, events = through_agent(agent, world)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    alone, alone_manifest, alone_events = record(
        tmp_path, PY, "-c", test_policy_run._attempts(world), name="alone.tar.gz",
        extra=("--standalone", "--policy", str(world["policy"]), "--workspace", str(world["ws"])), cwd=world["ws"],
    )  # fmt: skip
    assert alone.returncode == 0, alone.stderr
    assert got == json.loads(alone.stdout)
    assert got["read_secret"] == 13 and got["connect_denied"] == 1 and got["connect_allowed"] == "ok"
    assert _same(test_policy_run._denials(events)) == _same(
        test_policy_run._denials(alone_events)
    ) and test_policy_run._denials(events)
    pol = manifest["policy"]
    assert pol["mode"] == "enforce" and pol["connect_guard"] is True and pol["workspace"] == str(world["ws"])
    assert pol["sha256"] == alone_manifest["policy"]["sha256"]
    assert manifest["counts"]["dev.evidence.policy.denial"] == len(test_policy_run._denials(events))


def test_dry_run_through_the_agent_exits_4(agent: Agent, world: dict[str, Any]) -> None:
    proc, manifest, events = through_agent(agent, world, "--dry-run")
    assert proc.returncode == 4, proc.stderr
    got = json.loads(proc.stdout)
    assert got["read_secret"] == "ok" and got["connect_denied"] == "ok"
    den = test_policy_run._denials(events)
    assert den and all(d["enforced"] is False for d in den)
    assert manifest["policy"]["mode"] == "dry-run" and "would have been blocked" in proc.stderr


@pytest.mark.parametrize("as_nobody", [True, False], ids=["nobody", "root"])
def test_net_through_the_agent_as_standalone(agent: Agent, tmp_path: Path, as_nobody: bool) -> None:
    """--net through the agent: the client's child makes its own network namespace before the agent
    takes it (a client that is not root, inside a user namespace mapping only its own ids), the agent
    checks it and says so in the manifest; the job reaches neither the host's loopback nor, with
    `none`, any network at all, and its attempts are recorded."""
    host = test_policy_run._listener()
    port = host.getsockname()[1]
    tmp_path.chmod(0o777)
    who: dict[str, Any] = dict(user=NOBODY, group=NOBODY, extra_groups=[]) if as_nobody else {}
    try:
        for mode in ("loopback", "none"):
            bundle = tmp_path / f"{mode}.tar.gz"
            proc = subprocess.run(
                [sys.executable, "-m", "evidence", "run", "--agent", str(agent.socket), "--net", mode,
                 "--bundle", str(bundle), "--", PY, "-c", test_policy_run.net_attempts(port)],
                capture_output=True, text=True, timeout=120, cwd=tmp_path, **who,
            )  # fmt: skip
            assert proc.returncode == 0, proc.stderr + agent.output()
            got = json.loads(proc.stdout)
            assert got["host"] != "ok", got  # the host's loopback listener is out of reach
            assert (got["own"] == "ok") == (mode == "loopback"), got
            manifest, events = read_bundle(bundle)
            assert manifest["network"] == mode
            conns = [e["data"] for e in events if e["type"] == "dev.evidence.network.connect"]
            assert any(c["port"] == port and c["result"] != 0 for c in conns), conns
            (ex,) = [
                e["data"]
                for e in events
                if e["type"] == "dev.evidence.process.exec" and e["data"]["depth"] == 0
            ]
            assert ex["filename"] == PY  # the run holds the command from its exec, not the set-up
    finally:
        host.close()


def test_a_client_that_claims_a_private_network_it_has_not_is_refused(agent: Agent) -> None:
    """The manifest's `network` is checked, not taken on trust: a process in its client's network
    namespace is not isolated as one with --net, and nothing of it is recorded."""
    from evidence.agent.commands.client import AgentClient
    from evidence.errors import UsageError

    child = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(UsageError) as err:
            AgentClient(str(agent.socket)).isolate(child.pid, net="none")
        assert "no private network" in str(err.value) and "shares its client" in str(err.value)
        assert child.poll() is None
        with open(f"/proc/{child.pid}/cgroup") as f:
            assert "evidence" not in f.read()  # not moved into a run
    finally:
        child.kill()
        child.wait()


def test_environment_is_scrubbed_and_private_tmp_is_used(agent: Agent, world: dict[str, Any]) -> None:
    env = {**os.environ, "GITHUB_TOKEN": "ghp_notreal", "LD_PRELOAD": "/nonexistent.so", "CI": "true"}
    code = "import os, json; print(json.dumps({k: os.environ.get(k) for k in ('GITHUB_TOKEN','LD_PRELOAD','CI','TMPDIR')}))"
    proc, manifest, _ = through_agent(agent, world, code=code, env=env)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["GITHUB_TOKEN"] is None and seen["LD_PRELOAD"] is None and seen["CI"] == "true"
    assert seen["TMPDIR"] == manifest["policy"]["tmpdir"]
    assert {"GITHUB_TOKEN", "LD_PRELOAD"} <= set(manifest["policy"]["env_removed"])
    assert not os.path.exists(seen["TMPDIR"]), "the private tmp is removed afterwards"
    assert "ghp_notreal" not in json.dumps(manifest)


def test_a_bad_policy_starts_nothing(agent: Agent, world: dict[str, Any]) -> None:
    bad = world["ws"].parent / "bad.yaml"
    bad.write_text("version: 1\nnet:\n  allow: ['10.0.0.1/33']\n")
    marker = world["ws"] / "ran"
    proc = subprocess.run(
        [sys.executable, "-m", "evidence", "run", "--agent", str(agent.socket), "--policy", str(bad), "--",
         "/usr/bin/touch", str(marker)], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "bad.yaml:3" in proc.stderr and "Traceback" not in proc.stderr, (
        proc.stderr
    )
    assert not marker.exists() and agent.client.runs() == []


def test_with_a_policy_the_command_gets_the_same_seccomp_filters(agent: Agent, world: dict[str, Any]) -> None:
    """io_uring (and TIOCSTI) are refused on the policy path through the agent too."""
    from tests.kernel.test_escapes import URING

    proc, _, _ = through_agent(agent, world, code=URING)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "1", proc.stdout  # EPERM


@pytest.fixture
def allowed_place() -> Iterator[Path]:
    """A directory the world's exec rules allow (below /usr), that nobody can read."""
    d = Path(tempfile.mkdtemp(prefix="evidence-test-rt-", dir="/usr/local/lib"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("via", ["agent", "standalone"])
@pytest.mark.parametrize("how", ["itself", "symlink", "interpreter"])
def test_the_runs_own_command_refused_by_the_exec_rules_is_a_denial(
    agent: Agent, world: dict[str, Any], tmp_path: Path, allowed_place: Path, via: str, how: str
) -> None:
    """Issue 22, item 7. The run's command is refused by the policy's exec rules (EACCES, exit
    126): a program outside /usr, /bin, /lib (`itself`), or a name the rules allow that reaches
    one (`symlink` in /usr/local/lib to it; a `#!` script there whose `interpreter` it is).
    Landlock checks the files, not the names: the last two had exit 126 and no policy.denial.
    Each is recorded as a failed exec and a denial that names the file refused, its rule, and
    the command, through the agent (as nobody) as standalone."""
    prog = tmp_path / "prog"
    shutil.copy("/usr/bin/true", prog)
    prog.chmod(0o755)
    command = {"itself": prog, "symlink": allowed_place / "link", "interpreter": allowed_place / "script"}[
        how
    ]
    (allowed_place / "link").symlink_to(prog)
    (allowed_place / "script").write_text(f"#!{prog}\n")
    (allowed_place / "script").chmod(0o755)
    if via == "agent":
        proc, _, events = through_agent(agent, world, command=(str(command),))
    else:
        proc, _, events = record(
            tmp_path, str(command), extra=("--policy", str(world["policy"]), "--workspace", str(world["ws"])),
            cwd=world["ws"],
        )  # fmt: skip
    assert proc.returncode == 126, proc.stderr
    (ex,) = [e["data"] for e in events if e["type"] == "dev.evidence.process.exec"]
    assert (ex["filename"], ex["result"]) == (str(command), "EACCES")
    denials = [e["data"] for e in events if e["type"] == "dev.evidence.policy.denial"]
    assert [(d["operation"], d["target"], d["rule"], d["enforced"], d["exe"]) for d in denials] == [
        ("exec", str(prog), "fs.exec: not allowed", True, str(command))
    ], events
