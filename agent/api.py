"""The agent's control API: HTTP + JSON on a Unix socket, for `evidence start` / `evidence finish`.

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

Who may connect: the socket is created mode 0660 (owner and, with `socket_gid`, one group), and
every connection's peer is checked with SO_PEERCRED: allowed when its uid is in `allowed_uids`, its
primary or a supplementary gid in `allowed_gids`, it is the agent's own uid, or it is root (uid 0)
while `allow_root` is on (root could read the bundle directory and the kernel's state anyway).
Anyone else gets 403 and nothing is done for them.

Isolated runs (`evidence run --agent`): the client forks its command, which waits before exec; it
asks for `isolate_pid`. The agent makes a fresh cgroup below the process's own (so the job's cgroup
limits keep applying; `<cgroup mount>/evidence/` when that cannot be), starts tracking it, then moves
that process in, so the run holds the command from its first instruction and nothing else of the
client's. A process already recorded by a run is refused (409): moving it would hide it from that run. Only a process the peer owns may be moved: root, or a peer whose uid
is the process's real, effective, saved and filesystem uid (the rule ptrace uses); anything else is
403. A peer in a child pid namespace names the pid as it sees it: the agent looks for it among the
peer's own children. Finishing an isolated run kills what is left in its cgroup and removes it; the
client may report the command's exit code or signal, which the manifest then carries.

Where bundles go: always into the agent's bundle directory, under the name the client asks for (a
plain file name) or `<session>.tar.gz`. Only a root peer may name an absolute path: the agent runs
as root, and writing where an unprivileged client says would let it overwrite any file. A client in
another mount namespace (a sidecar's job container) downloads the bundle over the socket instead,
and writes it with its own credentials (`evidence finish --bundle`).

An optional TCP listener (off by default, `tcp_listen`) serves only /healthz, /readyz and /metrics:
read-only, for kubelet probes and Prometheus, which cannot reach a Unix socket.

The server talks to a `Backend` (the recorder, or a fake in tests); it does no recording itself.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import http.server
import json
import logging
import os
import re
import socket
import socketserver
import stat
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
from urllib.parse import unquote, urlsplit

from agent import k8s
from agent import metrics as m
from evidence.errors import Error, SetupError, UsageError

logger = logging.getLogger(__name__)

MAX_BODY = 1024 * 1024
MAX_LABELS = 64
_LABEL_KEY = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,126}[A-Za-z0-9])?$")
_SESSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
_SIGNAL = re.compile(r"^SIG[A-Z0-9+-]{2,12}$")
MAX_COMMAND_BYTES = 128 * 1024
_BUNDLE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,200}\.tar\.gz$")  # k8s: <ns>_<pod>_<uid>-<n>


class UnknownRun(UsageError):
    """No run with that session id (never started, or already finished)."""


class RunConflict(UsageError):
    """The request clashes with the agent's state (cgroup already recorded, bundle name taken)."""


class NotReady(SetupError):
    """The recorder cannot take runs yet (or any more)."""


class Forbidden(UsageError):
    """The peer may use the agent, but not on that process (someone else's, or out of its sight)."""


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """A run the backend is recording."""

    session_id: str
    cgroup: str  # absolute path of the cgroup
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    started_ns: int = 0
    attached_late: bool = True
    pid: int | None = None  # the pid the client named, if it named one
    isolated: bool = False  # the agent made the cgroup for this run (isolate_pid) and removes it

    def to_json(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "cgroup": self.cgroup,
            "labels": dict(self.labels),
            "started_ns": self.started_ns,
            "attached_late": self.attached_late,
            "pid": self.pid,
            "isolated": self.isolated,
        }


