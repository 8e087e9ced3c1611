"""The agent's side of a policy on an isolated run: the connect guard on the run's cgroup, and denials.

The client (agent/commands/run_agent.py: ClientPolicy) loaded the policy, gave the command its
private tmp, scrubbed environment and Landlock domain, and sent the policy's text and variables.
Here the same policy is parsed again (with the client's variables, so paths mean the same), the
connect guard is compiled and attached to the run's cgroup before the command is moved in, and the
recorded opens and execs are matched against the file rules, as for a standalone run
(agent/recorder/enforce.py: `Enforcement`, which this reuses). Nothing of the client's is removed
here: its tmp is its own.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from evidence.agent.recorder.enforce import Enforcement
from evidence.policy import landlock
from evidence.policy.model import parse_policy

if TYPE_CHECKING:
    from evidence.agent.daemon.models import PolicySpec

logger = logging.getLogger(__name__)

_COMPILE = threading.Lock()  # BCC compiles one program at a time in a process


class AgentEnforcement(Enforcement):
    """`Enforcement` built from what the client sent (no tmp, no environment, no namespace here)."""

    def __init__(self, spec: PolicySpec) -> None:  # noqa: D107 - the parent's set-up is not wanted
        self.mode = spec.mode
        self.workspace = spec.variables["WORKSPACE"]
        self.tmpdir = spec.variables["TMPDIR"]
        self.guard = None
        self.netns = None
        self.degradations = []
        self._rules = {}
        self._dry_run = spec.mode == "dry-run"
        self._fail_closed = spec.fail_closed
        self.env_removed = list(spec.env_removed)
        self.policy = parse_policy(spec.text, name=spec.name, variables=dict(spec.variables))
        self.abi = landlock.abi_version()
        self.plan = landlock.plan(self.policy, self.abi)
        self.degradations += [dict(d) for d in self.plan.degradations]
        if self.policy.fs is not None and not self.plan.enforced and not self._dry_run:
            self.degradations.append(
                {
                    "component": "landlock",
                    "reason": "Landlock is not available on this kernel",
                    "impact": "file rules are recorded but not enforced",
                }
            )

    def load_programs(self) -> None:
        with _COMPILE:
            super().load_programs()

    def close(self) -> None:
        if self.guard is not None:
            self.guard.close()
            self.guard = None
