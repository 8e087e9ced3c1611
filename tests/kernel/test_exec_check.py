"""The exec check (bpf/exec_check.bpf.c, issue 24 "no race past the decision") against real execs of
a job run as nobody: an exec of a checked run whose pin (what the supervisor decided, published with
RecorderProbes.publish; here by the test, as the supervisor will) names another file or other
arguments, or that has no pin, is killed before its first instruction (its shell never writes its
marker) and recorded; one as decided runs. The pins are computed with probes/abi.py's reference
(exec_pin, argv_digest, script_argv), so these tests also check that reference against the BPF
program's hash on what the kernel really copied. A racing thread that rewrites the path and argv
while its process execs never gets the rewritten exec to run."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from evidence.agent.recorder.cgroups import RunCgroup
from evidence.agent.recorder.decode import ExecViolationEvent, decode
from evidence.agent.recorder.kernel import mount_tracefs
from evidence.probes import abi, loader
from evidence.probes.headers import ensure_headers
from evidence.probes.loader import RecorderProbes
from tests.kernel.util import as_user, in_cgroup

NOBODY = 65534
SLOT = 1
SH = "/bin/sh"  # dash here: a builtin echo, so the job's one exec is the one under test

# The job: the thread that will exec says its id, waits for the test to publish its pin, then execs
# (libc's execve through ctypes, from the main thread or another) a path and argv kept in a shared
# mapping. `race`: a second thread rewrites the path and the last argument (to others of the same
# lengths) back and forth while the exec reads them; `race-process`: a child process does, through
# the mapping (it runs beside the exec on the other CPU instead of waiting for the GIL).
_LAUNCHER = r"""
import ctypes, mmap, os, sys, threading, time
mode, path, alt_path, alt_arg, *argv = sys.argv[1:]
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
shared = mmap.mmap(-1, 1 << 20)  # MAP_SHARED: a child sees and writes the same bytes
base = ctypes.addressof(ctypes.c_char.from_buffer(shared))
offs, at = [], 0
for s in (path, *argv):
    shared[at : at + len(s) + 1] = s.encode() + b"\0"
    offs.append(at)
    at += len(s) + 1
arr = (ctypes.c_char_p * (len(argv) + 1))(*[base + o for o in offs[1:]], None)
env = (ctypes.c_char_p * 1)(None)
flipping = threading.Event()
def rewrite(deadline=None, started=None):
    a, b = (path.encode(), argv[-1].encode()), (alt_path.encode(), alt_arg.encode())
    while deadline is None or time.monotonic() < deadline:
        for p, x in (a, b):  # the rewritten version stands while the loop goes round
            shared[offs[0] : offs[0] + len(p)] = p
            shared[offs[-1] : offs[-1] + len(x)] = x
        flipping.set()
        if started is not None:
            os.write(started, b"."); os.close(started); started = None
def run():
    print(libc.syscall(186), flush=True)  # gettid
    sys.stdin.readline()
    if mode == "race":
        threading.Thread(target=rewrite, daemon=True).start()
        flipping.wait()  # the exec starts while the rewrites go on, whichever version it finds
    elif mode == "race-process":
        r, w = os.pipe()
        if os.fork() == 0:
            os.close(0); os.close(1)
            rewrite(time.monotonic() + 0.5, w); os._exit(0)
        os.read(r, 1)
    libc.execve(ctypes.c_char_p(base + offs[0]), arr, env)
    print("execve failed", ctypes.get_errno(), flush=True)
    sys.stdin.readline()  # the test may look at the thread, alive, until it closes our stdin
if mode == "thread":
    t = threading.Thread(target=run)
    t.start()
    t.join()
else:
    run()
