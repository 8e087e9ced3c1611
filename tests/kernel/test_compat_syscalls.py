"""Attacks through the 32-bit system call entries, which the kernel's syscalls:* tracepoints skip.

A 64-bit program can call the kernel through `int $0x80` (the i386 ABI) without being a 32-bit
program; before, such a program opened and wrote a root-owned world-writable file outside the
workspace, renamed files, unshared and connected out, and the bundle had none of it. Every command
evidence launches now runs under a seccomp filter that refuses those entries (SIGSYS, the call not
made), and the recorder's probe on signal_generate records each attempt as a policy.denial that lint
flags (EV013). `--allow-32bit` lets them through, unrecorded, and says so (a degradation).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kernel.test_run_via_agent import NOBODY, agent, client, out, workdir  # noqa: F401 - fixtures
from tests.kernel.util import PY, evidence, of_type, read_bundle

AS_NOBODY = ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--")
SIGSYS = 31

# A 64-bit Python that makes i386 system calls with `int $0x80` (machine code in a MAP_32BIT page:
# the i386 ABI takes 32-bit pointers). With "handle" it catches SIGSYS and goes on, as an attacker
# would; it prints what each call returned. argv: victim (a file to write), src, dst (a rename), port.
INT80 = r"""
import ctypes, json, mmap, os, signal, socket, struct, sys
victim, src, dst, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
# push rbx; eax = nr; ebx, ecx, edx = the three arguments; int $0x80; pop rbx; ret
code = bytes.fromhex("53" "89f8" "89f3" "4189d0" "89ca" "4489c1" "cd80" "5b" "c3")
page = mmap.mmap(-1, 8192, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x40, prot=7)  # MAP_32BIT, rwx
page[: len(code)] = code
base = ctypes.addressof(ctypes.c_char.from_buffer(page))
call = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long)(base)
at = [4096]
def low(data):
    off = at[0]
    page[off : off + len(data)] = data
    at[0] += len(data) + 8
    return base + off
caught = []
if "handle" in sys.argv:
    signal.signal(signal.SIGSYS, lambda *a: caught.append(1))