@runtime_checkable
class Backend(Protocol):
    """What the API needs from the recorder. Methods are called from request threads, concurrently.

    Errors: raise UnknownRun (404), RunConflict (409), UsageError (400), NotReady/SetupError (503);
    anything else becomes a 500 whose details go to the agent's log, not to the client.
    """

    def start(self, cgroup: Path, labels: Mapping[str, str], pid: int | None = None) -> RunInfo:
        """Start recording an existing cgroup (attached late: take an inventory of what is there)."""
        ...

    def isolate(
        self,
        pid: int,
        labels: Mapping[str, str],
        mount: Path,
        *,
        command: Sequence[str] = (),
        detail: str = "summary",
        pidfd: int | None = None,
    ) -> RunInfo:
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

    def runs(self) -> Sequence[RunInfo]:
        """Runs being recorded now."""
        ...

    def metrics(self) -> m.MetricsSnapshot: ...

    def ready(self) -> str | None:
        """None when runs can be started; otherwise why not (shown by /readyz)."""
        ...


@dataclasses.dataclass(frozen=True)
class PeerPolicy:
    allowed_uids: frozenset[int] = frozenset()
    allowed_gids: frozenset[int] = frozenset()
    allow_root: bool = True
    own_uid: int = dataclasses.field(default_factory=os.geteuid)

    def allows(self, uid: int, gids: Sequence[int]) -> bool:
        if uid == 0:
            return self.allow_root
        if uid == self.own_uid or uid in self.allowed_uids:
            return True
        return any(g in self.allowed_gids for g in gids)


@dataclasses.dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()


