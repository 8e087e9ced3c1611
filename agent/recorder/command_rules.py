"""A policy's command rules on one run (issue 24): the exec supervisor, the approvals it asks for,
and what the job is told, put together for a `Run` (agent/recorder/run.py).

The command's launcher loads the exec filter last before it execs the command and hands its
listener over (agent/recorder/launch.py: `LaunchSpec.supervise`, agent/recorder/exec_helper.py);
`CommandRules.supervise` starts an `ExecSupervisor` (exec_supervisor.py) on it, whose decisions
become the run's records: a refused exec (or, in a dry run, one the rules would refuse or ask
about) a `policy.denial`, each approval request and its answer a `policy.approval` (the broker's
records). Refusals and waits are told to the job (`tell`: the run's `NoticeWriter`, notices.py, on
a dup of its stderr, unless `--quiet-denials`). `close` (once the run's processes are gone) stops the
supervisor and withdraws what still waits.

The no-race check after an allowed exec (exec_check.py, its BPF half to come) plugs in here:
`ExecSupervisor(publish=..., check_key=...)` in `supervise`; until then `publish` is None and
what another thread rewrites between the decision and the kernel's copy is not caught.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from evidence.agent.recorder.exec_supervisor import ExecDecision, ExecSupervisor, denial_record

if TYPE_CHECKING:
    from evidence.agent.recorder.approvals import ApprovalBroker
    from evidence.bundle.record_types import SpoolRecord
    from evidence.policy.model import Policy

logger = logging.getLogger(__name__)

USER_NOTIF = "/proc/sys/kernel/seccomp/actions_avail"


def user_notification() -> str | None:
    """Why command rules cannot be enforced here (None: they can): seccomp user notification in the
    kernel and Debian's python3-seccomp to load the filter."""
    try:
        with open(USER_NOTIF) as f:
            if "user_notif" not in f.read().split():
                return "the kernel has no seccomp user notification"
    except OSError:
        return "the kernel has no seccomp user notification (no actions_avail)"
    try:
        import seccomp  # noqa: F401 - is the binding there
    except ImportError:
        return "python3-seccomp (libseccomp's binding) is not installed"
    return None


class CommandRules:
    """The command rules of one run (this module's docstring)."""

    def __init__(
        self,
        session_id: str,
        policy: Policy,
        *,
        add_records: Callable[[list[SpoolRecord]], None],
        broker: ApprovalBroker,
        owner_uid: int,
        tell: Callable[[str], None] = lambda _line: None,
        dry_run: bool = False,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        assert policy.commands is not None
        self.session_id = session_id
        self.policy = policy
        self.commands = policy.commands
        self.add_records = add_records
        self.broker = broker
        self.owner_uid = owner_uid
        self.tell = tell  # a line to the job (the run's NoticeWriter.tell)
        self.dry_run = dry_run
        self.clock_ns = clock_ns
        self.supervisor: ExecSupervisor | None = None

    def supervise(self, listener: int, root_pid: int) -> None:
        """Decide the execs of the process `root_pid` (the command's, about to exec it) and of
        everything it starts, from the filter's `listener` (owned from now on)."""
        try:
            self.supervisor = ExecSupervisor(
                listener,
                self.commands,
                root_pid,
                approver=self.broker.approver(self.session_id, self.owner_uid, self.policy.approvals),
                on_decision=self._decided,
                tell=self.tell,
                dry_run=self.dry_run,
                publish=None,  # the BPF exec check plugs in here (exec_check.py)
            )
            self.supervisor.start()
        except BaseException:
            os.close(listener)  # the job's execs fail (ENOSYS): nothing runs undecided
            raise

    def _decided(self, result: ExecDecision) -> None:
        rec = denial_record(result, self.clock_ns())
        if rec is not None:
            self.add_records([rec])

    def close(self) -> None:
        """Stop deciding (what still waits fails) and withdraw the run's open approval requests."""
        sup, self.supervisor = self.supervisor, None
        if sup is not None:
            sup.stop()
        self.broker.close_run(self.session_id)
