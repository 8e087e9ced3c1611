"""Issue 24's red team, round two, as nobody under `evidence run --policy`: ways to have the exec
supervisor decide on one file while the kernel, or the dynamic loader after it, runs another.

Each got a program the rules refuse to run before its fix: a `#!` line split as the kernel does not
split it (`#!/w/ok\\r`: the kernel runs `/w/ok\\r`, a link of the job's to id; a NUL in it crashed
the supervisor); the dynamic loader as a script's interpreter (`#!/lib64/ld-linux-x86-64.so.2
/usr/bin/id`: nothing judged what it loads); a bind mount over a script's interpreter or over the
loader's program in a user and mount namespace of the job's own (judged by the name as it leads
here); and a symlink flipped between the decision and the loader's open of its program (nothing
checks what the loader opens after the exec). A seccomp filter of the job's own that answers its
execs itself cannot be installed (the kernel gives one chain of filters one listener)."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kernel.test_command_rules_run import _refused, _run
from tests.kernel.test_command_rules_via_agent import _run as _run_via_agent
from tests.kernel.test_daemon import Agent
from tests.kernel.test_policy_via_agent import agent  # noqa: F401 - the module's agent fixture
from tests.kernel.util import PY, of_type

pytestmark = pytest.mark.kernel

LDSO = "/lib64/ld-linux-x86-64.so.2"

DENY_ID = """\
default: allow
rules:
  - {name: no-id, program: [id], decision: deny}
"""


@pytest.fixture
def place() -> Iterator[Path]:  # nobody must reach it (pytest's tmp_path is 0700)
    d = Path(tempfile.mkdtemp(prefix="evidence-red-"))
    d.chmod(0o777)
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


def _default_deny(*extra: str) -> str:
    """default: deny, and the tools the attacks use allowed by their paths."""
    tools = [
        os.path.realpath(p)
        for p in ("/bin/sh", "/usr/bin/unshare", "/usr/bin/mount", "/usr/bin/true", "/usr/bin/setpriv")
        + ("/usr/bin/chmod", "/usr/bin/mkdir", "/usr/bin/ln", "/usr/bin/mv", "/usr/bin/seq", "/usr/bin/grep")
        + (LDSO,)
    ]
    listed = ", ".join(f"'{t}'" for t in (*tools, *extra))
    return f"default: deny\nrules:\n  - name: tools\n    program: [{listed}]\n    decision: allow\n"


def _no_violations_nor_degradations(events: list[dict]) -> None:  # type: ignore[type-arg]
    assert of_type(events, "policy.violation") == []
    # through the agent an unprivileged client's command shares the host's IPC: said, and nothing else
    assert [e["data"] for e in of_type(events, "degradation") if "IPC" not in e["data"]["reason"]] == []


def test_a_shebang_line_is_split_as_the_kernel_splits_it(place: Path) -> None:
    w = place / "w"
    script = (
        f"mkdir {w} && ln -s /usr/bin/true {w}/ok && ln -s /usr/bin/id \"{w}/ok$(printf '\\r')\" && "
        f"printf '#!{w}/ok\\r\\n' > {w}/crlf && chmod +x {w}/crlf && {w}/crlf; echo crlf=$?; "
        f"printf '#!/usr/bin/true\\0/x\\n' > {w}/nul && chmod +x {w}/nul && {w}/nul; echo nul=$?; "
        "/usr/bin/true; echo after=$?"
    )
    proc, _, events = _run(place, DENY_ID, script)
    lines = proc.stdout.splitlines()
    # id (its link `ok\r`) never ran: it would say the script is "no such user"
    assert "crlf=126" in lines and "no such user" not in proc.stdout + proc.stderr, proc
    assert _refused(events) == {f"{w}/crlf": "commands.rules[0] (no-id)"}
    # a NUL ends the interpreter's name, for the kernel and the supervisor: true ran, and the
    # supervisor lives on (it died of a ValueError, and every later exec failed with ENOSYS)
    assert "nul=0" in lines and "after=0" in lines, proc
    _no_violations_nor_degradations(events)


def test_the_dynamic_loader_as_a_scripts_interpreter_is_judged_by_what_it_loads(place: Path) -> None:
    w = place / "w"
    script = (
        f"mkdir {w} && printf '#!{LDSO} /usr/bin/id\\n' > {w}/s && chmod +x {w}/s && {w}/s; echo s=$?; "
        f"printf '#!{LDSO} /usr/bin/true\\n' > {w}/t && chmod +x {w}/t && {w}/t; echo t=$?"
    )
    proc, _, events = _run(place, DENY_ID, script)
    lines = proc.stdout.splitlines()
    assert "s=126" in lines and "no such user" not in proc.stdout + proc.stderr, proc
    assert "t=0" in lines, proc
    assert _refused(events) == {f"{w}/s": "commands.rules[0] (no-id)"}
    _no_violations_nor_degradations(events)


def test_a_bind_mount_over_an_interpreter_or_the_loaders_program_in_a_namespace_of_the_jobs(
    place: Path,
) -> None:
    w = place / "w"
    script = (
        f"mkdir {w} && printf '#!/usr/bin/true\\n' > {w}/s && chmod +x {w}/s; "
        "/usr/bin/unshare -Urm /bin/sh -c '/usr/bin/mount --bind /usr/bin/id /usr/bin/true && "
        f"{w}/s; echo interpreter=$?; {LDSO} /usr/bin/true; echo loader=$?'; "
        f"{w}/s; echo plain=$?; {LDSO} /usr/bin/true; echo plain_loader=$?"
    )
    proc, _, events = _run(place, _default_deny(f"{w}/*"), script)
    lines = proc.stdout.splitlines()
    assert "uid=" not in proc.stdout and "no such user" not in proc.stdout + proc.stderr, proc
    assert "interpreter=126" in lines and "loader=126" in lines, proc
    assert "plain=0" in lines and "plain_loader=0" in lines, proc  # the same, undisguised, runs
    assert _refused(events) == {f"{w}/s": "commands.default", os.path.realpath(LDSO): "commands.default"}


def test_the_loaders_program_flipped_after_the_decision_never_runs(place: Path) -> None:
    """A symlink the job owns flips between an allowed program and id while the loader is run on it
    200 times: its program is opened by name after the exec, unchecked, so a name the job can
    change is judged by commands.default (deny), and none runs. Before: about 1 in 20 ran id."""
    w = place / "w"
    script = (
        f"mkdir {w} && ln -s /usr/bin/true {w}/p && "
        f"(while :; do ln -sfn /usr/bin/id {w}/n; mv -T {w}/n {w}/p; "
        f"ln -sfn /usr/bin/true {w}/n; mv -T {w}/n {w}/p; done) & "
        f"for i in $(seq 200); do {LDSO} {w}/p 2>/dev/null; done | grep -c uid=; kill $!; "
        # an allowed program the job cannot move runs through the loader as before
        f"{LDSO} /usr/bin/true; echo stable=$?"
    )
    proc, _, events = _run(place, _default_deny(), script)
    lines = proc.stdout.splitlines()
    assert lines[0] == "0", proc  # grep's count of id's lines
    assert "stable=0" in lines, proc
    refused = [
        e["data"] for e in of_type(events, "policy.denial") if e["data"]["target"] == os.path.realpath(LDSO)
    ]
    # (denials alike are one event with a count)
    assert sum(d.get("count", 1) for d in refused) == 200, refused
    assert {d["rule"] for d in refused} == {"commands.default"}, refused


OWN_FILTER = """\
import os, seccomp
f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
f.add_rule(seccomp.NOTIFY, "execve")
try:
    f.load()
