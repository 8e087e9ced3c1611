#!/usr/bin/env python3
"""Recorder overhead, measured side by side in one run: untraced vs `evidence run` vs `strace -f`.

The headline is what a user waits for: the whole `evidence run` process's wall time against the
untraced command's (and the same after subtracting `evidence run -- true`, the fixed start cost),
with peak RSS. Beside it, the in-loop ratio: each workload (bench/workloads.c, compiled here) times its
own loop. Floods: 1M opens of one path, 2 processes x 1M opens of distinct paths. Run as root:
`make bench` (or `.venv/bin/python bench/bench.py [--quick] [--cases open,open1m] [--python PY]`;
`--python` runs another checkout's interpreter, for before/after figures from one session). Prints a
table and the checks: events captured exactly, lost = 0, every bundle verifies.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def compile_workloads(out: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        sys.exit("bench: needs a C compiler (apt-get install gcc)")
    exe = out / "workloads"
    subprocess.run([cc, "-O2", "-o", str(exe), str(HERE / "workloads.c")], check=True)
    return exe


def measure(cmd: list[str]) -> tuple[int, float, int, str]:
    """(the loop's own ns as the workload prints it, whole-process wall s, peak RSS KiB, stderr). The
    peak RSS is the largest of the process and the descendants it waited for (wait4)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t = time.monotonic()
        p = subprocess.Popen(cmd, stdout=out, stderr=err)
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.monotonic() - t
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode(errors="replace")
    if p.returncode != 0:
        sys.exit(f"bench: {' '.join(cmd)} failed ({p.returncode}): {stderr.strip()[-500:]}")
    return int(stdout.strip().splitlines()[-1]), wall, usage.ru_maxrss, stderr


def loop_ns(cmd: list[str]) -> tuple[int, float, str]:
    ns, wall, _rss, err = measure(cmd)
    return ns, wall, err


def bundle_facts(path: Path) -> tuple[dict, list[dict]]:
    with tarfile.open(path, "r:gz") as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
        events = [json.loads(x) for x in tar.extractfile("events.ndjson").read().splitlines()]  # type: ignore[union-attr]
    return manifest, events


CASES = {
    # name: (workload mode, N, label, extra `evidence run` options)
    "open": ("open", 300_000, "300k open/close", []),
    "exec": ("exec", 5_000, "5k fork+exec /bin/true", []),
    "connect": ("connect", 20_000, "20k loopback connects", []),
    "open1m": ("open", 1_000_000, "1M opens of one path", []),
    "open1m-full": ("open", 1_000_000, "1M opens, --detail full", ["--detail", "full"]),
    "distinct": ("distinct", 1_000_000, "2 x 1M distinct paths", []),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller loops (a smoke test, not the targets)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--start-repeat", type=int, default=11, help="runs of each start-cost row")
    ap.add_argument(
        "--baseline",
        metavar="PY",
        help="another checkout's interpreter, measured in the start-cost rows beside --python (before/after)",
    )
    ap.add_argument(
        "--cases",
        default=",".join(CASES),
        help=f"comma-separated, of {', '.join(CASES)} (none: start costs only)",
    )
    ap.add_argument("--python", default=sys.executable, help="the interpreter that runs `-m evidence`")
    ap.add_argument("--no-strace", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench: run as root")
    # -P: the interpreter's own evidence, never one in the current directory (before/after runs)
    evidence = [args.python, "-P", "-m", "evidence"]
    run_help = subprocess.run([*evidence, "run", "--help"], capture_output=True, text=True).stdout
    standalone = ["--standalone"] if "--standalone" in run_help else []  # never through an agent
    scale = 10 if args.quick else 1
    work = Path(tempfile.mkdtemp(prefix="evidence-bench-"))
    exe = compile_workloads(work)
    rows = []
    checks = []
    for case in [c for c in args.cases.split(",") if c and c != "none"]:
        mode, n, label, opts = CASES[case]
        n //= scale
        # untraced and traced runs alternate, so drift in a noisy VM hits both alike
        bases, traced = [], []
        for i in range(args.repeat):
            bases.append(measure([str(exe), mode, str(n)]))
            bundle = work / f"{case}-{i}.tar.gz"
            traced.append(
                measure(
                    [
                        *evidence,
                        "run",
                        *standalone,
                        "--bundle",
                        str(bundle),
                        *opts,
                        "--",
                        str(exe),
                        mode,
                        str(n),
                    ]
                )
            )
        base = int(statistics.median(b[0] for b in bases))
        base_wall = statistics.median(b[1] for b in bases)
        base_rss = max(b[2] for b in bases)
        t_ns = int(statistics.median(t[0] for t in traced))
        t_wall = statistics.median(t[1] for t in traced)
        t_rss = max(t[2] for t in traced)
        manifest, events = bundle_facts(bundle)
        lint = subprocess.run([*evidence, "lint", str(bundle)], capture_output=True, check=False).returncode
        # strace on a tenth of the loop (it is ~50x slower), compared per operation
        sn = max(1, n // 10)
        s_ns = (
            loop_ns(["strace", "-f", "-qq", "-o", "/dev/null", str(exe), mode, str(sn)])[0]
            if shutil.which("strace") and not args.no_strace and mode != "distinct"
            else 0
        )
        s_ratio = (s_ns / sn) / (base / n) if s_ns else float("nan")
        rows.append(
            (label, base_wall, t_wall, t_wall / base_wall, t_ns / base, base_rss, t_rss, s_ratio, manifest)
        )
        lost = manifest["lost"]["total"]
        checks.append((f"{label}: bundle verifies (lint exit 0 or 1)", lint in (0, 1), True))
        if mode == "open":
            hits = [
                e for e in events if e["type"] == "dev.evidence.file.open" and e["subject"] == "/etc/hostname"
            ]
            got = sum(e["data"]["count"] for e in hits)
            if "full" in opts:  # every operation kept, or counted as lost (the target: stated)
                checks.append((f"{label}: opens recorded + lost", got + lost, n))
            else:
                checks.append((f"{label}: opens of /etc/hostname counted", got, n))
        elif mode == "exec":
            execs = [
                e
                for e in events
                if e["type"] == "dev.evidence.process.exec"
                and e["data"]["argv"] == ["/bin/true", "bench-arg"]
                and e["data"]["result"] == 0
            ]
            checks.append((f"{label}: execs captured with argv", len(execs), n))
            want = hashlib.sha256(Path("/bin/true").read_bytes()).hexdigest()
            hashed = sum(1 for e in execs if e["data"].get("sha256") == want)
            checks.append((f"{label}: execs with the sha256 of /bin/true", hashed, n))
        elif mode == "connect":
            conns = [
                e for e in events if e["type"] == "dev.evidence.network.connect" and e["data"]["result"] == 0
            ]
            checks.append((f"{label}: connects counted", sum(e["data"]["count"] for e in conns), n))
        if mode == "distinct":
            opens = sum(
                e["data"]["count"]
                for e in events
                if e["type"] == "dev.evidence.file.open" and e["subject"].startswith("/nonexistent/p")
            )
            # every open is in the bundle or counted (lost, or past a cap): never silence
            checks.append((f"{label}: opens recorded + counted as not kept", opens + lost >= 2 * n, True))
        elif "full" not in opts:
            checks.append((f"{label}: events lost", lost, 0))
    # fixed cost of a recorded run: standalone (probes from the compiled-probe cache, and compiled
    # as on a first start), and through an agent; each the whole process, median and min of
    # `--start-repeat` runs, interleaved so that a busy VM's drift hits all alike
    true_base = statistics.median(loop_wall(["/bin/true"]) for _ in range(args.repeat))
    pythons = [*([args.baseline] if args.baseline else []), args.python]
    starts = start_costs(pythons, work, max(args.start_repeat, 1))
    true_rec = statistics.median(starts[ROW_WARM][args.python])
    py_start = statistics.median(loop_wall([args.python, "-c", "pass"]) for _ in range(args.repeat))

    print(
        f"\n{'workload':<24}{'untraced s':>11}{'run s':>8}{'whole':>8}{'-true':>8}{'in-loop':>9}"
        f"{'RSS MB':>8}{'run RSS':>9}{'strace':>8}{'events':>9}{'lost':>9}"
    )
    for label, b, w, r, loop, brss, trss, s, manifest in rows:
        minus_true = (w - true_rec) / b
        print(
            f"{label:<24}{b:>11.2f}{w:>8.2f}{r:>7.2f}x{minus_true:>7.2f}x{loop:>8.2f}x"
            f"{brss / 1024:>8.0f}{trss / 1024:>9.0f}{s:>7.1f}x{manifest['events']:>9}{manifest['lost']['total']:>9}"
        )
    print(
        "\nwhole: `evidence run` process wall / untraced process wall; -true: the same after subtracting"
        f" `evidence run -- true` ({true_rec:.2f} s);\nin-loop: the workload's own loop time, traced / untraced."
        f" RSS: peak (wait4). `evidence run -- true` adds {true_rec - true_base:.2f} s"
        f" (starting Python alone: {py_start:.2f} s)"
    )
    print(
        f"\nstart and end, whole process wall, median / min of {max(args.start_repeat, 1)} runs (interleaved):"
    )
    print(f"  {'':<46}" + "".join(f"{'baseline' if py == args.baseline else 'this':>22}" for py in pythons))
    for name, per in starts.items():
        cells = "".join(f"{statistics.median(w):>11.3f} /{min(w):>6.3f} s" for w in per.values())
        print(f"  {name:<46}{cells}")
    if args.baseline:
        print(f"  baseline: {args.baseline}\n  this:     {args.python}")
    print("\nchecks:")
    ok = True
    for name, got, want in checks:
        good = got == want
        ok &= good
        print(f"  {'ok  ' if good else 'FAIL'} {name}: {got} (want {want})")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


ROW_WARM = "run -- true"
ROW_COLD = "run -- true, probe cache off (a first start)"
ROW_AGENT = "run --agent SOCK -- true"


def start_costs(pythons: list[str], work: Path, repeat: int) -> dict[str, dict[str, list[float]]]:
    """Wall times of `run -- true` per interpreter (a checkout each), interleaved run by run so that
    a busy VM's drift hits all alike: standalone with the probe cache warm (the usual start), with it
    off (what a first start after a probe or kernel change costs: BCC compiles), and through an
    agent started here from the same checkout (`run --agent`: the client alone; the agent's probes
    are loaded already). A checkout without the probe cache ignores EVIDENCE_PROBE_CACHE: both of
    its standalone rows compile."""
    bundle = str(work / "true.tar.gz")
    cold_env = {**os.environ, "EVIDENCE_PROBE_CACHE": "0"}
    cmds: dict[str, tuple[list[str], list[str]]] = {}
    agents = []
    try:
        for n, py in enumerate(pythons):
            evidence = [py, "-P", "-m", "evidence"]
            help_ = subprocess.run([*evidence, "run", "--help"], capture_output=True, text=True).stdout
            standalone = ["--standalone"] if "--standalone" in help_ else []
            sock = work / f"agent-{n}.sock"
            agents.append(
                subprocess.Popen(
                    [*evidence, "agent", "--socket", str(sock), "--bundle-dir", str(work / f"agent-{n}")],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            run_true = [*evidence, "run", *standalone, "--bundle", bundle, "--", "/bin/true"]
            via_agent = [*evidence, "run", "--agent", str(sock), "--bundle", bundle, "--", "/bin/true"]
            cmds[py] = (run_true, via_agent)
        deadline = time.monotonic() + 180
        for (run_true, via_agent), agent in zip(cmds.values(), agents, strict=True):
            while subprocess.run(via_agent, capture_output=True, check=False).returncode != 0:
                if agent.poll() is not None or time.monotonic() > deadline:
                    sys.exit("bench: the agent did not start")
                time.sleep(0.5)
            loop_wall(run_true)  # fills the probe cache, if it was empty
        out: dict[str, dict[str, list[float]]] = {
            row: {py: [] for py in pythons} for row in (ROW_WARM, ROW_COLD, ROW_AGENT)
        }
        for i in range(repeat):
            for py, (run_true, via_agent) in cmds.items():
                out[ROW_WARM][py].append(loop_wall(run_true))
                if i < 3:  # each compiles for seconds: three are enough
                    out[ROW_COLD][py].append(loop_wall(run_true, cold_env))
                out[ROW_AGENT][py].append(loop_wall(via_agent))
        return out
    finally:
        for agent in agents:
            agent.terminate()
            agent.wait()


def loop_wall(cmd: list[str], env: dict[str, str] | None = None) -> float:
    t = time.monotonic()
    subprocess.run(cmd, capture_output=True, check=False, env=env)
    return time.monotonic() - t


if __name__ == "__main__":
    sys.exit(main())
