#!/usr/bin/env python3
"""Recorder overhead, measured side by side in one run: untraced vs `evidence run` vs `strace -f`.

The headline is what a user waits for: the whole `evidence run` process's wall time against the
untraced command's (and the same after subtracting `evidence run -- true`, the fixed start cost),
with peak RSS and the tail (how long `evidence run` still ran after the command's work was done).
Beside it, the in-loop ratio: each workload (bench/workloads.c, compiled here) times its own loop and
prints the CLOCK_REALTIME time at which its work (children included) ended. Floods: 1M opens of one
path (standalone, --detail full, and through an `evidence agent` started here), 1M opens cycling over
10 paths, 2 processes x 1M opens of distinct paths (summary and full). Real builds of code that is
not ours: `pip wheel` of a C-extension sdist downloaded once from the package registry (not timed;
skipped, and said so, when the registry cannot be reached) and `python -m compileall` of a copy of
the stdlib, each run under `workloads run` so that it has the same tail and in-loop figures.
Command rules (case `exec-commands`): 5k fork+exec under `--policy` with a 20-rule `commands`
section against the same run under the same policy without it, interleaved, whole process wall and
peak RSS each; and the exec supervisor's own time per exec, from receiving the notification to
responding, as its process reports it (agent/recorder/exec_process.py, exec_supervisor.RoundTrips):
median and p99 of each run. Beside them, the floor of the mechanism on this machine: the same loop
untraced under the least supervisor there is (`workloads notify`, C: answers "go on" at once, and
again after busy-waiting the run's median round trip), since what a stopped exec costs here is not
only the supervisor's time: a virtual CPU left idle meanwhile is slow to wake.
The floor (bench/floor.py, case `floor`): the 300k open/close loop in-loop untraced, with empty
programs on openat's tracepoints, with a minimal recorder of a cgroup's opens, and under `evidence
run`, interleaved: how much of an open's cost is the tracepoints', any recorder's, and ours.

Run as root: `make bench` (or `.venv/bin/python bench/bench.py [--quick] [--cases open,open1m]
[--python PY]`; `--python` runs another checkout's interpreter, for before/after figures from one
session). Prints a table, the start costs, the checks and, last, each target of issue 9 with the
figure measured in this run and ok/MISS.

Exit code: 1 when a correctness check fails (a count that is not exact, events lost where none may
be, a bundle that does not verify, a build not seen), else 0. A missed speed or memory target is
printed as MISS but does not change the exit code: timings on a shared VM are not pass/fail.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import floor  # bench/floor.py, beside this file

HERE = Path(__file__).resolve().parent

# a C-extension sdist, built from source by `pip wheel`; 2.1.x builds with Debian 12's setuptools
# (66), MarkupSafe 3.x needs setuptools >= 77 (its license field)
SDIST = "MarkupSafe==2.1.5"


@dataclass(frozen=True)
class Case:
    label: str
    mode: str  # a workloads.c mode, or a build: "pip-wheel", "compileall"
    n: int = 0  # the loop's N (divided by 10 under --quick); builds have none
    opts: tuple[str, ...] = ()  # extra `evidence run` options
    agent: bool = False  # through `run --agent` (an agent started by the bench) instead of standalone


CASES = {
    "open": Case("300k open/close", "open", 300_000),
    "exec": Case("5k fork+exec /bin/true", "exec", 5_000),
    "connect": Case("20k loopback connects", "connect", 20_000),
    "open1m": Case("1M opens of one path", "open", 1_000_000),
    "open1m-agent": Case("1M opens, via agent", "open", 1_000_000, agent=True),
    "open1m-full": Case("1M opens, --detail full", "open", 1_000_000, ("--detail", "full")),
    "open10": Case("1M opens of 10 paths", "open10", 1_000_000),
    "distinct": Case("2 x 1M distinct paths", "distinct", 1_000_000),
    "distinct-full": Case("2 x 1M distinct, full", "distinct", 1_000_000, ("--detail", "full")),
    "exec-commands": Case("5k fork+exec, 20 rules", "exec", 5_000),
    "pip-wheel": Case(f"pip wheel {SDIST.split('=')[0]}", "pip-wheel"),
    "compileall": Case("compileall stdlib copy", "compileall"),
}
BUILDS = ("pip-wheel", "compileall")


# case exec-commands: the same policy without and with 20 command rules, none of which matches the
# workload's /bin/true (each exec is matched against all 20; `default: allow` lets it run): names,
# absolute paths, globs, args patterns and depths, as a CI policy's would be
POLICY_BASE = "version: 1\n"
COMMAND_RULES = [
    ("no-curl", "[curl, /usr/bin/curl]", None, None),
    ("no-wget", "wget", None, None),
    ("no-nc", "[nc, ncat, netcat, socat]", None, None),
    ("no-ssh", "[ssh, scp, sftp]", None, None),
    ("no-telnet", "[telnet, ftp, tftp]", None, None),
    ("no-rsync-remote", "rsync", '["*:*"]', None),
    ("no-force-push", "git", '[push, "*--force*"]', None),
    ("no-push-delete", "git", '[push, "*--delete*"]', None),
    ("no-npm-publish", "npm", "[publish]", None),
    ("no-twine", "twine", "[upload]", None),
    ("no-pip-index", "[pip, pip3]", '[install, "--index-url*"]', None),
    ("no-docker", "[docker, podman]", None, None),
    ("no-kubectl", "kubectl", None, None),
    ("no-sudo", "[sudo, su, doas]", None, None),
    ("no-debuggers", "[gdb, strace, ltrace]", None, None),
    ("no-shm-programs", '["/var/tmp/*", "/dev/shm/*"]', None, None),  # not /tmp: the workload is there
    ("no-shell-from-make", "[bash, zsh]", '["-c", "*curl*"]', None),
    ("no-deep-python", "[python3]", '["-c", "*socket*"]', "{min: 3}"),
    ("no-crontab", "[crontab, at]", None, None),
    ("no-mount", "[/usr/bin/mount, /usr/bin/umount]", None, "any"),
]


def commands_policy() -> str:
    lines = [POLICY_BASE.rstrip("\n"), "commands:", "  default: allow", "  rules:"]
    for name, program, args, depth in COMMAND_RULES:
        lines += [f"    - name: {name}", f"      program: {program}"]
        if args:
            lines.append(f"      args: {args}")
        if depth:
            lines.append(f"      depth: {depth}")
        lines.append("      decision: deny")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Sample:
    loop_ns: int  # the work's own time, as the workload prints it
    wall: float  # the whole process, s
    rss_kib: int  # peak RSS (wait4 in workloads.c `rss`: the process and the descendants it waited for)
    tail: float  # s from the end of the work (the workload's CLOCK_REALTIME) to the process's exit


@dataclass
class Row:
    case: str
    label: str
    bases: list[Sample]  # the untraced runs
    wall: float  # `evidence run` wall, median
    start: float  # the fixed start cost to subtract for -true: `run -- true` (or via the agent), median
    # of runs interleaved with the case's own (a drift of the VM between the case and the start-cost
    # rows, measured at the end, would otherwise land in -true)
    traced_loop_ns: float  # the traced runs' loop time, median
    rss: int
    tail: float  # traced, median
    strace: float
    events: int
    lost: int

    @property
    def base(self) -> float:  # untraced wall, median
        return statistics.median(b.wall for b in self.bases)

    @property
    def loop(self) -> float:  # in-loop ratio
        return self.traced_loop_ns / statistics.median(b.loop_ns for b in self.bases)

    @property
    def base_rss(self) -> int:
        return max(b.rss_kib for b in self.bases)

    @property
    def whole(self) -> float:
        return self.wall / self.base

    @property
    def minus_true(self) -> float:
        return (self.wall - self.start) / self.base

    @property
    def tail_per_m(self) -> float:  # the tail per million events in the bundle
        return self.tail / max(self.events, 1) * 1e6

    @property
    def rss_mb(self) -> float:
        return self.rss / 1024


def compile_workloads(out: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        sys.exit("bench: needs a C compiler (apt-get install gcc)")
    exe = out / "workloads"
    subprocess.run([cc, "-O2", "-o", str(exe), str(HERE / "workloads.c")], check=True)
    return exe


def wait_released(timeout: float = 60.0) -> None:
    """Wait until no earlier `evidence run` is still releasing its probes. Its `evidence-detach`
    child closes the tracepoints' perf events after it exited, one grace period each (seconds);
    while they are registered every system call on the machine costs more (a loop of opens: 13%,
    and 30% before the programs were detached first), so an untraced run measured then would make
    every ratio look better than it is."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = False
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text()
            except OSError:
                continue
            comm, _, rest = fields.partition("(")[2].rpartition(")")
            if comm == "evidence-detach" and rest.split()[0] != "Z":
                busy = True
                break
        if not busy:
            return
        time.sleep(0.1)


