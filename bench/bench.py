#!/usr/bin/env python3
"""Recorder overhead, measured side by side in one run: untraced vs `evidence run` vs `strace -f`.

Each workload (bench/workloads.c, compiled here) times its own loop, so ratios compare the work
itself; `evidence run -- true` is timed whole to show the fixed cost of a recorded run. Run as root:
`make bench` (or `.venv/bin/python bench/bench.py [--quick]`). Prints a table and the checks:
events captured exactly and lost = 0.
"""

from __future__ import annotations

import argparse
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
EVIDENCE = [sys.executable, "-m", "evidence"]


def compile_workloads(out: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        sys.exit("bench: needs a C compiler (apt-get install gcc)")
    exe = out / "workloads"
    subprocess.run([cc, "-O2", "-o", str(exe), str(HERE / "workloads.c")], check=True)
    return exe


def loop_ns(cmd: list[str]) -> tuple[int, float, str]:
    t = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.monotonic() - t
    if p.returncode != 0:
        sys.exit(f"bench: {' '.join(cmd)} failed: {p.stderr.strip()[-500:]}")
    return int(p.stdout.strip().splitlines()[-1]), wall, p.stderr


def bundle_facts(path: Path) -> tuple[dict, list[dict]]:
    with tarfile.open(path, "r:gz") as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
        events = [json.loads(x) for x in tar.extractfile("events.ndjson").read().splitlines()]  # type: ignore[union-attr]
    return manifest, events


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller loops (a smoke test, not the targets)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench: run as root")
    scale = 10 if args.quick else 1
    work = Path(tempfile.mkdtemp(prefix="evidence-bench-"))
    exe = compile_workloads(work)
    rows = []
    checks = []
    cases = [
        ("open", 300_000 // scale, "300k open/close"),
        ("exec", 5_000 // scale, "5k fork+exec /bin/true"),
        ("connect", 20_000 // scale, "20k loopback connects"),
    ]
    for mode, n, label in cases:
        # untraced and traced runs alternate, so drift in a noisy VM hits both alike
        bases, traced = [], []
        for i in range(args.repeat):
            bases.append(loop_ns([str(exe), mode, str(n)])[0])
            bundle = work / f"{mode}-{i}.tar.gz"
            ns, wall, _err = loop_ns(
                [*EVIDENCE, "run", "--bundle", str(bundle), "--", str(exe), mode, str(n)]
            )
            traced.append((ns, wall))
        base = int(statistics.median(bases))
        t_ns = int(statistics.median(t[0] for t in traced))
        t_wall = statistics.median(t[1] for t in traced)
        manifest, events = bundle_facts(bundle)
        # strace on a tenth of the loop (it is ~50x slower), compared per operation
        sn = max(1, n // 10)
        s_ns = (
            loop_ns(["strace", "-f", "-qq", "-o", "/dev/null", str(exe), mode, str(sn)])[0]
            if shutil.which("strace")
            else 0
        )
        s_ratio = (s_ns / sn) / (base / n) if s_ns else float("nan")
        rows.append((label, base / 1e9, t_ns / 1e9, t_ns / base, t_wall, s_ratio, manifest["lost"]["total"]))
        if mode == "open":
            hits = [
                e for e in events if e["type"] == "dev.evidence.file.open" and e["subject"] == "/etc/hostname"
            ]
            got = sum(e["data"]["count"] for e in hits)
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
        else:
            conns = [
                e for e in events if e["type"] == "dev.evidence.network.connect" and e["data"]["result"] == 0
            ]
            checks.append((f"{label}: connects counted", sum(e["data"]["count"] for e in conns), n))
        checks.append((f"{label}: events lost", manifest["lost"]["total"], 0))
    # fixed cost of a recorded run
    true_base = statistics.median(loop_wall(["/bin/true"]) for _ in range(args.repeat))
    true_rec = statistics.median(
        loop_wall([*EVIDENCE, "run", "--bundle", str(work / "true.tar.gz"), "--", "/bin/true"])
        for _ in range(args.repeat)
    )
    py_start = statistics.median(loop_wall([*EVIDENCE, "--version"]) for _ in range(args.repeat))

    print(
        f"\n{'workload':<28}{'untraced s':>11}{'evidence s':>11}{'ratio':>8}{'run wall s':>11}{'strace ratio':>13}{'lost':>6}"
    )
    for label, b, t, r, w, s, lost in rows:
        print(f"{label:<28}{b:>11.3f}{t:>11.3f}{r:>7.2f}x{w:>11.2f}{s:>12.1f}x{lost:>6}")
    print(
        f"\n`evidence run -- true` adds {true_rec - true_base:.2f} s (of which {py_start:.2f} s is starting Python)"
    )
    print("\nchecks:")
    ok = True
    for name, got, want in checks:
        good = got == want
        ok &= good
        print(f"  {'ok  ' if good else 'FAIL'} {name}: {got} (want {want})")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


def loop_wall(cmd: list[str]) -> float:
    t = time.monotonic()
    subprocess.run(cmd, capture_output=True, check=False)
    return time.monotonic() - t


if __name__ == "__main__":
    sys.exit(main())
