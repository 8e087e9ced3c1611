"""`evidence start`: ask a running agent to start recording a cgroup; prints the session id alone.

    evidence start --agent /run/evidence/agent.sock --cgroup /sys/fs/cgroup/ci/job-42 --label job=42
    evidence start --agent /run/evidence/agent.sock --pid $$ --label job=42

Also the small HTTP-over-Unix-socket client that `evidence finish` (agent/client_finish.py) uses.
Pure standard library: the client runs in job containers that have no BCC.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import socket
import sys
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote

from evidence.errors import EXIT_SETUP, Error, UsageError

logger = logging.getLogger(__name__)

SOCKET_ENV = "EVIDENCE_AGENT_SOCKET"
DEFAULT_SOCKET = "/run/evidence/agent.sock"


class AgentError(Error):
    """The agent could not be reached, refused the request, or failed it."""


class AgentNotReady(AgentError):
    """The agent answered 503: its recorder cannot take runs (yet); nothing was recorded."""

    exit_code = EXIT_SETUP


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self._path)
        except BaseException:
            s.close()
            raise
        self.sock = s


class AgentClient:
    """One request per connection; errors become AgentError with a one-line message."""

    def __init__(self, socket_path: str | Path, timeout: float = 600.0) -> None:
        self.socket_path = str(socket_path)
        self.timeout = timeout

    def _open(
        self, method: str, path: str, body: dict[str, Any] | None
    ) -> tuple[_UnixConnection, http.client.HTTPResponse]:
        conn = _UnixConnection(self.socket_path, self.timeout)
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        try:
            conn.request(method, path, body=payload, headers=headers)
            return conn, conn.getresponse()
        except FileNotFoundError:
            conn.close()
            raise AgentError(
                f"no agent socket at {self.socket_path}",
                hint=f"is `evidence agent` running? pass --agent or set {SOCKET_ENV}",
            ) from None
        except ConnectionRefusedError:
            conn.close()
            raise AgentError(
                f"nothing is listening on {self.socket_path}", hint="is `evidence agent` running?"
            ) from None
        except PermissionError:
            conn.close()
            raise AgentError(
                f"permission denied on {self.socket_path}",
                hint="the socket is mode 0660: run as its owner or in its group",
            ) from None
        except TimeoutError:
            conn.close()
            raise AgentError(f"the agent at {self.socket_path} did not answer in {self.timeout:g}s") from None
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise AgentError(f"talking to the agent at {self.socket_path} failed: {e}") from None

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        conn, resp = self._open(method, path, body)
        try:
            raw = resp.read()
        finally:
            conn.close()
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
        try:
            if resp.status != 200:
                raw = resp.read()
                try:
                    message = json.loads(raw).get("error")
                except (ValueError, AttributeError):
                    message = None
                raise AgentError(f"agent: {message or f'HTTP {resp.status}'}")
            size = 0
            while chunk := resp.read(1 << 20):
                out.write(chunk)
                size += len(chunk)
            return size
        finally:
            conn.close()

    # the API, typed

    def start(
        self, *, cgroup: str | None = None, pid: int | None = None, labels: dict[str, str] | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"labels": labels or {}}
        if cgroup is not None:
            body["cgroup"] = cgroup
        if pid is not None:
            body["pid"] = pid
        result: dict[str, Any] = self.request("POST", "/runs", body)
        return result

    def isolate(
        self,
        pid: int,
        *,
        labels: dict[str, str] | None = None,
        command: list[str] | None = None,
        detail: str = "summary",
    ) -> dict[str, Any]:
        """Have the agent move `pid` (a child of ours, waiting before exec) into a cgroup made for a
        new run: the answer's "cgroup" is that cgroup, "session_id" the run."""
        body: dict[str, Any] = {"isolate_pid": pid, "labels": labels or {}, "detail": detail}
        if command is not None:
            body["command"] = command
        result: dict[str, Any] = self.request("POST", "/runs", body)
        return result

    def finish(
        self,
        session_id: str,
        bundle: str | None = None,
        *,
        exit_code: int | None = None,
        signal: str | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"bundle": bundle} if bundle else {}
        if exit_code is not None:
            body["exit_code"] = exit_code
        if signal is not None:
            body["signal"] = signal
        result: dict[str, Any] = self.request("POST", f"/runs/{quote(session_id, safe='')}/finish", body)
        return result

    def runs(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.request("GET", "/runs")["runs"]
        return result

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = self.request("GET", "/readyz")
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


def configure(parser: argparse.ArgumentParser) -> None:
    add_agent_argument(parser)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--cgroup", metavar="PATH", help="an existing cgroup (absolute, or relative to the cgroup2 mount)"
    )
    which.add_argument("--pid", type=int, metavar="PID", help="record the cgroup this process is in")
    parser.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a label recorded in the bundle (repeatable)",
    )
    parser.add_argument("--json", action="store_true", help="print the agent's whole answer as JSON")


def run(args: argparse.Namespace) -> int:
    labels: dict[str, str] = {}
    for text in args.label:
        key, value = parse_label(text)
        if key in labels:
            raise UsageError(f"--label {key} given twice")
        labels[key] = value
    if args.pid is not None and args.pid <= 0:
        raise UsageError("--pid must be a positive process id")
    result = AgentClient(args.agent).start(cgroup=args.cgroup, pid=args.pid, labels=labels)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(result["session_id"])
    logger.info("recording %s as %s", result.get("cgroup"), result["session_id"])
    sys.stdout.flush()
    return 0
