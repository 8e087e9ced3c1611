"""HTTP/1.1 over the agent's sockets: the request handler, the Unix and TCP servers, and their threads.

The Unix socket serves the whole API to peers that pass the `Router`'s check (SO_PEERCRED and
SO_PEERGROUPS, see agent/daemon/authz.py); a refused peer gets a one-line 403 from the accepting
thread, at once, and its connection is closed. The optional TCP
listener has no peer credentials: the router is handed `peer=None` and serves only /healthz,
/readyz and /metrics there. Bodies are JSON objects of at most MAX_BODY bytes, sent with a
Content-Length. What a request means is the router's business (agent/daemon/api.py: AgentAPI).

Connections are bounded (`ConnectionLimits`): at most `total` open at once on each listener, and on
the Unix socket at most `per_uid` of one peer uid (root counts only towards the total). Each open
connection has a thread of its own, closed after `_Handler.timeout` seconds without a request; a
connection past a bound is answered at once from the accepting thread with a one-line 503 and
closed, and logged (at most once a second), so that idle connections cannot pile up threads.
Refusing costs a few system calls and never waits for the peer (~20,000 refusals a second, where a
blocking read cost 0.2 s each), and the listen backlog (BACKLOG) holds a burst of connects: a loop of
connects by one uid cannot keep the others' out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import http.server
import json
import logging
import os
import socket
import socketserver
import stat
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Protocol

from evidence.agent.daemon.authz import Peer, peer_of
from evidence.errors import SetupError

logger = logging.getLogger(__name__)

MAX_BODY = 1024 * 1024
# Connections waiting to be accepted (listen(); the kernel caps it at net.core.somaxconn). The
# standard library's 5 was full at once under a loop of connects: other clients' connect() failed.
BACKLOG = 1024


@dataclasses.dataclass
class Response:
    """What the router answers; `stream` (an open file of `length` bytes) is sent instead of body."""

    status: int
    body: bytes
    content_type: str
    route: str
    stream: Any = None
    length: int | None = None

    @classmethod
    def json(cls, status: int, obj: Any, route: str) -> Response:
        return cls(status, json.dumps(obj, sort_keys=True).encode() + b"\n", "application/json", route)

    @classmethod
    def error(cls, status: int, message: str, route: str, hint: str | None = None) -> Response:
        obj: dict[str, Any] = {"error": message}
        if hint:
            obj["hint"] = hint
        return cls.json(status, obj, route)


class Router(Protocol):
    """What the transport asks of the API, from request threads, concurrently."""

    def admit(self, peer: Peer) -> bool:
        """Whether this peer may use the agent at all (and count it when not); on the accepting
        thread: it must not block."""
        ...

    def handle(self, method: str, path: str, body: dict[str, Any], peer: Peer | None) -> Response:
        """Answer one request; peer is None on the read-only TCP listener."""
        ...

    def count(self, route: str, code: int) -> None:
        """An answer was sent (for /metrics)."""
        ...


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _UnixServer | _TCPServer
    protocol_version = "HTTP/1.1"
    server_version = "evidence-agent"
    sys_version = ""
    timeout = 30

    def setup(self) -> None:
        super().setup()
        self.peer: Peer | None = self.server.limits.peer(self.request)  # None: on the TCP listener

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
        try:
            body = self._read_body() if method in ("POST", "PUT") else {}
            response = self.server.router.handle(method, self.path, body, self.peer)
        except _HTTPError as e:
            response = Response.error(e.status, e.message, "other")
            self.close_connection = True
        except Exception:  # the router answers its own errors: this is a bug, its details stay here
            logger.exception("request %s %s failed", method, self.path)
            response = Response.error(500, "internal error in the agent (see its log)", "error")
        self._send(response)

    def _send(self, r: Response) -> None:
        self.server.router.count(r.route, r.status)
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
    """A request the transport cannot read (no Content-Length, too big, not a JSON object)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class ConnectionLimits:
    """Open connections, counted in total and per peer uid; `admit` says why not when over a bound."""

    def __init__(self, total: int, per_uid: int) -> None:
        self.total = total
        self.per_uid = per_uid
        self._lock = threading.Lock()
        self._open = 0
        self._by_uid: Counter[int] = Counter()
        self._peers: dict[int, Peer] = {}  # id(request socket) -> its peer, for the handler
        self._last_log = 0.0
        self.refused = 0

    def admit(self, request: Any, peer: Peer | None) -> str | None:
        """None (and the connection counted) when it may be served, else why not."""
        with self._lock:
            if self._open >= self.total:
                return f"the agent has {self._open} connections open, its limit (max_connections)"
            if peer is not None and peer.uid != 0 and self._by_uid[peer.uid] >= self.per_uid:
                return (
                    f"uid {peer.uid} has {self.per_uid} connections open, its limit (max_connections_per_uid)"
                )
            self._open += 1
            if peer is not None:
                self._by_uid[peer.uid] += 1
                self._peers[id(request)] = peer
            return None

    def peer(self, request: Any) -> Peer | None:
        with self._lock:
            return self._peers.get(id(request))

    def release(self, request: Any) -> None:
        with self._lock:
            self._open -= 1
            peer = self._peers.pop(id(request), None)
            if peer is not None:
                self._by_uid[peer.uid] -= 1
                if not self._by_uid[peer.uid]:
                    del self._by_uid[peer.uid]

    def log_refusal(self, why: str, who: str) -> None:
        with self._lock:
            self.refused += 1
            now = time.monotonic()
            if now - self._last_log < 1.0:
                return
            self._last_log = now
            count = self.refused
        logger.warning("refused a connection from %s: %s (%d refused so far)", who, why, count)


