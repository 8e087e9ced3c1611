"""What the agent's transport (agent/daemon/transport.py) and its router (agent/daemon/api.py) exchange,
and the bounds on its connections: `Response` and the `Router` protocol; request bodies (JSON objects
of at most MAX_BODY bytes nested at most MAX_DEPTH deep: `parse_body`, else `BadRequest`); the
one-line answers of a refusal; `ConnectionLimits` (at most `total` connections open on a listener,
`per_uid` of one uid, a run's own connection held outside both). No I/O of its own: the event loop is
transport.py's."""

from __future__ import annotations

import dataclasses
import http
import json
import logging
import time
from collections import Counter
from typing import IO, Any, Protocol

from evidence.agent.daemon.authz import Peer

logger = logging.getLogger(__name__)

MAX_BODY = 1024 * 1024
MAX_DEPTH = 64  # a body's nesting (the API's deepest is 3): deeper is a 400, not a RecursionError


@dataclasses.dataclass
class Response:
    """What the router answers; `stream` (an open file of `length` bytes) is sent instead of body.
    `holds`: the session id of the run this answer started (the connection becomes the run's)."""

    status: int
    body: bytes
    content_type: str
    route: str
    stream: IO[bytes] | None = None
    length: int | None = None
    holds: str | None = None

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
    """What the transport asks of the API."""

    def admit(self, peer: Peer) -> bool:
        """Whether this peer may use the agent at all (and count it when not); on the event loop's
        thread: it must not block."""
        ...

    def handle(self, method: str, path: str, body: dict[str, Any], peer: Peer | None) -> Response:
        """Answer one request, on a worker thread (concurrently); peer is None on the TCP listener."""
        ...

    def count(self, route: str, code: int) -> None:
        """An answer was sent (for /metrics); on the event loop's thread: it must not block."""
        ...

    def live(self, session_id: str) -> bool:
        """Whether a run is still being recorded (a held connection stays its run's while it is);
        on a worker thread."""
        ...


class BadRequest(Exception):
    """A request the transport cannot read (no Content-Length, too big, not a JSON object)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request's body: a JSON object nested at most MAX_DEPTH deep ({} when empty), else BadRequest
    400 (never a RecursionError: found by the red team, a traceback in the agent's log)."""
    if not raw.strip():
        return {}
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise BadRequest(400, f"request body is nested more than {MAX_DEPTH} deep") from None
    except ValueError as e:
        raise BadRequest(400, f"request body is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise BadRequest(400, "request body must be a JSON object")
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise BadRequest(400, f"request body is nested more than {MAX_DEPTH} deep")
        children = value.values() if isinstance(value, dict) else value
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return obj


class ConnectionLimits:
    """Open connections, counted in total and per peer uid (keyed by any token of the connection);
    `admit` says why not when over a bound. Used from the event loop's thread only."""

    def __init__(self, total: int, per_uid: int) -> None:
        self.total = total
        self.per_uid = per_uid
        self._open = 0
        self._by_uid: Counter[int] = Counter()
        self._uids: dict[object, int | None] = {}  # connection -> its peer's uid (None: no peer)
        self._held: set[object] = set()  # connections a live run holds: counted in neither bound
        self._last_log = 0.0
        self.refused = 0

    def admit(self, conn: object, peer: Peer | None) -> str | None:
        """None (and the connection counted) when it may be served, else why not."""
        if self._open >= self.total:
            return f"the agent has {self._open} connections open, its limit (max_connections)"
        if peer is not None and peer.uid != 0 and self._by_uid[peer.uid] >= self.per_uid:
            return f"uid {peer.uid} has {self.per_uid} connections open, its limit (max_connections_per_uid)"
        self._count(conn, peer.uid if peer is not None else None)
        return None

    def _count(self, conn: object, uid: int | None) -> None:
        self._open += 1
        self._uids[conn] = uid
        if uid is not None:
            self._by_uid[uid] += 1

    def _uncount(self, conn: object) -> int | None:
        self._open -= 1
        uid = self._uids.pop(conn, None)
        if uid is not None:
            self._by_uid[uid] -= 1
            if not self._by_uid[uid]:
                del self._by_uid[uid]
        return uid

    def hold(self, conn: object) -> None:
        """A run holds the connection: it counts towards no bound until `unhold` or `release`."""
        if conn in self._uids and conn not in self._held:
            self._uids[conn] = self._uncount(conn)
            self._held.add(conn)

    def unhold(self, conn: object) -> None:
        """Its run is over: the connection counts again (even past a bound: it is open already)."""
        if conn in self._held:
            self._held.discard(conn)
            self._count(conn, self._uids.pop(conn, None))

    def release(self, conn: object) -> None:
        if conn in self._held:
            self._held.discard(conn)
            self._uids.pop(conn, None)
        elif conn in self._uids:
            self._uncount(conn)

    @property
    def open(self) -> int:
        return self._open

    def log_refusal(self, why: str, who: str) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._last_log < 1.0:
            return
        self._last_log = now
        logger.warning("refused a connection from %s: %s (%d refused so far)", who, why, self.refused)


BUSY_HINT = "close idle connections, or try again"
REFUSED = "permission denied: this uid/gid may not use the agent"
REFUSED_HINT = "add it to allowed_uids or allowed_gids"
BAD_REQUEST_HINT = "send HTTP/1.1 (with a Host header) and a body with a Content-Length"


def one_line(status: int, message: str, hint: str) -> bytes:
    """A whole answer that closes the connection, for a refusal (no h11: nothing was read)."""
    body = json.dumps({"error": message, "hint": hint}).encode() + b"\n"
    head = (
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\nCache-Control: no-store\r\n\r\n"
    )
    return head.encode() + body
