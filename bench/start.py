"""Where `evidence run -- true`'s start goes (issue 27 "Start"): ways of starting the same run, side
by side, interleaved run by run (the VM is shared: never compare walls taken at different times),
each with its wall and its CPU time (user + system of the whole process tree, from wait4's rusage:
what the run costs, whatever the other engineers' load does to the wall).

    .venv/bin/python bench/start.py                 # the default ways, 7 runs each
    .venv/bin/python bench/start.py -n 11 bench user-tty
    .venv/bin/python bench/start.py --profile user  # one run under pyinstrument (pip install pyinstrument)
    .venv/bin/python bench/start.py --phases user   # where a start's wall and CPU go, function by function
    .venv/bin/python bench/start.py --programs      # each program's load: the verifier's CPU and work

The ways:
  bench       what `make bench` times: `python -P -m evidence run --bundle X -- /bin/true`, output captured
  user        what a user types: `.venv/bin/evidence run -- true` (the console script; the bundle in the cwd)
  user-tty    the same on a terminal (a pty for stdin, stdout and stderr)
  cold-pyc    `user` with Python's bytecode cache bypassed (PYTHONDONTWRITEBYTECODE and a fresh
              PYTHONPYCACHEPREFIX: every module compiled, as on a first start after an install)
  no-cache    `user` with the probe cache off (EVIDENCE_PROBE_CACHE=0: BCC compiles, a first start
              after a probe or kernel change)
  settled     `user` once no earlier run's `evidence-detach` is still closing its perf events (what
              `make bench` waits for before each run; `user` starts right after the way before it,
              as a user's second run, or one right after `make demo`, does)
  held        `user` while another process holds the same probes loaded (as `make bench`'s agent does
              while the bench measures its start rows): every tracepoint is enabled already, so
              attaching and detaching do not patch the kernel's text nor wait for RCU
  module      `python -m evidence run -- true` of this checkout; `before`: the same of --before DIR
  python      `python -c pass`, and `import evidence.cli` (the interpreter's and the imports' share)
"""

from __future__ import annotations

import argparse
import os
import pty
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv" / "bin"
PY = str(VENV / "python")
BEFORE = [""]  # --before: another checkout (a `git archive` of it, bytecode compiled), way `before`


def _way(name: str, work: Path) -> tuple[list[str], dict[str, str], bool]:
    """(argv, environment, on a pty) of one way."""
    env = dict(os.environ)
    env.pop("PYTHONPYCACHEPREFIX", None)
    if name == "bench":
        return (
            [PY, "-P", "-m", "evidence", "run", "--bundle", str(work / "b.tar.gz"), "--", "/bin/true"],
            env,
            False,
        )
    if name in ("user", "user-tty"):
        return [str(VENV / "evidence"), "run", "--", "true"], env, name == "user-tty"
    if name == "cold-pyc":
        prefix = tempfile.mkdtemp(prefix="pyc-", dir=work)
        env |= {"PYTHONPYCACHEPREFIX": prefix}
        return [str(VENV / "evidence"), "run", "--", "true"], env, False
    if name in ("held", "settled"):
        return [str(VENV / "evidence"), "run", "--", "true"], env, False
    if name in ("module", "before"):  # `python -m evidence`: this checkout's, or --before's
        if name == "before":
            env["PYTHONPATH"] = BEFORE[0]
        return [PY, "-m", "evidence", "run", "--", "true"], env, False
    if name == "no-cache":
        return [str(VENV / "evidence"), "run", "--", "true"], env | {"EVIDENCE_PROBE_CACHE": "0"}, False
    if name == "python":
        return [PY, "-c", "pass"], env, False
    if name == "imports":
        return [PY, "-c", "import evidence.cli, evidence.agent.commands.run_standalone"], env, False
    raise SystemExit(f"start.py: no way {name!r}")