_RSS_WRAPPER: Path | None = None  # the compiled workloads, once made: measure's peak RSS goes through it


def measure(cmd: list[str], err_out: list[str] | None = None) -> Sample:
    """Run cmd to its end, its stdout and stderr to temp files, once no earlier run's probes are
    being released (wait_released). The tail is taken with the clock the workload printed its end
    with (CLOCK_REALTIME), right after wait4 returns."""
    wait_released()
    with (
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
        tempfile.NamedTemporaryFile("r") as peak,
    ):
        # the peak RSS through workloads.c `rss` (a small process forks the command): a child
        # spawned from here would start with this process's high-water mark
        how = [str(_RSS_WRAPPER), "rss", peak.name] if _RSS_WRAPPER is not None else []
        t = time.monotonic()
        p = subprocess.Popen([*how, *cmd], stdout=out, stderr=err)
        _, status, usage = os.wait4(p.pid, 0)
        exited_ns = time.time_ns()
        wall = time.monotonic() - t
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
        rss_kib = int(peak.read() or 0) if how else usage.ru_maxrss
    if p.returncode != 0:
        sys.exit(f"bench: {' '.join(cmd)} failed ({p.returncode}): {stderr.strip()[-500:]}")
    if err_out is not None:
        err_out.append(stderr)
    loop_ns, end_ns = (int(x) for x in stdout.strip().splitlines()[-1].split())
    return Sample(loop_ns, wall, rss_kib, (exited_ns - end_ns) / 1e9)


def iter_events(bundle: Path, type_: str) -> Iterator[dict[str, Any]]:
    """The bundle's events of one type, streamed (a full-detail flood has millions: never all in
    memory at once)."""
    needle = f'"{type_}"'.encode()
    with tarfile.open(bundle, "r:gz") as tar:
        f = tar.extractfile("events.ndjson")
        assert f is not None
        for line in f:
            if needle in line:
                e = json.loads(line)
                if e["type"] == type_:
                    yield e


def read_manifest(bundle: Path) -> dict[str, Any]:
    with tarfile.open(bundle, "r:gz") as tar:
        f = tar.extractfile("manifest.json")
        assert f is not None
        manifest: dict[str, Any] = json.loads(f.read())
        return manifest


