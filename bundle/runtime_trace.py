"""The in-toto Runtime Trace v0.2 predicate of a signed bundle (pure).

`Trace` is fed the run's events in order (`feed(type, time, data)`: the writer's, as it writes
them, or a verified bundle's) and keeps, within fixed budgets, what the predicate lists; then
`predicate(manifest, trace)` is the predicate (docs/bundle-format.md "Attestation"):

- monitor: `type` this tool's URI and version; `tracePolicy` the recording detail, the policy in
  force (its summary, and the policy itself);
- monitoredProcess: hostID, type, event from the CI's variables recorded as labels (GitHub Actions:
  github/server, github/repository, github/run = run id.attempt; GitLab CI: gitlab/server,
  gitlab/project, gitlab/job), else from the labels monitored/host, monitored/type, monitored/event,
  else this host and the run's own source URI;
- monitorLog.process: the execs (processBinary, arguments, sha256, pid, ppid, time, result);
  monitorLog.network: the connects (ip, port, hostname from the run's DNS answers, invokingProcess)
  and the DNS queries (the resolver's ip and port, the name asked and the addresses answered);
  `protocol` is left out: the events do not record the socket's type;
- monitorLog.fileAccess: ResourceDescriptors: first the subjects (digest, and how the run wrote
  them: bundle/provenance.py's tie as annotations), then each program executed with its digest, then
  the other files opened, by name (a file:// URI) with their access, in event order;
- metadata: buildStartedOn/FinishedOn (the run's times) and `evidenceOmitted`, what the budgets left
  out of each list (the bundle's events keep everything);
- evidenceRun: this tool's own run predicate (attestation.predicate), an extension field.

The budgets bound the statement whatever the run did (a run that opened 100k files lists the first
MAX_FILES_BY_NAME of them): each list stops at its byte budget (the canonical JSON of its entries)
or its count, and says how many entries it left out.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Generic, NotRequired, TypedDict, TypeVar
from urllib.parse import quote

import orjson

from evidence.bundle import format as fmt
from evidence.bundle import provenance
from evidence.bundle.read_types import ManifestJSON

if TYPE_CHECKING:
    from evidence.bundle.attestation import RunPolicyJSON, RunPredicateJSON

logger = logging.getLogger(__name__)

PREDICATE_TYPE = "https://in-toto.io/attestation/runtime-trace/v0.2"
MONITOR_URI = "https://evidence.dev/monitor/"  # + the producer's version
COMMAND_TYPE = "https://evidence.dev/monitored/command/v1"
GITHUB_TYPE = "https://actions.github.io/buildtypes/workflow/v1"
GITLAB_TYPE = "https://gitlab.com/gitlab-org/gitlab-runner/-/blob/main/PROVENANCE.md"

MAX_PROCESSES = 2000
MAX_PROCESS_BYTES = 512 * 1024
MAX_ARGS = 64  # arguments kept of each exec
MAX_ARG = 512  # characters kept of each argument
MAX_NETWORK = 1000
MAX_NETWORK_BYTES = 128 * 1024
MAX_PROGRAMS = 1000
MAX_PROGRAM_BYTES = 256 * 1024
MAX_FILES_BY_NAME = 1000
MAX_FILE_BYTES = 256 * 1024


# --- the predicate's JSON -------------------------------------------------------------------------


class InvokingProcess(TypedDict):
    pid: int | None
    exe: str | None


class ProcessEntry(TypedDict):
    """monitorLog.process: one exec."""

    eventType: str  # "exec"
    processBinary: str | None
    arguments: list[str]  # clipped (MAX_ARGS, MAX_ARG)
    sha256: str | None
    pid: int | None
    ppid: int | None
    time: str
    result: fmt.Result | None  # 0, or the errno's name


class ConnectEntry(TypedDict):
    """monitorLog.network: a connect (an IP family's)."""

    ip: str | None
    port: int | None
    hostname: NotRequired[str]  # the first name the run's DNS answers gave the address
    hostnames: NotRequired[list[str]]  # all of them, when more than one
    invokingProcess: InvokingProcess
    result: fmt.Result | None
    count: int


class DnsEntry(TypedDict):
    """monitorLog.network: a DNS query and its answer."""

    ip: str | None  # the resolver
    port: int | None
    dnsQuery: str | None
    dnsType: str | None
    dnsResult: str | None  # the rcode, "no answer"
    dnsAddresses: list[str]
    invokingProcess: InvokingProcess
    count: int


class FileAnnotations(TypedDict):
    access: list[str]  # "subject", "exec", or the accesses of the file's opens


class SubjectAnnotations(FileAnnotations, provenance.TieJSON):
    """A subject's annotations: how the run wrote it (provenance.Tie)."""


class ResourceDescriptor(TypedDict):
    """in-toto's ResourceDescriptor, as monitorLog.fileAccess lists files."""

    name: str
    uri: str
    digest: NotRequired[dict[str, str]]  # "sha256" -> lowercase hex
    annotations: NotRequired[FileAnnotations | SubjectAnnotations]


class MonitorLog(TypedDict):
    process: list[ProcessEntry]
    network: list[ConnectEntry | DnsEntry]
    fileAccess: list[ResourceDescriptor]


class TracePolicy(TypedDict):
    detail: str
    policySummary: RunPolicyJSON | None  # the run predicate's: the policy's mode and sha256
    policy: Mapping[str, object] | None  # manifest.policy, as it is


class Monitor(TypedDict):
    type: str  # MONITOR_URI + version
    tracePolicy: TracePolicy


class MonitoredProcess(TypedDict):
    hostID: str
    type: str
    event: str


class Metadata(TypedDict):
    buildStartedOn: str
    buildFinishedOn: str
    evidenceOmitted: dict[str, int]  # list -> entries left out by the budgets


class ManifestPart(TypedDict):
    """What of the predicate is a function of the manifest alone (`from_manifest`)."""

    monitor: Monitor
    monitoredProcess: MonitoredProcess
    evidenceRun: RunPredicateJSON


class TracePredicate(ManifestPart):
    """The Runtime Trace v0.2 predicate (PREDICATE_TYPE) the writer signs."""

    monitorLog: MonitorLog
    metadata: Metadata


# --- gathering ------------------------------------------------------------------------------------

_E = TypeVar("_E", ProcessEntry, ConnectEntry | DnsEntry, ResourceDescriptor)


class _List(Generic[_E]):
    """Entries up to a count and a byte budget; what did not fit is counted."""

    def __init__(self, count: int, size: int) -> None:
        self.entries: list[_E] = []
        self.count = count
        self.room = size
        self.omitted = 0

    @property
    def full(self) -> bool:
        return len(self.entries) >= self.count or self.room <= 0

    def add(self, entry: _E) -> None:
        if len(self.entries) >= self.count:
            self.omitted += 1
            return
        n = len(orjson.dumps(entry))
        if n > self.room:
            self.omitted += 1
            self.room = 0
            return
        self.room -= n
        self.entries.append(entry)


def _clip(argv: Any) -> list[str]:
    args = [a if len(a) <= MAX_ARG else a[:MAX_ARG] + "..." for a in argv[:MAX_ARGS] if isinstance(a, str)]
    if len(argv) > MAX_ARGS:
        args.append(f"... ({len(argv) - MAX_ARGS} more)")
    return args


def file_uri(path: str) -> str:
    return "file://" + quote(path, safe="/")


class Trace:
    """What the predicate lists, gathered from the events as they come (module docstring)."""

    def __init__(self) -> None:
        self.process = _List[ProcessEntry](MAX_PROCESSES, MAX_PROCESS_BYTES)
        self.network = _List[ConnectEntry | DnsEntry](MAX_NETWORK, MAX_NETWORK_BYTES)
        self.programs = _List[ResourceDescriptor](MAX_PROGRAMS, MAX_PROGRAM_BYTES)
        self.files = _List[ResourceDescriptor](MAX_FILES_BY_NAME, MAX_FILE_BYTES)
        self._programs: set[tuple[str, str]] = set()
        self._files: dict[str, set[str]] = {}  # path -> access, for the files listed
        self._unlisted: set[str] = set()  # paths seen past the budget (counted once each)
        self.tracker = provenance.Tracker()

    def feed(self, etype: str, time: str, data: Mapping[str, Any]) -> None:
        self.tracker.feed(etype, time, data)
        if etype == fmt.PROCESS_EXEC:
            self._exec(time, data)
        elif etype == fmt.FILE_OPEN:
            self._open(data)
        elif etype == fmt.NETWORK_CONNECT:
            self._connect(data)
        elif etype == fmt.NETWORK_DNS:
            self._dns(data)

    def feed_at(self, etype: str, t_ns: int, data: Mapping[str, Any]) -> None:
        """feed(), from the writer (its time in ns): an open, most of a run's events, is taken
        without formatting its time (its data has its own)."""
        if etype == fmt.FILE_OPEN:
            self._open(data)
            access = data.get("access") or ()
            if "write" in access or "create" in access:
                self.tracker.feed(etype, "", data)
            return
        self.feed(etype, fmt.format_time(t_ns), data)

    def feed_events(self, events: Iterable[Mapping[str, Any]]) -> None:
        for ev in events:
            self.feed(ev["type"], ev["time"], ev["data"])

    def _exec(self, time: str, d: Mapping[str, Any]) -> None:
        self.process.add(
            {
                "eventType": "exec",
                "processBinary": d.get("filename"),
                "arguments": _clip(d.get("argv") or []),
                "sha256": d.get("sha256"),
                "pid": d.get("pid"),
                "ppid": d.get("ppid"),
                "time": time,
                "result": d.get("result"),
            }
        )
        for name, digest in (
            (d.get("filename"), d.get("sha256")),
            (d.get("interpreter"), d.get("interpreter_sha256")),
        ):
            if isinstance(name, str) and isinstance(digest, str) and (name, digest) not in self._programs:
                self._programs.add((name, digest))
                self.programs.add(
                    {
                        "name": name,
                        "uri": file_uri(name),
                        "digest": {"sha256": digest},
                        "annotations": {"access": ["exec"]},
                    }
                )

    def open_data(self, d: Mapping[str, Any]) -> None:
        """feed_at of an open that neither writes nor creates, from what its data holds (the
        writer's full detail: its record, bundle/sink.py feed_trace): only its path, result and
        access are read."""
        self._open(d)

    def _open(self, d: Mapping[str, Any]) -> None:
        path = d.get("path")
        if not isinstance(path, str) or d.get("result") != 0:
            return
        access = self._files.get(path)
        if access is not None:
            access.update(d.get("access") or ())
            return
        if path in self._unlisted:
            return
        if self.files.full:  # (the common case past the budget: no entry is made)
            self.files.omitted += 1
            if len(self._unlisted) < 4 * MAX_FILES_BY_NAME:
                self._unlisted.add(path)
            return
        before = len(self.files.entries)
        self.files.add({"name": path, "uri": file_uri(path)})
        if len(self.files.entries) > before:
            self._files[path] = set(d.get("access") or ())
        elif len(self._unlisted) < 4 * MAX_FILES_BY_NAME:
            self._unlisted.add(path)

    def _connect(self, d: Mapping[str, Any]) -> None:
        if d.get("family") not in ("AF_INET", "AF_INET6"):
            return
        names = d.get("names") or []
        entry: ConnectEntry = {
            "ip": d.get("address"),
            "port": d.get("port"),
            "invokingProcess": {"pid": d.get("pid"), "exe": d.get("exe")},
            "result": d.get("result"),
            "count": d.get("count", 1),
        }
        if names:
            entry["hostname"] = names[0]
        if len(names) > 1:
            entry["hostnames"] = list(names)
        self.network.add(entry)

    def _dns(self, d: Mapping[str, Any]) -> None:
        if d.get("malformed"):
            return
        self.network.add(
            {
                "ip": d.get("server"),
                "port": d.get("port"),
                "dnsQuery": d.get("name"),
                "dnsType": d.get("type"),
                "dnsResult": d.get("result"),
                "dnsAddresses": list(d.get("addresses") or []),
                "invokingProcess": {"pid": d.get("pid"), "exe": d.get("exe")},
                "count": d.get("count", 1),
            }
        )

    def file_access(self, manifest: ManifestJSON) -> list[ResourceDescriptor]:
        out: list[ResourceDescriptor] = []
        artifacts = manifest.get("artifacts")
        if artifacts:
            ties = self.tracker.ties(artifacts["files"], manifest["started_at"], manifest["finished_at"])
            for tie in ties:
                out.append(
                    {
                        "name": tie.path,
                        "uri": file_uri(tie.path),
                        "digest": {"sha256": tie.sha256},
                        "annotations": {"access": ["subject"], **tie.to_json()},
                    }
                )
        out.extend(self.programs.entries)
        for entry in self.files.entries:
            out.append({**entry, "annotations": {"access": sorted(self._files[entry["name"]])}})
        return out

    def omitted(self) -> dict[str, int]:
        return {
            "process": self.process.omitted,
            "network": self.network.omitted,
            "programs": self.programs.omitted,
            "files": self.files.omitted,  # distinct paths (past 4 x MAX_FILES_BY_NAME, opens)
        }


def monitor_type(manifest: ManifestJSON) -> str:
    return MONITOR_URI + manifest["producer"].get("version", "unknown")


def monitored_process(manifest: ManifestJSON) -> MonitoredProcess:
    """hostID, type and event, from the CI's variables as the run's labels hold them (module doc)."""
    labels = manifest.get("labels") or {}
    repo, run = labels.get("github/repository"), labels.get("github/run")
    if repo and run:
        server = labels.get("github/server") or "https://github.com"
        run_id, _, attempt = run.partition(".")
        event = f"{server}/{repo}/actions/runs/{run_id}" + (f"/attempts/{attempt}" if attempt else "")
        return {"hostID": server, "type": GITHUB_TYPE, "event": event}
    project, job = labels.get("gitlab/project"), labels.get("gitlab/job")
    if project and job:
        server = labels.get("gitlab/server") or "https://gitlab.com"
        return {"hostID": server, "type": GITLAB_TYPE, "event": f"{server}/{project}/-/jobs/{job}"}
    host = manifest["host"].get("hostname") or "unknown"
    return {
        "hostID": labels.get("monitored/host") or "urn:evidence:host:" + quote(host, safe=""),
        "type": labels.get("monitored/type") or COMMAND_TYPE,
        "event": labels.get("monitored/event") or manifest["source"],
    }


def trace_policy(manifest: ManifestJSON, summary: RunPolicyJSON | None) -> TracePolicy:
    return {"detail": manifest["detail"], "policySummary": summary, "policy": manifest.get("policy")}


def from_manifest(manifest: ManifestJSON, run_predicate: RunPredicateJSON) -> ManifestPart:
    """The parts of the predicate that are a function of the manifest alone (what a verifier
    checks against it): everything but monitorLog and metadata.evidenceOmitted."""
    return {
        "monitor": {
            "type": monitor_type(manifest),
            "tracePolicy": trace_policy(manifest, run_predicate["policy"]),
        },
        "monitoredProcess": monitored_process(manifest),
        "evidenceRun": run_predicate,
    }


def predicate(manifest: ManifestJSON, run_predicate: RunPredicateJSON, trace: Trace) -> TracePredicate:
    p = from_manifest(manifest, run_predicate)
    return {
        "monitor": p["monitor"],
        "monitoredProcess": p["monitoredProcess"],
        "evidenceRun": p["evidenceRun"],
        "monitorLog": {
            "process": trace.process.entries,
            "network": trace.network.entries,
            "fileAccess": trace.file_access(manifest),
        },
        "metadata": {
            "buildStartedOn": manifest["started_at"],
            "buildFinishedOn": manifest["finished_at"],
            "evidenceOmitted": trace.omitted(),
        },
    }