def run_once(argv: list[str], env: dict[str, str], tty: bool, cwd: Path) -> tuple[float, float, int]:
    """(wall s, CPU s of the process tree, exit status) of one run."""
    if tty:
        master, slave = pty.openpty()
        stdio: dict[str, int] = {"stdin": slave, "stdout": slave, "stderr": slave}
    else:  # captured, as the bench's subprocess.run(capture_output=True): not a terminal
        master = -1
        captured = os.open(tempfile.gettempdir(), os.O_TMPFILE | os.O_RDWR)
        stdio = {"stdin": subprocess.DEVNULL, "stdout": captured, "stderr": captured}
    t = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, cwd=cwd, **stdio)  # type: ignore[call-overload]
    if tty:
        os.close(slave)
        while True:  # drain the terminal as a terminal would
            try:
                if not os.read(master, 65536):
                    break
            except OSError:
                break
    else:
        os.close(captured)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    proc.returncode = os.waitstatus_to_exitcode(status)
    if master >= 0:
        os.close(master)
    return wall, usage.ru_utime + usage.ru_stime, proc.returncode


# --phases: the run inside this driver, with these functions timed (wall, and CPU of the thread that
# calls them: the probes load in a thread of their own, and their programs on two: load_func and
# attach_tracepoint add up both threads' time), by wrapping them; nothing in evidence changes
PHASES = [
    ("evidence.agent.commands.run_standalone", "StandaloneRun.__init__"),
    ("evidence.agent.commands.run_standalone", "StandaloneRun.prepare"),
    ("evidence.agent.commands.run_standalone", "_load_probes"),
    ("evidence.agent.recorder.kernel", "kernel_ready"),
    ("evidence.agent.recorder.run", "open_recorder"),
    ("evidence.probes.loader", "ensure_headers"),
    ("evidence.probes.loader", "detect_config"),
    ("evidence.probes.loader", "render"),
    ("evidence.probes.objcache", "load"),
    ("evidence.probes.objcache", "cached_object"),
    ("evidence.probes.bpfsys", "LoadedObject.__init__"),
    ("evidence.probes.objcache", "load_side_by_side"),
    ("evidence.probes.bpfsys", "LoadedObject.load_func"),
    ("evidence.probes.bpfsys", "LoadedObject.attach_tracepoint"),
    ("evidence.probes.bpfsys", "LoadedObject.attach_raw_tracepoint"),
    ("evidence.agent.recorder.launch", "Launcher.__init__"),
    ("evidence.agent.commands.run_standalone", "StandaloneRun.launch"),
    ("evidence.agent.commands.run_standalone", "StandaloneRun.wait"),
    ("evidence.agent.commands.run_standalone", "StandaloneRun.finish"),
    ("evidence.agent.commands.run_standalone", "StandaloneRun.close"),
]

DRIVER = """
import atexit, functools, importlib, sys, threading, time
T0, C0 = time.perf_counter(), time.process_time()
import evidence.cli
import evidence.agent.commands.run_standalone
T1, C1 = time.perf_counter(), time.process_time()
PHASES = %r
seen = {}
lock = threading.Lock()  # the programs load and attach on two threads
def wrap(label, fn):
    @functools.wraps(fn)
    def timed(*a, **kw):
        w, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **kw)
        finally:
            with lock:
                n, tw, tc = seen.get(label, (0, 0.0, 0.0))
                seen[label] = (n + 1, tw + time.perf_counter() - w, tc + time.thread_time() - c)
    return timed
for mod, name in PHASES:
    m = importlib.import_module(mod)
    owner, _, attr = name.rpartition(".")
    where = getattr(m, owner) if owner else m
    setattr(where, attr, wrap(name, getattr(where, attr)))
def report():
    out = sys.stderr
    print(f"phases: imports (evidence.cli, run_standalone): wall {T1 - T0:.3f} CPU {C1 - C0:.3f}", file=out)
    for mod, name in PHASES:
        if name in seen:
            n, w, c = seen[name]
            print(f"phases: {name:40} x{n:<3} wall {w:.3f} CPU {c:.3f}", file=out)
    print(f"phases: whole process: wall {time.perf_counter() - T0:.3f} CPU {time.process_time() - C0:.3f}", file=out)
atexit.register(report)
sys.argv = ["evidence", *sys.argv[1:]]
sys.exit(evidence.cli.entry())
"""


