"""Red team of the 32-bit system call fix (issue 22.1).

The agent isolates a process for a client (`POST /runs` with isolate_pid, what `run --agent` uses),
whose child installs evidence's seccomp filters. A client of the job's own (uid 65534, the same
trust the threat model's row 43 gives it) need not: its child then opened and wrote a file through
`int $0x80`, and the bundle said 32-bit calls were refused and linted clean. The agent now reads the
child's filters back (ptrace PTRACE_SECCOMP_GET_FILTER) before it takes it: a filter missing is a
degradation, and the manifest says 32-bit calls were not refused.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernel.test_compat_syscalls import INT80, _refused, listener, victims  # noqa: F401 - fixtures
from tests.kernel.test_run_via_agent import NOBODY, agent, out, workdir  # noqa: F401 - fixtures
from tests.kernel.util import PY, evidence, of_type, read_bundle

pytestmark = pytest.mark.kernel

# As uid 65534: an agent client of its own. It forks a child that installs no filter, asks the agent
# to isolate it (as `run --agent` does), then lets it exec `argv`; finishes and downloads the bundle.
_OWN_CLIENT = r"""
import json, os, sys
from pathlib import Path
from evidence.agent.commands.client import AgentClient
from evidence.agent.commands.finish import fetch_bundle
sock, out, argv = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
c = AgentClient(sock, 60)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(w)
    if os.read(r, 1) == b"g":
        os.execv(argv[0], argv)
    os._exit(0)
os.close(r)
started = c.isolate(pid, command=argv)
os.write(w, b"g")
os.close(w)
_, status = os.waitpid(pid, 0)
answer = c.finish(started["session_id"], exit_code=os.waitstatus_to_exitcode(status))
fetch_bundle(c, answer, Path(out))
"""


def test_an_isolated_run_without_evidences_filters_says_so(
    agent,  # noqa: F811
    out: Path,  # noqa: F811
    victims: Path,  # noqa: F811
    listener: int,  # noqa: F811
) -> None:
    argv = [
        PY,
        "-c",
        INT80,
        str(victims / "victim"),
        str(victims / "src"),
        str(victims / "dst"),
        str(listener),
    ]
    bundle = out / "own-client.tar.gz"
    proc = subprocess.run(
        [sys.executable, "-c", _OWN_CLIENT, str(agent.socket), str(bundle), json.dumps(argv)],
        user=NOBODY, group=NOBODY, extra_groups=[], cwd=out, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr + agent.output()
    # the client's child had no filter: its i386 calls went through, and the bundle says so
    assert (victims / "victim").read_text() == "pwned\n"
    manifest, events = read_bundle(bundle)
    reasons = [e["data"]["reason"] for e in of_type(events, "degradation")]
    assert any("filter for 32-bit system calls" in r for r in reasons), reasons
    assert any("filter for io_uring" in r for r in reasons), reasons
    assert manifest["capabilities"]["32bit_syscalls"].startswith("not refused")
    lint = evidence("lint", str(bundle), "--fail-on", "warn")
    assert lint.returncode == 1 and "EV002" in lint.stdout, lint.stdout
