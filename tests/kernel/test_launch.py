"""The command launcher (agent/recorder/launch.py + exec_helper.py): `evidence run` starts the command
without preexec_fn, and the command gets exactly what it would get without evidence: the descriptors
evidence inherited, no blocked or ignored signals, its own pid; nothing of the launcher's own start
is recorded, and the run holds the command from its first exec."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.kernel.util import evidence, of_type, read_bundle


def test_the_command_gets_what_it_would_get_without_evidence(tmp_path: Path) -> None:
    r, w = os.pipe()
    os.write(w, b"from the caller")
    os.close(w)
    other, other_w = os.pipe()  # inherited by evidence but not named: the command does not get it
    bundle = tmp_path / "run.tar.gz"
    # cat changes no signal disposition: what it shows of itself is what the launcher left it
    cat = "/usr/bin/cat"
    command = (cat, "/proc/self/status", "/proc/self/cgroup", f"/dev/fd/{r}")
    proc = evidence("run", "--bundle", str(bundle), "--pass-fd", str(r), "--", *command, pass_fds=(r, other))
    os.close(r)
    os.close(other)
    os.close(other_w)
    assert proc.returncode == 0, proc.stderr
    status = dict(line.split(":\t", 1) for line in proc.stdout.splitlines() if ":\t" in line)
    assert proc.stdout.endswith("from the caller")  # named with --pass-fd (a jobserver's pipe): kept
    assert int(status["SigBlk"], 16) == 0 and int(status["SigIgn"], 16) == 0  # SIGPIPE at its default
    assert "/evidence/" in proc.stdout  # /proc/self/cgroup: in the run's cgroup
    bad = evidence("run", "--pass-fd", "97", "--", "true")
    assert bad.returncode == 2 and "--pass-fd 97" in bad.stderr and bad.stderr.count("\n") == 1
    manifest, events = read_bundle(bundle)
    pid = int(status["Pid"])
    assert of_type(events, "run.started")[0]["data"]["pid"] == pid
    execs = [e["data"] for e in of_type(events, "process.exec") if e["data"]["pid"] == pid]
    assert execs and execs[0]["filename"] == cat and execs[0]["depth"] == 0 and execs[0]["result"] == 0
    # the launcher's own interpreter start (sys.executable reading site-packages) is not in the run
    opens = of_type(events, "file.open")
    assert opens and not [e for e in opens if e["data"]["exe"] == os.path.realpath(sys.executable)]
    assert not [e for e in opens if "site-packages/evidence" in e["data"]["path"]]


def test_a_command_that_cannot_be_found_is_127_and_its_exec_recorded(tmp_path: Path) -> None:
    bundle = tmp_path / "run.tar.gz"
    proc = evidence("run", "--bundle", str(bundle), "--", "/nonexistent/tool", "x")
    assert proc.returncode == 127
    assert "cannot run '/nonexistent/tool'" in proc.stderr and "Traceback" not in proc.stderr
    _, events = read_bundle(bundle)
    failed = [e["data"] for e in of_type(events, "process.exec")]
    assert [(d["filename"], d["result"]) for d in failed] == [("/nonexistent/tool", "ENOENT")]


def test_only_stdio_reaches_the_command_unless_named(tmp_path: Path) -> None:
    r, w = os.pipe()
    proc = evidence(
        "run",
        "--bundle",
        str(tmp_path / "run.tar.gz"),
        "--",
        "/usr/bin/ls",
        "-l",
        "/proc/self/fd",
        pass_fds=(r, w),
    )
    os.close(r)
    os.close(w)
    assert proc.returncode == 0, proc.stderr
    targets = [line.split(" -> ", 1)[1] for line in proc.stdout.splitlines() if " -> " in line]
    fds = {int(line.split(" -> ")[0].split()[-1]) for line in proc.stdout.splitlines() if " -> " in line}
    assert fds - {0, 1, 2} == {3}, proc.stdout  # 3: ls's own listing; the caller's pipe is not passed
    # BCC's (kallsyms, BPF maps and programs, perf events), the spool, the launcher's pipes: none
    leaked = [
        t
        for t in targets
        if any(s in t for s in ("kallsyms", "anon_inode", "bpf", "evidence", "kernel-headers"))
    ]
    assert not leaked, proc.stdout


def test_the_recorder_is_protected_from_the_oom_killer_and_the_job_is_not(tmp_path: Path) -> None:
    """A job that fills memory must not get its recorder (or watchdog) killed first; the job itself
    keeps the score its caller had."""
    mine = Path("/proc/self/oom_score_adj").read_text().strip()
    proc = evidence(
        "run", "--bundle", str(tmp_path / "r.tar.gz"), "--", "sh", "-c",
        "cat /proc/self/oom_score_adj /proc/$PPID/oom_score_adj",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    job, parent = proc.stdout.split()
    assert job == mine  # sh's parent is the run's root (the sh itself): the job keeps its score
    assert parent == mine or int(parent) <= int(mine)