def phases(way: str, work: Path, n: int) -> None:
    """`n` runs of WAY's command inside the timing driver; each phase's median wall and CPU."""
    argv, env, _ = _way(way, work)
    args = argv[argv.index("run") :]
    table: dict[str, list[tuple[float, float]]] = {}
    for _ in range(n + 1):
        out = subprocess.run(
            [PY, "-c", DRIVER % (PHASES,), *args],
            env=env,
            cwd=work,
            capture_output=True,
            text=True,
            check=False,
        )
        _clean(work)
        for line in out.stderr.splitlines():
            if not line.startswith("phases: "):
                continue
            label, _, rest = line[8:].partition(" wall ")
            wall, _, cpu = rest.partition(" CPU ")
            table.setdefault(label.strip(), []).append((float(wall), float(cpu)))
    print(f"{'phase':58} {'wall med':>9} {'CPU med':>8} {'CPU min':>8}  ({n} runs after one)")
    for label, rows in table.items():
        rows = rows[1:] or rows  # the first run fills what is filled once
        print(
            f"{label:58} {statistics.median(r[0] for r in rows):9.3f}"
            f" {statistics.median(r[1] for r in rows):8.3f} {min(r[1] for r in rows):8.3f}"
        )


def detaching() -> int:
    """How many `evidence-detach` processes (an earlier run's perf events being closed) there are."""
    n = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            comm, _, rest = stat.read_text().partition("(")[2].rpartition(")")
        except OSError:
            continue
        n += comm == "evidence-detach" and rest.split()[0] != "Z"
    return n