"""


@dataclass
class Checked:
    probes: RecorderProbes
    cg: RunCgroup
    key: bytes


@pytest.fixture(scope="module")
def checked() -> Iterator[Checked]:
    mount_tracefs()
    ensure_headers()
    probes = RecorderProbes()
    cg = RunCgroup.create(f"exec-check-test-{os.getpid()}")
    probes.reset_lost(SLOT)
    probes.track(cg.id, SLOT)
    try:
        yield Checked(probes, cg, os.urandom(16))
    finally:
        probes.release_execs(SLOT)
        probes.untrack(cg.id)
        cg.wait_empty()
        cg.remove()
        probes.close()


def test_no_program_runs_at_exec_for_the_check_until_a_run_asks_for_it() -> None:
    """Runs without command rules pay nothing new: exec_check is attached by the first
    enforce_execs, not at load."""
    mount_tracefs()
    ensure_headers()
    probes = RecorderProbes()
    try:
        assert b"sched_process_exec" not in probes.bpf.raw_tracepoint_fds
        assert loader.EXEC_CHECK.encode() not in probes.bpf.funcs
        probes.enforce_execs(SLOT, bytes(16))
        assert probes.bpf.raw_tracepoint_fds[b"sched_process_exec"] >= 0
        probes.release_execs(SLOT)
    finally:
        probes.close()


def identity(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def shell(marker: Path, text: str = "ran") -> list[str]:
    return [SH, "-c", f"echo {text} > {marker}"]


@dataclass
class Outcome:
    status: int  # the job's wait status as subprocess gives it (-9: SIGKILL)
    output: str
    violations: list[ExecViolationEvent]
    pin_left: bool  # the exec's thread still had a pin once the job was gone


def launch(
    c: Checked,
    path: str,
    argv: list[str],
    pin: abi.ExecPin | None,
    *,
    mode: str = "plain",
    alt: tuple[str, str] = ("", ""),
    pin_tid: int | None = None,
    wrap: tuple[str, ...] = (),
) -> Outcome:
    """Start the job unchecked (under `wrap`, a command that runs its arguments), then check the
    run's execs, publish `pin` for the thread that will exec (or `pin_tid`), and let it exec."""
    c.probes.release_execs(SLOT)  # the job's own start (sh, setpriv, python) is not what is tested
    job = as_user(NOBODY, *wrap, "/usr/bin/python3", "-S", "-c", _LAUNCHER, mode, path, *alt, *argv)
    proc = subprocess.Popen(
        in_cgroup(c.cg.procs_file(), *job), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    tid = int(proc.stdout.readline())
    if wrap:  # the id the job sees is its namespace's: the kernel's (and the supervisor's) is global
        tid = global_tid(c.cg, tid)
    c.probes.ring().read()  # what the start recorded
    c.probes.enforce_execs(SLOT, c.key)
    if pin is not None:
        c.probes.publish(pin_tid if pin_tid is not None else tid, pin)
    proc.stdin.write("go\n")
    proc.stdin.flush()
    output, _ = proc.communicate(timeout=30)
    records = [decode(raw) for raw in c.probes.ring().read()]
    violations = [r for r in records if r["kind"] == "exec_violation"]
    assert all(v["old_tid"] == tid for v in violations)
    left = c.probes.bpf[b"exec_pins"].lookup(struct.pack("<I", tid))
    c.probes.forget(tid)
    return Outcome(proc.returncode, output, violations, left is not None)  # type: ignore[arg-type]


def global_tid(cg: RunCgroup, ns_tid: int) -> int:
    """The id, in this (the initial) pid namespace, of the run's process whose innermost id is
    `ns_tid` (a single-threaded process: its one thread)."""
    for pid in Path(cg.procs_file()).read_text().split():
        with open(f"/proc/{pid}/status") as f:
            ids = next(line.split()[1:] for line in f if line.startswith("NSpid:"))
        if len(ids) > 1 and int(ids[-1]) == ns_tid:
            return int(ids[0])
    raise AssertionError(f"no process of the run is {ns_tid} in a pid namespace of its own")


def pin_for(c: Checked, path: str, argv: list[str]) -> abi.ExecPin:
    return abi.exec_pin(c.key, identity(path), [a.encode() for a in argv])


def test_an_exec_as_decided_runs(checked: Checked, place: Path) -> None:
    marker = place / "m"
    argv = shell(marker)
    out = launch(checked, SH, argv, pin_for(checked, SH, argv))
    assert (out.status, out.violations) == (0, [])
    assert marker.read_text() == "ran\n"


@pytest.mark.parametrize("other", ["n", "longer-name"], ids=["same-length", "other-length"])
def test_other_arguments_are_killed_before_they_run(checked: Checked, place: Path, other: str) -> None:
    marker = place / "m"
    argv = shell(marker)
    decided = shell(place / other)  # what the supervisor saw and allowed
    out = launch(checked, SH, argv, pin_for(checked, SH, decided))
    assert out.status == -9
    assert not marker.exists() and not (place / other).exists()
    (v,) = out.violations
    assert v["reasons"] == ["args"]
    assert v["killed"]
    assert v["file"] == identity(SH) and v["decided"] == identity(SH)
    assert v["args_len"] == len(abi.arg_area([a.encode() for a in argv]))
    # the kernel's hash of what it copied is the reference's of the same bytes
    assert v["argv_hash"] == abi.argv_digest(checked.key, [a.encode() for a in argv])
    assert v["decided_hash"] == abi.argv_digest(checked.key, [a.encode() for a in decided])


def test_another_file_is_killed(checked: Checked, place: Path) -> None:
    marker = place / "m"
    argv = shell(marker)
    out = launch(checked, SH, argv, pin_for(checked, "/usr/bin/true", argv))
    assert out.status == -9 and not marker.exists()
    (v,) = out.violations
    assert v["reasons"] == ["file"]
    assert v["file"] == identity(SH) and v["decided"] == identity("/usr/bin/true")


def test_an_exec_without_a_pin_is_killed(checked: Checked, place: Path) -> None:
    marker = place / "m"
    out = launch(checked, SH, shell(marker), None)
    assert out.status == -9 and not marker.exists()
    (v,) = out.violations
    assert v["reasons"] == ["no_pin"] and v["decided"] is None
    assert v["argv_hash"] == abi.argv_digest(checked.key, [a.encode() for a in shell(marker)])


def test_a_pin_is_taken_by_one_exec(checked: Checked, place: Path) -> None:
    """The job's exec takes its pin: the same thread id cannot exec a second time on it."""
    marker = place / "m"
    argv = shell(marker)
    pin = pin_for(checked, SH, argv)
    assert launch(checked, SH, argv, pin).status == 0
    checked.probes.forget(0)  # no such thread: nothing to drop, no error
    assert len(checked.probes.bpf[b"exec_pins"].keys()) == 0


def test_a_pin_whose_exec_failed_is_dropped_when_the_exec_returns(checked: Checked, place: Path) -> None:
    """An exec that fails after the decision (no such file) returns: its pin goes with it, while the
    thread lives on (a job cannot fill the map with pins of execs it makes fail); one whose exec ran
    was taken by it."""
    c = checked
    missing = str(place / "missing")
    c.probes.release_execs(SLOT)
    job = as_user(NOBODY, "/usr/bin/python3", "-S", "-c", _LAUNCHER, "plain", missing, "", "", missing)
    proc = subprocess.Popen(
        in_cgroup(c.cg.procs_file(), *job), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    tid = int(proc.stdout.readline())
    c.probes.enforce_execs(SLOT, c.key)
    key = struct.pack("<I", tid)
    c.probes.publish(tid, pin_for(c, SH, [missing]))
    assert c.probes.bpf[b"exec_pins"].lookup(key) is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.stdout.readline().startswith("execve failed")
    assert c.probes.bpf[b"exec_pins"].lookup(key) is None  # the thread is alive, its pin gone
    proc.communicate(timeout=30)
    assert proc.returncode == 0
    argv = shell(place / "m")
    assert not launch(c, SH, argv, pin_for(c, SH, argv)).pin_left


def test_an_exec_from_another_thread_is_checked_under_that_threads_id(checked: Checked, place: Path) -> None:
    """A thread that is not the leader execs: the kernel gives the process the leader's id, and the
    pin is the calling thread's (sched_process_exec's old_pid), as the supervisor's notification
    names it. A pin under the process's id does not let it run."""
    marker = place / "m"
    argv = shell(marker)
    out = launch(checked, SH, argv, pin_for(checked, SH, argv), mode="thread")
    assert (out.status, out.violations) == (0, [])
    assert marker.read_text() == "ran\n"
    marker.unlink()
    c = checked
    c.probes.release_execs(SLOT)
    job = as_user(NOBODY, "/usr/bin/python3", "-S", "-c", _LAUNCHER, "thread", SH, "", "", *argv)
    proc = subprocess.Popen(
        in_cgroup(c.cg.procs_file(), *job), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    tid = int(proc.stdout.readline())
    assert tid != proc.pid
    c.probes.enforce_execs(SLOT, c.key)
    c.probes.publish(proc.pid, pin_for(c, SH, argv))  # the process's id, not the calling thread's
    proc.stdin.write("go\n")
    proc.stdin.flush()
    proc.communicate(timeout=30)
    assert proc.returncode == -9 and not marker.exists()
    c.probes.forget(proc.pid)


UNSHARE = ("unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc")


def test_the_init_of_a_pid_namespace_of_the_jobs_own_is_killed_too(checked: Checked, place: Path) -> None:
    """The job makes itself the init of a pid (and user) namespace of its own, which ignores
    signals it has no handler for: the kernel's SIGKILL still kills it; its pin is under its
    global id, as the supervisor's notification names it, and as decided it runs."""
    marker = place / "m"
    argv = shell(marker)
    out = launch(checked, SH, argv, None, wrap=UNSHARE)
    assert not marker.exists()
    (v,) = out.violations
    assert v["reasons"] == ["no_pin"] and v["killed"]
    out = launch(checked, SH, argv, pin_for(checked, SH, argv), wrap=UNSHARE)
    assert (out.status, out.violations) == (0, [])
    assert marker.read_text() == "ran\n"


def test_a_script_runs_as_its_interpreter_with_the_kernels_argv(checked: Checked, place: Path) -> None:
    """A `#!` script: the kernel loads the interpreter and rewrites argv (abi.script_argv); the pin
    names both, and the script runs."""
    marker = place / "m"
    script = place / "s.sh"
    script.write_text(f"#!{SH}\necho ran > {marker}\n")
    script.chmod(0o755)
    argv = [str(script), "one", "two"]
    kernel_argv = abi.script_argv(SH.encode(), None, str(script).encode(), [a.encode() for a in argv])
    pin = abi.exec_pin(checked.key, identity(SH), kernel_argv, script=True)
    out = launch(checked, str(script), argv, pin)
    assert (out.status, out.violations) == (0, [])
    assert marker.read_text() == "ran\n"
    # the script's own argv (what the caller passed) is not what the kernel copies: killed
    marker.unlink()
    out = launch(checked, str(script), argv, pin_for(checked, SH, argv))
    assert out.status == -9 and not marker.exists()
    assert out.violations[0]["reasons"] == ["args"]


def test_an_exec_from_an_overlay_is_identified_as_stat_names_it(checked: Checked, place: Path) -> None:
    """On overlayfs stat(2) gives the overlay's device and the layer's inode number: the kernel's
    mm->exe_file is the overlay's file, with the same identity (a lower file and a copied-up one)."""
    layers = {n: place / n for n in ("lower", "upper", "work", "merged")}
    for d in layers.values():
        d.mkdir()
    shutil.copy2("/usr/bin/true", layers["lower"] / "t")
    opts = f"lowerdir={layers['lower']},upperdir={layers['upper']},workdir={layers['work']}"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(layers["merged"])], check=True)
    try:
        shutil.copy2(layers["merged"] / "t", layers["merged"] / "u")  # in the upper layer
        for name in ("t", "u"):
            prog = str(layers["merged"] / name)
            assert identity(prog) != identity(str(layers["lower" if name == "t" else "upper"] / name))
            out = launch(checked, prog, [prog], pin_for(checked, prog, [prog]))
            assert (out.status, out.violations) == (0, []), name
    finally:
        subprocess.run(["umount", str(layers["merged"])], check=True)


LDSO = "/lib64/ld-linux-x86-64.so.2"


def test_the_dynamic_loader_run_as_a_program_is_the_file_loaded(checked: Checked, place: Path) -> None:
    """`ld.so PROGRAM`: the kernel loads the dynamic loader, which maps the program itself; the pin
    names the loader's file, and the program's name is in the arguments hashed."""
    marker = place / "m"
    argv = [LDSO, SH, "-c", f"echo ran > {marker}"]
    out = launch(checked, LDSO, argv, pin_for(checked, LDSO, argv))
    assert (out.status, out.violations) == (0, [])
    assert marker.read_text() == "ran\n"
    marker.unlink()
    out = launch(checked, LDSO, argv, pin_for(checked, SH, argv))  # the payload's file: not what was loaded
    assert out.status == -9 and not marker.exists()
    assert out.violations[0]["reasons"] == ["file"]


def test_an_empty_argv_is_pinned_as_the_kernel_fills_it(checked: Checked) -> None:
    """execve with no arguments: the kernel gives the program one empty argument (abi.arg_area)."""
    out = launch(checked, "/usr/bin/true", [], abi.exec_pin(checked.key, identity("/usr/bin/true"), []))
    assert (out.status, out.violations) == (0, [])


def test_a_long_argv_is_hashed_across_chunks(checked: Checked, place: Path) -> None:
    """An arg area of several EXEC_CHUNK bytes (the hash goes on in tail calls): as decided it runs;
    one byte changed in its last chunk and it is killed."""
    marker = place / "m"
    filler = ["x" * 1000 + str(i) for i in range(3 * abi.EXEC_CHUNK // 1000)]
    argv = [SH, "-c", f"echo ran > {marker}", "sh", *filler]
    out = launch(checked, SH, argv, pin_for(checked, SH, argv))
    assert (out.status, out.violations) == (0, [])
    assert marker.read_text() == "ran\n"
    marker.unlink()
    decided = [*argv[:-1], argv[-1][:-1] + "!"]
    out = launch(checked, SH, argv, pin_for(checked, SH, decided))
    assert out.status == -9 and not marker.exists()
    assert out.violations[0]["reasons"] == ["args"]
    assert out.violations[0]["argv_hash"] == abi.argv_digest(checked.key, [a.encode() for a in argv])


def test_an_arg_area_past_the_limit_is_killed(checked: Checked, place: Path) -> None:
    marker = place / "m"
    argv = [SH, "-c", f"echo ran > {marker}", "sh", *(["y" * 4095] * (abi.EXEC_ARGS_MAX // 4096 + 1))]
    with pytest.raises(ValueError):
        pin_for(checked, SH, argv)  # the supervisor cannot pin it: it refuses the exec
    fake = abi.ExecPin(
        abi.kernel_dev(identity(SH)[0]), identity(SH)[1], 0, len(abi.arg_area([a.encode() for a in argv]))
    )
    out = launch(checked, SH, argv, fake)
    assert out.status == -9 and not marker.exists()
    assert out.violations[0]["reasons"] == ["too_long"]


def test_a_thread_rewriting_path_and_argv_during_the_exec_never_runs_its_version(
    checked: Checked, place: Path
) -> None:
    """The race the check closes: the pin is made from the path and argv the supervisor read; a
    second thread (or a child process, through a shared mapping) flips both (to /bin/ls and another
    command) while the first execs. Every attempt
    either ran as decided (exit 0, the decided marker), was killed and recorded, or failed (a torn
    path names no file); the rewritten command never ran."""
    killed = ran = failed = 0
    for i in range(40):
        marker = place / f"m{i}"
        argv = [SH, "-c", f"echo ok1 > {marker}"]
        alt_arg = f"echo ev1 > {marker}"
        mode = "race" if i % 2 else "race-process"
        out = launch(checked, SH, argv, pin_for(checked, SH, argv), mode=mode, alt=("/bin/ls", alt_arg))
        if "execve failed" in out.output:  # a torn path (/bin/lh): no such file, nothing ran
            failed += 1
            assert out.violations == [] and not marker.exists()
        elif out.status == -9:
            killed += 1
            assert len(out.violations) == 1 and not marker.exists()
            assert set(out.violations[0]["reasons"]) <= {"args", "file"}
        else:
            ran += 1
            assert (out.status, out.violations) == (0, [])
            assert marker.read_text() == "ok1\n"
    assert killed + ran + failed == 40
    assert killed >= 1  # the rewrites did land in the execs
