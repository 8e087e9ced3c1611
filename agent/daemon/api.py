"""The agent's control API: the routes, what they ask of the `Backend`, and the errors they answer with.

    POST /runs                   {"cgroup": PATH} or {"pid": N}, "labels": {..}  -> 201 run
    POST /runs                   {"isolate_pid": N, "labels", "command", "detail"}  -> 201 run (isolated)
    GET  /runs                   -> {"runs": [run, ...]}
    GET  /runs/<session>         -> run
    POST /runs/<session>/finish  {"bundle": NAME?, "exit_code"?, "signal"?}
                                 -> {"session_id", "run_id", "path", "name", "sha256", "counts", ...}
    GET  /bundles/<name>         -> the bundle's bytes (application/gzip)
    GET  /healthz                -> 200 while the server answers
    GET  /readyz                 -> 200 once the recorder is ready (probes loaded), else 503 and why
    GET  /metrics                -> Prometheus text format

The pieces: agent/daemon/transport.py serves HTTP on the Unix socket (the whole API, for peers that
SO_PEERCRED lets in) and on the optional TCP listener (off by default, `tcp_listen`: only /healthz,
/readyz and /metrics, read-only, for kubelet probes and Prometheus, which cannot reach a Unix
socket); agent/daemon/models.py checks request bodies; agent/daemon/authz.py decides who may do
what: which peers, which processes, which cgroups, which bundle paths.

Isolated runs (`evidence run --agent`): the client forks its command, which waits before exec; it
asks for `isolate_pid`. The agent makes a fresh cgroup below the process's own (so the job's cgroup
limits keep applying; `<cgroup mount>/evidence/` when that cannot be), starts tracking it, then moves
that process in, so the run holds the command from its first instruction and nothing else of the
client's. A process already recorded by a run is refused (409): moving it would hide it from that
run. Only a process the peer owns may be moved (authz.claim_pid; else 403). Finishing an isolated
run kills what is left in its cgroup and removes it. The client may report the command's exit code
or signal, but the manifest carries what the agent observed through the pidfd it holds from before
the move (agent/daemon/exits.py); a run whose end it could not observe is cut short. Likewise its
"command" is only a claim: the manifest's command is the argv the kernel executed, the claim is
kept as claimed_command, and a difference is a degradation (bundle/command.py).

Ownership: a run is owned by the uid of the peer that started it (the agent's own runs, pods, are
root's). Only the owner and root see it in GET /runs, finish it, or download its bundle; to anyone
else it is a 404. Starts on a pid or a cgroup follow the isolate_pid rule (authz.check_start), and
PID 1, the agent and its ancestors are refused to every peer (authz.protected_pids).

Errors are one line (`{"error", "hint"?}`): 400 bad input, 403 not the peer's, 404 unknown run,
409 conflict, 503 not ready; anything unexpected is a 500 whose details stay in the agent's log.

The API talks to a `Backend` (the recorder, or a fake in tests); it does no recording itself.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable
from urllib.parse import unquote, urlsplit

from evidence.agent.daemon import metrics as m
from evidence.agent.daemon import models
from evidence.agent.daemon.authz import (
    Forbidden,
    Peer,
    PeerPolicy,
    bundle_target,
    check_start,
    claim_pid,
    resolve_cgroup,
)
from evidence.agent.daemon.transport import Listeners
from evidence.agent.daemon.wire import Response
from evidence.errors import Error, SetupError, UsageError
from evidence.files import file_sha256

logger = logging.getLogger(__name__)

OWNER_XATTR = "trusted.evidence.owner_uid"  # on a bundle: the uid that may download it (root only can set it)


class UnknownRun(UsageError):
    """No run with that session id (never started, or already finished)."""


class RunConflict(UsageError):
    """The request clashes with the agent's state (cgroup already recorded, bundle name taken)."""


class NotReady(SetupError):
    """The recorder cannot take runs yet (or any more)."""


