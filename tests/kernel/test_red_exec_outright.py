"""Issue 24's red team on the exec supervisor's shortcut (`answer` -> `_allowed_outright` ->
`_allow_outright`: an exec C's `read_usual` read whole, no `#!` line, not the loader by name, the
same file by its name here as for the caller, that the rules simply allow, pinned and let go on
without the whole request), as nobody under `evidence run --policy` with `default: deny`: each
exec the whole path would refuse, ask about, audit or have killed must be so through the
shortcut too, and recorded as the whole path records it (a denial, an audit, a violation)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kernel.test_command_rules_run import _refused, _run
from tests.kernel.test_red_exec_fast import _ended
from tests.kernel.util import PY, of_type

pytestmark = pytest.mark.kernel

# The job's helpers: `run(argv, path=None)` forks a child that execs (os.execv, bytes kept as they
# are) and says how it ended: ("exit", code) -- 100 + errno when the exec failed -- or ("signal", n).
PRELUDE = """\
import ctypes, os, sys, threading, time
libc = ctypes.CDLL(None, use_errno=True)

def ended(st):
    return ("exit", os.WEXITSTATUS(st)) if os.WIFEXITED(st) else ("signal", os.WTERMSIG(st))

def child(argv, path=None):
    try:
        os.execv(path or argv[0], argv)
    except OSError as e:
        os._exit(100 + e.errno)

def run(argv, path=None):
    pid = os.fork()
    if pid == 0:
        child(argv, path)
    return ended(os.waitpid(pid, 0)[1])

def show(what, how):
    print(what, *how, flush=True)
"""


@pytest.fixture
def place() -> Iterator[Path]:  # nobody must reach it (pytest's tmp_path is 0700)
    d = Path(tempfile.mkdtemp(prefix="evidence-red-outright-"))
    d.chmod(0o777)
    (d / "public").write_text("public\n")
    (d / "secret").write_text("TOPSECRET\n")
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


def _job(
    place: Path, commands: str, body: str, before: str = "", approvals: str = ""
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], list[dict[str, Any]]]:
    job = place / "job.py"
    job.write_text(PRELUDE + textwrap.dedent(body))
    job.chmod(0o644)
    return _run(place, commands, f"{before} {PY} {job}; echo job=$?", approvals=approvals)


def _uid_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("uid=")]


EACCES = ("exit", 113)
RULES = """\
default: deny
rules:
  - {name: shells, program: [dash, setpriv, "python3*"], decision: allow}
  - {name: usr-true, program: [/usr/bin/true], decision: allow}
  - {name: cat-shallow, program: [cat], depth: {max: 1}, decision: allow}
  - {name: ls, program: [/usr/bin/ls], decision: allow}
  - {name: no-secret-ls, program: [ls], args: ["*secret*"], decision: deny}
  - {name: head-public, program: [head], args: ["*public"], decision: allow}
  - {name: audit-printf, program: [/usr/bin/printf], decision: audit, message: seen}
  - {name: ask-touch, program: [touch], decision: approve}