def peer_of(sock: socket.socket) -> Peer:
    """The connecting process's credentials (from connect() time) and its supplementary groups."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Peer(pid, uid, gid, _supplementary_groups(pid))


def _supplementary_groups(pid: int) -> tuple[int, ...]:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return tuple(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return ()


# --- requests ---------------------------------------------------------------------------------------


def parse_labels(raw: Any) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise UsageError('"labels" must be an object of string: string')
    if len(raw) > MAX_LABELS:
        raise UsageError(f"at most {MAX_LABELS} labels")
    out: dict[str, str] = {}
    for k, v in raw.items():
        if not isinstance(k, str) or not _LABEL_KEY.match(k):
            raise UsageError(f"label name {k!r} is not valid (letters, digits, '._/-', at most 128)")
        if not isinstance(v, str) or len(v) > 1024 or any(ord(c) < 32 for c in v):
            raise UsageError(f"label {k!r}: the value must be a string of printable characters, at most 1024")
        out[k] = v
    return dict(sorted(out.items()))


def parse_command(raw: Any) -> list[str]:
    """The argv a client says its isolated process will exec (for the manifest; the exec event is
    what the kernel saw)."""
    if raw is None:
        return []
    if not isinstance(raw, list) or not all(isinstance(a, str) and "\x00" not in a for a in raw):
        raise UsageError('"command" must be a list of strings')
    if sum(len(a.encode("utf-8", "surrogatepass")) + 1 for a in raw) > MAX_COMMAND_BYTES:
        raise UsageError(f'"command" is over {MAX_COMMAND_BYTES} bytes')
    return list(raw)


def resolve_cgroup(
    cgroup: str | None,
    pid: int | None,
    cgroup_root: Path,
    proc_root: Path = Path("/proc"),
    ns_base: str = "",
) -> Path:
    """The cgroup directory a start request names, checked to be a cgroup under cgroup_root.

    `cgroup` may be absolute under cgroup_root, or relative to it (with or without a leading '/',
    as /proc/PID/cgroup shows it). For `pid`, its /proc/PID/cgroup line is used; in a cgroup
    namespace that path is relative to the namespace's root, whose path under cgroup_root is
    `ns_base` (see find_cgroup_by_inode).
    """
    if (cgroup is None) == (pid is None):
        raise UsageError('give exactly one of "cgroup" and "pid"')
    root = Path(os.path.realpath(cgroup_root))
    if pid is not None:
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            raise UsageError('"pid" must be a positive integer')
        try:
            text = (proc_root / str(pid) / "cgroup").read_text()
        except FileNotFoundError:
            raise UsageError(f"no process {pid}") from None
        except OSError as e:
            raise UsageError(f"cannot read the cgroup of process {pid}: {e.strerror}") from None
        rel = k8s.parse_proc_cgroup(text)
        if rel is None:
            raise UsageError(f"process {pid} is not in a cgroup v2 hierarchy")
        candidate = Path(os.path.normpath(f"{root}/{ns_base.strip('/')}/{rel.lstrip('/')}"))
    else:
        if not isinstance(cgroup, str) or not cgroup or "\x00" in cgroup:
            raise UsageError('"cgroup" must be a non-empty path')
        given = Path(cgroup)
        real = Path(os.path.realpath(given)) if given.is_absolute() else None
        if real is not None and (real == root or root in real.parents):
            candidate = real
        else:
            candidate = Path(os.path.normpath(f"{root}/{cgroup.lstrip('/')}"))
    candidate = Path(os.path.realpath(candidate))
    if candidate != root and root not in candidate.parents:
        raise UsageError(f"{cgroup if cgroup is not None else candidate} is outside the cgroup mount {root}")
    if not (candidate / "cgroup.procs").is_file():
        raise UsageError(f"{candidate} is not a cgroup (no cgroup.procs)")
    return candidate


def _proc_status(pid: int, proc_root: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in (proc_root / str(pid) / "status").read_text(errors="replace").splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key] = value.split()
    return out


def _child_in_namespace(parent: int, nspid: int, depth: int, proc_root: Path) -> int | None:
    """The child of `parent` whose pid in its own (depth-th) pid namespace is nspid."""
    try:
        tasks = list((proc_root / str(parent) / "task").iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for c in children:
            try:
                ns = _proc_status(int(c), proc_root).get("NSpid", [])
            except (OSError, ValueError):
                continue
            if len(ns) == depth and ns[-1] == str(nspid):
                return int(c)
    return None


def claim_pid(pid: Any, peer: Peer, proc_root: Path = Path("/proc"), agent_pid: int | None = None) -> int:
    """The pid, as the agent sees it, of the process a peer asks to isolate, checked to be the peer's.

    A peer in a child pid namespace (its NSpid line has more than one entry) names the pid as it
    sees it: the process is looked for among the peer's own children. The process must belong to
    the peer: root may name any, anyone else only one whose real, effective, saved and filesystem
    uids are all the peer's (the rule ptrace uses). Raises Forbidden (403) otherwise."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise UsageError('"isolate_pid" must be a positive integer')
    if peer.pid <= 0:
        raise Forbidden(
            "the agent cannot see your processes (they are in a pid namespace it does not share)",
            hint="share the process namespace with the agent (shareProcessNamespace, or hostPID)",
        )
    try:
        depth = len(_proc_status(peer.pid, proc_root).get("NSpid", ["-"]))
    except OSError:
        raise Forbidden(f"the agent cannot read your process {peer.pid} in /proc") from None
    target = pid
    if depth > 1:
        found = _child_in_namespace(peer.pid, pid, depth, proc_root)
        if found is None:
            raise Forbidden(f"process {pid} is not a child of yours", hint="isolate a process you forked")
        target = found
    try:
        uids = _proc_status(target, proc_root).get("Uid", [])
    except FileNotFoundError:
        raise UsageError(f"no process {pid}") from None
    except OSError as e:
        raise UsageError(f"cannot read process {pid}: {e.strerror}") from None
    if target == (agent_pid if agent_pid is not None else os.getpid()):
        raise Forbidden("the agent does not isolate itself")
    if peer.uid != 0 and (len(uids) != 4 or any(u != str(peer.uid) for u in uids)):
        raise Forbidden(
            f"process {pid} is not yours: uid {peer.uid} may only isolate its own processes",
            hint="run the command as the user that talks to the agent",
        )
    return target


