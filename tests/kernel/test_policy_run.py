"""`evidence run --policy`: enforce, dry-run, fail-closed, bad policies, profile round trip.
Network targets are loopback only (127.0.0.0/8, ::1); peers elsewhere live in tests/kernel/test_connect_guard.py."""

from __future__ import annotations

import os
import socket
import textwrap
from pathlib import Path

import pytest

from tests.kernel.util import PY, evidence, of_type, record


def _listener(family: int = socket.AF_INET, host: str = "127.0.0.1") -> socket.socket:
    s = socket.socket(family)
    s.bind((host, 0))
    s.listen(16)
    return s


@pytest.fixture
def world(tmp_path: Path):
    ws = tmp_path / "ws"
    ws.mkdir()
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret")
    outside = tmp_path / "outside"
    outside.mkdir()
    denied = _listener()
    allowed = _listener()
    denied6 = _listener(socket.AF_INET6, "::1")
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        textwrap.dedent(
            f"""
            version: 1
            fs:
              read: ["/usr", "/lib", "/lib64", "/etc", "/bin", "/proc", "/dev", "/sys", "${{WORKSPACE}}", "{tmp_path}"]
              write: ["${{WORKSPACE}}", "${{TMPDIR}}", "/dev/null", "/dev/tty"]
              exec: ["/usr", "/bin", "/lib", "/lib64"]
              deny: ["{secret}"]
            net:
              default: allow
              deny: ["127.0.0.1/32:{denied.getsockname()[1]}", "[::1/128]:{denied6.getsockname()[1]}"]
            env:
              strip_exec_influence: true
            """
        )
    )
    yield {
        "ws": ws,
        "secret": secret,
        "outside": outside,
        "policy": policy,
        "denied": denied,
        "allowed": allowed,
        "denied6": denied6,
    }
    for s in (denied, allowed, denied6):
        s.close()


def _attempts(w) -> str:
    d4 = w["denied"].getsockname()[1]
    ok4 = w["allowed"].getsockname()[1]
    d6 = w["denied6"].getsockname()[1]
    return textwrap.dedent(
        f"""
        import os, socket, subprocess, json
        out = {{}}
        def attempt(name, fn):
            try:
                fn(); out[name] = "ok"
            except OSError as e:
                out[name] = e.errno
        attempt("read_secret", lambda: open({str(w["secret"])!r}).read())
        attempt("write_outside", lambda: open({str(w["outside"] / "x.txt")!r}, "w").write("x"))
        attempt("write_inside", lambda: open("inside.txt", "w").write("x"))
        attempt("connect_denied", lambda: socket.create_connection(("127.0.0.1", {d4}), timeout=2).close())
        attempt("connect_mapped", lambda: socket.create_connection(("::ffff:127.0.0.1", {d4}), timeout=2).close())
        attempt("connect_denied6", lambda: socket.create_connection(("::1", {d6}), timeout=2).close())
        attempt("connect_allowed", lambda: socket.create_connection(("127.0.0.1", {ok4}), timeout=2).close())
        attempt("udp_denied", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", {d4})))
        print(json.dumps(out))
        """
    )


def _denials(events):
    return [e["data"] for e in of_type(events, "policy.denial")]


