"""Red team: past an enforced policy. Landlock checks opens, execs and the creation of sockets, not a
connect to a pathname unix socket that exists: a job (as nobody) under `--policy default`, which
gives it no access to /run, still talks to a server listening there (the system bus, a container
runtime). The bundle must say so: the connect, and a policy denial that was not enforced
(docs/threat-model.md, row 23)."""

from __future__ import annotations

import os
import socket
import tempfile
import textwrap
from pathlib import Path

from tests.kernel.util import PY, as_user, of_type, record

NOBODY = 65534


def test_a_connect_to_a_unix_socket_the_policy_keeps_out_of_reach_is_a_denial_not_enforced(
    tmp_path: Path,
) -> None:
    where = Path(tempfile.mkdtemp(prefix="evidence-test-rt-", dir="/run"))
    where.chmod(0o755)
    path = where / "server.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(str(path))
        os.chmod(path, 0o777)
        server.listen(8)
        ws = tmp_path / "ws"
        ws.mkdir()
        script = textwrap.dedent(
            f"""
            import os, socket
            try:
                open({str(path)!r})
            except PermissionError:
                pass  # the file rules hold for an open
            else:
                raise SystemExit('opened')
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect({str(path)!r})
            s.sendall(b'from the job')
            os.chdir({str(where)!r})  # and by a name relative to the cwd
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect('server.sock')
            """
        )
        proc, manifest, events = record(
            tmp_path,
            *as_user(NOBODY, PY, "-c", script),
            extra=("--policy", "default", "--workspace", str(ws)),
        )
        assert proc.returncode == 0, proc.stderr
        assert manifest["policy"]["mode"] == "enforce"
        conn, _ = server.accept()
        assert conn.recv(64) == b"from the job"  # it went through: Landlock does not check it
        conn.close()
    finally:
        server.close()
        path.unlink(missing_ok=True)
        where.rmdir()
    connects = [e["data"] for e in of_type(events, "network.connect") if e["data"]["address"] == str(path)]
    assert {(c["family"], c["result"]) for c in connects} == {("AF_UNIX", 0)}
    assert sum(c["count"] for c in connects) == 2
    found = [d for d in (e["data"] for e in of_type(events, "policy.denial")) if d["target"] == str(path)]
    denials = {(d["operation"], d["enforced"], d["result"], d["rule"]) for d in found}
    assert sum(d["count"] for d in found if d["operation"] == "connect") == 2
    assert denials == {
        ("read", True, "EACCES", "fs.read: not allowed"),
        ("connect", False, 0, "fs.read: not allowed"),
    }


def test_an_mptcp_connect_to_a_denied_address_is_refused_and_denied(tmp_path: Path) -> None:
    """MPTCP (IPPROTO_MPTCP, a protocol of its own on a stream socket) goes through the same cgroup
    connect hook as TCP: refused (EPERM), recorded, denied. Handled; kept as a test."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    policy = tmp_path / "policy.yaml"
    policy.write_text(f'version: 1\nnet:\n  default: allow\n  deny: ["127.0.0.1/32:{port}"]\n')
    script = textwrap.dedent(
        f"""
        import socket
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, 262)  # IPPROTO_MPTCP
        try:
            s.connect(('127.0.0.1', {port}))
        except PermissionError:
            print('refused')
        """
    )
    try:
        proc, _, events = record(
            tmp_path, *as_user(NOBODY, PY, "-c", script), extra=("--policy", str(policy))
        )
    finally:
        listener.close()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "refused\n"
    (connect,) = [e["data"] for e in of_type(events, "network.connect") if e["data"]["port"] == port]
    assert connect["result"] == "EPERM"
    (denial,) = [e["data"] for e in of_type(events, "policy.denial")]
    assert (denial["operation"], denial["enforced"], denial["target"]) == (
        "connect",
        True,
        f"127.0.0.1:{port}",
    )
