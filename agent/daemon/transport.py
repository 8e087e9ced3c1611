"""HTTP/1.1 over the agent's sockets: one event loop serves the Unix socket and the TCP listener.

The Unix socket serves the whole API to peers that pass the `Router`'s check (SO_PEERCRED and
SO_PEERGROUPS, see agent/daemon/authz.py); a refused peer gets a one-line 403 at once, when it is
accepted, and its connection is closed. The optional TCP listener has no peer credentials: the
router is handed `peer=None` and serves only /healthz, /readyz and /metrics there. Bodies are JSON
objects of at most MAX_BODY bytes nested at most MAX_DEPTH deep, sent with a Content-Length. What a
request means is the router's business (agent/daemon/api.py: AgentAPI); HTTP itself is h11's;
what a request and an answer are, and the bounds on connections, are agent/daemon/wire.py's.

One thread runs the event loop: it accepts, reads and writes every connection, and answers a refusal
itself, with a few system calls and no wait for the peer (a loop of connects by one uid cannot keep
the others out: see docs/threat-model.md). A request is answered on a worker thread (`Router.handle`
may take seconds: a finish writes a bundle); an idle connection costs no thread. The listen backlog
(BACKLOG) holds a burst of connects.

Connections are bounded (`ConnectionLimits`): at most `total` open at once on each listener, and on
the Unix socket at most `per_uid` of one peer uid (root counts only towards the total); past a bound
a connection is answered with a one-line 503 and closed, and logged (at most once a second). A
connection is closed after IDLE_SECONDS without a whole request.

A connection whose request started a run (a 201 answer naming it, `Response.holds`) is then that
run's: while the run lives it counts towards neither bound and is not closed for idleness, so that
the client that started the run can always finish it (`evidence run --agent` finishes and downloads
on the connection it started the run on, made before its command runs): the run's own job, of the
same uid, can fill its uid's bound or the backlog, but cannot take that connection away. Once the
run is over the connection counts again (it may then be over its bound until it is closed).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import http
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import h11

from evidence.agent.daemon.authz import Peer, peer_of
from evidence.agent.daemon.wire import (
    BAD_REQUEST_HINT,
    BUSY_HINT,
    MAX_BODY,
    REFUSED,
    REFUSED_HINT,
    BadRequest,
    ConnectionLimits,
    Response,
    Router,
    one_line,
    parse_body,
)
from evidence.errors import SetupError

logger = logging.getLogger(__name__)

MAX_HEAD = 64 * 1024  # a request's line and headers
# Connections waiting to be accepted (listen(); the kernel caps it at net.core.somaxconn). The
# standard library's 5 was full at once under a loop of connects: other clients' connect() failed.
BACKLOG = 1024
IDLE_SECONDS = 30.0  # a connection's most time without a whole request (and a write's most)
HELD_WORKERS = 1024  # request threads beyond max_connections: one a held connection (a run slot)
ACCEPT_BATCH = 64  # connections accepted (or refused) in one turn of the event loop
_CHUNK = 1 << 20
_METHODS = ("GET", "POST", "PUT", "DELETE")

T = TypeVar("T")


class _Idle(Exception):
    """No whole request within IDLE_SECONDS (or a write that did not drain): the connection closes."""


class _Server:
    """One listener: its own accept loop on the event loop (a reader callback on the listening
    socket), where a refusal is answered and closed at once with plain non-blocking socket calls
    (accept, two getsockopt, send, close: no task, no stream); an admitted connection is served by
    a task of its own."""

    def __init__(
        self,
        sock: socket.socket,
        router: Router,
        limits: ConnectionLimits,
        pool: concurrent.futures.ThreadPoolExecutor,
        *,
        credentials: bool,
    ) -> None:
        self.sock = sock
        self.router = router
        self.limits = limits
        self.pool = pool
        self.credentials = credentials  # the Unix socket: peers are known (SO_PEERCRED) and checked
        self.writers: set[asyncio.StreamWriter] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.sock.setblocking(False)
        self.sock.listen(BACKLOG)
        loop.add_reader(self.sock.fileno(), self._accept)

    def close(self) -> None:
        if self.loop is not None:
            self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
        for task in list(self.tasks):
            task.cancel()
        for w in list(self.writers):
            w.transport.abort()

    def _accept(self) -> None:
        assert self.loop is not None
        for _ in range(ACCEPT_BATCH):  # then the loop's other work gets its turn
            try:
                conn, address = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # out of descriptors: what is queued waits (the socket stays readable: no spin)
                    self.limits.log_refusal(f"cannot accept: {e.strerror}", "the backlog")
                    self.loop.remove_reader(self.sock.fileno())
                    self.loop.call_later(0.1, self._resume)
                    return
                continue  # that connection went (ECONNABORTED): the next one
            self._admit(conn, address)

    def _resume(self) -> None:
        if self.loop is not None and self.sock.fileno() >= 0:  # not closed meanwhile
            self.loop.add_reader(self.sock.fileno(), self._accept)

    def _admit(self, conn: socket.socket, address: Any) -> None:
        assert self.loop is not None
        conn.setblocking(False)
        peer: Peer | None = None
        if self.credentials:
            try:
                peer = peer_of(conn)
            except OSError:
                conn.close()
                return
        who = f"uid {peer.uid} pid {peer.pid}" if peer else str(address)
        if peer is not None and not self.router.admit(peer):
            self.limits.log_refusal("not allowed (allowed_uids, allowed_gids)", who)
            self._refuse(conn, 403, REFUSED, REFUSED_HINT, "refused")
            return
        why = self.limits.admit(conn, peer)
        if why is not None:
            self.limits.log_refusal(why, who)
            self._refuse(conn, 503, f"busy: {why}", BUSY_HINT, "busy")
            return
        task = self.loop.create_task(self._serve(conn, peer, who))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _refuse(self, conn: socket.socket, status: int, message: str, hint: str, route: str) -> None:
        """Answer and close, without waiting for anything: the socket is non-blocking (a timeout
        would make Python poll before each call: a peer that sent nothing cost the accepting thread
        0.2 s a refusal, five refusals a second for the whole agent)."""
        self.router.count(route, status)
        try:
            with contextlib.suppress(BlockingIOError):  # what was sent already: closing on unread
                for _ in range(16):  # data resets the peer's connection (at most a request's 1 MiB)
                    if not conn.recv(65536):
                        break
            conn.send(one_line(status, message, hint))  # a few hundred bytes into an empty buffer
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            conn.close()

    async def _serve(self, conn: socket.socket, peer: Peer | None, who: str) -> None:
        writer: asyncio.StreamWriter | None = None
        try:
            if conn.family == socket.AF_UNIX:
                reader, writer = await asyncio.open_unix_connection(sock=conn)
            else:
                reader, writer = await asyncio.open_connection(sock=conn)
            self.writers.add(writer)
            await _Connection(self, reader, writer, peer, conn).run()
        except (_Idle, ConnectionError, h11.ProtocolError) as e:
            logger.debug("connection of %s closed: %s", who, e)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug of the transport's: the connection goes, the agent stays
            logger.exception("connection of %s failed", who)
        finally:
            if writer is None:
                conn.close()
            else:
                writer.close()  # what is still buffered is sent first, for as long as a write may take
                try:
                    async with asyncio.timeout(IDLE_SECONDS):
                        await writer.wait_closed()
                except (TimeoutError, OSError):
                    writer.transport.abort()
                self.writers.discard(writer)
            self.limits.release(conn)  # counted until closed

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)


class _Connection:
    """Requests on one admitted connection, one after the other (HTTP/1.1 keep-alive)."""

    def __init__(
        self,
        server: _Server,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer: Peer | None,
        key: socket.socket,
    ) -> None:
        self.server = server
        self.reader = reader
        self.writer = writer
        self.peer = peer
        self.key = key  # the connection in the server's ConnectionLimits
        self.h = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        self.held: str | None = None  # the session id of the run that holds this connection

    async def run(self) -> None:
        while True:
            if self.held is not None and not await self.server.call(self.server.router.live, self.held):
                self.server.limits.unhold(self.key)
                self.held = None
            try:
                request = await self._request()
            except h11.RemoteProtocolError as e:  # not HTTP/1.1 as h11 reads it: one line, and close
                if self.h.our_state is h11.IDLE:
                    status = e.error_status_hint
                    self.server.router.count("other", status)
                    await self._write(one_line(status, f"bad request: {e}", BAD_REQUEST_HINT))
                return
            if request is None:
                return
            response, close = request
            await self._send(response, close)
            if close or self.h.our_state is h11.MUST_CLOSE:
                return
            self.h.start_next_cycle()

    async def _request(self) -> tuple[Response, bool] | None:
        """The next request's answer and whether to close after it; None when the peer closed."""
        deadline = None if self.held is not None else time.monotonic() + IDLE_SECONDS
        event = await self._next_event(deadline)
        if isinstance(event, h11.ConnectionClosed):
            return None
        if not isinstance(event, h11.Request):
            raise h11.RemoteProtocolError(f"unexpected {type(event).__name__}")
        if deadline is None:  # a held connection: from its first byte, a request has the usual time
            deadline = time.monotonic() + IDLE_SECONDS
        method = event.method.decode("ascii", "replace")
        path = event.target.decode("latin-1")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers}
        try:
            body = await self._body(headers, deadline)
        except BadRequest as e:
            return Response.error(e.status, e.message, "other"), True
        if method not in _METHODS:
            return Response.error(501, f"unsupported method {method}", "other"), True
        try:
            parsed = parse_body(body) if method in ("POST", "PUT") else {}
        except BadRequest as e:
            return Response.error(e.status, e.message, "other"), True
        router = self.server.router
        try:
            response = await self.server.call(router.handle, method, path, parsed, self.peer)
        except Exception:  # the router answers its own errors: this is a bug, its details stay here
            logger.exception("request %s %s failed", method, path)
            response = Response.error(500, "internal error in the agent (see its log)", "error")
        if response.holds is not None and response.status == 201 and self.peer is not None:
            if self.held is None:
                self.server.limits.hold(self.key)
            self.held = response.holds
        return response, False

    async def _body(self, headers: dict[str, str], deadline: float) -> bytes:
        if "transfer-encoding" in headers:
            raise BadRequest(411, "send a Content-Length, not chunked")
        try:
            length = int(headers.get("content-length") or 0)
        except ValueError:
            raise BadRequest(400, "bad Content-Length") from None
        if length > MAX_BODY:
            raise BadRequest(413, f"request body over {MAX_BODY} bytes")
        parts: list[bytes] = []
        while True:
            event = await self._next_event(deadline)
            if isinstance(event, h11.Data):
                parts.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(parts)
            else:
                raise h11.RemoteProtocolError(f"unexpected {type(event).__name__} in a body")

    async def _next_event(self, deadline: float | None) -> Any:
        while True:
            event = self.h.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.h.receive_data(await self._read(deadline))

    async def _read(self, deadline: float | None) -> bytes:
        while True:
            wait = IDLE_SECONDS if deadline is None else deadline - time.monotonic()
            if wait <= 0:
                raise _Idle(f"no whole request in {IDLE_SECONDS:g} s")
            try:
                async with asyncio.timeout(wait):
                    return await self.reader.read(65536)
            except TimeoutError:
                if deadline is not None:
                    raise _Idle(f"no whole request in {IDLE_SECONDS:g} s") from None
            # held: idle for as long as its run lives
            assert self.held is not None
            if not await self.server.call(self.server.router.live, self.held):
                self.server.limits.unhold(self.key)
                self.held = None
                deadline = time.monotonic() + IDLE_SECONDS

    async def _send(self, r: Response, close: bool) -> None:
        self.server.router.count(r.route, r.status)
        length = r.length if r.stream is not None else len(r.body)
        headers = [
            ("Content-Type", r.content_type),
            ("Content-Length", str(length)),
            ("Cache-Control", "no-store"),
            ("Server", "evidence-agent"),
        ]
        if close:
            headers.append(("Connection", "close"))
        try:
            head = self.h.send(
                h11.Response(status_code=r.status, headers=headers, reason=http.HTTPStatus(r.status).phrase)
            )
            await self._write(head or b"")
            if r.stream is None:
                await self._write(self.h.send(h11.Data(data=r.body)) or b"")
            else:
                with r.stream as f:
                    while chunk := await self.server.call(f.read, _CHUNK):
                        await self._write(self.h.send(h11.Data(data=chunk)) or b"")
            await self._write(self.h.send(h11.EndOfMessage()) or b"")
        finally:
            if r.stream is not None:
                r.stream.close()

    async def _write(self, data: bytes) -> None:
        self.writer.write(data)
        try:
            async with asyncio.timeout(IDLE_SECONDS):
                await self.writer.drain()
        except TimeoutError:
            raise _Idle(f"the peer read nothing for {IDLE_SECONDS:g} s") from None


