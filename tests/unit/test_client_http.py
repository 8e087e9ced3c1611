"""The agent client's own HTTP/1.1 over a Unix socket (agent/commands/client.py), against a server
that answers canned bytes: well-formed answers are read exactly, broken or truncated ones become one
AgentError (never a traceback), and the request it sends is plain HTTP/1.1 with a Content-Length."""

from __future__ import annotations

import io
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from evidence.agent.commands.client import AgentClient, AgentError, AgentUnreachable
from evidence.errors import UsageError


class CannedServer:
    def __init__(self, path: Path, answer: bytes) -> None:
        self.answer = answer
        self.requests: list[bytes] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(4)
        self._t = threading.Thread(target=self._serve, daemon=True)
        self._t.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                length = next(
                    (
                        int(v)
                        for k, _, v in (h.partition(b": ") for h in head.split(b"\r\n"))
                        if k == b"Content-Length"
                    ),
                    0,
                )
                while len(body) < length:
                    body += conn.recv(65536)
                self.requests.append(head + b"\r\n\r\n" + body)
                conn.sendall(self.answer)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[object]:
    servers: list[CannedServer] = []

    def start(answer: bytes) -> tuple[AgentClient, CannedServer]:
        path = tmp_path / f"s{len(servers)}"
        server = CannedServer(path, answer)
        servers.append(server)
        return AgentClient(path, timeout=10), server

    yield start
    for s in servers:
        s.close()


def _answer(status: str, body: bytes, length: int | None = None, extra: str = "") -> bytes:
    n = len(body) if length is None else length
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {n}\r\n{extra}\r\n".encode()
        + body
    )


def test_a_request_and_its_answer(serve) -> None:  # type: ignore[no-untyped-def]
    client, server = serve(_answer("200 OK", b'{"session_id": "abc", "cgroup": "/x"}'))
    assert client.isolate(42, labels={"k": "v"}) == {"session_id": "abc", "cgroup": "/x"}
    (req,) = server.requests
    head, _, body = req.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /runs HTTP/1.1"
    assert f"Content-Length: {len(body)}".encode() in lines
    assert json.loads(body) == {"isolate_pid": 42, "labels": {"k": "v"}, "detail": "summary"}


def test_errors_keep_their_meaning(serve) -> None:  # type: ignore[no-untyped-def]
    client, _ = serve(_answer("404 Not Found", b'{"error": "no such run", "hint": "h"}'))
    with pytest.raises(UsageError, match="agent: no such run"):
        client.finish("nope")


@pytest.mark.parametrize(
    "answer",
    [
        _answer("200 OK", b'{"a": 1}', length=50),  # the agent closed mid-body
        b"SSH-2.0-OpenSSH\r\n\r\n",  # not HTTP at all
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Le",  # closed mid-header
    ],
)
def test_a_broken_answer_is_one_error(serve, answer: bytes) -> None:  # type: ignore[no-untyped-def]
    client, _ = serve(answer)
    with pytest.raises(AgentUnreachable):
        client.runs()


def test_downloads_exactly_content_length(serve) -> None:  # type: ignore[no-untyped-def]
    blob = bytes(range(256)) * 12_000  # 3 MB: several reads
    client, _ = serve(_answer("200 OK", blob) + b"TRAILING GARBAGE")
    out = io.BytesIO()
    assert client.download("/runs/x/bundle", out) == len(blob)
    assert out.getvalue() == blob
    truncated, _ = serve(_answer("200 OK", blob[:1000], length=len(blob)))
    with pytest.raises(AgentError, match="mid-answer"):
        truncated.download("/runs/x/bundle", io.BytesIO())


def test_a_full_backlog_is_waited_out_not_failed_at_once(tmp_path: Path) -> None:
    # a listener that accepts nothing yet: its backlog (0: one connection) is full
    path = tmp_path / "full.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen(0)
    first = socket.socket(socket.AF_UNIX)
    first.connect(str(path))
    with srv, first:
        # nothing makes a place: after the wait, one line that says why (EAGAIN before, at once)
        with pytest.raises(AgentUnreachable, match="busy: no place in its backlog"):
            AgentClient(path, timeout=0.2).runs()
        # a place is made while the client waits: it connects and is answered
        answer = b'HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n{"runs": []}'

        def accept_then_answer() -> None:
            queued, _ = srv.accept()  # the first: a place in the backlog for the client's
            queued.close()
            conn, _ = srv.accept()
            with conn:
                while b"\r\n\r\n" not in conn.recv(65536):
                    pass
                conn.sendall(answer)

        t = threading.Timer(0.2, accept_then_answer)
        t.start()
        assert AgentClient(path, timeout=30).runs() == []
        t.join()
