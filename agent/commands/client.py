"""The small HTTP-over-Unix-socket client of the agent's API, used by `evidence start`, `finish` and
`run --agent`. Pure standard library: the client runs in job containers that have no BCC.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import socket
import struct
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import quote

from evidence.errors import EXIT_SETUP, Error, UsageError

if TYPE_CHECKING:
    from evidence.agent.daemon.models import FinishAnswer, PolicyBody, ReadyAnswer, RunAnswer

Body = dict[str, object]  # a request's JSON body (agent/daemon/models.py checks it)

logger = logging.getLogger(__name__)

SOCKET_ENV = "EVIDENCE_AGENT_SOCKET"
DEFAULT_SOCKET = "/run/evidence/agent.sock"
CONNECT_WAIT = 30.0  # seconds a connect() waits for a place in the agent's listen backlog


class AgentError(Error):
    """The agent could not be reached, refused the request, or failed it."""


class AgentNotReady(AgentError):
    """The agent answered 503: its recorder cannot take runs (yet); nothing was recorded."""

    exit_code = EXIT_SETUP


class AgentUnreachable(AgentError):
    """No agent answers at the socket (missing, refused, not allowed, timed out): nothing was run."""

    exit_code = EXIT_SETUP


class _ProtocolError(Exception):
    """The answer is not the HTTP/1.1 the agent speaks."""


class _ClosedBeforeAnswer(_ProtocolError):
    """The agent closed the connection before any byte of an answer (a kept connection it closed)."""


class _Response:
    """An HTTP/1.1 answer: status, headers (lower-case names), and a body of Content-Length bytes
    (or up to EOF when there is none) read from the connection's buffered reader."""

    MAX_LINE = 65536
    MAX_HEADERS = 100

    def __init__(self, rfile: io.BufferedReader) -> None:
        self._rfile = rfile
        try:
            first = rfile.peek(1)[:1]  # one read at most: b"" at EOF
        except ConnectionResetError:
            first = b""
        if not first:
            raise _ClosedBeforeAnswer("the agent closed the connection before answering")
        line = self._line()
        version, _, rest = line.partition(b" ")
        code = rest[:3]
        if not version.startswith(b"HTTP/1.") or not code.isdigit():
            raise _ProtocolError(f"not an HTTP answer: {line[:80]!r}")
        self.status = int(code)
        self.headers: dict[str, str] = {}
        while line := self._line():
            if len(self.headers) >= self.MAX_HEADERS:
                raise _ProtocolError("too many header lines")
            name, sep, value = line.partition(b":")
            if not sep:
                raise _ProtocolError(f"not a header line: {line[:80]!r}")
            self.headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
        if "transfer-encoding" in self.headers:
            raise _ProtocolError("chunked answers are not expected from the agent")
        length = self.headers.get("content-length")
        try:
            self._left: int | None = int(length) if length is not None else None
        except ValueError:
            raise _ProtocolError(f"bad Content-Length {length!r}") from None

    def getheader(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name.lower(), default)

    @property
    def reusable(self) -> bool:
        """Read whole, and the connection may carry another request."""
        return self._left == 0 and self.headers.get("connection", "").lower() != "close"

    def _line(self) -> bytes:
        line = self._rfile.readline(self.MAX_LINE + 1)
        if len(line) > self.MAX_LINE:
            raise _ProtocolError("header line too long")
        if not line.endswith(b"\n"):
            raise _ProtocolError("the agent closed the connection mid-answer")
        return line.rstrip(b"\r\n")

    def read(self, size: int = -1) -> bytes:
        if self._left is None:
            return self._rfile.read(size)
        want = self._left if size < 0 else min(size, self._left)
        data = self._rfile.read(want)  # a buffered read: short only at EOF
        if len(data) < want:
            raise _ProtocolError("the agent closed the connection mid-answer")
        self._left -= len(data)
        return data


