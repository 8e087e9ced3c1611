"""`evidence run` uses a running agent when one answers (its probes are loaded already), says so, and
`--standalone` loads probes here instead. Through the agent too, the command gets only stdio and
what --pass-fd names."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.kernel.test_run_via_agent import agent, out, workdir  # noqa: F401 - fixtures
from tests.kernel.util import read_bundle


def _run(env_socket: str, *args: str, cwd: Path, **kw: object) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "EVIDENCE_AGENT_SOCKET": env_socket, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "evidence", "run", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
        **kw,
    )  # type: ignore[call-overload]


def test_a_running_agent_is_used_and_named(agent, out: Path) -> None:  # noqa: F811
    r, w = os.pipe()
    proc = _run(
        str(agent.socket),
        "--bundle",
        str(out / "a.tar.gz"),
        "--",
        "/usr/bin/ls",
        "/proc/self/fd",
        cwd=out,
        pass_fds=(r, w),
    )
    assert proc.returncode == 0, proc.stderr + agent.output()
    assert f"recording through the agent at {agent.socket}" in proc.stderr
    fds = {int(x) for x in proc.stdout.split()}
    assert fds - {0, 1, 2} == {3}, proc.stdout  # ls's own listing: the unnamed inherited pipe is not passed
    manifest, _ = read_bundle(out / "a.tar.gz")
    assert manifest["exit_code"] == 0

    named = _run(
        str(agent.socket), "--pass-fd", str(r), "--bundle", str(out / "b.tar.gz"), "--", "/usr/bin/ls", "/proc/self/fd",
        cwd=out, pass_fds=(r, w),
    )  # fmt: skip
    assert named.returncode == 0, named.stderr
    assert r in {int(x) for x in named.stdout.split()}
    os.close(r)
    os.close(w)


def test_standalone_loads_probes_here(agent, out: Path) -> None:  # noqa: F811
    proc = _run(str(agent.socket), "--standalone", "--bundle", str(out / "s.tar.gz"), "--", "true", cwd=out)
    assert proc.returncode == 0, proc.stderr
    assert "through the agent" not in proc.stderr
    manifest, _ = read_bundle(out / "s.tar.gz")
    assert "isolation" in manifest["capabilities"]  # written by the standalone recorder only


def test_a_socket_a_job_could_have_made_is_never_chosen_without_being_named(tmp_path: Path) -> None:
    """EVIDENCE_AGENT_SOCKET may come from a job's environment: a socket that is not root's, or sits
    where others can write, is not taken for the agent (the run records on its own)."""
    import socket
    import stat

    fake_dir = tmp_path / "fake"
    fake_dir.mkdir()
    fake_dir.chmod(0o777)  # anybody could have put a socket here
    fake = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fake.bind(str(fake_dir / "agent.sock"))
    fake.listen(4)
    try:
        assert stat.S_ISSOCK(os.stat(fake_dir / "agent.sock").st_mode)
        proc = _run(
            str(fake_dir / "agent.sock"), "--bundle", str(tmp_path / "r.tar.gz"), "--", "true", cwd=tmp_path
        )
        assert proc.returncode == 0, proc.stderr
        assert "through the agent" not in proc.stderr
        assert "isolation" in read_bundle(tmp_path / "r.tar.gz")[0]["capabilities"]  # recorded standalone
    finally:
        fake.close()


FAKE_AGENT = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sys.argv[1]); s.listen(8)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.recv(65536)
    c.sendall(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n{"ready": true}')
    c.close()
"""


def test_a_root_client_talks_only_to_an_agent_running_as_root(tmp_path: Path) -> None:
    """A path checked once can be swapped before the next connection (a job's symlink race), so a
    root client checks on every connection that root answers: a fake agent of the job's uid gets
    nothing to record and forges no bundle."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(dir="/tmp"))  # not tmp_path: its parents are 0700, the fake is nobody
    d.chmod(0o777)
    sock = d / "agent.sock"
    fake = subprocess.Popen(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--",
            "/usr/bin/python3",
            "-c",
            FAKE_AGENT,
            str(sock),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert fake.stdout is not None and fake.stdout.readline().strip() == "ready"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "evidence",
                "run",
                "--agent",
                str(sock),
                "--bundle",
                str(tmp_path / "f.tar.gz"),
                "--",
                "true",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 70, proc.stderr
        assert "runs as uid 65534" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
        assert not (tmp_path / "f.tar.gz").exists()
    finally:
        fake.kill()
        fake.wait()
        shutil.rmtree(d)
