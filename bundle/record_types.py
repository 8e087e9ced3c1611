"""The recorder's records, typed: one TypedDict per kind, told apart by `k` (a Literal).

A record is what the correlator makes (agent/recorder/correlate.py) and what the spool holds, one
JSON line each (bundle/spool.py): `k` its kind, `t` its time (ns since the epoch), for a summary
record `n` and `tl` (how many more occurrences it stands for, up to which time, counted by the
kernel), and the fields of its event's data (bundle/format.py's data models, without `count`,
`first_time` and `last_time`, which the writer computes). bundle/records.py maps a record to its
event, for the writer and the live stream.

The types cost nothing at run time: records stay plain dicts (built as dict literals, copied,
serialised by orjson, read back from the spool). They exist for mypy, which checks every field name
and type from the correlator to the writer and the live stream; tests/unit/test_record_types.py
checks them against what the correlator makes of real probe records and against bundle/format.py.
The few places that cannot be followed statically (a record read back from the spool, a partial
record the recorder keeps for a kernel count, hash fields named at run time) say so with a `cast`.
"""

from __future__ import annotations

from typing import Literal, NotRequired, TypedDict

# 0 for success, the errno name of the failure ("ENOENT") otherwise (format.Result)
Result = int | str
Access = Literal["read", "write", "create", "exec"]


class InCgroup(TypedDict, total=False):
    """Where a process was, when not in the run's own cgroup (correlate.py)."""

    cgroup: str  # the cgroup below the run's
    container: str  # the container id its scope name carries


class Placed(InCgroup, total=False):
    """Where an operation on paths or addresses happened, when not in the run's own cgroup and
    mount namespace (correlate.py)."""

    mntns: Literal["other"]  # by a process that left the run's mount or user namespace


class Counted(TypedDict, total=False):
    """A summary record's kernel count: `n` occurrences after the first, the last at `tl`."""

    n: int
    tl: int


class ExeHash(TypedDict, total=False):
    """A successful exec's program file (agent/recorder/exe_hash.py; format.ProcessExec)."""

    sha256: str
    size: int
    hash_source: Literal["exe", "inode", "path"]
    not_hashed: str
    interpreter: str
    interpreter_sha256: str
    interpreter_size: int
    interpreter_hash_source: Literal["exe", "inode", "path"]
    interpreter_not_hashed: str
    # an exe_hash.Pending while the hash is computed: removed before the record is spooled
    _hash: object


class ExecRecord(ExeHash, Placed):
    k: Literal["exec"]
    t: int
    pid: int
    ppid: int
    depth: int
    filename: str
    argv: list[str]
    argv_truncated: bool
    cwd: str | None
    result: Result


class ExitRecord(InCgroup):
    k: Literal["exit"]
    t: int
    pid: int
    ppid: int
    exe: str | None
    exit_code: int | None
    signal: str | None


class OpenRecord(Placed, Counted):
    k: Literal["open"]
    t: int
    pid: int
    ppid: int
    exe: str | None
    path: str
    raw_path: str
    dirfd: int | None
    flags: tuple[str, ...] | list[str]  # a tuple as made (shared by records), a list once read back
    access: tuple[Access, ...] | list[Access]
    mode: int | None
    result: Result
    nlink: NotRequired[int]  # a write open's file has other names (its link count)


class ChangeRecord(Placed, Counted):
    k: Literal["change"]
    t: int
    pid: int
    ppid: int
    exe: str | None
    operation: str  # rename, unlink, ... (decode.CHANGE_OPS)
    path: str
    raw_path: str | None  # None: a call on a descriptor (fchmod, fchown)
    access: tuple[Access, ...] | list[Access]
    result: Result
    target: NotRequired[str]
    mode: NotRequired[int]
    uid: NotRequired[int | None]
    gid: NotRequired[int | None]
    at_flags: NotRequired[int]
    nlink: NotRequired[int]  # the file a descriptor names has other names (its link count)


class ConnectRecord(Placed, Counted):
    k: Literal["connect"]
    t: int
    pid: int
    ppid: int
    exe: str | None
    family: str  # AF_INET, AF_INET6, AF_UNIX, AF_UNSPEC, OTHER (decode.decode_sockaddr)
    address: str
    port: int | None
    result: Result
    names: NotRequired[list[str]]  # what the run's configured resolvers' answers named the address
    other_names: NotRequired[list[str]]  # ... and other servers' (answers to the run's queries)


