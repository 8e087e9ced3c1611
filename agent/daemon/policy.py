"""The agent's side of a policy on an isolated run: the connect guard on the run's cgroup, and denials.

The client (agent/commands/run_agent.py: ClientPolicy) loaded the policy, gave the command its
private tmp, scrubbed environment and Landlock domain, and sent the policy's text and variables.
Here the same policy is parsed again (with the client's variables, so paths mean the same), the
connect guard is compiled and attached to the run's cgroup before the command is moved in, and the
recorded opens and execs are matched against the file rules, as for a standalone run
(agent/recorder/enforce.py: `Enforcement`, which this reuses). Nothing of the client's is removed
here: its tmp is its own.

Command rules: the client's process loaded the exec filter before it asked to be isolated and
names its listener's descriptor; the agent reads the process's filters back (one must send execve
and execveat to a listener), takes the listener with pidfd_getfd (`take_exec_listener`) and
decides the run's execs with its one approvals broker (`command_rules`). The client's process
closes its copy before it execs; a client that kept one could answer CONTINUE itself until the BPF
exec check closes that (docs/threat-model.md).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import time
from typing import TYPE_CHECKING

from evidence.agent.recorder.enforce import Enforcement
from evidence.errors import Error, UsageError
from evidence.policy.model import parse_policy

if TYPE_CHECKING:
    from evidence.agent.daemon.models import PolicySpec
    from evidence.agent.recorder.approvals import ApprovalBroker
    from evidence.agent.recorder.command_rules import CommandRules
    from evidence.agent.recorder.description import Network
    from evidence.agent.recorder.recording import Recorder
    from evidence.agent.recorder.run import Run

logger = logging.getLogger(__name__)


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
        # limits: on the cgroup the agent makes for the run; commands: when the client's process
        # loaded the exec filter and names its listener (backend.py: _isolate takes it)
        applies=("limits", "commands") if spec.exec_listener_fd is not None else ("limits",),
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


_NR_PIDFD_GETFD = 438
_libc = ctypes.CDLL(None, use_errno=True)


def pidfd_getfd(pidfd: int, fd: int) -> int:
    """A copy, in this process, of descriptor `fd` of the process behind `pidfd` (close-on-exec)."""
    got = _libc.syscall(_NR_PIDFD_GETFD, ctypes.c_int(pidfd), ctypes.c_int(fd), ctypes.c_uint(0))
    if got < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return int(got)


def take_exec_listener(pid: int, pidfd: int, fd: int) -> int:
    """The exec filter's listener, taken from the client's process `pid` (descriptor `fd`), once
    its filters, read back, show that its execve and execveat go to a listener, and the descriptor
    is a seccomp listener; UsageError otherwise (a client that claims command rules it has not).
    A client that kept a copy of the listener could answer its own execs: the BPF exec check (to
    come) is what closes that (docs/threat-model.md)."""
    from evidence.agent.recorder import seccomp_check

    try:
        installed = seccomp_check.installed_filters(pid)
    except OSError as e:
        raise UsageError(f"cannot read the seccomp filters of process {pid}: {e.strerror}") from None
    if not seccomp_check.notifies_execs(installed):
        raise UsageError(
            f"process {pid} does not run under an exec filter that notifies: its command rules cannot be decided"
        )
    try:
        listener = pidfd_getfd(pidfd, fd)
    except OSError as e:
        raise UsageError(f"cannot take the exec listener {fd} of process {pid}: {e.strerror}") from None
    try:
        what = os.readlink(f"/proc/self/fd/{listener}")
    except OSError:
        what = ""
    if what != "anon_inode:seccomp notify":
        os.close(listener)
        raise UsageError(
            f"descriptor {fd} of process {pid} is not a seccomp listener ({what or errno.EBADF})"
        )
    return listener


def exec_listener(
    pid: int, pidfd: int | None, enforcement: Enforcement | None, spec: PolicySpec | None
) -> int | None:
    """The exec filter's listener of the client's process, when its policy has command rules and
    the client says where it is (else the run says they are not in force: Enforcement's applies)."""
    if enforcement is None or spec is None or enforcement.policy.commands is None:
        return None
    if spec.exec_listener_fd is None:
        return None
    if pidfd is None:
        raise UsageError("command rules need the command's process by pidfd")
    return take_exec_listener(pid, pidfd, spec.exec_listener_fd)


def command_rules(
    run: Run,
    pid: int,
    pidfd: int,
    listener: int,
    enforcement: Enforcement,
    spec: PolicySpec,
    broker: ApprovalBroker,
    recorder: Recorder,
) -> CommandRules:
    """The run's command rules (agent/recorder/command_rules.py), deciding from `listener` now:
    approvals through the agent's one broker, the job told through the run's notices."""
    from evidence.agent.recorder.command_rules import CommandRules

    offset = recorder.wall_offset_ns
    notices = run.notices
    try:
        owner = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        owner = 0
    rules = CommandRules(
        run.session_id,
        enforcement.policy,
        add_records=run.session.add_records,
        broker=broker,
        owner_uid=owner,
        tell=notices.tell if notices is not None else lambda _line: None,
        dry_run=enforcement.mode == "dry-run",
        clock_ns=lambda: time.monotonic_ns() + offset,
        pins=recorder.probes,
        slot=run.session.slot,
        degrade=run.degrade,
        past_cap=run.session.past_cap,  # audited execs past the cap: counted in the manifest's lost
    )
    try:
        rules.supervise(listener, pid)
    except BaseException:
        rules.close()
        raise
    from evidence.agent.recorder.exec_process import prespawn

    prespawn()  # the next run's supervisor process starts now, not while its first exec waits
    return rules


def job_notices(run: Run, pidfd: int, spec: PolicySpec) -> None:
    """Tell the job of the policy's refusals on its own stderr (a copy of the process's descriptor
    2, taken before it execs), unless the client asked for quiet (--quiet-denials)."""
    from evidence.agent.recorder.notices import NoticeWriter

    if spec.quiet_denials:
        return
    try:
        fd = pidfd_getfd(pidfd, 2)
    except OSError as e:
        logger.info("run %s: the job's stderr cannot be taken: %s", run.session_id, e.strerror)
        return
    run.notices = NoticeWriter(fd)
    run.notices.start()