class _UnixConnection:
    """One request over the agent's Unix socket (the standard library's http.client costs this
    client more to import, ~40 ms, than a whole run through the agent takes)."""

    def __init__(self, path: str, timeout: float, peer_uid: int | None = None) -> None:
        self._path = path
        self._peer_uid = peer_uid
        self.timeout = timeout
        self.sock: socket.socket | None = None
        self._rfile: io.BufferedReader | None = None

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # A full listen backlog (a burst, or another uid's loop of connects) is transient: wait
            # in the kernel's queue of connects for a place, at most CONNECT_WAIT seconds (blocking,
            # bounded by SO_SNDTIMEO; with a Python timeout the socket is non-blocking and connect()
            # fails at once with EAGAIN), in turn with the other waiting clients.
            wait = min(self.timeout, CONNECT_WAIT)
            s.setsockopt(
                socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(wait), int(wait % 1 * 1e6))
            )
            try:
                s.connect(self._path)
            except BlockingIOError:
                raise AgentUnreachable(
                    f"the agent at {self._path} is busy: no place in its backlog of connections for {wait:g}s",
                    "try again",
                ) from None
            s.settimeout(self.timeout)
            if self._peer_uid is not None:
                # every connection: a path checked once can be swapped before the next one
                _, uid, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
                if uid != self._peer_uid:
                    raise AgentUnreachable(
                        f"the process at {self._path} runs as uid {uid}, not as the agent's ({self._peer_uid})",
                        "give the agent's socket with --agent",
                    )
        except BaseException:
            s.close()
            raise
        self.sock = s

    def request(
        self, method: str, path: str, body: bytes | str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        """Send one request (as http.client's HTTPConnection.request does; a str body as UTF-8)."""
        payload = body.encode() if isinstance(body, str) else body or b""
        if any(ord(c) <= 0x20 or ord(c) == 0x7F for c in method + path):
            raise _ProtocolError(f"not a request line: {method!r} {path!r}")  # no header injection
        if self.sock is None:
            self.connect()
        assert self.sock is not None
        if self._rfile is None:
            self._rfile = self.sock.makefile("rb")
        lines = [f"{method} {path} HTTP/1.1", "Host: localhost", f"Content-Length: {len(payload)}"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload)

    def getresponse(self) -> _Response:
        if self._rfile is None:
            raise _ProtocolError("no request was sent")
        return _Response(self._rfile)

    def close(self) -> None:
        if self._rfile is not None:
            self._rfile.close()
            self._rfile = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class AgentClient:
    """One request per connection (or, with `keep_alive`, every request over one); errors become
    AgentError with a one-line message."""

    def __init__(
        self,
        socket_path: str | Path,
        timeout: float = 600.0,
        peer_uid: int | None = None,
        *,
        keep_alive: bool = False,
    ) -> None:
        """`peer_uid`: talk only to a server running as this uid (checked on every connection).
        `keep_alive`: the connection made for the first request carries the next ones (`evidence run
        --agent` starts its run on it before its command runs: the agent keeps it for the run, so the
        command cannot keep the client from finishing; agent/daemon/transport.py); `close()` it."""
        self.socket_path = str(socket_path)
        self.timeout = timeout
        self.peer_uid = peer_uid
        self.keep_alive = keep_alive
        self._kept: _UnixConnection | None = None

    def close(self) -> None:
        if self._kept is not None:
            self._kept.close()
            self._kept = None

    def _done(self, conn: _UnixConnection, resp: _Response | None) -> None:
        if self.keep_alive and resp is not None and resp.reusable and self._kept is None:
            self._kept = conn
        else:
            conn.close()

    def _open(self, method: str, path: str, body: Body | None) -> tuple[_UnixConnection, _Response]:
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        kept, self._kept = self._kept, None
        if kept is not None:
            try:
                kept.request(method, path, body=payload, headers=headers)
                return kept, kept.getresponse()
            except (BrokenPipeError, ConnectionResetError, _ClosedBeforeAnswer) as e:
                # the agent closed it (idle, or restarted) before reading this: on a new connection
                logger.debug("the kept connection to the agent is closed (%s): a new one", e)
                kept.close()
            except (OSError, _ProtocolError) as e:
                kept.close()
                raise AgentUnreachable(f"talking to the agent at {self.socket_path} failed: {e}") from None
        conn = _UnixConnection(self.socket_path, self.timeout, self.peer_uid)
        try:
            # the agent may answer before it reads (busy: 503) and close: its answer is still read
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                conn.request(method, path, body=payload, headers=headers)
            return conn, conn.getresponse()
        except FileNotFoundError:
            conn.close()
            raise AgentUnreachable(
                f"no agent socket at {self.socket_path}",
                hint=f"is `evidence agent` running? pass --agent or set {SOCKET_ENV}",
            ) from None
        except ConnectionRefusedError:
            conn.close()
            raise AgentUnreachable(
                f"nothing is listening on {self.socket_path}", hint="is `evidence agent` running?"
            ) from None
        except PermissionError:
            conn.close()
            raise AgentUnreachable(
                f"permission denied on {self.socket_path}",
                hint="the socket is mode 0660: run as its owner or in its group",
            ) from None
        except TimeoutError:
            conn.close()
            raise AgentUnreachable(
                f"the agent at {self.socket_path} did not answer in {self.timeout:g}s"
            ) from None
        except (OSError, _ProtocolError) as e:
            conn.close()
            raise AgentUnreachable(f"talking to the agent at {self.socket_path} failed: {e}") from None

    def request(self, method: str, path: str, body: Body | None = None) -> Any:
        """The answer's JSON (typed by the methods below), or the error it says."""
        conn, resp = self._open(method, path, body)
        read: _Response | None = None
        try:
            raw = resp.read()
            read = resp
        except (OSError, _ProtocolError) as e:
            raise AgentUnreachable(f"reading the agent's answer at {self.socket_path} failed: {e}") from None
        finally:
            self._done(conn, read)
        try:
            obj = json.loads(raw) if raw else {}
        except ValueError:
            raise AgentError(f"the agent answered {resp.status} with a body that is not JSON") from None
        if resp.status >= 400:
            message = (obj.get("error") or obj.get("reason")) if isinstance(obj, dict) else None
            hint = obj.get("hint") if isinstance(obj, dict) else None
            cls: type[Error] = AgentError
            if resp.status in (400, 404, 409):
                cls = UsageError
            elif resp.status == 503:
                cls = AgentNotReady
            raise cls(f"agent: {message or f'HTTP {resp.status}'}", hint=hint)
        return obj

    def download(self, path: str, out: IO[bytes]) -> int:
        conn, resp = self._open("GET", path, None)
        read: _Response | None = None
        try:
            if resp.status != 200:
                raw = resp.read()
                try:
                    message = json.loads(raw).get("error")
                except (ValueError, AttributeError):
                    message = None
                raise AgentError(f"agent: {message or f'HTTP {resp.status}'}")
            size = 0
            try:
                while chunk := resp.read(1 << 20):
                    out.write(chunk)
                    size += len(chunk)
            except _ProtocolError as e:
                raise AgentError(f"downloading from the agent at {self.socket_path} failed: {e}") from None
            read = resp
            return size
        finally:
            self._done(conn, read)

    # the API, typed (agent/daemon/models.py)

    def start(
        self, *, cgroup: str | None = None, pid: int | None = None, labels: dict[str, str] | None = None
    ) -> RunAnswer:
        body: Body = {"labels": labels or {}, "cgroup": cgroup, "pid": pid}
        result: RunAnswer = self.request("POST", "/runs", {k: v for k, v in body.items() if v is not None})
        return result

    def isolate(
        self,
        pid: int,
        *,
        labels: dict[str, str] | None = None,
        command: list[str] | None = None,
        detail: str = "summary",
        policy: PolicyBody | None = None,
        net: str | None = None,
        subjects: list[str] | None = None,
    ) -> RunAnswer:
        """Have the agent move `pid` (a child of ours, waiting before exec) into a cgroup made for a
        new run: the answer's "cgroup" is that cgroup, "session_id" the run. `net`: the private
        network the child made itself (--net), for the manifest."""
        body: Body = {
            "isolate_pid": pid,
            "labels": labels or {},
            "detail": detail,
            "command": command,
            "policy": policy,
            "net": net,
            "subjects": subjects,  # files the command produces: the agent hashes them as this uid
        }
        result: RunAnswer = self.request("POST", "/runs", {k: v for k, v in body.items() if v is not None})
        return result

    def finish(
        self,
        session_id: str,
        bundle: str | None = None,
        *,
        exit_code: int | None = None,
        signal: str | None = None,
    ) -> FinishAnswer:
        body: Body = {"bundle": bundle or None, "exit_code": exit_code, "signal": signal}
        result: FinishAnswer = self.request(
            "POST",
            f"/runs/{quote(session_id, safe='')}/finish",
            {k: v for k, v in body.items() if v is not None},
        )
        return result

    def runs(self) -> list[RunAnswer]:
        result: list[RunAnswer] = self.request("GET", "/runs")["runs"]
        return result

    def health(self) -> ReadyAnswer:
        result: ReadyAnswer = self.request("GET", "/readyz")
        return result


def parse_label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise UsageError(f"--label {text!r} is not KEY=VALUE")
    return key, value


def add_agent_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--agent",
        metavar="SOCKET",
        default=os.environ.get(SOCKET_ENV, DEFAULT_SOCKET),
        help=f"the agent's Unix socket (default: ${SOCKET_ENV} or {DEFAULT_SOCKET})",
    )