def test_enforce_blocks_and_records(tmp_path: Path, world) -> None:
    import json

    proc, manifest, events = record(
        tmp_path,
        PY,
        "-c",
        _attempts(world),
        extra=("--policy", str(world["policy"]), "--workspace", str(world["ws"])),
        cwd=world["ws"],
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["read_secret"] == 13 and got["write_outside"] == 13  # EACCES from Landlock
    assert got["write_inside"] == "ok" and got["connect_allowed"] == "ok"
    assert (
        got["connect_denied"] == 1
        and got["connect_mapped"] == 1
        and got["connect_denied6"] == 1
        and got["udp_denied"] == 1
    )
    assert not (world["outside"] / "x.txt").exists()
    den = _denials(events)
    by_target = {(d["operation"], d["target"]): d for d in den}
    secret = by_target[("read", str(world["secret"]))]
    assert secret["enforced"] and secret["result"] == "EACCES" and secret["rule"].startswith("fs.deny[0]")
    assert by_target[("write", str(world["outside"] / "x.txt"))]["rule"] == "fs.write: not allowed"
    d4 = world["denied"].getsockname()[1]
    assert by_target[("connect", f"127.0.0.1:{d4}")]["enforced"] is True
    assert by_target[("connect", f"127.0.0.1:{d4}")]["exe"] == PY
    assert ("connect", f"[::1]:{world['denied6'].getsockname()[1]}") in by_target
    assert ("sendmsg", f"127.0.0.1:{d4}") in by_target
    pol = manifest["policy"]
    assert pol["mode"] == "enforce" and pol["workspace"] == str(world["ws"]) and pol["landlock"]["abi"] >= 1
    assert pol["connect_guard"] is True
    assert manifest["counts"]["dev.evidence.policy.denial"] == len(den)


def test_dry_run_blocks_nothing_records_would_block_and_exits_4(tmp_path: Path, world) -> None:
    import json

    proc, manifest, events = record(
        tmp_path,
        PY,
        "-c",
        _attempts(world),
        extra=("--policy", str(world["policy"]), "--workspace", str(world["ws"]), "--dry-run"),
        cwd=world["ws"],
    )
    assert proc.returncode == 4, proc.stderr
    got = json.loads(proc.stdout)
    assert got["read_secret"] == "ok" and got["write_outside"] == "ok" and got["connect_denied"] == "ok"
    den = _denials(events)
    assert den and all(d["enforced"] is False for d in den)
    ops = {(d["operation"], d["target"]) for d in den}
    assert ("read", str(world["secret"])) in ops and (
        "connect",
        f"127.0.0.1:{world['denied'].getsockname()[1]}",
    ) in ops
    assert manifest["policy"]["mode"] == "dry-run"
    assert "would have been blocked" in proc.stderr


def test_exec_outside_the_exec_list_is_blocked(tmp_path: Path, world) -> None:
    tool = world["ws"] / "tool.sh"
    tool.write_text("#!/bin/sh\necho ran\n")
    tool.chmod(0o755)
    proc, _, events = record(
        tmp_path,
        "/bin/sh",
        "-c",
        f"{tool}; echo rc=$?",
        extra=("--policy", str(world["policy"]), "--workspace", str(world["ws"])),
    )
    assert "ran" not in proc.stdout and "rc=126" in proc.stdout
    den = [d for d in _denials(events) if d["operation"] == "exec"]
    assert (
        den
        and den[0]["target"] == str(tool)
        and den[0]["enforced"]
        and den[0]["rule"] == "fs.exec: not allowed"
    )


def test_environment_is_scrubbed_and_private_tmp_is_used(tmp_path: Path, world) -> None:
    env = {**os.environ, "GITHUB_TOKEN": "ghp_notreal", "LD_PRELOAD": "/nonexistent.so", "CI": "true"}
    code = "import os, json, tempfile; print(json.dumps({k: os.environ.get(k) for k in ('GITHUB_TOKEN','LD_PRELOAD','CI','TMPDIR')}))"
    proc, manifest, _ = record(
        tmp_path,
        PY,
        "-c",
        code,
        extra=("--policy", str(world["policy"]), "--workspace", str(world["ws"])),
        env=env,
    )
    import json

    seen = json.loads(proc.stdout)
    assert seen["GITHUB_TOKEN"] is None and seen["LD_PRELOAD"] is None and seen["CI"] == "true"
    assert seen["TMPDIR"] == manifest["policy"]["tmpdir"]
    assert {"GITHUB_TOKEN", "LD_PRELOAD"} <= set(manifest["policy"]["env_removed"])
    assert not os.path.exists(seen["TMPDIR"]), "the private tmp is removed afterwards"
    assert "ghp_notreal" not in json.dumps(manifest)


def test_allowed_work_succeeds(tmp_path: Path, world) -> None:
    (world["ws"] / "pkg").mkdir()
    (world["ws"] / "pkg" / "mod.py").write_text("X = 1\n")
    proc, _, events = record(
        tmp_path,
        PY,
        "-m",
        "compileall",
        "-q",
        "pkg",
        extra=("--policy", str(world["policy"]), "--workspace", str(world["ws"])),
        cwd=world["ws"],
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list((world["ws"] / "pkg" / "__pycache__").iterdir())
    assert not [d for d in _denials(events) if d["enforced"]]


def test_bad_policy_exits_2_and_never_starts(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nnet:\n  default: deny\n  allow: ['10.0.0.1/33']\n")
    marker = tmp_path / "started"
    bundle = tmp_path / "b.tar.gz"
    proc = evidence("run", "--policy", str(bad), "--bundle", str(bundle), "--", "/bin/touch", str(marker))
    assert proc.returncode == 2
    assert not marker.exists() and not bundle.exists()
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "bad.yaml:4" in lines[0] and "Traceback" not in proc.stderr
    proc = evidence("run", "--policy", str(tmp_path / "missing.yaml"), "--", "/bin/touch", str(marker))
    assert proc.returncode == 2 and not marker.exists()


def test_fail_closed_refuses_what_cannot_be_enforced(tmp_path: Path, world) -> None:
    # a hard link to the denied file, made before the run, inside an allowed tree: Landlock cannot
    # deny it (the planner reports it as a degradation), so --fail-closed must refuse to start
    os.link(world["secret"], world["ws"] / "alias.txt")
    marker = tmp_path / "started"
    proc = evidence(
        "run",
        "--policy",
        str(world["policy"]),
        "--workspace",
        str(world["ws"]),
        "--fail-closed",
        "--bundle",
        str(tmp_path / "fc.tar.gz"),
        "--",
        "/bin/touch",
        str(marker),
    )
    assert proc.returncode == 2, proc.stderr
    assert not marker.exists()
    assert "cannot be fully enforced" in proc.stderr
    # without --fail-closed it runs, and the degradation is in the bundle
    proc, manifest, events = record(
        tmp_path,
        "/bin/true",
        extra=("--policy", str(world["policy"]), "--workspace", str(world["ws"])),
        name="deg.tar.gz",
    )
    assert proc.returncode == 0
    assert of_type(events, "degradation")


def test_profile_of_a_run_blocks_nothing_on_a_second_run(tmp_path: Path, world) -> None:
    code = "open('inside.txt','w').write('x'); open('/etc/hostname').read(); import subprocess; subprocess.run(['/bin/ls'], stdout=subprocess.DEVNULL)"
    proc, m1, _ = record(
        tmp_path,
        PY,
        "-c",
        code,
        extra=("--workspace", str(world["ws"])),
        cwd=world["ws"],
        name="first.tar.gz",
    )
    assert proc.returncode == 0
    prof = evidence("profile", str(tmp_path / "first.tar.gz"))
    assert prof.returncode == 0, prof.stderr
    policy = tmp_path / "profiled.yaml"
    policy.write_text(prof.stdout)
    proc, m2, events = record(
        tmp_path,
        PY,
        "-c",
        code,
        extra=("--policy", str(policy), "--workspace", str(world["ws"])),
        cwd=world["ws"],
        name="second.tar.gz",
    )
    assert proc.returncode == 0, proc.stderr
    assert _denials(events) == []
    assert m2["policy"]["mode"] == "enforce"


def net_attempts(port: int) -> str:
    """A job that connects to the host's loopback listener on `port`, then to one of its own."""
    return textwrap.dedent(
        f"""
        import socket, json
        out = {{}}
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=2).close(); out["host"] = "ok"
        except OSError as e:
            out["host"] = e.errno
        try:
            s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
            socket.create_connection(s.getsockname(), timeout=2).close(); out["own"] = "ok"
        except OSError as e:
            out["own"] = e.errno
        print(json.dumps(out))
        """
    )


def test_net_none_and_loopback_namespaces(tmp_path: Path) -> None:
    host = _listener()
    port = host.getsockname()[1]
    code = net_attempts(port)
    import json

    try:
        proc, manifest, _ = record(tmp_path, PY, "-c", code, extra=("--net", "loopback"), name="lo.tar.gz")
        got = json.loads(proc.stdout)
        assert got["host"] != "ok" and got["own"] == "ok"  # its own loopback only
        assert manifest["network"] == "loopback"
        proc, manifest, events = record(tmp_path, PY, "-c", code, extra=("--net", "none"), name="none.tar.gz")
        got = json.loads(proc.stdout)
        assert got["host"] != "ok" and got["own"] != "ok"  # no network at all, not even loopback
        assert manifest["network"] == "none"
        conns = [e["data"] for e in of_type(events, "network.connect") if e["data"]["port"] == port]
        assert conns and conns[0]["result"] != 0
    finally:
        host.close()
