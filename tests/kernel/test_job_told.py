"""The job is told (issue 24): a file or connect refused by a policy's `fs` or `net` rules is one
line on the job's own stderr, standalone and through the agent (as nobody), as execs refused by
command rules are; `--quiet-denials` turns it off; a dry run tells nothing."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.kernel import test_policy_run
from tests.kernel.test_daemon import Agent
from tests.kernel.test_policy_via_agent import (  # noqa: F401 - the agent fixture
    agent,
    through_agent,
    tmp_path,  # noqa: F401 - a place nobody reaches
)
from tests.kernel.util import PY, as_user, record

pytestmark = pytest.mark.kernel

NOBODY = 65534
world = test_policy_run.world


def _code(w: dict[str, Any]) -> str:
    d4 = w["denied"].getsockname()[1]
    return textwrap.dedent(
        f"""
        import socket
        for what, fn in (("read", lambda: open({str(w["secret"])!r}).read()),
                         ("connect", lambda: socket.create_connection(("127.0.0.1", {d4}), timeout=2))):
            try:
                fn()
            except OSError as e:
                print(what, e.errno)
        """
    )


def _run(via: str, agent_: Agent, w: dict[str, Any], tmp: Path, *extra: str) -> str:
    if via == "agent":
        proc, _, _ = through_agent(agent_, w, *extra, code=_code(w))
    else:
        w["ws"].chmod(0o777)
        proc, _, _ = record(
            tmp, *as_user(NOBODY, PY, "-c", _code(w)),
            extra=("--policy", str(w["policy"]), "--workspace", str(w["ws"]), *extra), cwd=w["ws"],
        )  # fmt: skip
    return proc.stderr


@pytest.mark.parametrize("via", ["standalone", "agent"])
def test_file_and_connect_refusals_are_told_to_the_job(
    agent: Agent,  # noqa: F811
    world: dict[str, Any],
    tmp_path: Path,  # noqa: F811
    via: str,
) -> None:
    err = _run(via, agent, world, tmp_path)
    d4 = world["denied"].getsockname()[1]
    assert f"evidence: read of {world['secret']} refused by fs.deny[0]" in err, err
    assert f"evidence: connect of 127.0.0.1:{d4} refused by net.deny[0]" in err, err
    quiet = _run(via, agent, world, tmp_path, "--quiet-denials")
    assert "refused by" not in quiet, quiet
    dry = _run(via, agent, world, tmp_path, "--dry-run")
    assert "refused by" not in dry, dry