BUSY_HINT = "close idle connections, or try again"
REFUSED = "permission denied: this uid/gid may not use the agent"
REFUSED_HINT = "add it to allowed_uids or allowed_gids"


def _refuse(request: socket.socket, status: str, message: str, hint: str) -> None:
    """Answer `status` with one line and close, from the accepting thread, without ever waiting: the
    socket is non-blocking (a timeout would make Python poll before each call: a peer that sends
    nothing cost this thread 0.2 s a refusal, five refusals a second for the whole agent)."""
    body = json.dumps({"error": message, "hint": hint}).encode() + b"\n"
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\nCache-Control: no-store\r\n\r\n"
    )
    try:
        request.setblocking(False)
        with contextlib.suppress(OSError):  # read what was sent: closing on unread data resets the peer
            for _ in range(16):  # at most 1 MiB (a request's most), only what is there already
                if not request.recv(65536):
                    break
        request.send(head.encode() + body)  # a few hundred bytes into an empty buffer: sent whole
        request.shutdown(socket.SHUT_WR)
    except OSError:
        pass


class _QuietErrors:
    limits: ConnectionLimits
    router: Router

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client that hangs up mid-request, or a connection cut by stop(): not worth a traceback
        logger.debug("connection error", exc_info=True)

    def _peer_of(self, request: Any) -> Peer | None:
        return None

    def process_request(self, request: Any, client_address: Any) -> None:
        """On the accepting thread: a peer not allowed, or past a bound, is answered and closed here
        at once (a few system calls, no thread, nothing read from /proc); any other gets a thread."""
        try:
            peer = self._peer_of(request)
        except OSError:
            self.shutdown_request(request)  # type: ignore[attr-defined]
            return
        who = f"uid {peer.uid} pid {peer.pid}" if peer else str(client_address)
        if peer is not None and not self.router.admit(peer):
            self.limits.log_refusal("not allowed (allowed_uids, allowed_gids)", who)
            self.router.count("refused", 403)
            _refuse(request, "403 Forbidden", REFUSED, REFUSED_HINT)
            self.shutdown_request(request)  # type: ignore[attr-defined]
            return
        why = self.limits.admit(request, peer)
        if why is not None:
            self.limits.log_refusal(why, who)
            self.router.count("busy", 503)
            _refuse(request, "503 Service Unavailable", f"busy: {why}", BUSY_HINT)
            self.shutdown_request(request)  # type: ignore[attr-defined]
            return
        try:
            super().process_request(request, client_address)  # type: ignore[misc]
        except BaseException:
            self.limits.release(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)  # type: ignore[misc]
        finally:
            self.limits.release(request)


class _UnixServer(_QuietErrors, socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = BACKLOG

    def __init__(self, path: str, router: Router, socket_gid: int | None, limits: ConnectionLimits) -> None:
        self.router = router
        self.socket_gid = socket_gid
        self.limits = limits
        super().__init__(path, _Handler)

    def _peer_of(self, request: Any) -> Peer | None:
        return peer_of(request)

    def server_bind(self) -> None:
        super().server_bind()
        # Before listen(): nobody can connect until the mode and group are right.
        path = str(self.server_address)
        if self.socket_gid is not None:
            os.chown(path, -1, self.socket_gid)
        os.chmod(path, 0o660)


class _TCPServer(_QuietErrors, socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = BACKLOG
    allow_reuse_address = True

    def __init__(
        self, address: tuple[str, int], router: Router, family: socket.AddressFamily, limits: ConnectionLimits
    ) -> None:
        self.router = router
        self.limits = limits
        self.address_family = family
        super().__init__(address, _Handler)


class Listeners:
    """The Unix socket (mode 0660, group `socket_gid`) and the optional TCP listener, each served
    by `router` from a thread of its own: `start()` binds them, `stop()` closes them and removes
    the socket file (if it is still the one this bound)."""

    def __init__(
        self,
        router: Router,
        socket_path: Path,
        *,
        socket_gid: int | None = None,
        tcp_listen: tuple[str, int] | None = None,
        max_connections: int = 64,
        max_connections_per_uid: int = 16,
    ) -> None:
        self.router = router
        self.max_connections = max_connections
        self.max_connections_per_uid = max_connections_per_uid
        self.socket_path = socket_path
        self.socket_gid = socket_gid
        self.tcp_listen = tcp_listen  # the bound address once started (the real port when 0 was asked)
        self._servers: list[socketserver.BaseServer] = []
        self._threads: list[threading.Thread] = []
        self._socket_ino: int | None = None

    def start(self) -> None:
        self._prepare_socket_path()
        unix = _UnixServer(
            str(self.socket_path),
            self.router,
            self.socket_gid,
            ConnectionLimits(self.max_connections, self.max_connections_per_uid),
        )
        self._socket_ino = os.stat(self.socket_path).st_ino
        self._serve(unix, "evidence-api")
        if self.tcp_listen is not None:
            host, port = self.tcp_listen
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            tcp = _TCPServer(
                (host, port),
                self.router,
                family,
                ConnectionLimits(self.max_connections, self.max_connections),
            )
            self._serve(tcp, "evidence-health")
            bound = tcp.server_address
            self.tcp_listen = (str(bound[0]), int(bound[1]))

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
