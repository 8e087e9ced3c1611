"""A policy's command rules on one run (issue 24): the exec supervisor, the approvals it asks for,
and what the job is told, put together for a `Run` (agent/recorder/run.py).

The command's launcher loads the exec filter last before it execs the command and hands its
listener over (agent/recorder/launch.py: `LaunchSpec.supervise`, agent/recorder/exec_helper.py);
`CommandRules.supervise` starts an `ExecSupervisor` (exec_supervisor.py) on it, whose decisions
become the run's records: a refused exec (or, in a dry run, one the rules would refuse or ask
about) a `policy.denial`, an exec an `audit` rule matched a `policy.audit` (the first
format.AUDIT_RECORDS_MAX of the run; past them counted, `audit_past_cap` in the manifest's lost),
each approval request and its answer a `policy.approval` (the broker's records). The supervisor
runs in a process of its own (exec_process.py), the records, approvals and notices here. Refusals and waits are told to the job (`tell`: the run's `NoticeWriter`, notices.py, on
a dup of its stderr, unless `--quiet-denials`). `close` (once the run's processes are gone) stops the
supervisor and withdraws what still waits.

The no-race check after an allowed exec (exec_check.py, probes/bpf/exec_check.bpf.c): `supervise`
builds the run's `ExecCheck` on the run's slot and enforces it before it answers the command's first
exec (the launcher's own execs are over by then: it hands the listener over last), so that from
then on every exec of the run must have been pinned by the supervisor (`publish`) or is killed
before its first instruction; `close` releases it. A kernel that refuses the check's program leaves
the race open: `degrade` says so (the run's manifest), the rules still decide.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from evidence.agent.recorder.exec_check import ExecCheck, ExecPins
from evidence.agent.recorder.exec_process import SupervisorProcess
from evidence.agent.recorder.exec_supervisor import ExecDecision, audit_record, denial_record

if TYPE_CHECKING:
    from evidence.agent.recorder.approvals import ApprovalBroker
    from evidence.bundle.format import Degradation
    from evidence.bundle.record_types import SpoolRecord
    from evidence.policy.model import Policy

logger = logging.getLogger(__name__)

USER_NOTIF = "/proc/sys/kernel/seccomp/actions_avail"
AUDIT_PAST_CAP = "audit_past_cap"  # lost.by_kind: audited execs past the run's cap, counted


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


# filesystems whose files stat(2) names by another device than the one the kernel's check compares
# (a btrfs subvolume's anonymous device): every exec of a program there would be killed
UNPINNABLE = frozenset({"btrfs"})


def unpinnable_programs(mountinfo: str) -> str | None:
    """Why the exec check cannot be used here (None: it can): / or /usr (where programs are) is on a
    filesystem whose files the pins cannot name (`UNPINNABLE`). `mountinfo`: /proc/self/mountinfo."""
    types: dict[str, str] = {}
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) >= 5 and right:
            types[fields[4]] = right.split()[0]  # a later mount on the same point is over the earlier
    for where in ("/", "/usr"):
        fs = types.get(where) if where in types or where == "/" else types.get("/")
        if fs in UNPINNABLE:
            return f"{where} is {fs}, whose files stat(2) names by another device than the kernel's check"
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
        pins: ExecPins | None = None,
        slot: int = 0,
        degrade: Callable[[Degradation], None] = lambda _said: None,
        past_cap: dict[str, int] | None = None,
        audit_max: int | None = None,
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
        self.supervisor: SupervisorProcess | None = None
        # the exec check (None: no probes to pin through, e.g. fakes): built by `supervise`
        self.pins = pins
        self.slot = slot
        self.degrade = degrade
        self.check: ExecCheck | None = None
        # audit records: the first `audit_max` kept, the rest counted into `past_cap` (the run's
        # Session.past_cap: the manifest's lost.by_kind AUDIT_PAST_CAP) when the rules close
        from evidence.bundle.format import AUDIT_RECORDS_MAX

        self.past_cap = past_cap if past_cap is not None else {}
        self.audit_max = AUDIT_RECORDS_MAX if audit_max is None else audit_max
        self.audits = 0  # audit matches, kept or not
        self._lock = threading.Lock()

    def supervise(self, listener: int, root_pid: int) -> None:
        """Decide the execs of the process `root_pid` (the command's, about to exec it) and of
        everything it starts, from the filter's `listener` (owned from now on)."""
        try:
            check = self._enforce()
        except BaseException:
            os.close(listener)  # the job's execs fail (ENOSYS): nothing runs undecided
            raise
        pins_fd = check.probes.pins_fd() if check is not None else None
        if check is not None and pins_fd is None:  # nothing to publish into: every exec would be killed
            os.close(listener)
            raise OSError("the exec check has no pin map to publish into")
        self.supervisor = SupervisorProcess(  # takes the listener, whatever happens
            listener,
            self.commands,
            root_pid,
            approver=self.broker.approver(self.session_id, self.owner_uid, self.policy.approvals),
            on_decision=self._decided,
            tell=self.tell,
            dry_run=self.dry_run,
            pins_fd=pins_fd,
            check_key=check.key if check is not None else b"",
            on_death=self._died,
        )
        self.supervisor.start()

    def _enforce(self) -> ExecCheck | None:
        """The run's exec check, enforced (None: not in force, and the run says why; a dry run
        refuses nothing, so has nothing to check)."""
        if self.pins is None or self.dry_run:
            return None
        from evidence.bundle.format import Degradation
        from evidence.probes.bpfsys import ObjectError

        try:
            with open("/proc/self/mountinfo") as f:
                unpinnable = unpinnable_programs(f.read())
        except OSError:
            unpinnable = None
        if unpinnable is not None:  # every exec would be killed: a broken run, not a checked one
            self.degrade(
                Degradation(
                    component="commands",
                    reason=f"the exec check is off: {unpinnable}, so every exec would be killed",
                    impact="an exec the command rules allowed may run other arguments or another file "
                    "if another thread of the job rewrites them between the decision and the kernel's copy",
                )
            )
            return None
        check = ExecCheck(self.pins, self.slot)
        try:
            check.enforce()
        except ObjectError as e:
            logger.warning("run %s: the exec check is not in force: %s", self.session_id, e)
            self.degrade(
                Degradation(
                    component="commands",
                    reason=f"the kernel refused the exec check: {e}",
                    impact="an exec the command rules allowed may run other arguments or another file "
                    "if another thread of the job rewrites them between the decision and the kernel's copy",
                )
            )
            return None
        self.check = check
        return check

    def moved(self, slot: int) -> None:
        """The run's records go to slot `slot` from now on (a window cut by the agent): its execs
        are checked there with the same key (the supervisor's pins stay valid), then not in the
        old slot."""
        old, self.slot = self.check, slot
        if old is None:
            return
        new = ExecCheck(old.probes, slot, key=old.key)
        new.enforce()
        self.check = new
        old.release()

    def _died(self, why: str) -> None:
        from evidence.bundle.format import Degradation

        self.degrade(
            Degradation(
                component="commands",
                reason=f"the exec supervisor's process died ({why})",
                impact="every exec of the job after that failed (ENOSYS): command rules fail closed",
            )
        )

    def _decided(self, result: ExecDecision) -> None:
        t = self.clock_ns()
        if result.answered_ns:  # when it was answered, not when the news came
            t -= max(0, time.monotonic_ns() - result.answered_ns)
        rec = denial_record(result, t)
        if rec is not None:
            self.add_records([rec])
        audit = audit_record(result, t)
        if audit is not None:
            with self._lock:
                self.audits += 1
                keep = self.audits <= self.audit_max
            if keep:
                self.add_records([audit])

    def close(self) -> None:
        """Stop deciding (what still waits fails) and withdraw the run's open approval requests."""
        sup, self.supervisor = self.supervisor, None
        if sup is not None:
            sup.stop()
        with self._lock:
            past, self.audits = max(0, self.audits - self.audit_max), min(self.audits, self.audit_max)
        if past:
            self.past_cap[AUDIT_PAST_CAP] = self.past_cap.get(AUDIT_PAST_CAP, 0) + past
            logger.warning(
                "run %s: past its cap of %d audit records, %d audited execs were counted, not kept",
                self.session_id,
                self.audit_max,
                past,
            )
        check, self.check = self.check, None
        if check is not None:
            try:
                check.release()
            except Exception as e:  # noqa: BLE001 - the slot's key is wiped when the slot is reused
                logger.warning("run %s: releasing the exec check failed: %s", self.session_id, e)
        self.broker.close_run(self.session_id)