def _bind_unix(path: Path, socket_gid: int | None) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        # before listen(): nobody can connect until the mode and group are right
        if socket_gid is not None:
            os.chown(path, -1, socket_gid)
        os.chmod(path, 0o660)
    except BaseException:
        sock.close()
        raise
    return sock


def _bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


class Listeners:
    """The Unix socket (mode 0660, group `socket_gid`) and the optional TCP listener, served by
    `router` from one event loop on a thread of its own: `start()` binds them, `stop()` closes them
    and removes the socket file (if it is still the one this bound)."""

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
        self._socket_ino: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._servers: list[_Server] = []
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def start(self) -> None:
        self._prepare_socket_path()
        socks: list[tuple[socket.socket, bool, ConnectionLimits]] = []
        try:
            unix = _bind_unix(self.socket_path, self.socket_gid)
            socks.append((unix, True, ConnectionLimits(self.max_connections, self.max_connections_per_uid)))
            self._socket_ino = os.stat(self.socket_path).st_ino
            if self.tcp_listen is not None:
                tcp = _bind_tcp(*self.tcp_listen)
                socks.append((tcp, False, ConnectionLimits(self.max_connections, self.max_connections)))
                bound = tcp.getsockname()
                self.tcp_listen = (str(bound[0]), int(bound[1]))
        except BaseException:
            for s, _, _ in socks:
                s.close()
            raise
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self.max_connections + HELD_WORKERS, thread_name_prefix="evidence-request"
        )
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._servers = [
            _Server(sock, self.router, lim, self._pool, credentials=cred) for sock, cred, lim in socks
        ]
        for server in self._servers:
            server.start(loop)  # listen() here: a connect succeeds from now on, answered once it runs
        self._thread = threading.Thread(target=loop.run_forever, name="evidence-api", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None:

            async def close() -> None:
                tasks = [t for server in self._servers for t in server.tasks]
                for server in self._servers:
                    server.close()  # cancels its tasks: each closes its connection on its way out
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(5):
                        await asyncio.gather(*tasks, return_exceptions=True)
                loop.stop()

            with contextlib.suppress(RuntimeError):  # the loop is closed already
                asyncio.run_coroutine_threadsafe(close(), loop)
            thread.join(timeout=10)
            if not thread.is_alive():
                loop.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._loop = self._thread = self._pool = None
        self._servers = []
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