def find_cgroup_by_inode(root: Path, inode: int, max_depth: int = 8) -> Path | None:
    """The directory under root whose inode (the cgroup id) is `inode`: how an agent in a cgroup
    namespace finds its namespace root on the host's cgroup mount (stat its own /sys/fs/cgroup)."""
    stack = [(root, 0)]
    while stack:
        d, depth = stack.pop()
        try:
            if os.stat(d).st_ino == inode:
                return d
            if depth < max_depth:
                with os.scandir(d) as it:
                    stack.extend((Path(e.path), depth + 1) for e in it if e.is_dir(follow_symlinks=False))
        except OSError:
            continue
    return None


def bundle_target(bundle: Any, session_id: str, bundle_dir: Path, peer_uid: int) -> Path:
    if bundle is None:
        name = f"{session_id}.tar.gz"
        if not _BUNDLE_NAME.match(name):
            raise UsageError(f'session id {session_id!r} does not make a bundle name; give "bundle"')
        return bundle_dir / name
    if not isinstance(bundle, str) or not bundle:
        raise UsageError('"bundle" must be a file name')
    if os.path.isabs(bundle):
        if peer_uid != 0:
            raise UsageError(
                "only root may have the agent write a bundle outside its bundle directory",
                hint="give a file name, then download it: evidence finish --bundle",
            )
        return Path(os.path.normpath(bundle))
    if not _BUNDLE_NAME.match(bundle):
        raise UsageError(f"bundle name {bundle!r} must be a plain file name ending in .tar.gz")
    return bundle_dir / bundle