class DnsRecord(InCgroup, Counted):
    k: Literal["dns"]
    t: int
    pid: int
    ppid: int
    exe: str | None
    server: str
    port: int | None
    name: str | None
    type: str | None
    result: str
    answers: list[str]
    addresses: list[str]
    malformed: NotRequired[bool]
    received: NotRequired[bool]
    size: NotRequired[int]
    truncated: NotRequired[bool]
    unasked: NotRequired[bool]  # written by recorders before `unsolicited`
    unsolicited: NotRequired[str]  # why a received answer is not credited (dns.py UNVERIFIED, ...)
    configured_resolver: NotRequired[bool]
    source: NotRequired[str | None]  # where an answer came from, as the kernel delivered it
    source_port: NotRequired[int | None]
    _cgid: NotRequired[int]  # the record's cgroup id while dns.py holds it: removed before it is spooled


class NamespaceRecord(Placed):
    k: Literal["namespace"]
    t: int
    pid: int
    ppid: int
    exe: str | None
    operation: str  # unshare, setns, clone, mount, ... (decode.NS_OPS)
    flags: list[str]
    paths: list[str]
    result: Result
    fstype: NotRequired[str]
    target_pid: NotRequired[int]
    target_in_run: NotRequired[bool]
    written: NotRequired[int]


class DenialRecord(Counted):
    """An operation a policy refused, or would have (agent/recorder/enforce.py for files and execs,
    policy/connect.py for the connect guard)."""

    k: Literal["denial"]
    t: int
    pid: int
    exe: str | None
    operation: str  # read, write, create, exec, connect, sendmsg
    target: str
    rule: str
    enforced: bool
    result: Result


class ApprovalRecord(TypedDict):
    """An approval request or its resolution (agent/recorder/approvals.py; format.PolicyApproval)."""

    k: Literal["approval"]
    t: int
    id: str
    state: Literal["requested", "allowed", "denied"]
    pid: int
    program: str
    argv: list[str]
    argv_truncated: bool
    depth: int
    rule: str
    message: str | None
    requested_at: str
    via: NotRequired[Literal["terminal", "api", "timeout", "withdrawn"]]
    by_uid: NotRequired[int | None]
    reason: NotRequired[str | None]


class LimitRecord(TypedDict):
    """A resource limit reached (agent/recorder/limits.py: LimitEvent; format.PolicyLimit)."""

    k: Literal["limit"]
    t: int
    limit: Literal["memory", "pids", "cpu", "wall"]
    kind: Literal["oom_kill", "memory_max", "fork_refused", "cpu_throttled", "wall"]
    count: int
    pids: list[int]
    certain: bool
    detail: str


class ViolationRecord(TypedDict):
    """An exec killed by the exec check (agent/recorder/correlate.py from decode's exec_violation;
    format.PolicyViolation)."""

    k: Literal["violation"]
    t: int
    pid: int
    tid: int
    exe: str | None
    operation: Literal["exec"]
    reasons: list[Literal["no_pin", "file", "args", "too_long", "unread"]]
    loaded: str | None
    decided: str | None
    args_len: int
    decided_args_len: int | None
    rule: str
    killed: bool
    result: Result


class AuditRecord(TypedDict):
    """An exec an `audit` command rule matched (agent/recorder/exec_supervisor.py audit_record;
    format.PolicyAudit)."""

    k: Literal["audit"]
    t: int
    pid: int
    program: str
    argv: list[str]
    argv_truncated: bool
    depth: int
    rule: str
    rule_index: int
    rule_name: str
    message: str | None


class InventoryRecord(TypedDict):
    """A process already in the cgroup when the recording started (agent/recorder/inventory.py)."""

    k: Literal["inventory"]
    t: int
    pid: int
    ppid: int
    argv: list[str]
    cwd: str | None
    exe: str | None
    sockets: list[str]


class DegradationRecord(TypedDict):
    # about the run, not one of its cgroups: the correlator names no cgroup in it (format.Degradation
    # has no such fields)
    k: Literal["degradation"]
    t: int
    component: str
    reason: str
    impact: str


SpoolRecord = (
    ExecRecord
    | ExitRecord
    | OpenRecord
    | ChangeRecord
    | ConnectRecord
    | DnsRecord
    | NamespaceRecord
    | DenialRecord
    | ApprovalRecord
    | LimitRecord
    | ViolationRecord
    | AuditRecord
    | InventoryRecord
    | DegradationRecord
)
# the kinds the writer sums up in summary mode (records.SUMMARY_KEYS): they may carry `n` and `tl`
SummaryRecord = OpenRecord | ChangeRecord | ConnectRecord | DnsRecord | DenialRecord
# what the correlator records and a policy may refuse (enforce.py)
RECORD_TYPES: dict[str, type] = {
    "exec": ExecRecord,
    "exit": ExitRecord,
    "open": OpenRecord,
    "change": ChangeRecord,
    "connect": ConnectRecord,
    "dns": DnsRecord,
    "namespace": NamespaceRecord,
    "denial": DenialRecord,
    "approval": ApprovalRecord,
    "limit": LimitRecord,
    "violation": ViolationRecord,
    "audit": AuditRecord,
    "inventory": InventoryRecord,
    "degradation": DegradationRecord,
}
