"""The approvals broker: an exec that a `commands` rule says to `approve` waits here for a person
(issue 24; wired into a run by the lead: see the report's hooks).

The exec supervisor (exec_supervisor.py) calls the approver it was given with an `Asked` (what the
exec asks, the rule, the depth, and whether the exec is still waiting); `ApprovalBroker.approver()`
makes that approver for one run: it opens a request, tells the subscribers (the terminal prompt,
the agent's API and live stream), and waits, holding the exec in the kernel, until
- a person answers: `answer(id, allow, uid=, via="terminal"|"api", reason=)`: through the API root
  or the run's owner only (a request of another user's run is not disclosed: UnknownRequest), at
  the run's own terminal whoever sits there (tty_approver.py);
- the timeout (`approvals.timeout`) passes: `approvals.on_timeout` decides, recorded as `timeout`;
- the exec's caller goes away (it was killed: its notification is no longer pending), or the run
  ends (`close_run`): the request is `withdrawn` and the exec does not run.
Each request and each resolution is an `ApprovalRecord` handed to `record` (the recorder spools it
as a dev.evidence.policy.approval event). Who owns a run is the agent's API's to say (`set_owner`,
called when a run starts through it), whatever uid the run's approver was made with. A resolution
is final: a second answer gets AlreadyAnswered.

If the supervisor itself dies while an exec waits, the kernel fails the exec (ENOSYS from a listener
that is gone); the broker, if it survives (the agent), withdraws the run's requests at close_run.

Thread-safe: one lock guards the requests; each waiting exec waits on its own event.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from evidence.policy.commands import CommandDecision

if TYPE_CHECKING:  # not imported by the exec supervisor's process, which needs `Asked` alone
    from evidence.bundle.record_types import ApprovalRecord
    from evidence.policy.governance import ApprovalsPolicy

logger = logging.getLogger(__name__)

Via = Literal["terminal", "api", "timeout", "withdrawn"]
ROOT = 0


class ApprovalError(Exception):
    """An answer that cannot be taken; `status` is the HTTP status the agent's API answers with."""

    status = 400


class UnknownRequest(ApprovalError):
    status = 404


class AlreadyAnswered(ApprovalError):
    status = 409


@dataclass(frozen=True)
class ApprovalRequest:
    """One exec waiting for a person."""

    id: str
    run: str  # the run's id (session id)
    owner_uid: int  # the run's owner: who may answer besides root
    pid: int
    program: str
    argv: tuple[str, ...]
    argv_truncated: bool
    depth: int
    rule: str  # `commands.rules[2] (no-force-push)`
    message: str | None
    requested_at: int  # ns since the epoch
    timeout_ms: int
    on_timeout: Literal["allow", "deny"]


@dataclass(frozen=True)
class Answer:
    allowed: bool
    via: Via
    by_uid: int | None
    at: int  # ns since the epoch
    reason: str | None


@dataclass(frozen=True)
class Asked:
    """What the supervisor hands its approver: the exec, the rule's decision, the caller's depth,
    and whether the exec still waits (False once its caller died or the supervisor stopped)."""

    pid: int
    program: str
    argv: tuple[str, ...]
    truncated: bool
    depth: int
    decision: CommandDecision
    pending: Callable[[], bool] = lambda: True


@dataclass
class _Open:
    request: ApprovalRequest
    done: threading.Event = field(default_factory=threading.Event)
    answer: Answer | None = None