got = {}
fd = call(5, low(victim.encode() + b"\0"), os.O_WRONLY | os.O_TRUNC, 0)  # open
got["open"] = fd
got["write"] = call(4, fd, low(b"pwned\n"), 6)  # write
got["rename"] = call(38, low(src.encode() + b"\0"), low(dst.encode() + b"\0"), 0)  # rename
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
sa = struct.pack("<H", socket.AF_INET) + struct.pack("!H4s8x", port, socket.inet_aton("127.0.0.1"))
got["connect"] = call(362, s.fileno(), low(sa), len(sa))  # connect
got["unshare"] = call(310, 0x10000000 | 0x20000, 0, 0)  # unshare(CLONE_NEWUSER | CLONE_NEWNS)
got["sigsys"] = len(caught)
print(json.dumps(got))
"""

# The x32 ABI: the x86_64 entry with bit 30 of the number set (openat = 257). This kernel has no
# x32 (ENOSYS outside a run); a kernel that has it would run the call unseen by the tracepoints.
X32 = r"""
import ctypes, json, signal
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
caught = []
signal.signal(signal.SIGSYS, lambda *a: caught.append(1))
ret = libc.syscall(0x40000000 | 257, -100, b"/etc/hostname", 0, 0)
print(json.dumps({"ret": ret, "errno": ctypes.get_errno(), "sigsys": len(caught)}))
"""


# `syscall` from 32-bit code: a far return to the 32-bit code segment (0x23) of a 64-bit process,
# then mkdir(path, 0777) with the `syscall` instruction (the compat entry: the mode in ebp). The
# kernel returns from such a call to the 32-bit vDSO's landing pad, which a 64-bit process does not
# have: the process dies of SIGSEGV right after the call, so an attacker makes one call per process.
# Assembled from (GNU as, .intel_syntax): push rbx..r15; mov [rip+saved], rsp; mov ebx, edi; mov rsp,
# rsi; lea rdi, [rip+back64]; lea rax, [rip+code32]; push 0x23; push rax; retfq; .code32 code32:
# mov eax, 39; mov ebp, 0x1ff; syscall; mov esi, eax; push 0x33; push edi; retf; .code64 back64:
# mov rsp, [rip+saved]; movsxd rax, esi; pop r15..rbx; ret; saved: .quad 0
SYSCALL32 = r"""
import ctypes, mmap, sys
code = bytes.fromhex(
    "535541544155415641574889253f00000089fb4889f4488d3d1e000000488d05050000006a235048cbb827000000"
    "bdff0100000f0589c66a3357cb488b250e0000004863c6415f415e415d415c5d5bc30000000000000000"
)
page = mmap.mmap(-1, 1 << 17, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x40, prot=7)  # MAP_32BIT, rwx
page[: len(code)] = code
base = ctypes.addressof(ctypes.c_char.from_buffer(page))
path = sys.argv[1].encode() + b"\0"
page[4096 : 4096 + len(path)] = path
ctypes.CFUNCTYPE(ctypes.c_long, ctypes.c_long, ctypes.c_long)(base)(base + 4096, base + (1 << 17) - 64)
"""


@pytest.fixture
def victims() -> Iterator[Path]:
    """A root-owned world-writable file outside any workspace (the victim), a file to rename, and a
    listener on loopback: what the attack reaches when nothing refuses it."""
    d = Path(tempfile.mkdtemp(prefix="evidence-compat-", dir="/tmp"))
    d.chmod(0o777)
    (d / "victim").write_text("original\n")
    (d / "victim").chmod(0o666)
    (d / "src").write_text("x")
    (d / "src").chmod(0o666)
    yield d
    shutil.rmtree(d)


@pytest.fixture
def listener() -> Iterator[int]:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    yield s.getsockname()[1]
    s.close()


def _attack_args(victims: Path, port: int, *extra: str) -> list[str]:
    return [
        PY,
        "-c",
        INT80,
        str(victims / "victim"),
        str(victims / "src"),
        str(victims / "dst"),
        str(port),
        *extra,
    ]


def _refused(events: list[dict[str, object]]) -> set[str]:
    return {
        e["data"]["target"]  # type: ignore[index]
        for e in of_type(events, "policy.denial")  # type: ignore[arg-type]
        if e["data"]["operation"] == "syscall"  # type: ignore[index]
    }


def _untouched(victims: Path) -> None:
    assert (victims / "victim").read_text() == "original\n", "the i386 write went through"
    assert (victims / "src").exists() and not (victims / "dst").exists(), "the i386 rename went through"


def test_the_attack_works_when_nothing_refuses_it(victims: Path, listener: int) -> None:
    """The control: outside a run the same program, as nobody, does write, rename and connect, so the
    tests below prove the filter refused it and not that the attack is broken."""
    proc = subprocess.run(
        [*AS_NOBODY, *_attack_args(victims, listener)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["open"] >= 0 and got["write"] == 6 and got["rename"] == 0 and got["connect"] == 0, got
    assert (victims / "victim").read_text() == "pwned\n" and (victims / "dst").exists()


def test_a_job_cannot_act_through_int_0x80_and_each_attempt_is_recorded(
    tmp_path: Path, victims: Path, listener: int
) -> None:
    """As nobody, catching SIGSYS and going on: every i386 call is refused (nothing written, renamed
    or connected), each is a policy.denial, and lint fails the run at --fail-on warn (EV013)."""
    bundle = tmp_path / "r.tar.gz"
    proc = evidence(
        "run",
        "--bundle",
        str(bundle),
        "--",
        *AS_NOBODY,
        *_attack_args(victims, listener, "handle"),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["sigsys"] == 5, got  # each of the five calls trapped, none made
    _untouched(victims)
    manifest, events = read_bundle(bundle)
    assert manifest["capabilities"]["32bit_syscalls"].startswith("refused")
    assert _refused(events) == {
        "i386 open (5)",
        "i386 write (4)",
        "i386 rename (38)",
        "i386 connect (362)",
        "i386 unshare (310)",
    }
    denial = next(e["data"] for e in of_type(events, "policy.denial"))
    assert denial["rule"] == "isolation: 32-bit system calls" and denial["enforced"] is True
    assert denial["exe"] == PY and denial["result"] == "SIGSYS"
    lint = evidence("lint", str(bundle), "--fail-on", "warn")
    assert lint.returncode == 1 and "EV013" in lint.stdout, lint.stdout


def test_a_job_that_does_not_catch_sigsys_dies_of_it_recorded(
    tmp_path: Path, victims: Path, listener: int
) -> None:
    bundle = tmp_path / "r.tar.gz"
    proc = evidence("run", "--bundle", str(bundle), "--", *AS_NOBODY, *_attack_args(victims, listener))
    assert proc.returncode == 128 + SIGSYS, proc.stderr
    _untouched(victims)
    manifest, events = read_bundle(bundle)
    assert manifest["signal"] == "SIGSYS"
    assert _refused(events) == {"i386 open (5)"}


def test_the_policy_path_refuses_and_records_them_too(tmp_path: Path, victims: Path, listener: int) -> None:
    """Under `--policy default` (Landlock covers some of what an i386 call does, not all): refused
    the same way, with its policy.denial."""
    bundle = tmp_path / "r.tar.gz"
    proc = evidence(
        "run",
        "--bundle",
        str(bundle),
        "--policy",
        "default",
        "--workspace",
        str(tmp_path),
        "--",
        *AS_NOBODY,
        *_attack_args(victims, listener, "handle"),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["sigsys"] == 5
    _untouched(victims)
    _, events = read_bundle(bundle)
    assert "i386 open (5)" in _refused(events)


def test_through_the_agent_the_client_refuses_them_and_the_agent_records_them(
    agent,  # noqa: F811
    out: Path,  # noqa: F811
    victims: Path,
    listener: int,
) -> None:
    proc = client(
        agent.socket,
        out / "a.tar.gz",
        *_attack_args(victims, listener, "handle"),
        cwd=out,
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
    )
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr + agent.output()
    assert json.loads(stdout)["sigsys"] == 5
    _untouched(victims)
    manifest, events = read_bundle(out / "a.tar.gz")
    assert "i386 connect (362)" in _refused(events)
    assert not [e for e in of_type(events, "degradation") if "32-bit" in e["data"]["reason"]]


def test_an_adopted_cgroup_is_said_not_to_be_covered(agent, out: Path) -> None:  # noqa: F811
    """`start --cgroup`: the agent did not launch what runs there, so no filter of evidence's refuses
    its 32-bit calls: the bundle says so."""
    from evidence.agent.recorder.cgroups import find_cgroup2_mount

    cgroup = find_cgroup2_mount() / f"evidence-test-compat-{os.getpid()}"
    cgroup.mkdir()
    try:
        started = evidence("start", "--agent", str(agent.socket), "--cgroup", str(cgroup))
        assert started.returncode == 0, started.stderr + agent.output()
        bundle = out / "adopted.tar.gz"
        done = evidence(
            "finish", "--agent", str(agent.socket), started.stdout.strip(), "--bundle", str(bundle)
        )
        assert done.returncode == 0, done.stderr
    finally:
        cgroup.rmdir()
    manifest, events = read_bundle(bundle)
    reasons = [e["data"]["reason"] for e in of_type(events, "degradation")]
    assert any("32-bit" in r and "not refused" in r for r in reasons), reasons
    # the manifest agrees with the degradation (it said "refused in commands `run --agent`
    # launches", the agent's text for every run, before it was set per run)
    assert manifest["capabilities"]["32bit_syscalls"].startswith("not refused"), manifest["capabilities"]


def test_allow_32bit_lets_them_through_and_says_so(tmp_path: Path, victims: Path, listener: int) -> None:
    bundle = tmp_path / "r.tar.gz"
    proc = evidence(
        "run", "--bundle", str(bundle), "--allow-32bit", "--", *AS_NOBODY, *_attack_args(victims, listener)
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["write"] == 6 and got["sigsys"] == 0, got
    manifest, events = read_bundle(bundle)
    assert manifest["capabilities"]["32bit_syscalls"].startswith("allowed, not recorded")
    assert not _refused(events)
    reasons = [e["data"]["reason"] for e in of_type(events, "degradation")]
    assert any(r.startswith("--allow-32bit") for r in reasons), reasons
    lint = evidence("lint", str(bundle), "--fail-on", "warn")
    assert lint.returncode == 1 and "EV002" in lint.stdout, lint.stdout


def test_allow_32bit_is_refused_through_the_agent(tmp_path: Path) -> None:
    proc = evidence("run", "--agent", "/nonexistent.sock", "--allow-32bit", "--", "true")
    assert proc.returncode == 2 and proc.stderr.startswith("evidence:") and "Traceback" not in proc.stderr


def test_x32_calls_are_refused_and_recorded(tmp_path: Path) -> None:
    bundle = tmp_path / "r.tar.gz"
    proc = evidence("run", "--bundle", str(bundle), "--", *AS_NOBODY, PY, "-c", X32)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["sigsys"] == 1
    _, events = read_bundle(bundle)
    assert _refused(events) == {"x32 call 257"}


def test_sigsys_from_kill_is_not_a_refusal(tmp_path: Path) -> None:
    """SIGSYS sent with kill() (SI_USER) is not a seccomp trap: nothing is recorded as refused."""
    bundle = tmp_path / "r.tar.gz"
    script = "trap 'echo got' SYS; kill -SYS $$; echo done"
    proc = evidence("run", "--bundle", str(bundle), "--", *AS_NOBODY, "sh", "-c", script)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr
    _, events = read_bundle(bundle)
    assert not _refused(events)


def test_syscall_from_32bit_code_is_refused_and_recorded(tmp_path: Path, victims: Path) -> None:
    """The `syscall` instruction in the 32-bit code segment of a 64-bit process is a compat entry
    too (AUDIT_ARCH_I386): outside a run its mkdir is made; in a run it is refused (SIGSYS, the
    directory never made) and recorded."""
    import signal

    outside = subprocess.run([*AS_NOBODY, PY, "-c", SYSCALL32, str(victims / "outside")], timeout=60)
    assert outside.returncode == -signal.SIGSEGV  # after the call, at the missing vDSO landing pad
    assert (victims / "outside").is_dir(), "the control: the 32-bit syscall should have made it"
    bundle = tmp_path / "r.tar.gz"
    proc = evidence(
        "run", "--bundle", str(bundle), "--", *AS_NOBODY, PY, "-c", SYSCALL32, str(victims / "inside")
    )
    assert proc.returncode == 128 + SIGSYS, proc.stderr
    assert not (victims / "inside").exists()
    _, events = read_bundle(bundle)
    assert _refused(events) == {"i386 mkdir (39)"}