def wait_released(timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while detaching() and time.monotonic() < deadline:
        time.sleep(0.05)


HOLDER = """
import sys
from evidence.probes.loader import load_probes
p = load_probes()
print("ready", flush=True)
sys.stdin.read()
"""


def holding(run: Callable[[], tuple[float, float, int]]) -> tuple[float, float, int]:
    """`run` while another process holds the recorder's probes attached."""
    holder = subprocess.Popen([PY, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert holder.stdout is not None and holder.stdin is not None
    if holder.stdout.readline() != b"ready\n":
        raise SystemExit("start.py: the holder did not load the probes")
    try:
        return run()
    finally:
        holder.stdin.close()
        holder.wait()


def _clean(work: Path) -> None:
    for p in work.glob("evidence-*.tar.gz"):
        p.unlink()


# --programs: each program a start loads, loaded alone (from the probe cache, maps made once),
# `n` times: the CPU its load costs this thread (nearly all of it the kernel's verifier) and the
# instructions the verifier walked (bpf_prog_info.verified_insns)
PROGRAMS = """
import ctypes, struct, sys, time
from evidence.agent.recorder.kernel import kernel_ready
from evidence.probes import bpfsys, loader, objcache

n = int(sys.argv[1])
headers = kernel_ready()
source = loader.render(loader.detect_config())
obj, _ = objcache.cached_object(source, str(headers.path))
attach, _ = loader._syscall_attachments()
tp = bpfsys.LoadedObject.TRACEPOINT
kinds = {fn: (tp, 0) for _, fn in attach}
kinds |= {fn: (tp, 0) for fn in (b"on_exit_hash", b"on_exit_name", b"on_exit")}
kinds[loader.INGRESS.encode()] = (loader._PROG_TYPE_CGROUP_SKB, loader._CGROUP_INET_INGRESS)
kinds |= {f.encode(): (tp, 0) for f in obj.functions if f.startswith("tracepoint__")}
kinds |= {f.encode(): (bpfsys.LoadedObject.RAW_TRACEPOINT, 0) for f in obj.functions if f.startswith("raw_")}
rows = []
loaded = bpfsys.LoadedObject(obj)
for name, (kind, attach_type) in kinds.items():
    cpu, verified = [], 0
    for _ in range(n):
        t = time.thread_time()
        fn = loaded.load_func(name, kind, attach_type)
        cpu.append(time.thread_time() - t)
        info = ctypes.create_string_buffer(256)
        attr = ctypes.create_string_buffer(struct.pack("<IIQ", fn.fd, len(info), ctypes.addressof(info)), 16)
        bpfsys._bpf(15, attr)  # BPF_OBJ_GET_INFO_BY_FD
        verified = struct.unpack_from("<I", info.raw, 216)[0]  # bpf_prog_info.verified_insns
        bpfsys.os.close(loaded.funcs.pop(name).fd)
    rows.append((sorted(cpu)[len(cpu) // 2], verified, len(obj.functions[name.decode()]) // 8, name.decode()))
loaded.cleanup()
print(f"{'program':40} {'CPU med':>8} {'verified':>9} {'insns':>6}   ({n} loads each)")
for cpu, verified, insns, name in sorted(rows, reverse=True):
    print(f"{name:40} {cpu * 1000:6.1f}ms {verified:9} {insns:6}")
print(f"{'all':40} {sum(r[0] for r in rows) * 1000:6.1f}ms {sum(r[1] for r in rows):9}")
"""


def programs(n: int) -> None:
    subprocess.run([PY, "-c", PROGRAMS, str(n)], check=True)


def profile(way: str, work: Path) -> None:
    argv, env, _ = _way(way, work)
    if argv[0].endswith("/evidence"):
        argv = [PY, "-m", "pyinstrument", "-i", "0.001", "--show-all", "-m", "evidence", *argv[1:]]
    else:
        argv = [PY, "-m", "pyinstrument", "-i", "0.001", *argv[1:]]
    subprocess.run(argv, env=env, cwd=work, check=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ways", nargs="*", default=["bench", "user", "user-tty", "cold-pyc", "python", "imports"])
    ap.add_argument("-n", type=int, default=7, help="runs of each way (interleaved)")
    ap.add_argument("--profile", metavar="WAY", help="one run of WAY under pyinstrument, its tree printed")
    ap.add_argument(
        "--before", metavar="DIR", help="way `before`: `python -m evidence` from DIR, beside `module`"
    )
    ap.add_argument("--phases", metavar="WAY", help="-n runs of WAY with its phases timed (wall and CPU)")
    ap.add_argument(
        "--programs",
        action="store_true",
        help="each program a start loads, -n loads each alone: CPU (the verifier) and instructions verified",
    )
    args = ap.parse_args()
    if args.before:
        BEFORE[0] = str(Path(args.before).resolve())
    if os.geteuid() != 0:
        sys.exit("start.py: evidence run needs root")
    work = Path(tempfile.mkdtemp(prefix="evidence-start-"))
    try:
        if args.profile:
            profile(args.profile, work)
            return 0
        if args.phases:
            phases(args.phases, work, args.n)
            return 0
        if args.programs:
            programs(args.n)
            return 0
        ways: dict[str, Callable[[], tuple[float, float, int]]] = {}
        for name in args.ways:

            def once(name: str = name) -> tuple[float, float, int]:
                argv, env, tty = _way(name, work)
                if name == "settled":
                    wait_released()
                if name == "held":
                    out = holding(lambda: run_once(argv, env, tty, work))
                else:
                    out = run_once(argv, env, tty, work)
                _clean(work)
                return out

            ways[name] = once
        for once in ways.values():  # a first run of each: the probe cache filled, pages read
            once()
        walls: dict[str, list[float]] = {w: [] for w in ways}
        cpus: dict[str, list[float]] = {w: [] for w in ways}
        for _ in range(args.n):
            for name, once in ways.items():
                wall, cpu, rc = once()
                if rc != 0:
                    print(f"start.py: {name} exited {rc}", file=sys.stderr)
                walls[name].append(wall)
                cpus[name].append(cpu)
        print(
            f"{'way':10} {'wall median':>12} {'wall min':>9} {'CPU median':>11} {'CPU min':>8}   (s, {args.n} runs each, interleaved)"
        )
        for name in ways:
            w, c = walls[name], cpus[name]
            print(
                f"{name:10} {statistics.median(w):12.3f} {min(w):9.3f} {statistics.median(c):11.3f} {min(c):8.3f}"
            )
        print(f"(this process's own CPU: {resource.getrusage(resource.RUSAGE_SELF).ru_utime:.2f} s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
