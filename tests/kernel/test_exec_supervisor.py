"""The exec supervisor's core (agent/recorder/exec_supervisor.py) with a real child run as nobody:
its launcher loads the seccomp filter (python3-seccomp), hands the listener over SCM_RIGHTS and
execs a shell; a denied exec fails with EACCES and the shell goes on; what the supervisor read
(resolved program, argv, depth) is what the job asked; a supervisor that goes away fails the job's
next exec (ENOSYS)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from evidence.agent.recorder.exec_supervisor import ExecDecision, ExecSupervisor, receive_listener
from evidence.policy.governance import CommandsPolicy
from tests.kernel.util import EXEC_LAUNCHER, as_user

NOBODY = 65534


def _commands(rules: list[dict[str, object]], default: str = "allow") -> CommandsPolicy:
    return CommandsPolicy.model_validate({"default": default, "rules": rules}, context={"variables": {}})


def _run(
    commands: CommandsPolicy, script: str, cwd: Path, **supervisor: Any
) -> tuple[subprocess.CompletedProcess[str], list[ExecDecision], list[str]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    decisions: list[ExecDecision] = []
    told: list[str] = []
    proc = subprocess.Popen(
        as_user(NOBODY, sys.executable, "-c", EXEC_LAUNCHER, str(theirs.fileno()), "/bin/sh", "-c", script),
        pass_fds=[theirs.fileno()],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
    )
    theirs.close()
    try:
        ours.settimeout(30)
        listener = receive_listener(ours)
        sup = ExecSupervisor(
            listener, commands, proc.pid, on_decision=decisions.append, tell=told.append, **supervisor
        )
        sup.start()
        out, err = proc.communicate(timeout=60)
        sup.stop()
    finally:
        ours.close()
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), decisions, told


def test_denied_exec_fails_with_eacces_and_the_caller_goes_on(place: Path) -> None:
    link = place / "innocent"
    link.symlink_to("/usr/bin/id")
    script_file = place / "script"
    script_file.write_text("#!/usr/bin/id\n")  # a `#!` script is judged by its interpreter too
    script_file.chmod(0o755)
    commands = _commands(
        [
            {"name": "no-id", "program": ["/usr/bin/id"], "decision": "deny", "message": "no ids here"},
            {"name": "no-force", "program": "echo", "args": ["*--force*"], "decision": "deny"},
        ]
    )
    script = (
        "/usr/bin/id; echo id=$?; "
        f"{link}; echo link=$?; "  # a symlink with another name: what really runs decides
        "/usr/bin/env /usr/bin/id -u; echo env=$?; "  # nested through env: the second exec is refused
        "/bin/echo a --force; echo force=$?; "
        "/bin/echo fine; "
        f"{script_file}; echo shebang=$?; "
        "/proc/self/root/usr/bin/id; echo procself=$?; "
        "cd /usr && ./bin/id; echo rel=$?"  # relative to the caller's cwd
    )
    proc, decisions, told = _run(commands, script, place)
    lines = proc.stdout.splitlines()
    assert "id=126" in lines and "link=126" in lines and "force=126" in lines and "rel=126" in lines, proc
    assert "shebang=126" in lines and "procself=126" in lines
    assert "env=126" in lines  # env's own exec ran, its exec of id was refused (env exits 126)
    assert "fine" in lines and "uid=" not in proc.stdout
    assert "Permission denied" in proc.stderr
    refused = [d for d in decisions if not d.allowed]
    assert [d.request.program for d in refused if d.request] == ["/usr/bin/id"] * 3 + [
        os.path.realpath("/bin/echo")
    ] + [str(script_file), "/usr/bin/id", "/usr/bin/id"]
    assert {d.decision.label for d in refused} == {
        "commands.rules[0] (no-id)",
        "commands.rules[1] (no-force)",
    }
    by_path = {d.request.path: d for d in decisions if d.request}
    assert by_path[str(link)].request.program == "/usr/bin/id"  # type: ignore[union-attr]
    assert by_path["/bin/sh"].depth == 0 and by_path["/usr/bin/id"].depth == 1
    assert by_path["./bin/id"].request.program == "/usr/bin/id"  # type: ignore[union-attr]
    assert [d.request.argv for d in refused if d.request and d.request.argv[0] == "/bin/echo"] == [
        ("/bin/echo", "a", "--force")
    ]
    assert told[0] == "evidence: exec of /usr/bin/id refused by commands.rules[0] (no-id): no ids here"
    from evidence.agent.recorder.exec_supervisor import denial_record

    rec = denial_record(refused[0], 5)
    assert rec is not None and (rec["target"], rec["rule"], rec["enforced"], rec["result"]) == (
        "/usr/bin/id",
        "commands.rules[0] (no-id)",
        True,
        "EACCES",
    )
    assert all(denial_record(d, 5) is None for d in decisions if d.allowed)


def test_default_deny_and_a_supervisor_gone_fails_closed(place: Path) -> None:
    sh = os.path.realpath("/bin/sh")
    commands = _commands([{"name": "shell", "program": [sh], "decision": "allow"}], default="deny")
    proc, decisions, told = _run(commands, "/usr/bin/true; echo true=$?; /bin/sh -c 'echo inner'", place)
    assert proc.stdout.splitlines() == ["true=126", "inner"], proc
    assert told == ["evidence: exec of /usr/bin/true refused by commands.default"]
    # the listener closed (supervisor stopped) while the job still runs: its next exec fails
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child = subprocess.Popen(
        as_user(
            NOBODY,
            sys.executable,
            "-c",
            EXEC_LAUNCHER,
            str(theirs.fileno()),
            "/bin/sh",
            "-c",
            "read x; /usr/bin/true; echo after=$?",
        ),
        pass_fds=[theirs.fileno()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    theirs.close()
    try:
        ours.settimeout(30)
        listener = receive_listener(ours)
        sup = ExecSupervisor(listener, _commands([]), child.pid)
        sup.start()
        # wait for sh to be running (its own exec answered), then stop answering
        for _ in range(500):
            if os.path.realpath(f"/proc/{child.pid}/exe") == sh:
                break
            __import__("time").sleep(0.01)
        sup.stop()
        out, err = child.communicate("go\n", timeout=30)
    finally:
        ours.close()
        if child.poll() is None:
            child.kill()
    assert "after=" in out and "after=0" not in out, (out, err)


def test_a_bind_mount_in_the_jobs_own_namespace_does_not_pass_for_an_allowed_program(place: Path) -> None:
    # nobody makes a user and mount namespace of its own and binds /usr/bin/id over the allowed
    # /usr/bin/true: judged by name alone, id would run as true
    allowed = [
        os.path.realpath(p) for p in ("/bin/sh", "/usr/bin/unshare", "/usr/bin/mount", "/usr/bin/true")
    ]
    commands = _commands([{"name": "tools", "program": allowed, "decision": "allow"}], default="deny")
    script = (
        "/usr/bin/true; echo plain=$?; "
        "/usr/bin/unshare -Urm /bin/sh -c '/usr/bin/mount --bind /usr/bin/id /usr/bin/true && "
        "/usr/bin/true; echo bound=$?'"
    )
    proc, decisions, told = _run(commands, script, place)
    lines = proc.stdout.splitlines()
    assert "plain=0" in lines and "bound=126" in lines, proc
    assert "uid=" not in proc.stdout
    foreign = [d for d in decisions if d.request and d.request.foreign]
    assert [(d.request.program, d.allowed, d.decision.label) for d in foreign if d.request] == [
        ("/usr/bin/true", False, "commands.default")
    ]


def test_fexecve_through_a_descriptor_is_decided_on_the_file(place: Path) -> None:
    commands = _commands([{"name": "no-id", "program": "id", "decision": "deny"}])
    code = "import os; fd = os.open('/usr/bin/id', os.O_RDONLY)\ntry: os.execve(fd, ['innocent'], {})\nexcept OSError as e: print('fexecve', e.errno)"
    py = os.path.realpath("/usr/bin/python3")
    proc, decisions, _ = _run(commands, f'{py} -c "{code}"', place)
    assert "fexecve 13" in proc.stdout, proc
    refused = [d for d in decisions if not d.allowed and d.request]
    assert [(d.request.program, d.request.argv) for d in refused if d.request] == [
        ("/usr/bin/id", ("innocent",))
    ]


def test_the_dynamic_loader_run_as_a_program_is_judged_by_what_it_loads(place: Path) -> None:
    commands = _commands([{"name": "no-id", "program": "/usr/bin/id", "args": ["-u"], "decision": "deny"}])
    ldso = next(p for p in ("/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-aarch64.so.1") if os.path.exists(p))
    script = (
        f"{ldso} /usr/bin/id -u; echo direct=$?; "
        f"{ldso} --argv0 x --inhibit-cache /usr/bin/id -u; echo options=$?; "
        f"{ldso} /usr/bin/id -g; echo other=$?"
    )
    proc, decisions, _ = _run(commands, script, place)
    lines = proc.stdout.splitlines()
    assert "direct=126" in lines and "options=126" in lines and "other=0" in lines, proc
    refused = [d for d in decisions if not d.allowed and d.request]
    assert [d.request.loads for d in refused if d.request] == ["/usr/bin/id", "/usr/bin/id"]


def test_what_the_supervisor_pins_is_what_the_kernel_loads(place: Path) -> None:
    """The no-race check's user-space half against the kernel's own view of the new image: the file
    mapped (/proc/PID/exe) and the arg area it copied (/proc/PID/cmdline), for a program and for a
    `#!` script run by a relative name (the kernel maps the interpreter and rewrites argv)."""
    import time

    from evidence.agent.recorder.exec_check import MemoryPublisher, new_key

    script_file = place / "follow"
    script_file.write_text("#!/usr/bin/tail -f\n")
    script_file.chmod(0o755)
    key = new_key()
    pub = MemoryPublisher(key)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen(
        as_user(
            NOBODY,
            sys.executable,
            "-c",
            EXEC_LAUNCHER,
            str(theirs.fileno()),
            "/bin/sh",
            "-c",
            "/bin/sleep 300 & ./follow -n 1 & wait",
        ),
        pass_fds=[theirs.fileno()],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=place,
    )
    theirs.close()
    decisions: list[ExecDecision] = []
    running: dict[str, int] = {}
    try:
        ours.settimeout(30)
        sup = ExecSupervisor(
            receive_listener(ours),
            _commands([]),
            proc.pid,
            on_decision=decisions.append,
            publish=pub,
            check_key=key,
        )
        sup.start()
        want = {os.path.realpath("/bin/sleep"), os.path.realpath("/usr/bin/tail")}
        for _ in range(3000):
            for d in decisions:
                if d.request and d.request.argv[0] in ("/bin/sleep", "./follow"):
                    with contextlib.suppress(OSError):
                        exe = os.readlink(f"/proc/{d.request.pid}/exe")
                        if exe in want:
                            running[exe] = d.request.pid
            if len(running) == 2:
                break
            time.sleep(0.01)
        assert len(running) == 2, (decisions, proc.stderr)
        for exe, pid in running.items():
            st = os.stat(f"/proc/{pid}/exe")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert pub.check(pid, st.st_dev, st.st_ino, cmdline), (exe, cmdline)
        assert Path(f"/proc/{running[os.path.realpath('/usr/bin/tail')]}/cmdline").read_bytes() == (
            b"/usr/bin/tail\0-f\0./follow\0-n\0001\0"
        )
    finally:
        proc.kill()
        for pid in running.values():
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
        proc.wait(10)
        sup.stop()
        ours.close()


def test_an_allowed_exec_whose_pin_the_map_does_not_take_is_refused(place: Path) -> None:
    """Fail closed in the one-call answer (src/fast/_exec.c allow): a pin the kernel's map refuses
    (here the "map" is a pipe: bpf(2) fails) refuses the exec with EACCES and says why; nothing
    is let run unpinned (the launcher's own exec of the shell is the first refused)."""
    from evidence.agent.recorder import exec_supervisor
    from evidence.agent.recorder.exec_check import new_key

    if exec_supervisor._fast is None:
        pytest.skip("the compiled module is not built (tests/unit/test_native.py fails under CI=true)")
    r, w = os.pipe()
    try:
        done, decisions, told = _run(
            _commands([]),
            "echo ran",
            place,
            publish=lambda _tid, _pin: True,  # never reached: the compiled path answers
            pins_fd=r,
            check_key=new_key(),
        )
    finally:
        os.close(r)
        os.close(w)
    assert done.returncode != 0 and "ran" not in done.stdout
    assert "Permission denied" in done.stderr, done.stderr
    assert decisions and not decisions[0].allowed
    assert decisions[0].error == "what would run cannot be pinned"
    assert any("cannot be pinned" in line for line in told)


def test_a_dry_run_lets_every_exec_run_and_records_what_would_have_been_refused(place: Path) -> None:
    from evidence.agent.recorder.exec_supervisor import denial_record

    commands = _commands(
        [
            {"name": "no-id", "program": ["/usr/bin/id"], "decision": "deny"},
            {"name": "ask-true", "program": ["true"], "decision": "approve"},
        ]
    )
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen(
        as_user(
            NOBODY,
            sys.executable,
            "-c",
            EXEC_LAUNCHER,
            str(theirs.fileno()),
            "/bin/sh",
            "-c",
            "/usr/bin/id -u; echo id=$?; /usr/bin/true; echo true=$?",
        ),
        pass_fds=[theirs.fileno()],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=place,
    )
    theirs.close()
    decisions: list[ExecDecision] = []
    told: list[str] = []
    asked: list[object] = []
    try:
        ours.settimeout(30)
        sup = ExecSupervisor(
            receive_listener(ours),
            commands,
            proc.pid,
            on_decision=decisions.append,
            tell=told.append,
            approver=lambda a: asked.append(a) or True,
            dry_run=True,
        )
        sup.start()
        out, err = proc.communicate(timeout=60)
        sup.stop()
    finally:
        ours.close()
        if proc.poll() is None:
            proc.kill()
    assert out.splitlines() == [str(NOBODY), "id=0", "true=0"], (out, err)
    assert told == [] and asked == []  # nobody is told or asked in a dry run
    would = [denial_record(d, 1) for d in decisions]
    assert [(r["target"], r["rule"], r["enforced"], r["result"]) for r in would if r] == [
        ("/usr/bin/id", "commands.rules[0] (no-id)", False, 0),
        ("/usr/bin/true", "commands.rules[1] (ask-true)", False, 0),
    ]


def test_the_supervisor_times_each_exec_from_receive_to_respond(
    place: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What bench/bench.py reports as the supervisor's round trip: every exec decided on its thread
    counted (200 execs of /bin/true through 20 rules none of which matches), its summary logged
    at stop."""
    rules: list[dict[str, object]] = [
        {
            "name": f"r{i}",
            "program": [f"/opt/nothing/tool{i}", f"tool{i}*"],
            "args": ["--x*"],
            "decision": "deny",
        }
        for i in range(20)
    ]
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen(
        as_user(NOBODY, sys.executable, "-c", EXEC_LAUNCHER, str(theirs.fileno()), "/bin/sh", "-c",
                "i=0; while [ $i -lt 200 ]; do /bin/true; i=$((i+1)); done; echo done"),
        pass_fds=[theirs.fileno()], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=place,
    )  # fmt: skip
    theirs.close()
    decisions: list[ExecDecision] = []
    try:
        ours.settimeout(30)
        sup = ExecSupervisor(receive_listener(ours), _commands(rules), proc.pid, on_decision=decisions.append)
        sup.start()
        out, _ = proc.communicate(timeout=120)
        with caplog.at_level(logging.INFO, logger="evidence.agent.recorder.exec_supervisor"):
            sup.stop()
    finally:
        ours.close()
        if proc.poll() is None:
            proc.kill()
    assert out == "done\n" and len(decisions) == 201 and all(d.allowed for d in decisions)
    s = sup.round_trips.summary()
    assert s["count"] == 201 and 0 < s["median_us"] <= s["p99_us"] <= s["max_us"]
    assert sup.round_trips.line() in caplog.text and "201 execs decided" in caplog.text


def test_a_fifo_or_device_named_as_the_program_is_never_opened(place: Path) -> None:
    """The job names what it likes as the program: the supervisor reads a `#!` line only from a
    regular file. A FIFO opened for reading would block it (every exec of the job waiting behind
    it), a device could act on being opened; the kernel refuses to exec either (EACCES) anyway."""
    fifo = place / "fifo"
    os.mkfifo(fifo)
    fifo.chmod(0o777)
    proc, decisions, _ = _run(
        _commands([]), f"{fifo}; echo fifo=$?; /dev/null; echo dev=$?; /bin/echo after", place
    )
    lines = proc.stdout.splitlines()
    assert "fifo=126" in lines and "dev=126" in lines and "after" in lines, proc
    assert {d.request.program for d in decisions if d.request} >= {str(fifo), "/dev/null", "/usr/bin/echo"}


def test_what_would_run_is_named_as_realpath_names_it_and_proc_self_is_the_callers(place: Path) -> None:
    """For a caller in the supervisor's root and mount namespace the program is named by the
    kernel's own walk of the caller's name (exec_resolve._resolve_as_ours): the same name
    os.path.realpath gives, through symlinks, chains, `..`, a relative name and the caller's
    /proc/self (its own executable: a program that re-executes itself is judged as itself)."""
    (place / "one").symlink_to("/usr/bin/id")
    (place / "two").symlink_to(place / "one")
    (place / "sub").mkdir()
    (place / "rel").symlink_to("sub/../one")
    names = [
        "/bin/true",
        str(place / "two"),
        str(place / "rel"),
        "/proc/self/root/usr/bin/id",
        "/usr/bin/../bin/id",
    ]
    script = "; ".join(f"{n} >/dev/null" for n in names)
    script += "; cd /usr && ./bin/id >/dev/null; /bin/sh -c 'exec /proc/self/exe -c \"echo again\"'"
    proc, decisions, _ = _run(_commands([]), script, place)
    assert "again" in proc.stdout, proc
    got = {d.request.path: d.request for d in decisions if d.request}
    for name in [*names, "./bin/id"]:
        req = got[name]
        want = os.path.realpath(name if name != "./bin/id" else "/usr/bin/id")
        if name.startswith("/proc/self/"):
            want = "/usr/bin/id"
        assert req.program == want and not req.foreign, req
        st = os.stat(want)
        assert req.identity == (st.st_dev, st.st_ino), req
    again = got["/proc/self/exe"]
    assert again.program == os.path.realpath("/bin/sh") and not again.foreign, again


def test_a_script_rewritten_between_two_execs_is_judged_as_it_is_now(place: Path) -> None:
    """The supervisor keeps a program's head by its identity, size and times: a script rewritten
    at once (same tick, other interpreter) is read again, and refused by its new interpreter."""
    script = place / "job"
    commands = _commands([{"name": "no-id", "program": "id", "decision": "deny"}])
    run = (
        f"printf '#!/bin/sh\\necho ran\\n' > {script}; chmod +x {script}; {script}; echo first=$?; "
        f"printf '#!/usr/bin/id\\n' > {script}; {script}; echo second=$?"
    )
    proc, decisions, _ = _run(commands, run, place)
    lines = proc.stdout.splitlines()
    assert "ran" in lines and "first=0" in lines and "second=126" in lines, proc
    refused = [d for d in decisions if not d.allowed and d.request]
    assert [(d.request.program, d.request.interpreter) for d in refused if d.request] == [
        (str(script), "/usr/bin/id")
    ]


def test_a_caller_in_a_mount_namespace_of_its_own_is_not_taken_for_ours() -> None:
    """The usual request (its names walked as ours) is taken only for a caller whose root is
    ours on the same mount (exec_resolve.root_mount): a mount namespace of its own, where a job
    can bind anything over any name, has a root mount of its own, even unchanged; a chroot to
    another directory, another root."""
    from evidence.agent.recorder import exec_resolve

    ours = exec_resolve.root_mount("/")
    same = subprocess.Popen(["sleep", "30"])
    own = subprocess.Popen(["unshare", "--mount", "sleep", "30"])
    chrooted = subprocess.Popen(["chroot", "/usr", "/bin/sleep", "30"])
    try:
        for proc in (same, own, chrooted):
            for _ in range(500):  # until it runs its own program (unshare and chroot exec sleep)
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{proc.pid}/exe").endswith("/sleep"):
                        break
                time.sleep(0.01)
        assert exec_resolve.root_mount(f"/proc/{same.pid}/root") == ours
        assert exec_resolve.root_mount(f"/proc/{own.pid}/root")[2] != ours[2]
        assert exec_resolve.root_mount(f"/proc/{chrooted.pid}/root")[:2] != ours[:2]
    finally:
        for proc in (same, own, chrooted):
            proc.kill()
            proc.wait()