"""


def test_what_the_rules_do_not_simply_allow_never_takes_the_shortcut(place: Path) -> None:
    """Each exec below names a plain program by an absolute name (the shortcut's case), but the
    rules do not simply allow it as it is called: a deny by an argument that is not UTF-8, an allow
    by an argument whose last byte is not, an argv past what the supervisor reads (allow rules'
    patterns stop matching, deny rules' match), an orphan under a depth rule, an `approve` rule
    nobody answers, an `audit` rule: each is refused and recorded, or run and audited, as the whole
    path does it; the allowed ones beside them run."""
    body = f"""\
    P = b"{place}"
    show("ls", run([b"/usr/bin/ls", P + b"/public"]))
    show("ls_secret", run([b"/usr/bin/ls", P + b"/\\xffsecret"]))
    show("head", run([b"/usr/bin/head", b"-c0", P + b"/public"]))
    show("head_bad", run([b"/usr/bin/head", b"-c0", P + b"/public\\xff"]))
    filler = [b"x" * 4000] * 17  # past MAX_ARGV_BYTES (65536): argv read cut
    show("head_long", run([b"/usr/bin/head", b"-c0", *filler, P + b"/public"]))
    show("ls_long", run([b"/usr/bin/ls", *filler, P + b"/secret"]))
    show("printf", run([b"/usr/bin/printf", b""]))
    show("touch", run([b"/usr/bin/touch", P + b"/touched"]))
    show("id", run([b"/usr/bin/id"]))
    show("cat2", run([b"/usr/bin/cat", P + b"/public"]))  # depth 2: past cat-shallow
    # an orphan (its parent gone, reparented out of the run's tree): depth -1, the most restrictive
    # of every depth from 1 on decides (cat at depth 2: the default's deny)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        mid = os.getpid()
        if os.fork() == 0:
            os.close(r)
            while os.getppid() == mid:  # wait to be reparented out of the run's tree
                time.sleep(0.01)
            how = run([b"/usr/bin/cat", P + b"/public"])
            os.write(w, repr(how).encode())
            os._exit(0)
        os._exit(0)
    os.waitpid(pid, 0)
    os.close(w)
    got = b""
    while chunk := os.read(r, 100):
        got += chunk
    show("orphan", eval(got.decode()))
    """
    proc, _, events = _job(
        place,
        RULES,
        body,
        before=f"cat {place}/public >/dev/null; echo cat1=$?;",
        approvals="approvals:\n  timeout: 1s\n  on_timeout: deny\n",
    )
    out = proc.stdout
    assert "cat1=0" in out and "job=0" in out, out + proc.stderr
    ended = _ended(out)
    assert ended["ls"] == ended["head"] == ("exit", 0), out
    assert ended["printf"] == ("exit", 0), out
    for what in ("ls_secret", "head_bad", "head_long", "ls_long", "touch", "id", "cat2", "orphan"):
        assert ended[what] == EACCES, (what, out)
    assert not (place / "touched").exists()
    refused = _refused(events)
    assert refused["/usr/bin/id"] == "commands.default"
    assert refused["/usr/bin/touch"].startswith("commands.rules[7]")
    assert refused["/usr/bin/cat"] == "commands.default"
    denials = [e["data"] for e in of_type(events, "policy.denial") if e["data"]["operation"] == "exec"]
    by_target: dict[str, int] = {}
    for d in denials:
        by_target[d["target"]] = by_target.get(d["target"], 0) + d.get("count", 1)  # like ones coalesced
    # ls twice (secret, long), head twice (\xff, long), cat twice (depth 2, orphan), touch, id
    assert by_target == {
        "/usr/bin/ls": 2,
        "/usr/bin/head": 2,
        "/usr/bin/cat": 2,
        "/usr/bin/touch": 1,
        "/usr/bin/id": 1,
    }
    audits = [e["data"] for e in of_type(events, "policy.audit")]
    assert [(a["program"], a["rule_name"], a["message"]) for a in audits] == [
        ("/usr/bin/printf", "audit-printf", "seen")
    ]


RACE_RULES = """\
default: deny
rules:
  - {name: shells, program: [dash, setpriv, "python3*"], decision: allow}
  - {name: usr-true, program: [/usr/bin/true], decision: allow}
  - {name: workspace, program: ["WS/ok/*"], decision: allow}
"""


def _race_check(proc: subprocess.CompletedProcess[str], events: list[dict[str, Any]]) -> dict[str, int]:
    out = proc.stdout
    assert "job=0" in out, out + proc.stderr
    assert _uid_lines(out) == [], out  # id (allowed by no rule) never ran
    seen = {}
    for line in out.splitlines():
        if line.startswith("seen "):
            what, n = line.split()[1:]
            seen[what] = int(n)
    for line in out.splitlines():  # anything else: an exec that failed (a name flipped mid-walk)
        if line.startswith("other "):
            assert line.split()[1] == "exit" and int(line.split()[2]) > 100, out
    violations = of_type(events, "policy.violation")
    assert len(violations) == seen.get("killed", 0), (seen, violations)
    said = [e["data"]["component"] for e in of_type(events, "degradation")]
    assert "commands" not in said, said
    return seen


def test_a_symlink_flipped_to_a_denied_program_while_decided_is_killed_and_recorded(place: Path) -> None:
    """ok/link flips (rename over it) between a link to ok/true (a copy of /usr/bin/true, allowed
    by the workspace glob) and one to /usr/bin/id (allowed by nothing) while a child execs it, many
    times: whichever C's openat2 saw and Identity's stat then saw, the kernel loads id only to be
    killed (the pin names true's file), and each kill is a violation in the bundle; id never runs."""
    ok = place / "ok"
    ok.mkdir()
    ok.chmod(0o777)
    shutil.copy("/usr/bin/true", ok / "true")
    body = f"""\
    ok = "{ok}"
    def flip():
        i = 0
        while True:
            tmp = f"{{ok}}/.l{{i & 1}}"
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            os.symlink(f"{{ok}}/true" if i & 1 else "/usr/bin/id", tmp)
            os.rename(tmp, f"{{ok}}/link")
            i += 1
    threading.Thread(target=flip, daemon=True).start()
    seen = {{"ran": 0, "refused": 0, "killed": 0, "other": 0}}
    for _ in range(300):
        how = run([f"{{ok}}/link".encode()])
        key = {{("exit", 0): "ran", ("exit", 113): "refused", ("signal", 9): "killed"}}.get(how, "other")
        seen[key] += 1
        if key == "other":
            print("other", *how, flush=True)
    for k, n in seen.items():
        print("seen", k, n, flush=True)
    """
    proc, _, events = _job(place, RACE_RULES.replace("WS", str(place)), body)
    seen = _race_check(proc, events)
    assert seen["ran"] >= 1, seen
    assert seen["refused"] + seen["killed"] >= 1, seen  # id was named at least once


def test_a_file_rewritten_into_a_script_after_its_read_is_killed_and_recorded(place: Path) -> None:
    """ok/prog (a copy of /usr/bin/true, allowed by the workspace glob, no `#!` line: the shortcut's
    case) is rewritten in place, the same file, between its ELF header and `#!/usr/bin/id` while a
    child execs it, many times: an exec decided on the ELF that the kernel runs as a script loads
    id, which the exec check kills (a script was not pinned); one decided on the script is refused
    (its interpreter id is allowed by nothing). id never runs; each kill is a violation."""
    ok = place / "ok"
    ok.mkdir()
    ok.chmod(0o777)
    shutil.copy("/usr/bin/true", ok / "prog")
    (ok / "prog").chmod(0o777)
    body = f"""\
    prog = "{ok}/prog"
    elf = open(prog, "rb").read(16)
    script = b"#!/usr/bin/id\\n\\n\\n"
    assert len(script) == len(elf)
    def flip():
        i = 0
        while True:
            try:
                fd = os.open(prog, os.O_WRONLY)
            except OSError:  # ETXTBSY: it runs
                continue
            os.pwrite(fd, script if i & 1 else elf, 0)
            os.close(fd)
            i += 1
    threading.Thread(target=flip, daemon=True).start()
    seen = {{"ran": 0, "refused": 0, "killed": 0, "busy": 0, "other": 0}}
    for _ in range(300):
        how = run([prog.encode()])
        key = {{("exit", 0): "ran", ("exit", 113): "refused", ("signal", 9): "killed", ("exit", 126): "busy"}}
        seen[key.get(how, "other")] += 1
        if how not in key:
            print("other", *how, flush=True)
    for k, n in seen.items():
        print("seen", k, n, flush=True)
    """
    proc, _, events = _job(place, RACE_RULES.replace("WS", str(place)), body)
    seen = _race_check(proc, events)
    assert seen["refused"] + seen["killed"] >= 1, seen  # the script was seen at least once


# The job, in a user and mount namespace of its own, binds /usr/bin/id over /usr/bin/true and runs
# it ("bound"), then chroots back to the root it had before and runs it again ("chrooted")
BIND_OVER_TRUE = """\
    CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x00020000
    old = os.open("/", os.O_PATH | os.O_DIRECTORY)
    assert libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) == 0, ctypes.get_errno()
    open("/proc/self/setgroups", "w").write("deny")
    open("/proc/self/uid_map", "w").write("0 65534 1")
    open("/proc/self/gid_map", "w").write("0 65534 1")
    MS_REC, MS_PRIVATE, MS_BIND = 0x4000, 0x40000, 0x1000
    assert libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0, ctypes.get_errno()
    assert libc.mount(b"/usr/bin/id", b"/usr/bin/true", None, MS_BIND, None) == 0, ctypes.get_errno()
    show("bound", run([b"/usr/bin/true"]))
    os.fchdir(old)
    os.chroot(".")
    show("chrooted", run([b"/usr/bin/true"]))
"""


def test_a_bind_mount_or_a_chroot_back_to_our_root_in_a_namespace_of_the_jobs_own(place: Path) -> None:
    """In a user and mount namespace of its own (`unshare -Urm`), the job binds /usr/bin/id over
    /usr/bin/true: an exec of /usr/bin/true there is not the shortcut's (its root mount is its
    own), the name leads elsewhere for it than for evidence, so `default: deny` refuses it. Then it
    chroots back to the root it had before (an O_PATH descriptor of evidence's own root kept across
    unshare): its root is now ours by device, inode and mount (C's test passes), but a walk from it
    sees evidence's mounts, not the bind: /usr/bin/true there is true (runs), never id."""
    body = BIND_OVER_TRUE
    proc, _, events = _job(place, RACE_RULES.replace("WS", str(place)), body)
    out = proc.stdout
    assert "job=0" in out, out + proc.stderr
    assert _uid_lines(out) == [], out
    ended = _ended(out)
    assert ended["bound"] == EACCES, out
    assert ended["chrooted"] == ("exit", 0), out  # evidence's /usr/bin/true, pinned and run
    assert _refused(events).get("/usr/bin/true") == "commands.default", _refused(events)


NAME_RULES = """\
default: deny
rules:
  - {name: shells, program: [dash, setpriv, "python3*"], decision: allow}
  - {name: workspace, program: ["WS/ok/*"], decision: allow}
  - {name: no-bad, program: ["WS/ok/bad*"], decision: deny}
  - {name: usr-true, program: [/usr/bin/true], decision: allow}
  - {name: loader, program: ["ld-linux*"], decision: allow}
"""


def test_names_not_utf8_links_to_the_loader_and_threads_exec_at_once(place: Path) -> None:
    """A copy of true named `bad\\xff` (denied by the `bad*` glob, allowed otherwise by the
    workspace glob) is refused by its name or a link's to it, a copy named `\\xffbad` runs; a link
    in the workspace to the dynamic loader (`ok/tool /usr/bin/id`) is the loader by the name it
    leads to (allowed by its own rule; the whole path judges what it loads: id refused, true run); eight threads of one process exec at once, one
    of them id: true runs, id never does, and nothing is left pinned wrong (no violation); an
    execve with a NULL argv runs true and refuses id."""
    ok = place / "ok"
    ok.mkdir()
    ok.chmod(0o777)
    shutil.copy("/usr/bin/true", ok / "good")
    body = f"""\
    ok = b"{ok}"
    for name in (b"/bad\\xff", b"/\\xffbad"):
        fd = os.open(ok + name, os.O_WRONLY | os.O_CREAT, 0o755)
        os.write(fd, open(ok + b"/good", "rb").read())
        os.close(fd)
    os.symlink(ok + b"/bad\\xff", ok + b"/link")
    os.symlink(b"/lib64/ld-linux-x86-64.so.2", ok + b"/tool")
    show("bad", run([ok + b"/bad\\xff"]))
    show("link", run([ok + b"/link"]))
    show("xffbad", run([ok + b"/\\xffbad"]))
    show("tool", run([ok + b"/tool", b"/usr/bin/id"]))
    show("tool_true", run([ok + b"/tool", b"/usr/bin/true"]))

    def null_argv(path):  # argv NULL: the kernel gives the program an argv of one empty string
        pid = os.fork()
        if pid == 0:
            libc.syscall(59, ctypes.c_char_p(path), None, None)
            os._exit(100 + ctypes.get_errno())
        return ended(os.waitpid(pid, 0)[1])

    show("null_true", null_argv(b"/usr/bin/true"))
    show("null_id", null_argv(b"/usr/bin/id"))

    def together(n):
        go = threading.Barrier(n)
        def one(i):
            go.wait()
            if i != n - 1:  # the last to reach the barrier goes on first: id
                child([b"/usr/bin/true", b"%d" % i])
            try:
                os.execv(b"/usr/bin/id", [b"/usr/bin/id"])
            except OSError as e:
                os.write(1, b"id-failed %d\\n" % e.errno)
        for i in range(n):
            threading.Thread(target=one, args=(i,)).start()
        time.sleep(60)  # killed by the exec that wins
        os._exit(99)
    outcomes = {{}}
    for _ in range(40):
        pid = os.fork()
        if pid == 0:
            together(8)
        how = ended(os.waitpid(pid, 0)[1])
        outcomes[how] = outcomes.get(how, 0) + 1
    print("threads", sorted(outcomes.items()), flush=True)
    show("threads", ("exit", outcomes.get(("exit", 0), 0)))
    """
    proc, _, events = _job(place, NAME_RULES.replace("WS", str(place)), body)
    out = proc.stdout
    assert "job=0" in out, out + proc.stderr
    assert _uid_lines(out) == [], out
    ended = _ended(out)
    assert ended["bad"] == ended["link"] == ended["tool"] == EACCES, out
    assert ended["xffbad"] == ended["tool_true"] == ended["null_true"] == ("exit", 0), out
    assert ended["null_id"] == EACCES, out
    assert ended["threads"] == ("exit", 40), out  # true won every time (id refused: its thread went on)
    refused = _refused(events)
    assert refused[f"{ok}/bad\\xff"].startswith("commands.rules[2]"), refused
    assert refused["/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"] == "commands.default", refused
    failed = [line for line in out.splitlines() if line.startswith("id-failed")]
    assert set(failed) <= {"id-failed 13"}, out  # EACCES, and only when refused (as recorded)
    id_denials = [
        d["data"].get("count", 1)
        for d in of_type(events, "policy.denial")
        if d["data"]["target"] == "/usr/bin/id"
    ]
    assert sum(id_denials) >= len(failed), (id_denials, out)
    assert of_type(events, "policy.violation") == []
