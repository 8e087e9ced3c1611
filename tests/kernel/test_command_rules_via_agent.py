"""A policy's command rules through an agent (`evidence run --agent --policy`, an unprivileged
client): the client's process loads the exec filter before it asks to be isolated, the agent takes
the listener (pidfd_getfd, after reading the filters back) and decides every exec as a standalone
run does: refused directly and nested, the job told on its stderr, approvals that time out,
--dry-run exiting 4; and a client that names a listener it has not is refused."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kernel.test_command_rules_run import APPROVE_ID, DENY_ID, _refused
from tests.kernel.test_daemon import Agent
from tests.kernel.test_policy_via_agent import agent  # noqa: F401 - the module's agent fixture
from tests.kernel.util import of_type, read_bundle

pytestmark = pytest.mark.kernel

NOBODY = 65534


@pytest.fixture
def place() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="evidence-cmds-agent-"))
    d.chmod(0o777)
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


def _run(
    agent_: Agent, place: Path, commands: str, script: str, *extra: str, approvals: str = ""
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], list[dict[str, Any]]]:
    policy = place / "policy.yaml"
    policy.write_text(
        "version: 1\ncommands:\n" + textwrap.indent(textwrap.dedent(commands), "  ") + approvals
    )
    policy.chmod(0o644)
    bundle = place / "agent.tar.gz"
    bundle.unlink(missing_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "evidence", "run", "--agent", str(agent_.socket), "--bundle", str(bundle),
         "--policy", str(policy), "--workspace", str(place), *extra, "--", "/bin/sh", "-c", script],
        user=NOBODY, group=NOBODY, extra_groups=[], cwd=place, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bundle.exists(), proc.stderr + agent_.output()
    manifest, events = read_bundle(bundle)
    return proc, manifest, events


def test_execs_are_decided_by_the_agent(agent: Agent, place: Path) -> None:  # noqa: F811
    (place / "myid").symlink_to("/usr/bin/id")
    proc, manifest, events = _run(
        agent,
        place,
        DENY_ID,
        f"id; echo direct=$?; sh -c id; echo nested=$?; {place}/myid; echo link=$?; echo done",
    )
    assert "uid=" not in proc.stdout and "done" in proc.stdout, proc.stdout + proc.stderr
    assert _refused(events).get("/usr/bin/id") == "commands.rules[0] (no-id)"
    assert "evidence: exec of /usr/bin/id refused by commands.rules[0] (no-id): ask a human" in proc.stderr
    said = [e["data"]["component"] for e in of_type(events, "degradation")]
    assert "commands" not in said, said


def test_quiet_denials_through_the_agent(agent: Agent, place: Path) -> None:  # noqa: F811
    proc, _, events = _run(agent, place, DENY_ID, "id", "--quiet-denials")
    assert "/usr/bin/id" in _refused(events) and "refused by" not in proc.stderr, proc.stderr


def test_an_approval_times_out_through_the_agent(agent: Agent, place: Path) -> None:  # noqa: F811
    proc, _, events = _run(
        agent, place, APPROVE_ID, "/usr/bin/id; echo rc=$?", approvals="approvals:\n  timeout: 1s\n"
    )
    asked = [e["data"] for e in of_type(events, "policy.approval")]
    assert [a["state"] for a in asked] == ["requested", "denied"] and asked[1]["via"] == "timeout", asked
    assert "uid=" not in proc.stdout


def test_dry_run_through_the_agent_exits_4(agent: Agent, place: Path) -> None:  # noqa: F811
    proc, _, events = _run(agent, place, DENY_ID, "id", "--dry-run")
    assert "uid=65534" in proc.stdout and proc.returncode == 4, proc.stderr
    den = [e["data"] for e in of_type(events, "policy.denial") if e["data"]["target"] == "/usr/bin/id"]
    assert den and not den[0]["enforced"]


def test_a_client_that_names_a_listener_it_has_not_is_refused(agent: Agent, place: Path) -> None:  # noqa: F811
    """A client of the job's own claims command rules with no exec filter loaded: refused."""
    from evidence.agent.commands.client import AgentClient

    policy_text = "version: 1\ncommands:\n" + textwrap.indent(DENY_ID, "  ")
    child = subprocess.Popen(["/bin/sleep", "30"], pass_fds=())
    try:
        with pytest.raises(Exception) as e:
            AgentClient(str(agent.socket)).isolate(
                child.pid,
                command=["/bin/sleep", "30"],
                policy={
                    "text": policy_text,
                    "name": "p.yaml",
                    "variables": {"WORKSPACE": str(place), "TMPDIR": str(place), "HOME": str(place)},
                    "mode": "enforce",
                    "fail_closed": False,
                    "env_removed": [],
                    "exec_listener_fd": 3,
                },
            )
        assert "does not run under an exec filter" in str(e.value), e.value
    finally:
        child.kill()
        child.wait()