def opens_by_path(bundle: Path, keep: set[str]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for e in iter_events(bundle, "dev.evidence.file.open"):
        if e["subject"] in keep:
            counts[e["subject"]] += e["data"]["count"]
    return counts


def builder_python(candidates: list[str]) -> str | None:
    """The first interpreter that has pip and setuptools (builds without build isolation)."""
    for py in candidates:
        if subprocess.run([py, "-c", "import setuptools, pip"], capture_output=True).returncode == 0:
            return py
    return None


def prepare_build(mode: str, work: Path, py: str | None, quick: bool) -> tuple[list[str], str]:
    """(the build's argv without its output dir, '') or ([], why it is skipped). What is downloaded
    or copied here is not timed."""
    if py is None:
        return [], "no interpreter with pip and setuptools"
    if mode == "pip-wheel":
        dl = work / "sdist"
        got = subprocess.run(
            [py, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", str(dl), SDIST],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        sdists = sorted(dl.glob("*.tar.gz")) if dl.is_dir() else []
        if got.returncode != 0 or not sdists:
            last = (got.stderr.strip().splitlines() or ["no sdist"])[-1][:160]
            return [], f"the package registry could not be reached (pip download {SDIST}: {last})"
        return [
            py,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-binary",
            ":all:",
            "--no-index",
            "--no-cache-dir",
            "-q",
            str(sdists[0]),
            "-w",
        ], ""
    stdlib = Path(
        sysconfig.get_paths(vars={"installed_base": sys.base_prefix, "base": sys.base_prefix})["stdlib"]
    )
    copy = work / "stdlib"
    if not copy.exists():
        shutil.copytree(
            stdlib,
            copy,
            symlinks=True,
            ignore=shutil.ignore_patterns("__pycache__", "site-packages", "dist-packages"),
        )
    # --quick: the top level only (-l), a smoke test
    return [py, "-m", "compileall", "-f", "-q", *(["-l"] if quick else []), str(copy)], ""


def stdlib_sources(copy: Path, quick: bool) -> set[str]:
    """The copy's .py files by the names a bundle gives them: an open is named by the kernel, so a
    file reached through a symlink (Debian's sitecustomize.py -> /etc/python3.11/) by its target."""
    found = copy.glob("*.py") if quick else copy.rglob("*.py")
    return {os.path.realpath(p) for p in found if p.is_file() and not any(d.is_symlink() for d in p.parents)}


class Agents:
    """One `evidence agent` per interpreter, started once for the bench (its probes stay attached
    while it runs, so it is started only after the standalone cases) and stopped at the end."""

    def __init__(self, pythons: list[str], work: Path) -> None:
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.socks: dict[str, Path] = {}
        for n, py in enumerate(pythons):
            sock = work / f"agent-{n}.sock"
            self.socks[py] = sock
            self.procs[py] = subprocess.Popen(
                [
                    py,
                    "-P",
                    "-m",
                    "evidence",
                    "agent",
                    "--socket",
                    str(sock),
                    "--bundle-dir",
                    str(work / f"agent-{n}"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + 180
        for py, agent in self.procs.items():
            probe = [
                py,
                "-P",
                "-m",
                "evidence",
                "run",
                "--agent",
                str(self.socks[py]),
                "--bundle",
                str(work / "ready.tar.gz"),
                "--",
                "/bin/true",
            ]
            while subprocess.run(probe, capture_output=True, check=False).returncode != 0:
                if agent.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    sys.exit("bench: the agent did not start")
                time.sleep(0.5)

    def peak_rss_kib(self, py: str) -> int:
        """The agent's own peak RSS so far (VmHWM): wait4 of a `run --agent` client does not see it."""
        for line in Path(f"/proc/{self.procs[py].pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        return 0

    def stop(self) -> None:
        for agent in self.procs.values():
            agent.terminate()
        for agent in self.procs.values():
            try:
                agent.wait(timeout=60)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a smoke test, not the targets: N / 10, one run of each case, fewer start-cost runs",
    )
    ap.add_argument("--repeat", type=int, help="runs of each case (default 3; --quick: 1)")
    ap.add_argument("--start-repeat", type=int, help="runs of each start-cost row (default 11; --quick: 3)")
    ap.add_argument(
        "--baseline",
        metavar="PY",
        help="another checkout's interpreter, measured in the start-cost rows beside --python (before/after)",
    )
    ap.add_argument(
        "--cases",
        default=",".join([*CASES, "floor"]),
        help=f"comma-separated, of {', '.join(CASES)}, floor (none: start costs only)",
    )
    ap.add_argument("--python", default=sys.executable, help="the interpreter that runs `-m evidence`")
    ap.add_argument("--no-strace", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench: run as root")
    args.repeat = max(1, args.repeat or (1 if args.quick else 3))
    args.start_repeat = max(1, args.start_repeat or (3 if args.quick else 11))
    cases = [c for c in args.cases.split(",") if c and c != "none"]
    with_floor = "floor" in cases
    cases = [c for c in cases if c != "floor"]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        sys.exit(f"bench: unknown case {', '.join(unknown)} (known: {', '.join(CASES)})")
    work = Path(tempfile.mkdtemp(prefix="evidence-bench-"))
    agents: Agents | None = None
    try:
        # the standalone cases first, with no agent's probes attached; then one agent per
        # interpreter for the cases through it and the start-cost rows
        ordered = [c for c in cases if not CASES[c].agent] + [c for c in cases if CASES[c].agent]
        rows: list[Row] = []
        skipped: list[tuple[str, str]] = []
        checks: list[tuple[str, object, object]] = []
        pythons = [*([args.baseline] if args.baseline else []), args.python]
        exe = compile_workloads(work)
        global _RSS_WRAPPER
        _RSS_WRAPPER = exe
        # the probe cache filled before any case: else the first traced run of the first case compiles
        # (seconds, and clang's memory in its peak RSS), which is the cold start row's figure, not a case's
        for py in pythons:
            subprocess.run(
                [py, "-P", "-m", "evidence", "run", "--bundle", str(work / "warm.tar.gz"), "--", "/bin/true"],
                capture_output=True,
                check=False,
            )
        builder = builder_python([sys.executable, args.python, "/usr/bin/python3"])
        floor_rows = run_floor(args, exe, work) if with_floor else None
        agent_rss = 0
        clean: dict[str, list[Sample]] = {}
        commands_rows: list[str] = []

        def untraced(case: str) -> list[Sample]:
            """A case's untraced runs, no agent's probes attached (none: the case is skipped)."""
            got = case_workload(case, args, exe, work, builder)
            return [] if isinstance(got, str) else [measure(got[0]) for _ in range(args.repeat)]

        for case in ordered:
            if CASES[case].agent and agents is None:
                # the untraced runs of the cases through the agent, before it starts: with its
                # probes attached every process pays for them, so they would flatter its ratios
                clean = {later: untraced(later) for later in ordered if CASES[later].agent}
                agents = Agents(pythons, work)
            if case == "exec-commands":
                row = run_commands_case(args, exe, work, checks, commands_rows)
            else:
                row = run_case(case, args, exe, work, builder, agents, checks, clean.get(case))
            if isinstance(row, str):
                skipped.append((CASES[case].label, row))
            else:
                rows.append(row)
        if agents is not None:  # started for a case through it
            agent_rss = agents.peak_rss_kib(args.python)
        if agents is None:
            agents = Agents(pythons, work)
        # fixed cost of a recorded run: standalone (probes from the compiled-probe cache, and
        # compiled as on a first start), and through the agent; each the whole process, median and
        # min of `--start-repeat` runs, interleaved so that a busy VM's drift hits all alike
        true_base = statistics.median(loop_wall(["/bin/true"]) for _ in range(args.repeat))
        starts = start_costs(pythons, agents.socks, work, args.start_repeat, 1 if args.quick else 3)
        true_rec = statistics.median(starts[ROW_WARM][args.python])
        true_agent = statistics.median(starts[ROW_AGENT][args.python])
        py_start = statistics.median(loop_wall([args.python, "-c", "pass"]) for _ in range(args.repeat))
        agents.stop()
        agents = None
        # the cases through the agent: untraced again now that its probes are gone, so that a
        # drift of the VM between their untraced runs (before it started) and their traced ones
        # does not all land on one side of the ratio
        for row in rows:
            if CASES[row.case].agent:
                row.bases.extend(untraced(row.case))

        print_table(rows, skipped, true_rec, true_agent, true_rec - true_base, py_start, agent_rss)
        print_starts(starts, pythons, args)
        if commands_rows:
            print("\n".join(commands_rows))
        if floor_rows is not None:
            print_floor(floor_rows, args)
        ok = print_checks(checks)
        print_targets({r.case: r for r in rows}, true_rec, true_agent, true_base, args.quick)
        return 0 if ok else 1
    finally:
        if agents is not None:
            agents.stop()
        shutil.rmtree(work, ignore_errors=True)


def case_workload(
    case: str, args: argparse.Namespace, exe: Path, work: Path, builder: str | None
) -> tuple[list[str], list[str]] | str:
    """(the case's command, the paths it opens when it names them), or why it is skipped."""
    c = CASES[case]
    n = c.n // (10 if args.quick else 1)
    paths: list[str] = []
    if c.mode in BUILDS:
        build, why = prepare_build(c.mode, work, builder, args.quick)
        if why:
            return why
        workload = [str(exe), "run", *build]
    elif c.mode == "open10":
        pdir = work / "open10"
        pdir.mkdir(exist_ok=True)
        for k in range(10):
            (pdir / f"f{k}").write_text(f"{k}\n")
            paths.append(str(pdir / f"f{k}"))
        workload = [str(exe), "open", str(n), *paths]
    else:
        workload = [str(exe), c.mode, str(n)]
    return workload, paths


def run_case(
    case: str,
    args: argparse.Namespace,
    exe: Path,
    work: Path,
    builder: str | None,
    agents: Agents | None,
    checks: list[tuple[str, object, object]],
    clean_bases: list[Sample] | None = None,
) -> Row | str:
    """Measure one case, untraced and traced runs alternating (so drift in a noisy VM hits both
    alike); append its checks; return its row, or why it was skipped. `clean_bases`: its untraced
    runs, measured before (a case through the agent: not while the agent's probes are attached)."""
    c = CASES[case]
    evidence = [args.python, "-P", "-m", "evidence"]
    n = c.n // (10 if args.quick else 1)
    got = case_workload(case, args, exe, work, builder)
    if isinstance(got, str):
        return got
    workload, paths = got
    if c.agent:
        assert agents is not None
        how = ["--agent", str(agents.socks[args.python])]
    else:
        run_help = subprocess.run([*evidence, "run", "--help"], capture_output=True, text=True).stdout
        how = ["--standalone"] if "--standalone" in run_help else []  # never through an agent
    bases: list[Sample] = list(clean_bases or [])
    traced: list[Sample] = []
    trues: list[float] = []
    bundle = work / f"{case}.tar.gz"
    run_true = [*evidence, "run", *how, "--bundle", str(work / f"{case}-true.tar.gz"), "--", "/bin/true"]
    for i in range(args.repeat):
        out = (
            [str(work / f"{case}-out-{i}-{side}") for side in ("base", "run")]
            if c.mode == "pip-wheel"
            else []
        )
        if clean_bases is None:
            bases.append(measure([*workload, *out[:1]]))
        trues.append(loop_wall(run_true))
        bundle = work / f"{case}-{i}.tar.gz"
        traced.append(
            measure([*evidence, "run", *how, "--bundle", str(bundle), *c.opts, "--", *workload, *out[1:]])
        )
        if i:  # keep the last bundle only (a full-detail flood's is large)
            (work / f"{case}-{i - 1}.tar.gz").unlink(missing_ok=True)
    manifest = read_manifest(bundle)
    lost = manifest["lost"]["total"]
    lint = subprocess.run([*evidence, "lint", str(bundle)], capture_output=True, check=False).returncode
    # strace on a tenth of the loop (it is ~50x slower), compared per operation
    base_ns = statistics.median(b.loop_ns for b in bases)
    sn = max(1, n // 10)
    s_ratio = float("nan")
    if (
        shutil.which("strace")
        and not args.no_strace
        and c.mode in ("open", "open10", "exec", "connect")
        and not c.agent
    ):
        s_ns = measure(
            ["strace", "-f", "-qq", "-o", "/dev/null", *workload[:2], str(sn), *workload[3:]]
        ).loop_ns
        s_ratio = (s_ns / sn) / (base_ns / n)
    checks.append((f"{c.label}: bundle verifies (lint exit 0 or 1)", lint in (0, 1), True))
    full = "full" in c.opts
    if c.mode == "open":
        got = opens_by_path(bundle, {"/etc/hostname"})["/etc/hostname"]
        if full:  # every operation kept, or counted as lost (the target: stated)
            checks.append((f"{c.label}: opens recorded + lost", got + lost, n))
        else:
            checks.append((f"{c.label}: opens of /etc/hostname counted", got, n))
    elif c.mode == "open10":
        counts = opens_by_path(bundle, set(paths))
        want = {p: n // 10 + (k < n % 10) for k, p in enumerate(paths)}
        wrong = {Path(p).name: counts[p] for p in paths if counts[p] != want[p]}
        checks.append((f"{c.label}: each path's opens counted exactly ({n // 10} each)", wrong, {}))
    elif c.mode == "exec":
        execs = [
            e
            for e in iter_events(bundle, "dev.evidence.process.exec")
            if e["data"]["argv"] == ["/bin/true", "bench-arg"] and e["data"]["result"] == 0
        ]
        checks.append((f"{c.label}: execs captured with argv", len(execs), n))
        sha = hashlib.sha256(Path("/bin/true").read_bytes()).hexdigest()
        hashed = sum(1 for e in execs if e["data"].get("sha256") == sha)
        checks.append((f"{c.label}: execs with the sha256 of /bin/true", hashed, n))
    elif c.mode == "connect":
        conns = [e for e in iter_events(bundle, "dev.evidence.network.connect") if e["data"]["result"] == 0]
        checks.append((f"{c.label}: connects counted", sum(e["data"]["count"] for e in conns), n))
    elif c.mode == "distinct":
        opens = sum(
            e["data"]["count"]
            for e in iter_events(bundle, "dev.evidence.file.open")
            if e["subject"].startswith("/nonexistent/p")
        )
        # every open is in the bundle or counted (lost, or past a cap): never silence
        checks.append((f"{c.label}: opens recorded + counted as not kept >= 2N", opens + lost >= 2 * n, True))
    elif c.mode == "pip-wheel":
        wheels = list(Path(f"{work}/{case}-out-{args.repeat - 1}-run").glob("*.whl"))
        checks.append((f"{c.label}: a wheel built under `evidence run`", len(wheels), 1))
        cc = sum(
            1
            for e in iter_events(bundle, "dev.evidence.process.exec")
            if any(a.endswith("_speedups.c") for a in e["data"]["argv"])
        )
        checks.append((f"{c.label}: the compiler's exec on _speedups.c recorded", cc >= 1, True))
    elif c.mode == "compileall":
        sources = stdlib_sources(work / "stdlib", args.quick)
        seen = opens_by_path(bundle, sources)
        checks.append((f"{c.label}: every .py of the copy seen opened", len(sources - set(seen)), 0))
    if c.mode != "distinct" and not full:
        checks.append((f"{c.label}: events lost", lost, 0))
    return Row(
        case=case,
        label=c.label,
        bases=bases,
        wall=statistics.median(t.wall for t in traced),
        start=statistics.median(trues),
        traced_loop_ns=statistics.median(t.loop_ns for t in traced),
        rss=max(t.rss_kib for t in traced),
        tail=statistics.median(t.tail for t in traced),
        strace=s_ratio,
        events=manifest["events"],
        lost=lost,
    )


def run_commands_case(
    args: argparse.Namespace,
    exe: Path,
    work: Path,
    checks: list[tuple[str, object, object]],
    out: list[str],
) -> Row | str:
    """Case exec-commands: untraced, `--policy` without and with the 20 rules, interleaved; the
    row is the run with the rules (its -true: `run --policy` with them, of /bin/true), `out` gets
    the side-by-side lines and the supervisor's round trip."""
    c = CASES["exec-commands"]
    n = c.n // (10 if args.quick else 1)
    evidence = [args.python, "-P", "-m", "evidence"]
    workload = [str(exe), "exec", str(n)]
    plain, ruled = work / "policy-base.yaml", work / "policy-commands.yaml"
    plain.write_text(POLICY_BASE)
    ruled.write_text(commands_policy())
    run_help = subprocess.run([*evidence, "run", "--help"], capture_output=True, text=True).stdout
    how = ["--standalone"] if "--standalone" in run_help else []
    bases: list[Sample] = []
    without: list[Sample] = []
    with_rules: list[Sample] = []
    floors: list[Sample] = []  # under the least supervisor there is (workloads.c notify), at once
    floors_rt: list[tuple[float, Sample]] = []  # the same taking the run's round trip before answering
    trues: list[float] = []
    errs: list[str] = []
    bundle = work / "exec-commands.tar.gz"
    for i in range(args.repeat):
        bases.append(measure(workload))
        floors.append(measure([str(exe), "notify", "0", *workload]))
        without.append(
            measure(
                [
                    *evidence,
                    "run",
                    *how,
                    "--policy",
                    str(plain),
                    "--bundle",
                    str(work / f"ec-base-{i}.tar.gz"),
                    "--",
                    *workload,
                ]
            )
        )
        bundle = work / f"exec-commands-{i}.tar.gz"
        with_rules.append(
            measure(
                [
                    *evidence,
                    "-v",
                    "run",
                    *how,
                    "--policy",
                    str(ruled),
                    "--bundle",
                    str(bundle),
                    "--",
                    *workload,
                ],
                errs,
            )
        )
        last = errs[-1].splitlines() if errs else []
        this_run, _ = _round_trip_figures([line for line in last if "execs decided" in line])
        if this_run:
            floors_rt.append((this_run[0], measure([str(exe), "notify", str(round(this_run[0])), *workload])))
        trues.append(
            loop_wall(
                [
                    *evidence,
                    "run",
                    *how,
                    "--policy",
                    str(ruled),
                    "--bundle",
                    str(work / "ec-true.tar.gz"),
                    "--",
                    "/bin/true",
                ]
            )
        )
    manifest = read_manifest(bundle)
    lost = manifest["lost"]["total"]
    round_trip = [
        line
        for e in errs
        for line in e.splitlines()
        if "exec supervisor:" in line and "execs decided" in line
    ]
    enforced = bool(round_trip)
    checks.append(
        (f"{c.label}: the exec supervisor decided the execs (wired into `evidence run`)", enforced, True)
    )
    execs = [
        e
        for e in iter_events(bundle, "dev.evidence.process.exec")
        if e["data"]["argv"] == ["/bin/true", "bench-arg"] and e["data"]["result"] == 0
    ]
    checks.append((f"{c.label}: execs captured with argv", len(execs), n))
    refused = sum(1 for _ in iter_events(bundle, "dev.evidence.policy.denial"))
    checks.append((f"{c.label}: no exec refused (no rule matches /bin/true)", refused, 0))
    checks.append((f"{c.label}: events lost", lost, 0))
    med = statistics.median
    w0, w1 = med(s.wall for s in without), med(s.wall for s in with_rules)
    r0, r1 = max(s.rss_kib for s in without), max(s.rss_kib for s in with_rules)
    out.append(
        f"\ncommand rules, {n} fork+exec of /bin/true, whole process, median of {args.repeat} (interleaved):"
        f"\n  untraced                         {med(s.wall for s in bases):>7.2f} s"
        f"\n  --policy without `commands`      {w0:>7.2f} s  peak RSS {r0 / 1024:>5.0f} MB"
        f"\n  --policy with 20 command rules   {w1:>7.2f} s  peak RSS {r1 / 1024:>5.0f} MB"
        f"  ({(w1 - w0) / n * 1e6:+.0f} us per exec, {w1 / w0:.2f}x)"
    )
    out.append(
        f"  supervisor round trip per exec, notification read to response sent ({len(round_trip)} runs):"
        + (
            "".join(f"\n    {line.split('response sent: ', 1)[-1]}" for line in round_trip)
            if enforced
            else " no line: commands not enforced by this build"
        )
    )
    medians, p99s = _round_trip_figures(round_trip)
    if medians:
        out.append(
            f"  supervisor round trip, median of the runs' medians {statistics.median(medians):.0f} us, "
            f"of their p99s {statistics.median(p99s):.0f} us"
        )
    # what user notification itself costs here: the same loop under a C supervisor that does
    # nothing but answer, at once and after as much busy time as ours took (the wake-ups of an idle
    # virtual CPU grow with that time): the part of the cost ours could still cut is the rest
    b0 = med(s.wall for s in bases)
    f0 = med(s.wall for s in floors)
    out.append(
        f"  the floor, untraced, under a C supervisor answering at once:       {f0:>7.2f} s"
        f"  ({(f0 - b0) / n * 1e6:+.0f} us per exec, {f0 / b0:.2f}x untraced)"
    )
    if floors_rt:
        rt = med(r for r, _ in floors_rt)
        f1 = med(s.wall for _, s in floors_rt)
        out.append(
            f"  the floor, untraced, answering after the round trip ({rt:.0f} us):  {f1:>7.2f} s"
            f"  ({(f1 - b0) / n * 1e6:+.0f} us per exec, {f1 / b0:.2f}x untraced; ours"
            f" {(w1 - w0) / n * 1e6:+.0f} us, {w1 / w0:.2f}x)"
        )
    return Row(
        case="exec-commands",
        label=c.label,
        bases=bases,
        wall=w1,
        start=med(trues),
        traced_loop_ns=med(s.loop_ns for s in with_rules),
        rss=r1,
        tail=med(s.tail for s in with_rules),
        strace=float("nan"),
        events=manifest["events"],
        lost=lost,
    )


def _round_trip_figures(lines: list[str]) -> tuple[list[float], list[float]]:
    """Each run's median and p99 round trip (us) from the supervisor's lines (RoundTrips.line_of)."""
    medians: list[float] = []
    p99s: list[float] = []
    for line in lines:
        m = re.search(r"median ([0-9.]+) us, p99 ([0-9.]+) us", line)
        if m:
            medians.append(float(m.group(1)))
            p99s.append(float(m.group(2)))
    return medians, p99s


def print_table(
    rows: list[Row],
    skipped: list[tuple[str, str]],
    true_rec: float,
    true_agent: float,
    true_adds: float,
    py_start: float,
    agent_rss: int,
) -> None:
    print(
        f"\n{'workload':<24}{'untraced s':>11}{'run s':>8}{'whole':>8}{'-true':>8}{'in-loop':>9}"
        f"{'tail s':>8}{'RSS MB':>8}{'run RSS':>9}{'strace':>8}{'events':>9}{'lost':>9}"
    )
    for r in rows:
        strace = f"{r.strace:>7.1f}x" if r.strace == r.strace else f"{'-':>8}"  # NaN: not run
        print(
            f"{r.label:<24}{r.base:>11.2f}{r.wall:>8.2f}{r.whole:>7.2f}x{r.minus_true:>7.2f}x{r.loop:>8.2f}x"
            f"{r.tail:>8.2f}{r.base_rss / 1024:>8.0f}{r.rss / 1024:>9.0f}{strace}{r.events:>9}{r.lost:>9}"
        )
    for label, why in skipped:
        print(f"{label:<24} skipped: {why}")
    print(
        "\nwhole: `evidence run` process wall / untraced process wall; -true: the same after subtracting"
        " `evidence run -- true` (run beside\neach case's runs, the same way: standalone or through the"
        f" agent; at the end, {true_rec:.2f} s and {true_agent:.2f} s); in-loop: the workload's own\nloop"
        " time, traced / untraced; tail: from the"
        "\nend of the command's work (its children waited for) to `evidence run`'s exit. RSS: peak (wait4 by a small process that forks it;"
        " through the agent, the client's"
        + (f":\nthe agent's own peak was {agent_rss / 1024:.0f} MB" if agent_rss else "")
        + f"). `evidence run -- true` adds {true_adds:.2f} s (starting Python alone: {py_start:.2f} s)."
        "\nBuilds run under `workloads run`. The cases through the agent ran with its probes attached;"
        " their untraced runs were measured\nbefore it started and after it stopped (with them attached"
        " every process pays)."
        " Every run waits for the release of the run before it."
    )


def print_starts(
    starts: dict[str, dict[str, list[float]]], pythons: list[str], args: argparse.Namespace
) -> None:
    print(f"\nstart and end, whole process wall, median / min of {args.start_repeat} runs (interleaved):")
    print(f"  {'':<46}" + "".join(f"{'baseline' if py == args.baseline else 'this':>22}" for py in pythons))
    for name, per in starts.items():
        cells = "".join(f"{statistics.median(w):>11.3f} /{min(w):>6.3f} s" for w in per.values())
        print(f"  {name:<46}{cells}")
    if args.baseline:
        print(f"  baseline: {args.baseline}\n  this:     {args.python}")


def run_floor(args: argparse.Namespace, exe: Path, work: Path) -> dict[str, list[float]]:
    """The floor under the 300k open/close loop (bench/floor.py): its in-loop seconds untraced, with
    empty programs on openat, with a minimal recorder and under `evidence run`, interleaved."""
    n = CASES["open"].n // (10 if args.quick else 1)
    bundle = str(work / "floor.tar.gz")
    evidence = [args.python, "-P", "-m", "evidence", "run", "--standalone", "--bundle", bundle, "--"]

    def loop_s(cmd: list[str]) -> float:
        return measure(cmd).loop_ns / 1e9

    return floor.in_loop(loop_s, [str(exe), "open", str(n)], evidence, args.repeat)


def print_floor(rows: dict[str, list[float]], args: argparse.Namespace) -> None:
    base = statistics.median(rows[floor.ROWS[0]])
    n = CASES["open"].n // (10 if args.quick else 1)
    print(f"\nthe floor under {n:,} open/close (in-loop, median of {args.repeat} rounds, interleaved):")
    for name, times in rows.items():
        t = statistics.median(times)
        print(f"  {name:<28}{t:>7.3f} s {t / base:>6.2f}x {(t - base) / n * 1e6:>6.2f} us an open")
    print("  (bench/floor.bpf.c: the tracepoints alone, then the least a recorder of a cgroup's opens does)")


def print_checks(checks: list[tuple[str, object, object]]) -> bool:
    print("\nchecks:")
    ok = True
    for name, got, want in checks:
        good = got == want
        ok &= good
        print(f"  {'ok  ' if good else 'FAIL'} {name}: {got} (want {want})")
    return ok


def print_targets(
    rows: dict[str, Row], true_rec: float, true_agent: float, true_base: float, quick: bool
) -> None:
    """Issue 9's targets, each with the figure of this run and the untraced baseline it was measured
    against. Not part of the exit code."""
    targets: list[tuple[str, float | None, float, str, str]] = []  # (what, got, limit, unit, detail)

    def add(what: str, case: str, value: str, limit: float, unit: str) -> None:
        r = rows.get(case)
        if r is None:
            targets.append((what, None, limit, unit, f"case {case} not run"))
            return
        if value == "minus_true":
            detail = f"run {r.wall:.2f} s - run -- true {r.start:.2f} s, untraced {r.base:.2f} s"
        elif value == "whole":
            detail = f"run {r.wall:.2f} s, untraced {r.base:.2f} s"
        elif value == "rss_mb":
            detail = f"untraced {r.base_rss / 1024:.0f} MB"
        elif value == "tail":
            detail = f"run {r.wall:.2f} s, untraced {r.base:.2f} s"
        elif value == "tail_per_m":
            detail = (
                f"tail {r.tail:.2f} s for {r.events:,} events; run {r.wall:.2f} s, untraced {r.base:.2f} s"
            )
        else:
            detail = f"{r.events} events"
        targets.append((what, float(getattr(r, value)), limit, unit, detail))

    add("1M one path, standalone: (whole - run -- true) / untraced", "open1m", "minus_true", 1.5, "x")
    add("1M one path, standalone: tail after the command exits", "open1m", "tail", 0.3, " s")
    add("1M one path, standalone: events lost", "open1m", "lost", 0, "")
    add("1M one path, through an agent: whole / untraced", "open1m-agent", "whole", 1.5, "x")
    add("1M one path, through an agent: tail", "open1m-agent", "tail", 0.3, " s")
    add("1M one path, through an agent: events lost", "open1m-agent", "lost", 0, "")
    add("300k open/close: (whole - run -- true) / untraced", "open", "minus_true", 1.4, "x")
    add("5k fork+exec: (whole - run -- true) / untraced", "exec", "minus_true", 1.4, "x")
    add("2 x 1M distinct, summary: whole / untraced", "distinct", "whole", 2.0, "x")
    add("2 x 1M distinct, summary: peak RSS of `evidence run`", "distinct", "rss_mb", 400, " MB")
    add("1M opens of 10 paths, summary: tail", "open10", "tail", 0.3, " s")
    # issue 27: full detail at the kernel's pace (the tail per million events, whatever their names)
    add("1M one path, --detail full: tail per 1M events", "open1m-full", "tail_per_m", 1.0, " s")
    add("1M one path, --detail full: peak RSS of `evidence run`", "open1m-full", "rss_mb", 300, " MB")
    add("2 x 1M distinct, full: tail per 1M events", "distinct-full", "tail_per_m", 1.0, " s")
    add("2 x 1M distinct, full: peak RSS of `evidence run`", "distinct-full", "rss_mb", 300, " MB")
    add("2 x 1M distinct, full: whole / untraced", "distinct-full", "whole", 5.0, "x")
    add("2 x 1M distinct, full: events lost (every operation kept)", "distinct-full", "lost", 0, "")
    targets.append(
        (
            "standalone `evidence run -- true`, median",
            true_rec,
            1.0,
            " s",
            f"untraced /bin/true {true_base:.3f} s",
        )
    )
    targets.append(("`evidence run --agent SOCK -- true`, median", true_agent, 0.2, " s", "the client alone"))
    print(f"\ntargets (issues 9 and 27; {'--quick: small N, not the targets' if quick else 'this run'}):")
    for what, got, limit, unit, detail in targets:
        if got is None:
            print(f"  ---- {what}: not measured ({detail})")
            continue
        fmt = {"": ".0f", " MB": ".0f", "x": ".3f", " s": ".3f"}[unit]
        want = f"target {limit:g}" if unit == "" else f"target <= {limit:g}{unit}"
        print(f"  {'ok  ' if got <= limit else 'MISS'} {what}: {got:{fmt}}{unit} ({want}; {detail})")
    print("  (lint 1M <= 5 s, diff 1M <= 10 s: bench/bundles.py, which `make bench` runs next)")


ROW_WARM = "run -- true"
ROW_COLD = "run -- true, probe cache off (a first start)"
ROW_AGENT = "run --agent SOCK -- true"


def start_costs(
    pythons: list[str], socks: dict[str, Path], work: Path, repeat: int, cold: int
) -> dict[str, dict[str, list[float]]]:
    """Wall times of `run -- true` per interpreter (a checkout each), interleaved run by run so that
    a busy VM's drift hits all alike: standalone with the probe cache warm (the usual start), with it
    off (what a first start after a probe or kernel change costs: BCC compiles), and through the
    bench's agent of the same checkout (`run --agent`: the client alone; the agent's probes are
    loaded already). A checkout without the probe cache ignores EVIDENCE_PROBE_CACHE: both of its
    standalone rows compile."""
    bundle = str(work / "true.tar.gz")
    cold_env = {**os.environ, "EVIDENCE_PROBE_CACHE": "0"}
    cmds: dict[str, tuple[list[str], list[str]]] = {}
    for py in pythons:
        evidence = [py, "-P", "-m", "evidence"]
        help_ = subprocess.run([*evidence, "run", "--help"], capture_output=True, text=True).stdout
        standalone = ["--standalone"] if "--standalone" in help_ else []
        run_true = [*evidence, "run", *standalone, "--bundle", bundle, "--", "/bin/true"]
        via_agent = [*evidence, "run", "--agent", str(socks[py]), "--bundle", bundle, "--", "/bin/true"]
        cmds[py] = (run_true, via_agent)
        loop_wall(run_true)  # fills the probe cache, if it was empty
    out: dict[str, dict[str, list[float]]] = {
        row: {py: [] for py in pythons} for row in (ROW_WARM, ROW_COLD, ROW_AGENT)
    }
    for i in range(repeat):
        for py, (run_true, via_agent) in cmds.items():
            out[ROW_WARM][py].append(loop_wall(run_true))
            if i < cold:  # each compiles for seconds: three are enough
                out[ROW_COLD][py].append(loop_wall(run_true, cold_env))
            out[ROW_AGENT][py].append(loop_wall(via_agent))
    return out


def loop_wall(cmd: list[str], env: dict[str, str] | None = None) -> float:
    wait_released()
    t = time.monotonic()
    subprocess.run(cmd, capture_output=True, check=False, env=env)
    return time.monotonic() - t


if __name__ == "__main__":
    sys.exit(main())