@dataclass
class ApprovalBroker:
    """Open approval requests of one recorder (or of every run of the agent), and their answers."""

    record: Callable[[ApprovalRecord], None]  # each request and resolution, as a run's record
    clock_ns: Callable[[], int] = time.time_ns
    monotonic: Callable[[], float] = time.monotonic
    poll_s: float = 0.25  # how often a waiting request checks that its exec still waits
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    _open: dict[str, _Open] = field(init=False, default_factory=dict)
    _owners: dict[str, int] = field(init=False, default_factory=dict)  # run -> owner, set by the API
    _subscribers: list[Callable[[ApprovalRequest], None]] = field(init=False, default_factory=list)
    # a broker of many runs (the agent's): each record to its run's records, instead of `record`
    route: Callable[[str, ApprovalRecord], None] | None = None

    # -- subscribers (terminal prompt, API's event stream) ---------------------------------------

    def subscribe(self, fn: Callable[[ApprovalRequest], None]) -> None:
        """Call `fn` with each new request (on the waiting exec's thread: return quickly)."""
        with self._lock:
            self._subscribers.append(fn)

    # -- the supervisor's side ----------------------------------------------------------------

    def approver(self, run: str, owner_uid: int, policy: ApprovalsPolicy) -> Callable[[Asked], bool]:
        """The supervisor's approver for one run: opens a request and waits for its answer."""

        def approve(asked: Asked) -> bool:
            request = self.open(asked, run=run, owner_uid=owner_uid, policy=policy)
            return self.wait(request.id, asked.pending).allowed

        return approve

    def set_owner(self, run: str, uid: int) -> None:
        """The run's owner, as the agent's API knows it (the uid of the peer that started the run):
        who, besides root, sees and answers its requests, open ones included. It stands over the
        `owner_uid` the run's approver was made with."""
        with self._lock:
            self._owners[run] = uid
            for entry in self._open.values():
                if entry.request.run == run:
                    entry.request = replace(entry.request, owner_uid=uid)

    def open(self, asked: Asked, *, run: str, owner_uid: int, policy: ApprovalsPolicy) -> ApprovalRequest:
        request = ApprovalRequest(
            id=secrets.token_hex(8),
            run=run,
            owner_uid=owner_uid,
            pid=asked.pid,
            program=asked.program,
            argv=asked.argv,
            argv_truncated=asked.truncated,
            depth=asked.depth,
            rule=asked.decision.label,
            message=asked.decision.message,
            requested_at=self.clock_ns(),
            timeout_ms=policy.timeout_ms,
            on_timeout=policy.on_timeout,
        )
        with self._lock:  # the owner read and the request listed at once: set_owner misses none
            request = replace(request, owner_uid=self._owners.get(run, owner_uid))
            self._open[request.id] = _Open(request)
            subscribers = list(self._subscribers)
        self._emit(request, _record(request, None, request.requested_at))
        for fn in subscribers:
            try:
                fn(request)
            except Exception:  # a subscriber's failure leaves the request open for the others
                logger.exception("approvals: a subscriber failed")
        return request

    def wait(self, request_id: str, pending: Callable[[], bool] = lambda: True) -> Answer:
        """Block until the request is answered, times out, or its exec stops waiting."""
        with self._lock:
            entry = self._open.get(request_id)
        if entry is None:
            raise UnknownRequest(f"no approval request {request_id}")
        deadline = self.monotonic() + entry.request.timeout_ms / 1000
        while True:
            left = deadline - self.monotonic()
            if left <= 0:
                allow = entry.request.on_timeout == "allow"
                reason = f"no answer in {entry.request.timeout_ms / 1000:g}s"
                return self._resolve(entry, allow, "timeout", None, reason)
            if entry.done.wait(min(left, self.poll_s)):
                assert entry.answer is not None
                return entry.answer
            if not pending():
                return self._resolve(entry, False, "withdrawn", None, "the exec no longer waits")

    # -- the people's side ----------------------------------------------------------------------

    def pending(self, uid: int) -> list[ApprovalRequest]:
        """The open requests `uid` may see and answer: all for root, its own runs' for others."""
        with self._lock:
            entries = [e.request for e in self._open.values() if e.answer is None]
        return sorted(
            (r for r in entries if uid == ROOT or r.owner_uid == uid), key=lambda r: (r.requested_at, r.id)
        )

    def get(self, request_id: str) -> ApprovalRequest | None:
        with self._lock:
            entry = self._open.get(request_id)
        return entry.request if entry is not None and entry.answer is None else None

    def answer(
        self, request_id: str, allow: bool, *, uid: int, via: Literal["terminal", "api"], reason: str | None
    ) -> Answer:
        """A person's answer. Raises UnknownRequest (none by that id, or, through the API, not
        visible to `uid`: a request of another user's run is not disclosed), AlreadyAnswered. The
        terminal approver answers with the authority of the run's own terminal (the person who
        started the run, perhaps through sudo): `uid` (the terminal's owner) is recorded, not
        checked."""
        with self._lock:
            entry = self._open.get(request_id)
        if entry is None or (via == "api" and uid != ROOT and entry.request.owner_uid != uid):
            raise UnknownRequest(f"no approval request {request_id}")
        return self._resolve(entry, allow, via, uid, reason)

    def close_run(self, run: str) -> int:
        """The run ends (or its supervisor stopped): withdraw its open requests (how many) and
        forget the run's requests. Call it after the supervisor stopped."""
        with self._lock:
            entries = [e for e in self._open.values() if e.request.run == run and e.answer is None]
        n = 0
        for entry in entries:
            try:
                self._resolve(entry, False, "withdrawn", None, "the run ended")
                n += 1
            except AlreadyAnswered:
                pass
        with self._lock:  # the run's resolved requests are forgotten (an agent runs many)
            for rid in [rid for rid, e in self._open.items() if e.request.run == run]:
                del self._open[rid]
            self._owners.pop(run, None)
        return n

    def _emit(self, request: ApprovalRequest, rec: ApprovalRecord) -> None:
        if self.route is not None:
            self.route(request.run, rec)
        else:
            self.record(rec)

    def _resolve(self, entry: _Open, allow: bool, via: Via, uid: int | None, reason: str | None) -> Answer:
        with self._lock:
            if entry.answer is not None:
                if via in ("terminal", "api"):
                    raise AlreadyAnswered(f"approval request {entry.request.id} was already resolved")
                return entry.answer  # the timeout or a withdrawal after an answer: the answer stands
            answer = Answer(allow, via, uid, self.clock_ns(), reason)
            entry.answer = answer  # kept: a later answer to it is AlreadyAnswered, not unknown
        self._emit(entry.request, _record(entry.request, answer, answer.at))
        entry.done.set()
        return answer


def _record(request: ApprovalRequest, answer: Answer | None, t: int) -> ApprovalRecord:
    from evidence.bundle.format import format_time

    rec: ApprovalRecord = {
        "k": "approval",
        "t": t,
        "id": request.id,
        "state": "requested" if answer is None else ("allowed" if answer.allowed else "denied"),
        "pid": request.pid,
        "program": request.program,
        "argv": list(request.argv),
        "argv_truncated": request.argv_truncated,
        "depth": request.depth,
        "rule": request.rule,
        "message": request.message,
        "requested_at": format_time(request.requested_at),
    }
    if answer is not None:
        rec["via"] = answer.via
        rec["by_uid"] = answer.by_uid
        rec["reason"] = answer.reason
    return rec