def _file_digest(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


# --- server -----------------------------------------------------------------------------------------


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
    ) -> None:
        self.backend = backend
        self.socket_path = Path(socket_path)
        self.bundle_dir = Path(bundle_dir)
        self.policy = policy or PeerPolicy()
        self.socket_gid = socket_gid
        self.cgroup_root = Path(cgroup_root)
        self.ns_base = ns_base
        self.proc_root = Path(proc_root)
        self.metrics_enabled = metrics_enabled
        self.registry = registry or m.Registry()
        self.tcp_listen = tcp_listen
        self._requests = self.registry.counter(
            "evidence_api_requests", "API requests, by route and status.", ("route", "code")
        )
        self._refused = self.registry.counter(
            "evidence_api_refused_peers", "Connections refused by SO_PEERCRED."
        )
        self._servers: list[socketserver.BaseServer] = []
        self._threads: list[threading.Thread] = []
        self._socket_ino: int | None = None
        self._finishing: set[str] = set()
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, backend: Backend, settings: Any, registry: m.Registry | None = None) -> AgentAPI:
        from agent.settings import AgentSettings, parse_host_port

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
        )

    # lifecycle

    def start(self) -> None:
        self.bundle_dir.mkdir(parents=True, exist_ok=True)
        self._prepare_socket_path()
        unix = _UnixServer(str(self.socket_path), self)
        st = os.stat(self.socket_path)
        self._socket_ino = st.st_ino
        self._serve(unix, "evidence-api")
        if self.tcp_listen is not None:
            host, port = self.tcp_listen
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            tcp = _TCPServer((host, port), self, family)
            self._serve(tcp, "evidence-health")
            bound = tcp.server_address
            self.tcp_listen = (str(bound[0]), int(bound[1]))  # the real port when 0 was asked
        logger.info(
            "API on %s%s",
            self.socket_path,
            f", health and metrics on {self.tcp_listen}" if self.tcp_listen else "",
        )

    def _serve(self, server: socketserver.BaseServer, name: str) -> None:
        t = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.2}, name=name, daemon=True
        )
        t.start()
        self._servers.append(server)
        self._threads.append(t)

    def stop(self) -> None:
        for srv in self._servers:
            srv.shutdown()
            srv.server_close()
        for t in self._threads:
            t.join(timeout=5)
        self._servers.clear()
        self._threads.clear()
        try:
            if self._socket_ino is not None and os.lstat(self.socket_path).st_ino == self._socket_ino:
                os.unlink(self.socket_path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> AgentAPI:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _prepare_socket_path(self) -> None:
        self.socket_path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        try:
            st = os.lstat(self.socket_path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise SetupError(
                f"{self.socket_path} exists and is not a socket", hint="remove it or choose --socket"
            )
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1)
            probe.connect(str(self.socket_path))
        except OSError as e:
            if e.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise SetupError(f"cannot check the old socket {self.socket_path}: {e.strerror}") from None
            logger.info("removing stale socket %s", self.socket_path)
            os.unlink(self.socket_path)
        else:
            raise SetupError(f"another agent is listening on {self.socket_path}")
        finally:
            probe.close()

    # request handling (called by the handler)

    def handle(self, method: str, path: str, body: dict[str, Any], peer: Peer | None) -> _Response:
        """Route one request. peer is None on the read-only TCP listener."""
        parts = [unquote(p) for p in urlsplit(path).path.split("/") if p]
        read_only = peer is None
        if method == "GET" and parts == ["healthz"]:
            return _Response.json(200, {"status": "ok"}, "/healthz")
        if method == "GET" and parts == ["readyz"]:
            reason = self.backend.ready()
            if reason is None:
                return _Response.json(200, {"status": "ready"}, "/readyz")
            return _Response.json(503, {"status": "not ready", "reason": reason}, "/readyz")
        if method == "GET" and parts == ["metrics"]:
            if not self.metrics_enabled:
                return _Response.error(404, "metrics are turned off", "/metrics")
            families = m.snapshot_families(self.backend.metrics()) + self.registry.families()
            return _Response(200, m.render(families).encode(), m.CONTENT_TYPE, "/metrics")
        if read_only or peer is None:
            return _Response.error(404, "only /healthz, /readyz and /metrics are served here", "other")
        if parts == ["runs"] and method == "POST":
            return self._start(body, peer)
        if parts == ["runs"] and method == "GET":
            return _Response.json(200, {"runs": [r.to_json() for r in self.backend.runs()]}, "/runs")
        if len(parts) == 2 and parts[0] == "runs" and method == "GET":
            sid = _session(parts[1])
            for r in self.backend.runs():
                if r.session_id == sid:
                    return _Response.json(200, r.to_json(), "/runs/{id}")
            raise UnknownRun(f"no run {sid}")
        if len(parts) == 3 and parts[0] == "runs" and parts[2] == "finish" and method == "POST":
            return self._finish(_session(parts[1]), body, peer)
        if len(parts) == 2 and parts[0] == "bundles" and method == "GET":
            return self._bundle(parts[1])
        return _Response.error(404, f"no route {method} {urlsplit(path).path}", "other")

    def _start(self, body: dict[str, Any], peer: Peer) -> _Response:
        if "isolate_pid" in body:
            return self._isolate(body, peer)
        unknown = sorted(set(body) - {"cgroup", "pid", "labels"})
        if unknown:
            raise UsageError(f"unknown field(s) {', '.join(unknown)}")
        labels = parse_labels(body.get("labels"))
        pid = body.get("pid")
        if pid is not None and (not isinstance(pid, int) or isinstance(pid, bool)):
            raise UsageError('"pid" must be a positive integer')
        cgroup = resolve_cgroup(body.get("cgroup"), pid, self.cgroup_root, ns_base=self.ns_base)
        reason = self.backend.ready()
        if reason is not None:
            raise NotReady(f"the recorder is not ready: {reason}")
        info = self.backend.start(cgroup, labels, pid=pid)
        logger.info("run %s started on %s for uid %d (labels %s)", info.session_id, cgroup, peer.uid, labels)
        return _Response.json(201, info.to_json(), "/runs")

    def _isolate(self, body: dict[str, Any], peer: Peer) -> _Response:
        unknown = sorted(set(body) - {"isolate_pid", "labels", "command", "detail"})
        if unknown:
            raise UsageError(f"unknown field(s) {', '.join(unknown)} (with isolate_pid)")
        labels = parse_labels(body.get("labels"))
        command = parse_command(body.get("command"))
        detail = body.get("detail", "summary")
        if detail not in ("summary", "full"):
            raise UsageError('"detail" must be "summary" or "full"')
        pid = claim_pid(body.get("isolate_pid"), peer, self.proc_root)
        reason = self.backend.ready()
        if reason is not None:
            raise NotReady(f"the recorder is not ready: {reason}")
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise UsageError(f"process {body['isolate_pid']} has exited") from None
        try:
            info = self.backend.isolate(
                pid, labels, self.cgroup_root, command=command, detail=detail, pidfd=pidfd
            )
        finally:
            os.close(pidfd)
        logger.info(
            "run %s started on %s for pid %d of uid %d (labels %s)",
            info.session_id,
            info.cgroup,
            pid,
            peer.uid,
            labels,
        )
        return _Response.json(201, info.to_json(), "/runs")

    def _finish(self, sid: str, body: dict[str, Any], peer: Peer) -> _Response:
        unknown = sorted(set(body) - {"bundle", "exit_code", "signal"})
        if unknown:
            raise UsageError(f"unknown field(s) {', '.join(unknown)}")
        target = bundle_target(body.get("bundle"), sid, self.bundle_dir, peer.uid)
        run = next((r for r in self.backend.runs() if r.session_id == sid), None)
        if run is None:
            raise UnknownRun(f"no run {sid}")
        exit_code, sig = body.get("exit_code"), body.get("signal")
        if (exit_code is not None or sig is not None) and not run.isolated:
            raise UsageError('"exit_code" and "signal" are only for isolated runs (the agent ran nothing)')
        if exit_code is not None and (
            not isinstance(exit_code, int) or isinstance(exit_code, bool) or not 0 <= exit_code <= 255
        ):
            raise UsageError('"exit_code" must be an integer from 0 to 255')
        if sig is not None and (not isinstance(sig, str) or not _SIGNAL.match(sig)):
            raise UsageError('"signal" must be a signal name such as SIGTERM')
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
        sha, size = _file_digest(target)
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
        return _Response.json(200, result, "/runs/{id}/finish")

    def _bundle(self, name: str) -> _Response:
        if not _BUNDLE_NAME.match(name):
            raise UsageError(f"{name!r} is not a bundle name")
        path = self.bundle_dir / name
        try:
            f = open(path, "rb")  # noqa: SIM115 - the handler streams and closes it
        except FileNotFoundError:
            return _Response.error(404, f"no bundle {name}", "/bundles/{name}")
        size = os.fstat(f.fileno()).st_size
        return _Response(200, b"", "application/gzip", "/bundles/{name}", stream=f, length=size)

    def count(self, route: str, code: int) -> None:
        self._requests.inc(route=route, code=str(code))

    def refused(self, peer: Peer) -> None:
        self._refused.inc()
        logger.warning("refused peer pid %d uid %d gid %d", peer.pid, peer.uid, peer.gid)


def _session(text: str) -> str:
    if not _SESSION.match(text):
        raise UsageError(f"{text!r} is not a session id")
    return text


@dataclasses.dataclass
class _Response:
    status: int
    body: bytes
    content_type: str
    route: str
    stream: Any = None
    length: int | None = None

    @classmethod
    def json(cls, status: int, obj: Any, route: str) -> _Response:
        return cls(status, json.dumps(obj, sort_keys=True).encode() + b"\n", "application/json", route)

    @classmethod
    def error(cls, status: int, message: str, route: str, hint: str | None = None) -> _Response:
        obj: dict[str, Any] = {"error": message}
        if hint:
            obj["hint"] = hint
        return cls.json(status, obj, route)


def _error_status(e: Error) -> int:
    if isinstance(e, UnknownRun):
        return 404
    if isinstance(e, Forbidden):
        return 403
    if isinstance(e, RunConflict):
        return 409
    if isinstance(e, SetupError):
        return 503
    return 400


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _UnixServer | _TCPServer
    protocol_version = "HTTP/1.1"
    server_version = "evidence-agent"
    sys_version = ""
    timeout = 30

    def setup(self) -> None:
        super().setup()
        self.peer: Peer | None = None
        self.refused = False
        if isinstance(self.server, _UnixServer):
            self.peer = peer_of(self.request)
            if not self.server.api.policy.allows(self.peer.uid, (self.peer.gid, *self.peer.groups)):
                self.refused = True
                self.server.api.refused(self.peer)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s " + format, self._who(), *args)

    def _who(self) -> str:
        return f"uid {self.peer.uid} pid {self.peer.pid}" if self.peer else str(self.client_address)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _read_body(self) -> dict[str, Any]:
        if self.headers.get("Transfer-Encoding"):
            raise _HTTPError(411, "send a Content-Length, not chunked")
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise _HTTPError(400, "bad Content-Length") from None
        if length < 0 or length > MAX_BODY:
            raise _HTTPError(413, f"request body over {MAX_BODY} bytes")
        raw = self.rfile.read(length) if length else b""
        if not raw.strip():
            return {}
        try:
            obj = json.loads(raw)
        except ValueError as e:
            raise _HTTPError(400, f"request body is not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise _HTTPError(400, "request body must be a JSON object")
        return obj

    def _dispatch(self, method: str) -> None:
        api = self.server.api
        if self.refused:
            self._send(
                _Response.error(
                    403,
                    "permission denied: this uid/gid may not use the agent",
                    "refused",
                    hint="add it to allowed_uids or allowed_gids",
                )
            )
            self.close_connection = True
            return
        try:
            body = self._read_body() if method in ("POST", "PUT") else {}
            response = api.handle(method, self.path, body, self.peer)
        except _HTTPError as e:
            response = _Response.error(e.status, e.message, "other")
            self.close_connection = True
        except Error as e:
            response = _Response.error(_error_status(e), e.message, "error", e.hint)
        except Exception:
            logger.exception("request %s %s failed", method, self.path)
            response = _Response.error(500, "internal error in the agent (see its log)", "error")
        self._send(response)

    def _send(self, r: _Response) -> None:
        api = self.server.api
        api.count(r.route, r.status)
        try:
            self.send_response(r.status)
            self.send_header("Content-Type", r.content_type)
            self.send_header("Content-Length", str(r.length if r.stream is not None else len(r.body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            if r.stream is not None:
                with r.stream as f:
                    while chunk := f.read(1 << 20):
                        self.wfile.write(chunk)
            else:
                self.wfile.write(r.body)
        except (BrokenPipeError, ConnectionResetError):
            logger.debug("client went away")
            self.close_connection = True


class _HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _QuietErrors:
    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client that hangs up mid-request, or a connection cut by stop(): not worth a traceback
        logger.debug("connection error", exc_info=True)


class _UnixServer(_QuietErrors, socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, path: str, api: AgentAPI) -> None:
        self.api = api
        super().__init__(path, _Handler)

    def server_bind(self) -> None:
        super().server_bind()
        # Before listen(): nobody can connect until the mode and group are right.
        path = str(self.server_address)
        if self.api.socket_gid is not None:
            os.chown(path, -1, self.api.socket_gid)
        os.chmod(path, 0o660)


class _TCPServer(_QuietErrors, socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], api: AgentAPI, family: socket.AddressFamily) -> None:
        self.api = api
        self.address_family = family
        super().__init__(address, _Handler)


def wait_for_socket(path: str | Path, timeout: float = 5.0) -> bool:
    """True once something accepts connections on path (for tests and the daemon's start-up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(str(path))
            return True
        except OSError:
            time.sleep(0.02)
        finally:
            s.close()
    return False
