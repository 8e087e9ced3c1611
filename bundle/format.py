"""The bundle format: names, event types, data models, limits and hashes (the events' content
hashes, the root hash). The run id is not made here: bundle/run_id.py computes it (the writer asks).

docs/bundle-format.md is the prose version of this module; bundle/schemas/ holds the JSON Schemas
generated from the models here (`python -m bundle.schemas` rewrites them, a test checks they match).

(Over 600 lines on purpose: the bundle's contract, models and hashes, in the one place the docs
mirror; each event type's model is a few lines, and a reader looks for them together.)
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from evidence.bundle import canonical

FORMAT_NAME = "evidence-bundle"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
EVENTS_NAME = "events.ndjson"
MEMBERS = (MANIFEST_NAME, EVENTS_NAME)  # exactly these, in this order...
ATTESTATION_NAME = "attestation.intoto.json"  # ...then, in a signed bundle, this (bundle/attestation.py)
SPECVERSION = "1.0"
DATACONTENTTYPE = "application/json"
TYPE_PREFIX = "dev.evidence."

# Verification limits (a bundle is untrusted input).
MAX_COMPRESSED = 100 * 1024 * 1024
# (4 GiB and 4M events: a full-detail run of 2 x 1M distinct paths, ~1.3 GB of events, fits)
MAX_DECOMPRESSED = 4 * 1024 * 1024 * 1024
MAX_EVENTS = 4_000_000
MAX_LINE = 1024 * 1024
MAX_DEPTH = 64
# its payload: a statement about a manifest of at most MAX_LINE (twice: the run predicate and the
# trace policy), the subjects (at most subjects.MAX_FILES, twice), and the runtime trace's lists
# within their budgets (runtime_trace.MAX_*_BYTES): base64 of at most ~4 MiB
MAX_ATTESTATION = 8 * 1024 * 1024

RUN_STARTED = "dev.evidence.run.started"
RUN_FINISHED = "dev.evidence.run.finished"
PROCESS_EXEC = "dev.evidence.process.exec"
PROCESS_EXIT = "dev.evidence.process.exit"
FILE_OPEN = "dev.evidence.file.open"
FILE_CHANGE = "dev.evidence.file.change"
PROCESS_NAMESPACE = "dev.evidence.process.namespace"
NETWORK_CONNECT = "dev.evidence.network.connect"
LOSS = "dev.evidence.loss"
DEGRADATION = "dev.evidence.degradation"
POLICY_DENIAL = "dev.evidence.policy.denial"
POLICY_APPROVAL = "dev.evidence.policy.approval"
POLICY_LIMIT = "dev.evidence.policy.limit"
POLICY_VIOLATION = "dev.evidence.policy.violation"
POLICY_AUDIT = "dev.evidence.policy.audit"
INVENTORY = "dev.evidence.inventory"
NETWORK_DNS = "dev.evidence.network.dns"

# `mntns: "other"` on an exec, open, change, connect or namespace event: by a process that left the
# run's mount or user namespace, mounted, chrooted or entered a namespace with setns (or a child of
# one): its paths may name other files than the same paths in the run's own namespace.
MntNs = Literal["other"] | None

# A result is 0 for success or the errno name of the failure ("ENOENT"); "E<n>" when unnamed.
Result = Literal[0] | str
# each model is built the first time it is used (a plain `evidence run` uses Degradation alone)
_FROZEN = ConfigDict(extra="forbid", frozen=True, defer_build=True)


class RunStarted(BaseModel):
    model_config = _FROZEN
    session_id: str
    command: list[str]
    cwd: str
    pid: int
    cgroup: str
    detail: Literal["summary", "full"]
    labels: dict[str, str] = Field(default_factory=dict)


class RunFinished(BaseModel):
    model_config = _FROZEN
    exit_code: int | None
    signal: str | None = None
    duration_ns: int
    cut_short: bool = False


class ProcessExec(BaseModel):
    model_config = _FROZEN
    pid: int
    ppid: int
    depth: int
    filename: str
    argv: list[str]
    argv_truncated: bool = False
    cwd: str | None
    result: Result
    count: int = 1
    cgroup: str | None = None  # the cgroup below the run's, when not the run's own
    container: str | None = None  # the container id, when the agent knows it (Kubernetes mode)
    mntns: MntNs = None
    # a successful exec: the program file's content (agent/recorder/exe_hash.py). `hash_source`:
    # "exe" read through /proc/<pid>/exe, "inode" read by its path and shown to be the file the
    # kernel mapped (a process gone by then), "path" read by its path without that (a `#!` script, a
    # file replaced since); `not_hashed` (instead of sha256) says why not
    sha256: str | None = None  # hex
    size: int | None = None
    hash_source: Literal["exe", "inode", "path"] | None = None
    not_hashed: str | None = None
    # a `#!` script: the interpreter its first line names, hashed as the program is
    interpreter: str | None = None
    interpreter_sha256: str | None = None  # hex
    interpreter_size: int | None = None
    interpreter_hash_source: Literal["exe", "inode", "path"] | None = None
    interpreter_not_hashed: str | None = None


class ProcessExit(BaseModel):
    model_config = _FROZEN
    pid: int
    ppid: int
    exe: str | None
    exit_code: int | None
    signal: str | None = None
    cgroup: str | None = None
    container: str | None = None


class FileOpen(BaseModel):
    model_config = _FROZEN
    pid: int
    ppid: int
    exe: str | None
    path: str
    raw_path: str
    dirfd: int | None = None
    flags: list[str]
    access: list[Literal["read", "write", "create", "exec"]]
    mode: int | None = None
    result: Result
    # a write open's file had other names (its link count, > 1): a hard link, maybe made in an
    # earlier run, writes what they name too
    nlink: int | None = None
    count: int = 1
    first_time: str
    last_time: str
    cgroup: str | None = None
    container: str | None = None
    mntns: MntNs = None


class FileChange(BaseModel):
    """A change to a file that is not an open: one type for every family, told apart by
    `operation`. `path` is the name changed (rename's and link's old name, symlink's new link);
    `target` is rename's and link's new name, symlink's content as given (not resolved)."""

    model_config = _FROZEN
    pid: int
    ppid: int
    exe: str | None
    operation: Literal[
        "rename", "unlink", "rmdir", "link", "symlink", "truncate", "chmod", "chown", "mkdir", "mknod"
    ]
    path: str
    raw_path: str | None = None  # None: a call on a descriptor (fchmod, fchown)
    target: str | None = None
    access: list[Literal["read", "write", "create", "exec"]]
    mode: int | None = None  # chmod, mkdir, mknod
    uid: int | None = None  # chown (None: unchanged)
    gid: int | None = None
    at_flags: int | None = None
    result: Result
    nlink: int | None = None  # the file changed had other names (fchmod, fchown, a magic link)
    count: int = 1
    first_time: str
    last_time: str
    cgroup: str | None = None
    container: str | None = None
    mntns: MntNs = None


class NetworkConnect(BaseModel):
    model_config = _FROZEN
    pid: int
    ppid: int
    exe: str | None
    family: Literal["AF_INET", "AF_INET6", "AF_UNIX", "AF_UNSPEC", "OTHER"]
    address: str
    port: int | None = None
    result: Result
    count: int = 1
    first_time: str
    last_time: str
    cgroup: str | None = None
    container: str | None = None
    # what the run's DNS answers named the address: answers credited to a query of the run
    # (NetworkDns), from one of its configured resolvers (Manifest.resolvers); diff, baseline and
    # profile compare the connect by these names
    names: list[str] = Field(default_factory=list)
    # ... and credited answers from other servers (shown; compared by the address, never by these)
    other_names: list[str] = Field(default_factory=list)
    mntns: MntNs = None


# why a received DNS answer is not credited to a query of the run (NetworkDns.unsolicited):
# "unverified": its bytes are not those of a message the kernel delivered to the socket it was
# read from (rewritten in the job's buffer, or its delivery not recorded); "other source": from
# another address or port than its query was sent to; "no query": no query with its ID and
# question was sent on that socket
Unsolicited = Literal["unverified", "other source", "no query"]


class NetworkDns(BaseModel):
    """A DNS query and its answer (one event), an answer credited to no query (`unsolicited`), or a
    message sent to or received from port 53 that is not DNS (`malformed`, with its size)."""

    model_config = _FROZEN
    pid: int
    ppid: int
    exe: str | None
    server: str
    port: int | None = None
    name: str | None
    type: str | None
    result: str  # the answer's rcode ("NOERROR", "NXDOMAIN", ...), "no answer" or "malformed"
    answers: list[str] = Field(default_factory=list)  # "owner TYPE value", as in a zone file
    addresses: list[str] = Field(default_factory=list)  # of the answer's A and AAAA records
    malformed: bool = False
    received: bool | None = None  # malformed: a message received (else sent)
    truncated: bool = False  # malformed: only the first bytes were kept
    size: int | None = None  # malformed: bytes kept
    unasked: bool = False  # older recorders: an answer whose query was not seen (now `unsolicited`)
    unsolicited: Unsolicited | None = None  # an answer that names nothing: why
    # where the answer came from, as the kernel delivered it (None: not known, or no answer)
    source: str | None = None
    source_port: int | None = None
    # the answer came from (a query with no answer went to) one of the run's configured resolvers
    configured_resolver: bool = False
    count: int = 1
    first_time: str
    last_time: str
    cgroup: str | None = None
    container: str | None = None


class ProcessNamespace(BaseModel):
    """A namespace, mount, chroot or ptrace call by a process of the run (record.bpf.c). `flags`
    are names (CLONE_*, MS_*, MOVE_MOUNT_*, OPEN_TREE_*, the ptrace request); `paths` what the call
    names, resolved as an open's (mount: source (only for a bind or move) and target; move_mount:
    from and to; pivot_root: new root and put_old). ptrace and process_vm_writev: `target_pid` and
    whether it was a process of the run; clone: `target_pid` is the child."""

    model_config = _FROZEN
    pid: int
    ppid: int
    exe: str | None
    operation: Literal[
        "unshare", "setns", "clone", "mount", "move_mount", "open_tree", "fsmount", "pivot_root",
        "chroot", "ptrace", "process_vm_writev",
    ]  # fmt: skip
    flags: list[str]
    paths: list[str]
    fstype: str | None = None  # mount: the filesystem type (at most 15 bytes)
    target_pid: int | None = None
    target_in_run: bool | None = None
    written: int | None = None  # process_vm_writev: bytes written
    result: Result
    count: int = 1
    cgroup: str | None = None
    container: str | None = None
    mntns: MntNs = None


class Loss(BaseModel):
    model_config = _FROZEN
    kind: str
    count: int
    where: Literal["kernel", "agent", "writer"] = "kernel"  # writer: past the bundle's caps


class Degradation(BaseModel):
    model_config = _FROZEN
    component: str
    reason: str
    impact: str


# the rule of a denial that is a system call through a 32-bit entry, which the kernel's syscall
# tracepoints skip: refused by the seccomp filter of every command evidence launches (lint EV013)
COMPAT_RULE = "isolation: 32-bit system calls"


class PolicyDenial(BaseModel):
    model_config = _FROZEN
    pid: int
    exe: str | None
    # syscall: a system call through a 32-bit entry, refused (rule "isolation: 32-bit system calls")
    operation: Literal["read", "write", "create", "exec", "connect", "sendmsg", "syscall"]
    target: str
    rule: str
    enforced: bool
    result: Result
    count: int = 1


class PolicyApproval(BaseModel):
    """A request for a person's approval of an exec (`commands` rule with decision `approve`), or its
    resolution: `state` requested, then allowed or denied. The resolution repeats the request's
    fields, so each event stands alone. `via`: who resolved it, a person at the terminal of `evidence
    run` or through the agent's API (`by_uid` the uid of the terminal's owner or of the socket's
    peer), the timeout (`approvals.on_timeout` decided), or withdrawn (the exec's caller died, or the
    supervisor stopped, before an answer: the exec did not run). A resolution's time is the event's
    `time`."""

    model_config = _FROZEN
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
    via: Literal["terminal", "api", "timeout", "withdrawn"] | None = None
    by_uid: int | None = None
    reason: str | None = None


class PolicyLimit(BaseModel):
    """A resource limit of the policy reached (`limits`), as the kernel counted it since the last
    look (agent/recorder/limits.py): `kind` oom_kill (processes the OOM killer took at
    limits.memory), memory_max (memory use reached the limit), fork_refused (forks refused at
    limits.pids), cpu_throttled (periods throttled at limits.cpu), wall (limits.wall reached: the
    run is killed). `pids`: the processes it names (an OOM kill's victims, from the run's exits:
    `certain` when as many as counted, else candidates)."""

    model_config = _FROZEN
    limit: Literal["memory", "pids", "cpu", "wall"]
    kind: Literal["oom_kill", "memory_max", "fork_refused", "cpu_throttled", "wall"]
    count: int
    pids: list[int]
    certain: bool
    detail: str


# the rule of a policy.violation: an exec the kernel ran otherwise than the exec supervisor allowed
EXEC_CHECK_RULE = "commands: the exec check"


class PolicyViolation(BaseModel):
    """An exec of a run whose command rules are enforced that the kernel ran otherwise than the
    exec supervisor allowed, found at sched_process_exec by the exec check (a BPF program; see
    docs/policy-format.md "Closing the race after an allowed exec"): the new program was killed
    before its first instruction (`killed`; when the kernel could not send the signal the recorder
    killed it on reading the event, `result` then says the kernel's error). `reasons`: no_pin (no
    exec of that thread was allowed: the supervisor never saw it, or refused it), file (another
    file was loaded than decided), args (other arguments were copied), too_long (an arg area past
    128 KiB, never compared), unread (what was loaded could not be read). `loaded` and `decided`:
    the file the kernel loaded and the one decided, as `MAJOR:MINOR:INODE` (null: not read, or no
    decision); `args_len`/`decided_args_len`: the arg area's bytes (each argument and its NUL)."""

    model_config = _FROZEN
    pid: int
    tid: int  # the thread that called exec
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


class PolicyAudit(BaseModel):
    """An exec a `commands` rule with decision `audit` matched: it ran, and the policy asked for it
    to be noted. `rule` names the rule as denials do (commands.rules[N] (name)), `rule_index` and
    `rule_name` are its index and name; `program` what was really executed (symlinks resolved in
    the caller's root), `argv` as the supervisor read it (`argv_truncated`: not whole), `depth` the
    caller's depth in the run's process tree (0: the run's command), `message` the rule's. A run
    keeps the first AUDIT_RECORDS_MAX of them; later matches are counted in the manifest's
    lost.by_kind (`audit_past_cap`), not kept."""

    model_config = _FROZEN
    pid: int
    program: str
    argv: list[str]
    argv_truncated: bool
    depth: int
    rule: str
    rule_index: int
    rule_name: str
    message: str | None


# audit records a run keeps (PolicyAudit): a job execing an audited program without end is counted
AUDIT_RECORDS_MAX = 1000


class Inventory(BaseModel):
    model_config = _FROZEN
    pid: int
    ppid: int
    argv: list[str]
    cwd: str | None
    exe: str | None
    sockets: list[str] = Field(default_factory=list)


DATA_MODELS: dict[str, type[BaseModel]] = {
    RUN_STARTED: RunStarted,
    RUN_FINISHED: RunFinished,
    PROCESS_EXEC: ProcessExec,
    PROCESS_EXIT: ProcessExit,
    FILE_OPEN: FileOpen,
    FILE_CHANGE: FileChange,
    PROCESS_NAMESPACE: ProcessNamespace,
    NETWORK_CONNECT: NetworkConnect,
    LOSS: Loss,
    DEGRADATION: Degradation,
    POLICY_DENIAL: PolicyDenial,
    POLICY_APPROVAL: PolicyApproval,
    POLICY_LIMIT: PolicyLimit,
    POLICY_VIOLATION: PolicyViolation,
    POLICY_AUDIT: PolicyAudit,
    INVENTORY: Inventory,
    NETWORK_DNS: NetworkDns,
}


class LossCounts(BaseModel):
    model_config = _FROZEN
    total: int
    by_kind: dict[str, int]


class FileEntry(BaseModel):
    model_config = _FROZEN
    sha256: str
    size: int


class BundleHeader(BaseModel):
    """What manifest.json says about the bundle itself: its format, its producer, and the run id and
    source that name its events."""

    model_config = _FROZEN
    format: Literal["evidence-bundle"]
    format_version: int
    producer: dict[str, str]
    run_id: str
    source: str


class ArtifactFile(BaseModel):
    """A file the run's `--subject` patterns matched, as it was when the run ended (bundle/subjects.py):
    a subject of the signed attestation. `name` is relative to the workspace (what the statement's
    subject is named), `path` the absolute path it was read at (its real path: what the events
    name); mtime and ctime as the file system gave them then."""

    model_config = _FROZEN
    name: str
    path: str
    sha256: str
    size: int
    mtime: str
    ctime: str


class ArtifactRefusal(BaseModel):
    """A match of a `--subject` pattern that is not a subject, and why (or a pattern that matched
    nothing: its name is the pattern)."""

    model_config = _FROZEN
    name: str
    reason: str


class Artifacts(BaseModel):
    """What the run's `--subject` patterns found when the run ended: the subjects (in name order),
    what was refused and why (at most subjects.MAX_REFUSED listed, the rest counted), and the caps
    they were collected under."""

    model_config = _FROZEN
    workspace: str
    patterns: list[str]
    collected_at: str
    max_files: int
    max_bytes: int
    files: list[ArtifactFile]
    refused: list[ArtifactRefusal]
    refused_more: int = 0


class RunInfo(BaseModel):
    """What manifest.json says about the run itself, declared once: `Manifest` adds the bundle header
    and what the writer computes (times, counts, hashes), writer.RunMeta what it computes them from."""

    model_config = _FROZEN
    session_id: str
    # a run whose command started in it (`run`, `run --agent`): the argv of its first process's
    # first exec, as the kernel copied it (bundle/command.py), and what the caller claimed; a run
    # attached to processes already there: their argv (read from /proc), and no claim (None). A
    # bundle made before claimed_command existed has no such field: its command is the claim.
    command: list[str]
    claimed_command: list[str] | None = None
    cwd: str
    exit_code: int | None
    signal: str | None = None
    cut_short: bool = False
    attached_late: bool = False
    detail: Literal["summary", "full"]
    host: dict[str, str]
    capabilities: dict[str, Any]
    headers: dict[str, Any]
    labels: dict[str, str] = Field(default_factory=dict)
    policy: dict[str, Any] | None = None
    # the command's private network namespace (`--net`): empty, or loopback only; None: the host's
    network: Literal["none", "loopback"] | None = None
    # the nameservers of /etc/resolv.conf as the run's first process saw it when the run started
    # (its mount namespace): the run's configured resolvers. None: not read (an older recorder)
    resolvers: list[str] | None = None
    # the run's artifacts (`--subject`): absent when none were asked for (and in older bundles)
    artifacts: Artifacts | None = None


class Manifest(RunInfo, BundleHeader):
    """manifest.json. Times are RFC 3339 UTC strings; hashes lowercase hex sha256."""

    # pydantic orders fields from the last base to the first, then these: BundleHeader's come first,
    # so a manifest of another format fails on `format` before anything else.
    started_at: str
    finished_at: str
    counts: dict[str, int]
    events: int
    lost: LossCounts
    files: dict[str, FileEntry]
    root_hash: str


def format_time(ns: int) -> str:
    """RFC 3339 UTC with nanoseconds: 2026-11-22T01:43:44.123456789Z."""
    secs, frac = divmod(ns, 1_000_000_000)
    return f"{_second(secs)}.{frac:09d}Z"


@functools.lru_cache(maxsize=4096)
def _second(secs: int) -> str:
    """The part of format_time above the second (a run's events share few seconds: a bundle of a
    million events formats each second once)."""
    return _dt.datetime.fromtimestamp(secs, _dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")


def parse_time(text: str) -> int:
    """Inverse of format_time (accepts any RFC 3339 UTC 'Z' time with up to 9 fraction digits)."""
    if not text.endswith("Z"):
        raise ValueError(f"time {text!r} is not UTC ('Z')")
    main, _, frac = text[:-1].partition(".")
    if len(frac) > 9 or (frac and not frac.isdigit()):
        raise ValueError(f"bad fraction in time {text!r}")
    dt = _dt.datetime.strptime(main, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=_dt.UTC)
    return int(dt.timestamp()) * 1_000_000_000 + int((frac or "0").ljust(9, "0"))


def labels_attribute(labels: dict[str, str] | None) -> str | None:
    """The `labels` extension attribute every event of a run with labels carries: the canonical
    JSON of the manifest's labels, as a string (CloudEvents extension values are scalars). None,
    and no attribute, when the run has no labels."""
    if not labels or type(labels) is not dict:
        return None
    return canonical.dumps(labels).decode()


def event_id(run_id: str, seq: int) -> str:
    return f"{run_id}:{seq}"


def source_for(run_id: str) -> str:
    return f"urn:evidence:run:{run_id}"


def content_hash(event: Mapping[str, object]) -> str:
    """sha256 over the canonical {specversion, type, datacontenttype, subject, data} of an event:
    what happened, without when (time) or its place in this bundle (id, seq, run id)."""
    core = {k: event.get(k) for k in ("specversion", "type", "datacontenttype", "subject", "data")}
    return hashlib.sha256(canonical.dumps(core, check=False)).hexdigest()


class RootHasher:
    """root_hash = sha256 over each event's content hash (64 hex chars + '\\n'), in sequence order.
    The hashes are gathered and go into the sha256 _BATCH at a time (one update, not one each)."""

    _BATCH = 4096

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self._pending: list[str] = []

    def add(self, chash: str) -> None:
        self._pending.append(chash)
        if len(self._pending) >= self._BATCH:
            self._flush()

    def add_many(self, chashes: list[str]) -> None:
        """add() of each of `chashes`, in order."""
        self._pending += chashes
        if len(self._pending) >= self._BATCH:
            self._flush()

    def add_lines(self, lines: bytes) -> None:
        """add() of each hash of `lines`, given as they are hashed: each followed by a newline."""
        self._flush()
        self._h.update(lines)

    def _flush(self) -> None:
        if self._pending:
            self._pending.append("")
            self._h.update("\n".join(self._pending).encode("ascii"))
            self._pending.clear()

    def hexdigest(self) -> str:
        self._flush()
        return self._h.hexdigest()


def root_hash(content_hashes: Iterable[str]) -> str:
    h = RootHasher()
    for c in content_hashes:
        h.add(c)
    return h.hexdigest()


def has_dotdot(name: str) -> bool:
    """Whether a recorded name has a '..' component. The recorder keeps one only where the
    component before it may be a symlink (a name the kernel could not name, docs/bundle-format.md):
    such a name says what the process asked for, not where it led, so a check of where a file is
    takes it to be anywhere."""
    return ".." in name and ".." in name.split("/")