@dataclasses.dataclass(frozen=True)
class RunStatus:
    """A run the backend is recording, as the API shows it (GET /runs, POST /runs): not the
    manifest's `format.RunInfo`."""

    session_id: str
    cgroup: str  # absolute path of the cgroup
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    started_ns: int = 0
    attached_late: bool = True
    pid: int | None = None  # the pid the client named, if it named one
    isolated: bool = False  # the agent made the cgroup for this run (isolate_pid) and removes it

    def to_json(self, owner_uid: int) -> models.RunAnswer:
        return {
            "session_id": self.session_id,
            "cgroup": self.cgroup,
            "labels": dict(self.labels),
            "started_ns": self.started_ns,
            "attached_late": self.attached_late,
            "pid": self.pid,
            "isolated": self.isolated,
            "owner_uid": owner_uid,
        }


@runtime_checkable
class Backend(Protocol):
    """What the API needs from the recorder. Methods are called from request threads, concurrently.

    Errors: raise UnknownRun (404), RunConflict (409), UsageError (400), NotReady/SetupError (503);
    anything else becomes a 500 whose details go to the agent's log, not to the client.
    """

    def start(self, cgroup: Path, labels: Mapping[str, str], pid: int | None = None) -> RunStatus:
        """Start recording an existing cgroup (attached late: take an inventory of what is there)."""
        ...

    def isolate(
        self,
        pid: int,
        labels: Mapping[str, str],
        mount: Path,
        *,
        command: Sequence[str] = (),
        detail: Literal["summary", "full"] = "summary",
        pidfd: int | None = None,
        policy: models.PolicySpec | None = None,
        net: Literal["none", "loopback"] | None = None,
        subjects: Sequence[str] = (),
        subjects_as: tuple[int, int] | None = None,
    ) -> RunStatus:
        """Make a cgroup below the one `pid` is in (else under mount/evidence/), start recording it,
        then move `pid` into it (the caller checked the peer owns it; `pidfd` tells whether it is
        still the same process). RunConflict when a run already records the process."""
        ...

    def finish(
        self,
        session_id: str,
        bundle_path: Path,
        *,
        exit_code: int | None = None,
        signal: str | None = None,
    ) -> Mapping[str, Any]:
        """Drain the run's events, write its bundle to bundle_path (atomically), return its manifest.
        An isolated run's leftover processes are killed first and its cgroup removed after."""
        ...

    def runs(self) -> Sequence[RunStatus]:
        """Runs being recorded now."""
        ...

    def metrics(self) -> m.MetricsSnapshot: ...

    def ready(self) -> str | None:
        """None when runs can be started; otherwise why not (shown by /readyz)."""
        ...


def error_status(e: Error) -> int:
    """The HTTP status an error is answered with."""
    if isinstance(e, UnknownRun):
        return 404
    if isinstance(e, Forbidden):
        return 403
    if isinstance(e, RunConflict):
        return 409
    if isinstance(e, SetupError):
        return 503
    return 400


