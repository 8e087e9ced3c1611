"""A policy's `limits` on a run (issue 24), standalone (`evidence run --policy`, the job as nobody)
and through an agent (`run --agent`, an unprivileged client): a memory hog OOM-killed and recorded
naming the process, a fork bomb stopped at limits.pids and recorded, limits.wall killing the run
(standalone: exit 124), and the manifest saying which limits were in force; --fail-closed runs when
they are."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kernel.test_daemon import Agent
from tests.kernel.test_policy_via_agent import agent  # noqa: F401 - the module's agent fixture
from tests.kernel.util import PY, as_user, evidence, of_type, read_bundle

pytestmark = pytest.mark.kernel

NOBODY = 65534

HOG = """\
import os, sys
chunks = []
print(os.getpid(), flush=True)
for _ in range(256):                     # up to 4 GiB, 16 MiB at a time, every page touched
    chunks.append(bytearray(16 << 20))
print("not killed", flush=True)
"""

BOMB = """\
import os, time
made = refused = 0
for _ in range(64):
    try:
        pid = os.fork()
    except OSError:
        refused += 1
        continue
    if pid == 0:
        time.sleep(3)
        os._exit(0)
    made += 1
print(made, refused, flush=True)
"""


@pytest.fixture
def place() -> Iterator[Path]:  # nobody must reach it (pytest's tmp_path is 0700)
    d = Path(tempfile.mkdtemp(prefix="evidence-limits-"))
    d.chmod(0o777)
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


def _policy(place: Path, limits: str) -> Path:
    p = place / "policy.yaml"
    p.write_text(textwrap.dedent("version: 1\nlimits:\n") + textwrap.indent(limits, "  "))
    p.chmod(0o644)
    return p


def _run(
    via: str, agent_: Agent, place: Path, limits: str, *command: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], list[dict[str, Any]]]:
    policy = _policy(place, limits)
    bundle = place / f"{via}.tar.gz"
    bundle.unlink(missing_ok=True)
    if via == "standalone":
        proc = evidence(
            "run",
            "--bundle",
            str(bundle),
            "--policy",
            str(policy),
            "--",
            *as_user(NOBODY, *command),
            cwd=place,
        )
    else:
        proc = subprocess.run(
            [sys.executable, "-m", "evidence", "run", "--agent", str(agent_.socket), "--bundle", str(bundle),
             "--policy", str(policy), "--workspace", str(place), "--", *command],
            user=NOBODY, group=NOBODY, extra_groups=[], cwd=place, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert bundle.exists(), proc.stderr + (agent_.output() if via == "agent" else "")
    manifest, events = read_bundle(bundle)
    return proc, manifest, events


@pytest.mark.parametrize("via", ["standalone", "agent"])
def test_a_memory_hog_is_oom_killed_and_recorded_naming_it(agent: Agent, place: Path, via: str) -> None:  # noqa: F811
    proc, manifest, events = _run(via, agent, place, "memory: 64MiB\n", PY, "-c", HOG)
    assert "not killed" not in proc.stdout, proc.stderr
    hog = int(proc.stdout.split()[0])
    assert "memory" in manifest["capabilities"]["limits"], manifest["capabilities"]
    said = [e["data"] for e in of_type(events, "degradation")]
    assert not [d for d in said if d["component"] == "limits"], said
    limits = of_type(events, "policy.limit")
    ooms = [e["data"] for e in limits if e["data"]["kind"] == "oom_kill"]
    assert ooms, limits
    killed = [e["data"] for e in of_type(events, "process.exit") if e["data"]["signal"] == "SIGKILL"]
    assert any(k["pid"] == hog for k in killed), killed
    named = {p for o in ooms for p in o["pids"]}
    assert hog in named, (ooms, hog, proc.stderr)


@pytest.mark.parametrize("via", ["standalone", "agent"])
def test_a_fork_bomb_is_stopped_at_pids_and_recorded(agent: Agent, place: Path, via: str) -> None:  # noqa: F811
    proc, manifest, events = _run(via, agent, place, "pids: 16\n", PY, "-c", BOMB)
    made, refused = map(int, proc.stdout.split())
    assert refused > 0 and made < 16, proc.stdout
    forks = [e["data"] for e in of_type(events, "policy.limit") if e["data"]["kind"] == "fork_refused"]
    assert forks and sum(f["count"] for f in forks) >= refused, forks
    assert "pids 16" in manifest["capabilities"]["limits"]


@pytest.mark.parametrize("via", ["standalone", "agent"])
def test_the_wall_limit_kills_the_run_and_says_so(agent: Agent, place: Path, via: str) -> None:  # noqa: F811
    marker = place / "late"
    proc, manifest, events = _run(
        via, agent, place, "wall: 2s\n", "/bin/sh", "-c", f"sleep 20; touch {marker}"
    )
    assert not marker.exists()
    walls = [e["data"] for e in of_type(events, "policy.limit") if e["data"]["kind"] == "wall"]
    assert len(walls) == 1 and "killed" in walls[0]["detail"], walls
    if via == "standalone":
        assert proc.returncode == 124, proc.stderr
        assert "limits.wall" in proc.stderr
    else:
        assert proc.returncode != 0


def test_fail_closed_runs_when_commands_and_limits_are_in_force(place: Path) -> None:
    """--fail-closed with commands and limits this host applies: the run starts, nothing degraded
    (a section not applied refuses it: tests/unit/test_enforce.py)."""
    policy = place / "policy.yaml"
    policy.write_text(
        "version: 1\nlimits:\n  pids: 64\ncommands:\n  rules:\n    - {name: x, program: [curl], decision: deny}\n"
    )
    marker = place / "ran"
    proc = evidence(
        "run", "--bundle", str(place / "b.tar.gz"), "--policy", str(policy), "--fail-closed", "--",
        *as_user(NOBODY, "/bin/sh", "-c", f"touch {marker}"),
    )  # fmt: skip
    assert proc.returncode == 0 and marker.exists(), proc.stderr
    _, events = read_bundle(place / "b.tar.gz")
    assert of_type(events, "degradation") == [], of_type(events, "degradation")
