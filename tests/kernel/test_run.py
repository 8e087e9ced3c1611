"""`evidence run` end to end: real commands, real BPF, assertions on the bundle."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from tests.kernel.util import PY, evidence, of_type, read_bundle, record


def _execs(events):
    return [e["data"] for e in of_type(events, "process.exec") if e["data"]["result"] == 0]


def _opens(events, path):
    return [e["data"] for e in of_type(events, "file.open") if e["data"]["path"] == str(path)]


def test_nested_exec_chain_argv_and_parents(tmp_path: Path) -> None:
    script = "import subprocess; subprocess.run(['/bin/cat', '/etc/hostname'], stdout=subprocess.DEVNULL)"
    proc, manifest, events = record(tmp_path, "/bin/sh", "-c", f'{PY} -c "{script}"; true')
    assert proc.returncode == 0, proc.stderr
    execs = _execs(events)
    sh = next(e for e in execs if e["filename"] == "/bin/sh")
    py = next(e for e in execs if e["argv"][:1] == [PY])
    cat = next(e for e in execs if e["filename"] == "/bin/cat")
    assert sh["argv"] == ["/bin/sh", "-c", f'{PY} -c "{script}"; true']
    assert py["argv"] == [PY, "-c", script]
    assert cat["argv"] == ["/bin/cat", "/etc/hostname"]
    assert py["ppid"] == sh["pid"] and cat["ppid"] == py["pid"]
    assert (sh["depth"], py["depth"], cat["depth"]) == (0, 1, 2)
    assert manifest["lost"]["total"] == 0
    assert manifest["exit_code"] == 0
    # every exec'd process also exits, with its code
    exits = {e["data"]["pid"]: e["data"] for e in of_type(events, "process.exit")}
    assert exits[cat["pid"]]["exit_code"] == 0 and exits[cat["pid"]]["exe"] == "/bin/cat"
    # the summary line on stderr
    assert (
        "0 lost" in proc.stderr
        and "process.exec" in proc.stderr
        and str(tmp_path / "run.tar.gz") in proc.stderr
    )


def test_open_flags_failure_relative_and_dirfd(tmp_path: Path) -> None:
    work = tmp_path / "w"
    (work / "sub").mkdir(parents=True)
    (work / "sub" / "x.txt").write_text("x")
    (work / "rel.txt").write_text("r")
    code = textwrap.dedent(
        f"""
        import os
        fd = os.open({str(work / "new.txt")!r}, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640); os.close(fd)
        try:
            open({str(work / "missing.txt")!r})
        except FileNotFoundError:
            pass
        os.chdir({str(work)!r})
        open('rel.txt').close()
        d = os.open('sub', os.O_RDONLY | os.O_DIRECTORY)
        os.close(os.open('x.txt', os.O_RDONLY, dir_fd=d))
        """
    )
    proc, manifest, events = record(tmp_path, PY, "-c", code)
    assert proc.returncode == 0, proc.stderr
    new = _opens(events, work / "new.txt")
    assert len(new) == 1
    assert {"O_WRONLY", "O_CREAT", "O_TRUNC", "O_CLOEXEC"} <= set(new[0]["flags"])
    assert new[0]["access"] == ["write", "create"] and new[0]["mode"] == 0o640 and new[0]["result"] == 0
    missing = _opens(events, work / "missing.txt")
    assert [m["result"] for m in missing] == ["ENOENT"]
    rel = _opens(events, work / "rel.txt")
    assert rel and rel[0]["raw_path"] == "rel.txt" and rel[0]["access"] == ["read"]
    via_fd = _opens(events, work / "sub" / "x.txt")
    assert via_fd and via_fd[0]["raw_path"] == "x.txt" and via_fd[0]["dirfd"] is not None


def test_connects_loopback_refused_and_ipv6(tmp_path: Path) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()
    srv6 = socket.socket(socket.AF_INET6)
    srv6.bind(("::1", 0))
    srv6.listen(8)
    port6 = srv6.getsockname()[1]
    code = textwrap.dedent(
        f"""
        import socket
        s = socket.create_connection(('127.0.0.1', {port})); s.close()
        try:
            socket.create_connection(('127.0.0.1', {dead_port}))
        except ConnectionRefusedError:
            pass
        s = socket.socket(socket.AF_INET6); s.connect(('::1', {port6})); s.close()
        """
    )
    try:
        proc, manifest, events = record(tmp_path, PY, "-c", code)
    finally:
        srv.close()
        srv6.close()
    assert proc.returncode == 0, proc.stderr
    conns = [e for e in of_type(events, "network.connect")]
    by_port = {(c["data"]["family"], c["data"]["port"]): c for c in conns}
    ok = by_port[("AF_INET", port)]
    assert ok["data"]["address"] == "127.0.0.1" and ok["data"]["result"] == 0
    assert ok["subject"] == f"127.0.0.1:{port}"
    assert by_port[("AF_INET", dead_port)]["data"]["result"] == "ECONNREFUSED"
    v6 = by_port[("AF_INET6", port6)]
    assert v6["data"]["address"] == "::1" and v6["data"]["result"] == 0 and v6["subject"] == f"[::1]:{port6}"


def test_process_in_child_cgroup_is_recorded(tmp_path: Path) -> None:
    marker = tmp_path / "from-child-cgroup.txt"
    marker.write_text("m")
    code = textwrap.dedent(
        f"""
        import os
        mount = '/sys/fs/cgroup' if os.path.exists('/sys/fs/cgroup/cgroup.procs') else '/sys/fs/cgroup/unified'
        rel = [l for l in open('/proc/self/cgroup').read().splitlines() if l.startswith('0::')][0][3:]
        child = os.path.join(mount + rel, 'nested')
        os.mkdir(child)
        with open(os.path.join(child, 'cgroup.procs'), 'w') as f:
            f.write(str(os.getpid()))
        open({str(marker)!r}).close()
        print(open('/proc/self/cgroup').read().strip().split('::')[-1])
        """
    )
    proc, manifest, events = record(tmp_path, PY, "-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("/nested")
    opens = _opens(events, marker)
    assert opens, "open from the nested cgroup is missing"
    assert opens[0]["cgroup"] == "nested"  # attributed to the sub-cgroup it came from
    execs = _execs(events)
    assert "cgroup" not in execs[0]  # the run's own cgroup is not named


def test_exit_codes_pass_through(tmp_path: Path) -> None:
    proc, manifest, _ = record(tmp_path, "/bin/true", name="ok.tar.gz")
    assert proc.returncode == 0 and manifest["exit_code"] == 0
    proc, manifest, events = record(tmp_path, "/bin/sh", "-c", "exit 3", name="three.tar.gz")
    assert proc.returncode == 3 and manifest["exit_code"] == 3
    assert of_type(events, "run.finished")[0]["data"]["exit_code"] == 3
    proc, manifest, events = record(tmp_path, "/bin/sh", "-c", "kill -TERM $$", name="term.tar.gz")
    assert proc.returncode == 128 + signal.SIGTERM
    assert manifest["exit_code"] is None and manifest["signal"] == "SIGTERM"
    sh_exit = [e["data"] for e in of_type(events, "process.exit")]
    assert any(x["signal"] == "SIGTERM" for x in sh_exit)


def test_stdio_passes_through(tmp_path: Path) -> None:
    bundle = tmp_path / "io.tar.gz"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "evidence",
            "run",
            "--bundle",
            str(bundle),
            "--",
            "/bin/sh",
            "-c",
            "cat; echo err >&2",
        ],
        input="hello from stdin\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0
    assert proc.stdout == "hello from stdin\n"
    assert proc.stderr.startswith("err\n")


def test_sigterm_to_evidence_reaches_the_command(tmp_path: Path) -> None:
    bundle = tmp_path / "fwd.tar.gz"
    ready = tmp_path / "ready"
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "evidence",
            "run",
            "--bundle",
            str(bundle),
            "--",
            "/bin/sh",
            "-c",
            f"touch {ready}; sleep 30",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists()
    p.send_signal(signal.SIGTERM)
    rc = p.wait(timeout=30)
    assert rc == 128 + signal.SIGTERM
    manifest, _ = read_bundle(bundle)
    assert manifest["signal"] == "SIGTERM"


def test_argv_truncation_is_marked(tmp_path: Path) -> None:
    many = [f"arg{i:04d}-" + "y" * 100 for i in range(100)]  # 100 args, ~10 KiB
    proc, _, events = record(tmp_path, "/bin/echo", *many)
    echo = next(e for e in _execs(events) if e["filename"] == "/bin/echo")
    assert echo["argv_truncated"] is True
    assert echo["argv"][:65] == ["/bin/echo", *many[:64]]  # at least 64 arguments and 4 KiB kept
    assert len("\0".join(echo["argv"])) >= 4096


def test_two_runs_at_once_are_isolated(tmp_path: Path) -> None:
    a, b = tmp_path / "a-only.txt", tmp_path / "b-only.txt"
    a.write_text("a")
    b.write_text("b")
    results = {}

    def go(name: str, path: Path) -> None:
        results[name] = record(
            tmp_path,
            "/bin/sh",
            "-c",
            f"for i in 1 2 3 4 5; do cat {path} >/dev/null; sleep 0.2; done",
            name=f"{name}.tar.gz",
        )

    threads = [threading.Thread(target=go, args=("a", a)), threading.Thread(target=go, args=("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for mine, other in (("a", b), ("b", a)):
        _, _, events = results[mine]
        own = a if mine == "a" else b
        assert _opens(events, own)[0]["count"] == 5
        assert not _opens(events, other)


def test_same_command_twice_gives_same_run_id(tmp_path: Path) -> None:
    cmd = ("/bin/sh", "-c", "cat /etc/hostname > /dev/null; ls / > /dev/null")
    _, m1, _ = record(tmp_path, *cmd, name="1.tar.gz")
    _, m2, _ = record(tmp_path, *cmd, name="2.tar.gz")
    assert m1["run_id"] == m2["run_id"]
    assert m1["session_id"] != m2["session_id"]
    _, m3, _ = record(tmp_path, "/bin/sh", "-c", "cat /etc/passwd > /dev/null", name="3.tar.gz")
    assert m3["run_id"] != m1["run_id"]


def test_no_cgroup_left_behind(tmp_path: Path) -> None:
    from evidence.agent.recorder.cgroups import find_cgroup2_mount

    # a leftover background process is killed and the run's own cgroup removed (other runs, such as
    # another test session's, may come and go under the same parent meanwhile)
    _, manifest, events = record(tmp_path, "/bin/sh", "-c", "sleep 100 & exit 0")
    cgroup = Path(of_type(events, "run.started")[0]["data"]["cgroup"])
    assert cgroup.parent == find_cgroup2_mount() / "evidence" and not cgroup.exists()


def test_command_not_found(tmp_path: Path) -> None:
    bundle = tmp_path / "nf.tar.gz"
    proc = evidence("run", "--bundle", str(bundle), "--", "/nonexistent/tool")
    assert proc.returncode == 127
    assert "cannot run" in proc.stderr and "Traceback" not in proc.stderr
    manifest, events = read_bundle(bundle)
    failed = [e["data"] for e in of_type(events, "process.exec")]
    assert failed and failed[0]["result"] == "ENOENT" and failed[0]["filename"] == "/nonexistent/tool"


def test_doctor_reports_capabilities_as_json() -> None:
    import json

    proc = evidence("doctor", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    by_name = {c["name"]: c for c in doc["checks"]}
    assert doc["ready"] is True
    for name in (
        "cgroup v2",
        "tracefs",
        "BTF",
        "kernel headers",
        "bpf prog tracepoint",
        "bpf ringbuf",
        "landlock",
        "lockdown",
    ):
        assert name in by_name, name
    assert by_name["bpf prog tracepoint"]["ok"] and by_name["bpf ringbuf"]["ok"]
    assert by_name["landlock"]["detail"].startswith("ABI ")


def _ia32_elf(path: Path) -> None:
    """A tiny 32-bit x86 program: open("/etc/hostname") with int 0x80, then exit(7)."""
    import struct

    base, code_off = 0x08048000, 0x54
    code_len = 26
    target = b"/etc/hostname\0"
    code = (
        b"\xb8"
        + struct.pack("<I", 5)
        + b"\xbb"
        + struct.pack("<I", base + code_off + code_len)
        + b"\x31\xc9\xcd\x80"
        + b"\xb8"
        + struct.pack("<I", 1)
        + b"\xbb"
        + struct.pack("<I", 7)
        + b"\xcd\x80"
    )
    body = code + target
    size = code_off + len(body)
    ehdr = b"\x7fELF" + bytes([1, 1, 1, 0]) + b"\0" * 8
    ehdr += struct.pack("<HHIIIIIHHHHHH", 2, 3, 1, base + code_off, 52, 0, 0, 52, 32, 1, 0, 0, 0)
    phdr = struct.pack("<IIIIIIII", 1, 0, base, base, size, size, 5, 0x1000)
    path.write_bytes(ehdr + phdr + body)
    path.chmod(0o755)


def test_a_32bit_program_is_refused_or_with_allow_32bit_flagged(tmp_path: Path) -> None:
    """A 32-bit program's system calls are not seen by the tracepoints: by default it is refused at
    its first call (SIGSYS, recorded); with --allow-32bit it runs and every exec of it is flagged."""
    prog = tmp_path / "open32"
    _ia32_elf(prog)
    if subprocess.run([str(prog)], check=False).returncode != 7:
        import pytest

        pytest.fail(
            "this kernel cannot run ia32 programs (CONFIG_IA32_EMULATION off): the test cannot prove anything"
        )
    proc, manifest, events = record(tmp_path, str(prog))
    assert proc.returncode == 128 + 31, proc.stderr  # SIGSYS
    refused = [e["data"] for e in of_type(events, "policy.denial")]
    assert [(d["operation"], d["target"]) for d in refused] == [("syscall", "i386 open (5)")]
    proc, manifest, events = record(tmp_path, str(prog), extra=("--allow-32bit",), name="allowed.tar.gz")
    assert proc.returncode == 7
    reasons = [e["data"]["reason"] for e in of_type(events, "degradation")]
    assert any("ia32" in r and str(prog) in r for r in reasons), reasons
    assert any(r.startswith("--allow-32bit") for r in reasons), reasons


def test_the_job_cannot_reach_its_runs_spool(tmp_path: Path) -> None:
    """The records wait in root's 0700 spool directory, not beside the bundle (where a job that can
    write its workspace could swap them and so write the bundle): the job sees no spool, and an
    unprivileged job cannot even list where it is."""
    from evidence.agent.commands.run import RUN_SPOOL_DIR

    tmp_path.chmod(0o777)
    script = f"ls -a {tmp_path}; ls {RUN_SPOOL_DIR} 2>&1; echo done"
    proc, manifest, events = record(
        tmp_path, "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sh", "-c", script
    )
    assert proc.returncode == 0, proc.stderr
    assert ".spool.zst" not in proc.stdout and "Permission denied" in proc.stdout, proc.stdout
    assert (RUN_SPOOL_DIR.stat().st_mode & 0o777) == 0o700 and RUN_SPOOL_DIR.stat().st_uid == 0
    # removed once the bundle is written
    assert not list(RUN_SPOOL_DIR.glob(f"{manifest['session_id']}*"))
    assert any(e["data"].get("argv", [None])[:1] == ["ls"] for e in of_type(events, "process.exec"))


def test_a_job_that_moves_itself_out_of_the_runs_cgroup_is_flagged(tmp_path: Path) -> None:
    """Root in the job can move itself out of the run's cgroup (a stated limit); what it does after
    that is not recorded, but the bundle says that it could: a degradation, and lint warns."""
    from evidence.agent.recorder.cgroups import find_cgroup2_mount

    procs = find_cgroup2_mount() / "cgroup.procs"
    proc, _, events = record(tmp_path, "sh", "-c", f"echo $$ > {procs}; cat /etc/hostname")
    assert proc.returncode == 0, proc.stderr
    (d,) = [e["data"] for e in of_type(events, "degradation")]
    assert d["component"] == "cgroup" and str(procs) in d["reason"] and "not recorded" in d["impact"]
    lint = evidence("lint", "--format", "json", str(tmp_path / "run.tar.gz"))
    assert "EV002" in lint.stdout


def test_moving_out_past_the_cap_on_distinct_keys_is_still_flagged(tmp_path: Path) -> None:
    """A job that first floods distinct paths past the run's cap (its opens are then counted in the
    kernel, not sent) and then moves itself out of the run's cgroup is still flagged: the open of
    cgroup.procs for writing says so even though it makes no record of its own."""
    import os

    from evidence.agent.recorder.cgroups import find_cgroup2_mount

    procs = find_cgroup2_mount() / "cgroup.procs"
    flood = "for i in $(seq 40); do cat /nonexistent/$i 2>/dev/null; done"
    env = {**os.environ, "EVIDENCE_MAX_DISTINCT": "8"}
    proc, manifest, events = record(
        tmp_path, "sh", "-c", f"{flood}; echo $$ > {procs}; echo $$ > {procs}; cat /etc/hostname", env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert manifest["lost"]["by_kind"].get("open_past_cap", 0) > 0  # the cap was reached first
    (d,) = [e["data"] for e in of_type(events, "degradation") if e["data"]["component"] == "cgroup"]
    assert str(procs) in d["reason"] and "not recorded" in d["impact"]  # once, not per write


def test_an_exec_flood_past_the_writers_memory_is_written_whole(tmp_path: Path) -> None:
    """Execs are never aggregated: a job (as nobody) that runs many distinct commands would grow the
    writer's memory with each. Past its budget (EVIDENCE_WRITER_MEMORY, small here) the writer puts
    the run id's sets on disk and streams the events in a second pass: every exec is still in the
    bundle, which verifies, and the run id is the one an unbounded writer gives the same spool."""
    import os

    script = "i=0; while [ $i -lt 300 ]; do /bin/true flood-$i; i=$((i+1)); done"
    nobody = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
    runs = {}
    for memory in ("40", "1000000"):
        env = {**os.environ, "EVIDENCE_WRITER_MEMORY": memory}
        proc, manifest, events = record(
            tmp_path, *nobody, "sh", "-c", script, env=env, name=f"{memory}.tar.gz"
        )
        assert proc.returncode == 0, proc.stderr
        argv = {tuple(e["data"]["argv"]) for e in of_type(events, "process.exec")}
        assert {("/bin/true", f"flood-{i}") for i in range(300)} <= argv
        assert evidence("lint", str(tmp_path / f"{memory}.tar.gz")).returncode in (0, 1)
        runs[memory] = manifest["run_id"]
    assert runs["40"] == runs["1000000"]  # the same behaviour, the same run id, bounded or not


def test_sends_to_an_address_without_connect_are_recorded(tmp_path: Path) -> None:
    """UDP sendto/sendmsg/sendmmsg to an explicit address reach the network as surely as a
    connect: each is a network.connect to that address. Sends on a connected socket are not
    repeated (its connect is recorded)."""
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    port = rx.getsockname()[1]
    code = textwrap.dedent(
        f"""
        import ctypes, socket, struct
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.sendto(b'a', ('127.0.0.1', {port}))
        s.sendmsg([b'b'], [], 0, ('127.0.0.2', {port}))
        # sendmmsg (no Python wrapper): one message to 127.0.0.3
        libc = ctypes.CDLL(None, use_errno=True)
        sin = struct.pack('=H', socket.AF_INET) + struct.pack('!H', {port}) + socket.inet_aton('127.0.0.3')
        addr = ctypes.create_string_buffer(sin + bytes(8))  # struct sockaddr_in
        data = ctypes.create_string_buffer(b'c')
        iov = (ctypes.c_void_p * 2)(ctypes.addressof(data), 1)
        msg = struct.pack('=QI4xQQQQi4xI4x', ctypes.addressof(addr), 16, ctypes.addressof(iov), 1, 0, 0, 0, 0)
        buf = ctypes.create_string_buffer(msg)
        assert libc.sendmmsg(s.fileno(), buf, 1, 0) == 1, ctypes.get_errno()
        c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        c.connect(('127.0.0.1', {port}))
        for _ in range(5):
            c.send(b'd')
        """
    )
    try:
        proc, _, events = record(tmp_path, PY, "-c", code, extra=("--detail", "full"))
        got = sorted(rx.recv(10) for _ in range(6))
    finally:
        rx.close()
    assert proc.returncode == 0, proc.stderr
    assert got == [b"a"] + [b"d"] * 5  # 127.0.0.2 and .3 are not where rx listens
    dests = [
        (c["data"]["address"], c["data"]["port"], c["data"]["result"])
        for c in of_type(events, "network.connect")
    ]
    assert sorted(dests) == [
        ("127.0.0.1", port, 0),  # sendto
        ("127.0.0.1", port, 0),  # connect (its sends are not repeated)
        ("127.0.0.2", port, 0),  # sendmsg
        ("127.0.0.3", port, 0),  # sendmmsg
    ], dests