except RuntimeError as e:  # libseccomp's ECANCELED for the kernel's EBUSY
    print("own filter refused", flush=True)
    try:
        os.execv("/usr/bin/id", ["id"])
    except OSError as e:
        print("exec", e.errno, flush=True)
    raise SystemExit(0)
pid = os.fork()
if pid == 0:
    try:
        os.execv("/usr/bin/id", ["id"])
    finally:
        os._exit(100)
n = f.receive_notify()  # the job's own listener, not the supervisor's, would get the child's exec
f.respond_notify(seccomp.NotificationResponse(n, 0, 0, 1))  # SECCOMP_USER_NOTIF_FLAG_CONTINUE
_, st = os.waitpid(pid, 0)
print("own", os.WTERMSIG(st) if os.WIFSIGNALED(st) else "exit", flush=True)
"""


def test_a_seccomp_listener_of_the_jobs_own_is_refused_by_the_kernel(place: Path) -> None:
    """The newest filter's listener gets an exec both filters send to one: a job whose own
    listener answered its execs would never ask the supervisor. The kernel gives no second listener
    in one chain of filters (EBUSY), so the job never has one (and were it to, the exec check would
    kill what it let go on: no pin). The same script without evidence runs id: the attack works."""
    (place / "own.py").write_text(OWN_FILTER)
    plain = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", PY, f"{place}/own.py"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "uid=65534" in plain.stdout and "own exit" in plain.stdout, plain
    proc, _, events = _run(place, DENY_ID, f"{PY} {place}/own.py")
    assert proc.stdout.splitlines() == ["own filter refused", "exec 13"], proc
    assert _refused(events) == {"/usr/bin/id": "commands.rules[0] (no-id)"}


def test_an_exec_from_another_thread_of_the_first_process_is_at_depth_0(place: Path) -> None:
    """The run's first process execs from a thread other than its first (a Go program's exec may):
    that is the first process, depth 0 (`direct`), not a process of unknown depth judged as nested
    (its thread's parent link leads past the first process)."""
    commands = """\
    default: allow
    rules:
      - {name: nested-id, program: [id], depth: nested, decision: deny}
    """
    code = "import os, threading; t = threading.Thread(target=os.execv, args=('/usr/bin/id', ['id'])); t.start(); t.join()"
    proc, _, events = _run(place, commands, f'exec {PY} -c "{code}"')
    assert "uid=65534" in proc.stdout, proc
    assert _refused(events) == {}
    (ran,) = [e["data"] for e in of_type(events, "process.exec") if e["data"]["filename"] == "/usr/bin/id"]
    assert ran["depth"] == 0, ran


def test_the_same_names_through_the_agent(agent: Agent, place: Path) -> None:  # noqa: F811
    """`run --agent` as nobody: the agent's supervisor is the same, and so are its answers."""
    w = place / "w"
    script = (
        f"mkdir {w} && ln -s /usr/bin/true {w}/ok && ln -s /usr/bin/id \"{w}/ok$(printf '\\r')\" && "
        f"printf '#!{w}/ok\\r\\n' > {w}/crlf && chmod +x {w}/crlf && {w}/crlf; echo crlf=$?; "
        f"printf '#!{LDSO} /usr/bin/id\\n' > {w}/s && chmod +x {w}/s && {w}/s; echo s=$?; "
        f"printf '#!/usr/bin/true\\0/x\\n' > {w}/nul && chmod +x {w}/nul && {w}/nul; echo nul=$?"
    )
    proc, _, events = _run_via_agent(agent, place, DENY_ID, script)
    lines = proc.stdout.splitlines()
    assert "no such user" not in proc.stdout + proc.stderr, proc
    assert "crlf=126" in lines and "s=126" in lines and "nul=0" in lines, proc
    assert _refused(events) == {
        f"{w}/crlf": "commands.rules[0] (no-id)",
        f"{w}/s": "commands.rules[0] (no-id)",
    }
    _no_violations_nor_degradations(events)


def test_a_scripts_interpreter_is_judged_with_the_arguments_the_kernel_gives_it(place: Path) -> None:
    """`#!/usr/bin/id -u` runs `id -u SCRIPT`: a rule on id's arguments sees `-u` (it saw the
    script's own argv, without the line's argument, and let id run)."""
    commands = """\
    default: allow
    rules:
      - {name: no-id-u, program: [id], args: ["-u"], decision: deny}
    """
    w = place / "w"
    script = (
        f"mkdir {w} && printf '#!/usr/bin/id -u\\n' > {w}/s && chmod +x {w}/s && {w}/s; echo s=$?; "
        f"printf '#!/usr/bin/id\\n' > {w}/t && chmod +x {w}/t && {w}/t -g; echo t=$?"
    )
    proc, _, events = _run(place, commands, script)
    lines = proc.stdout.splitlines()
    assert "s=126" in lines, proc
    assert "t=1" in lines, proc  # id -g SCRIPT ran (and said the script is no user)
    assert _refused(events) == {f"{w}/s": "commands.rules[0] (no-id-u)"}


def test_an_argv_past_what_the_supervisor_reads_never_runs(place: Path) -> None:
    """A denied argument hidden past the supervisor's reading (after 1,000 arguments, or past 64 KiB
    of them) is not let through: a deny rule's patterns count as matching what was not read, and an
    argv not read whole cannot be pinned, so even an allowed program is refused."""
    commands = """\
    default: allow
    rules:
      - {name: no-secret-id, program: [id], args: ["*secret*"], decision: deny}
    """
    script = (
        "id $(seq 1000) secret; echo many=$?; "
        'id "$(head -c 70000 /dev/zero | tr "\\\\0" x)" secret; echo long=$?; '
        "/usr/bin/true $(seq 1001); echo allowed=$?; id -u; echo plain=$?"
    )
    proc, _, events = _run(place, commands, script)
    lines = proc.stdout.splitlines()
    assert "many=126" in lines and "long=126" in lines and "allowed=126" in lines, proc
    assert "65534" in lines and "plain=0" in lines, proc  # id -u itself runs
    den = [e["data"] for e in of_type(events, "policy.denial") if e["data"]["operation"] == "exec"]
    assert {d["target"] for d in den} == {"/usr/bin/id", "/usr/bin/true"}, den


def test_a_shebang_line_past_the_kernels_256_bytes_is_cut_where_the_kernel_cuts_it(place: Path) -> None:
    """`#!/usr/bin/id -u`, spaces, and byte 255 of the file not a space: the kernel reads 256 bytes,
    finds no newline, ends the line at byte 255 (which it drops) and the spaces before it: id runs
    as `id -u SCRIPT`. Split over all 256 bytes the argument was `-u   ...Z`, not `-u`: the rule on
    `id -u` did not match, and the exec check killed what it pinned wrong (a violation, not a denial)."""
    commands = """\
    default: allow
    rules:
      - {name: no-id-u, program: [id], args: ["-u"], decision: deny}
    """
    w = place / "w"
    w.mkdir()
    line = b"#!/usr/bin/id -u"
    (w / "s").write_bytes(line + b" " * (255 - len(line)) + b"Z\nrest\n")
    (w / "s").chmod(0o755)
    proc, _, events = _run(place, commands, f"{w}/s; echo s=$?")
    assert "s=126" in proc.stdout.splitlines(), proc
    assert _refused(events) == {f"{w}/s": "commands.rules[0] (no-id-u)"}
    assert of_type(events, "policy.violation") == []
