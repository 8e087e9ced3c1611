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

from typing import TYPE_CHECKING

from evidence.agent.recorder.enforce import Enforcement
from evidence.errors import Error, UsageError
from evidence.policy.model import parse_policy

if TYPE_CHECKING:
    from evidence.agent.daemon.models import PolicySpec
    from evidence.agent.recorder.description import Network


def agent_enforcement(spec: PolicySpec, net: Network = None) -> Enforcement:
    """The `Enforcement` of what the client sent: the policy parsed with the client's variables,
    the client's tmp (not removed here) and the names it scrubbed from the environment."""
    return Enforcement(
        parse_policy(spec.text, name=spec.name, variables=dict(spec.variables)),
        workspace=spec.variables["WORKSPACE"],
        tmpdir=spec.variables["TMPDIR"],
        dry_run=spec.mode == "dry-run",
        fail_closed=spec.fail_closed,
        env_removed=spec.env_removed,
        net_mode=net,
        applies=("limits",),  # on the cgroup the agent makes for the run (backend.py: _isolate)
    )


def loaded_enforcement(spec: PolicySpec, net: Network = None) -> Enforcement:
    """`agent_enforcement`, its programs compiled (the connect guard) and --fail-closed checked; a
    policy that cannot be is the client's error (UsageError), and nothing of it is left loaded."""
    enforcement = None
    try:
        enforcement = agent_enforcement(spec, net)
        enforcement.load_programs()
    except Error as e:
        if enforcement is not None:
            enforcement.close()
        raise UsageError(e.message, e.hint) from None
    return enforcement