class AgentAPI:
    """The API server: `start()` binds the socket and serves from a thread; `stop()` removes it."""

    def __init__(
        self,
        backend: Backend,
        socket_path: str | Path,
        bundle_dir: str | Path,
        *,
        policy: PeerPolicy | None = None,
        socket_gid: int | None = None,
        cgroup_root: str | Path = Path("/sys/fs/cgroup"),
        ns_base: str = "",
        proc_root: str | Path = Path("/proc"),
        metrics_enabled: bool = True,
        registry: m.Registry | None = None,
        tcp_listen: tuple[str, int] | None = None,
        max_connections: int = 64,
        max_connections_per_uid: int = 16,
        agent_pid: int | None = None,
    ) -> None:
        self.backend = backend
        self.agent_pid = agent_pid  # None: this process (tests that serve the API in-process name another)
        self.max_connections = max_connections
        self.max_connections_per_uid = max_connections_per_uid
        self.socket_path = Path(socket_path)
        self.bundle_dir = Path(bundle_dir)
        self.policy = policy or PeerPolicy()
        self.socket_gid = socket_gid
        self.cgroup_root = Path(cgroup_root)
        self.ns_base = ns_base
        self.proc_root = Path(proc_root)
        self.metrics_enabled = metrics_enabled
        self.registry = registry or m.Registry()
        self.registry.read_snapshot_from(backend.metrics)
        self.tcp_listen = tcp_listen
        self._requests = self.registry.counter(
            "evidence_api_requests", "API requests, by route and status.", ("route", "code")
        )
        self._refused = self.registry.counter(
            "evidence_api_refused_peers", "Connections refused by SO_PEERCRED."
        )
        self._listeners: Listeners | None = None
        self._finishing: set[str] = set()
        self._owners: dict[str, int] = {}  # session id -> uid of the peer that started the run
        self._bundle_owners: dict[str, int] = {}  # bundle name -> uid of the run's owner
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, backend: Backend, settings: Any, registry: m.Registry | None = None) -> AgentAPI:
        from evidence.agent.daemon.settings import AgentSettings, parse_host_port

        s: AgentSettings = settings
        return cls(
            backend,
            s.socket,
            s.bundle_dir,
            policy=PeerPolicy(frozenset(s.allowed_uids), frozenset(s.allowed_gids), s.allow_root),
            socket_gid=s.socket_gid,
            cgroup_root=s.cgroup_root,
            metrics_enabled=s.metrics,
            registry=registry,
            tcp_listen=parse_host_port(s.tcp_listen) if s.tcp_listen else None,
            max_connections=s.max_connections,
            max_connections_per_uid=s.max_connections_per_uid,
        )

    # lifecycle

    def start(self) -> None:
        from evidence.files import private_dir

        private_dir(self.bundle_dir)  # bundles are their owners' alone: read through GET /bundles
        listeners = Listeners(
            self,
            self.socket_path,
            socket_gid=self.socket_gid,
            tcp_listen=self.tcp_listen,
            max_connections=self.max_connections,
            max_connections_per_uid=self.max_connections_per_uid,
        )
        listeners.start()
        self._listeners = listeners
        self.tcp_listen = listeners.tcp_listen  # the real port when 0 was asked
        logger.info(
            "API on %s%s",
            self.socket_path,
            f", health and metrics on {self.tcp_listen}" if self.tcp_listen else "",
        )

    def stop(self) -> None:
        if self._listeners is not None:
            self._listeners.stop()
            self._listeners = None

    def __enter__(self) -> AgentAPI:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # what the transport asks (agent/daemon/transport.py: Router)

    def admit(self, peer: Peer) -> bool:
        """Counted here; the transport logs refusals (at most one line a second: a loop of connects
        from a refused uid must not flood the log)."""
        if self.policy.allows(peer.uid, (peer.gid, *peer.groups)):
            return True
        self._refused.inc()
        return False

    def count(self, route: str, code: int) -> None:
        self._requests.labels(route=route, code=str(code)).inc()

    def live(self, session_id: str) -> bool:
        return any(r.session_id == session_id for r in self.backend.runs())

    def handle(self, method: str, path: str, body: dict[str, Any], peer: Peer | None) -> Response:
        """Answer one request; errors of ours become their one-line answer. peer is None on the
        read-only TCP listener."""
        try:
            return self._route(method, path, body, peer)
        except Error as e:
            return Response.error(error_status(e), e.message, "error", e.hint)

    def _route(self, method: str, path: str, body: dict[str, Any], peer: Peer | None) -> Response:
        parts = [unquote(p) for p in urlsplit(path).path.split("/") if p]
        read_only = peer is None
        if method == "GET" and parts == ["healthz"]:
            return Response.json(200, {"status": "ok"}, "/healthz")
        if method == "GET" and parts == ["readyz"]:
            reason = self.backend.ready()
            if reason is None:
                return Response.json(200, {"status": "ready"}, "/readyz")
            return Response.json(503, {"status": "not ready", "reason": reason}, "/readyz")
        if method == "GET" and parts == ["metrics"]:
            if not self.metrics_enabled:
                return Response.error(404, "metrics are turned off", "/metrics")
            return Response(200, self.registry.render(), m.CONTENT_TYPE, "/metrics")
        if read_only or peer is None:
            return Response.error(404, "only /healthz, /readyz and /metrics are served here", "other")
        if parts == ["runs"] and method == "POST":
            request = models.parse_run_request(body)
            if isinstance(request, models.IsolateRequest):
                return self._isolate(request, peer)
            return self._start(request, peer)
        if parts == ["runs"] and method == "GET":
            runs = [self._run_json(r) for r in self.backend.runs() if self._visible(r, peer)]
            return Response.json(200, {"runs": runs}, "/runs")
        if len(parts) == 2 and parts[0] == "runs" and method == "GET":
            sid = models.session_id(parts[1])
            for r in self.backend.runs():
                if r.session_id == sid and self._visible(r, peer):
                    return Response.json(200, self._run_json(r), "/runs/{id}")
            raise UnknownRun(f"no run {sid}")
        if len(parts) == 3 and parts[0] == "runs" and parts[2] == "finish" and method == "POST":
            sid = models.session_id(parts[1])
            return self._finish(sid, models.parse(models.FinishRequest, body), peer)
        if len(parts) == 2 and parts[0] == "bundles" and method == "GET":
            return self._bundle(models.bundle_name(parts[1]), peer)
        return Response.error(404, f"no route {method} {urlsplit(path).path}", "other")

    # ownership: a run is its starter's (root's when the agent started it: pods, windows)

    def owner(self, session_id: str) -> int:
        with self._lock:
            return self._owners.get(session_id, 0)

    def _visible(self, run: RunStatus, peer: Peer) -> bool:
        """Only root and the run's owner may see, finish or download a run."""
        return peer.uid == 0 or self.owner(run.session_id) == peer.uid

    def _run_json(self, run: RunStatus) -> models.RunAnswer:
        return run.to_json(self.owner(run.session_id))

    def _own(self, info: RunStatus, peer: Peer) -> None:
        with self._lock:
            live = {r.session_id for r in self.backend.runs()} | self._finishing
            for sid in [s for s in self._owners if s not in live]:  # finished by the agent itself
                del self._owners[sid]
            self._owners[info.session_id] = peer.uid

    def _bundle_owner(self, name: str, path: Path) -> int:
        """Who may download a bundle: the run's owner (kept in memory and, where the file system
        allows, in a trusted.* attribute only root can set), else root only."""
        with self._lock:
            uid = self._bundle_owners.get(name)
        if uid is not None:
            return uid
        try:
            return int(os.getxattr(path, OWNER_XATTR))
        except (OSError, ValueError):
            return 0

    def _mark_bundle(self, name: str, path: Path, uid: int) -> None:
        with self._lock:
            self._bundle_owners[name] = uid
        try:
            os.setxattr(path, OWNER_XATTR, str(uid).encode())
        except OSError as e:
            logger.debug("cannot record the owner of %s in an attribute: %s", path, e.strerror)

    def _start(self, request: models.StartRequest, peer: Peer) -> Response:
        cgroup = resolve_cgroup(
            request.cgroup, request.pid, self.cgroup_root, self.proc_root, ns_base=self.ns_base
        )
        check_start(
            cgroup,
            request.pid,
            request.cgroup is not None,
            peer,
            self.cgroup_root,
            self.proc_root,
            self.ns_base,
            self.agent_pid,
        )
        reason = self.backend.ready()
        if reason is not None:
            raise NotReady(f"the recorder is not ready: {reason}")
        info = self.backend.start(cgroup, request.labels, pid=request.pid)
        self._own(info, peer)
        logger.info(
            "run %s started on %s for uid %d (labels %s)", info.session_id, cgroup, peer.uid, request.labels
        )
        return self._started(info)

    def _isolate(self, request: models.IsolateRequest, peer: Peer) -> Response:
        pid = claim_pid(request.isolate_pid, peer, self.proc_root, self.agent_pid)
        reason = self.backend.ready()
        if reason is not None:
            raise NotReady(f"the recorder is not ready: {reason}")
        if request.net is not None:  # the client's child made it: checked, not taken on trust
            from evidence.policy.netns import private_network_problem

            why = private_network_problem(pid, peer.pid, self.proc_root)
            if why is not None:
                raise UsageError(
                    f"--net {request.net}: process {request.isolate_pid} has no private network: {why}"
                )
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise UsageError(f"process {request.isolate_pid} has exited") from None
        try:
            info = self.backend.isolate(
                pid,
                request.labels,
                self.cgroup_root,
                command=list(request.command),
                detail=request.detail,
                pidfd=pidfd,
                policy=request.policy,
                net=request.net,
                subjects=request.subjects,
                subjects_as=(peer.uid, peer.gid),  # read as the client, never as root
            )
        finally:
            os.close(pidfd)
        self._own(info, peer)
        logger.info(
            "run %s started on %s for pid %d of uid %d (labels %s)",
            info.session_id,
            info.cgroup,
            pid,
            peer.uid,
            request.labels,
        )
        return self._started(info)

    def _started(self, info: RunStatus) -> Response:
        """201; the connection that asked is the run's from now on (see agent/daemon/transport.py)."""
        response = Response.json(201, self._run_json(info), "/runs")
        response.holds = info.session_id
        return response

    def _finish(self, sid: str, request: models.FinishRequest, peer: Peer) -> Response:
        target = bundle_target(request.bundle, sid, self.bundle_dir, peer.uid)
        run = next((r for r in self.backend.runs() if r.session_id == sid), None)
        if run is None or not self._visible(run, peer):
            raise UnknownRun(f"no run {sid}")
        if request.reports_exit and not run.isolated:
            raise UsageError('"exit_code" and "signal" are only for isolated runs (the agent ran nothing)')
        status = request.exit_status()
        exit_code, sig = status.exit_code, status.signal
        with self._lock:
            if sid in self._finishing:
                raise RunConflict(f"run {sid} is already being finished")
            if os.path.lexists(target):
                raise RunConflict(f"{target} already exists", hint="give another bundle name")
            self._finishing.add(sid)
        try:
            if exit_code is None and sig is None:
                manifest = self.backend.finish(sid, target)
            else:
                manifest = self.backend.finish(sid, target, exit_code=exit_code, signal=sig)
        finally:
            with self._lock:
                self._finishing.discard(sid)
        if target.parent == self.bundle_dir:
            self._mark_bundle(target.name, target, self.owner(sid))
        with self._lock:
            self._owners.pop(sid, None)
        sha, size = file_sha256(target)
        lost = manifest.get("lost") or {}
        result = {
            "session_id": sid,
            "run_id": manifest.get("run_id"),
            "path": str(target),
            "name": target.name if target.parent == self.bundle_dir else None,
            "sha256": sha,
            "size": size,
            "events": manifest.get("events"),
            "lost": lost.get("total", 0) if isinstance(lost, dict) else lost,
            "cut_short": manifest.get("cut_short", False),
            "root_hash": manifest.get("root_hash"),
            "counts": manifest.get("counts") or {},
        }
        logger.info("run %s finished: %s (%d bytes, run id %s)", sid, target, size, result["run_id"])
        return Response.json(200, result, "/runs/{id}/finish")

    def _bundle(self, name: str, peer: Peer) -> Response:
        path = self.bundle_dir / name
        try:
            f = open(path, "rb")  # noqa: SIM115 - the handler streams and closes it
        except FileNotFoundError:
            return Response.error(404, f"no bundle {name}", "/bundles/{name}")
        if peer.uid != 0 and self._bundle_owner(name, path) != peer.uid:
            f.close()  # someone else's bundle: answered as if it were not there
            return Response.error(404, f"no bundle {name}", "/bundles/{name}")
        size = os.fstat(f.fileno()).st_size
        return Response(200, b"", "application/gzip", "/bundles/{name}", stream=f, length=size)
