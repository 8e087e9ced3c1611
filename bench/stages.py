#!/usr/bin/env python3
"""The user-space stages of a `--detail full` run, each timed on its own, in events a CPU-second.

No kernel and no root: raw open records as the probes write them (probes/abi.py's layout) go
through the recorder's real code, stage by stage, as a full-detail run of bench/bench.py's
workloads would send them:
- decode: the one unpack per open that Recorder._process makes (OPEN_REC), over every record;
- correlate: the rest of Recorder._process (the repeat cache, Correlator.open_record, routing), in
  batches of the tree's pipeline.COALESCE (the poller's reads and spill are not in it);
- spool: SpoolWriter.write_many (orjson lines; their zstandard compression, for a flood's batches a
  thread's of its own, is not in it) and the run id's Behaviour it feeds (its C path's spills of
  sorted lines are a thread's of their own, not in it);
- make: the events' lines made as the records are spooled (bundle/premade.py, as Recorder.start
  sets it up for a full-detail run), while the job runs: on the correlator's thread, and on the
  premade's own where it has one (its CPU added: off the correlator's; their content hashes and their
  compression into the premade files are the files' threads', not in it: about 0.35 s of CPU a
  million for the compression);
- write: write_bundle at the run's end, its own thread (the premade lines with the run id put in,
  the root hash), the deflate threads' time left out;
- compress: what the writer's Deflater does to the events (sha256, CRC-32, deflate in chunks on
  its threads), timed on its own over the bundle's events.ndjson: the CPU of all its threads (its
  wall, on two cores, is printed beside).
Cases: `one`, N opens of one path (bench.py's open1m-full); `distinct`, N opens of distinct paths
that do not exist, from two processes interleaved (bench.py's distinct-full makes 2 x N). Times are CPU times (time.thread_time for the thread doing the stage), not walls, so that the
figures hold on a shared machine; each stage is also given as a share of the whole.

Side by side: `--tree DIR` (repeatable) runs the same stages over another checkout's code (a
`git worktree` of another commit: its `evidence` package, imported from DIR), interleaved with this
one's in one run, `--repeat` times each, and prints the medians. The bundles of the same case must
be byte-identical across runs of a tree, and their events.ndjson across trees (a tree from before
the level-1 chunked deflate compresses the same events to other bytes).

    .venv/bin/python bench/stages.py [--n 1000000] [--cases one,distinct] [--repeat 3] [--tree DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import struct
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
STAGES = ("decode", "correlate", "spool", "make", "write", "compress")
CGID = 7


def _raws(case: str, n: int) -> list[bytes]:
    from evidence.agent.recorder import decode as d

    def raw(path: bytes, ts: int, tgid: int, ret: int) -> bytes:
        body = struct.pack("<qQQiIHHHHQQ", ret, 0, 0, -100, 0, 0, 0, 0, len(path) + 1, 0, 0) + path + b"\0"
        return d.HDR.pack(ts, CGID, 1, tgid, tgid, d.EV_OPEN, 0) + body

    if case == "one":
        return [raw(b"/etc/hostname", 1_000 + i, 10, 3) for i in range(n)]
    # two processes, interleaved as their records reach the ring buffer: names that never repeat
    return [raw(b"/nonexistent/p%d/%d" % (i & 1, i >> 1), 1_000 + i, 10 + (i & 1), -2) for i in range(n)]


class _Ring:
    def wait(self, timeout_ms: int) -> None:
        time.sleep(timeout_ms / 1000)

    def wake(self) -> None:
        pass

    def read(self, max_records: int = 65536) -> list[bytes]:
        return []


class _Probes:
    def ring(self) -> _Ring:
        return _Ring()

    def close(self, background: bool = False) -> None:
        pass


def measure(case: str, n: int, work: Path) -> dict[str, Any]:
    """Every stage over `n` records of `case`: {stage: cpu seconds, ..., "sha256": the bundle's}."""
    from evidence.agent.recorder import decode as d
    from evidence.agent.recorder import pipeline, recording
    from evidence.agent.recorder.correlate import Correlator
    from evidence.bundle import writer as _w
    from evidence.bundle.deflate import Deflater

    try:  # (a tree from before premade lines: its writer makes them at the end, no make stage)
        from evidence.bundle.premade import Premade
    except ImportError:
        Premade = None
    from evidence.bundle.spool import SpoolWriter, read_spool, read_spool_lines
    from evidence.bundle.writer import RECORDING_ITEMS, Behaviour, RunMeta

    write_bundle = _w.write_bundle

    raws = _raws(case, n)
    out: dict[str, Any] = {}

    # decode alone: the unpack Recorder._process makes of every open (the rest is correlate's)
    unpack = d.OPEN_REC.unpack_from
    t0 = time.thread_time()
    for r in raws:
        unpack(r)
    out["decode"] = time.thread_time() - t0

    rec = recording.Recorder(work, probes=_Probes())  # type: ignore[arg-type]
    rec.close()
    behaviour = Behaviour({}, RECORDING_ITEMS, work)
    spool = SpoolWriter(work / f"{case}.spool.zst", feed=behaviour.add_many)
    corr = Correlator(0)
    corr.add_root(10, 1, "/home/u", exe="/usr/bin/workloads")
    corr.add_root(11, 1, "/home/u", exe="/usr/bin/workloads")
    corr.cgroup_name = lambda cgid: None  # type: ignore[method-assign]
    session = recording.Session(
        slot=1,
        session_id=case,
        cgroup_path=work,
        cgroup_id=CGID,
        command=["workloads", "open", str(n)],
        cwd="/home/u",
        detail="full",
        labels={},
        spool=spool,
        correlator=corr,
        started_ns=0,
        behaviour=behaviour,
    )
    premade = None if Premade is None else Premade(work, session.labels, 1)
    made = [0.0, 0.0]  # CPU in Premade.add on the correlator's thread, and on the premade's own
    if premade is not None:
        make = premade.add

        def timed_make(records: Any, *lines: Any) -> None:
            t = time.thread_time()
            make(records, *lines)
            made[0] += time.thread_time() - t

        spool.events = timed_make
        if getattr(premade, "from_lines", False):  # (its lines made on its own thread: timed there)
            add = premade._add

            def timed_add(items: Any, **how: Any) -> None:
                t = time.thread_time()
                add(items, **how)
                made[1] += time.thread_time() - t

            premade._add = timed_add  # type: ignore[method-assign]
        session.premade = premade  # (as Recorder.start sets it: the correlator makes the data with it)
    rec._sessions[1] = session
    spooled = [0.0]
    write_many = spool.write_many

    def timed(records: Any) -> None:  # the instance's own: the spool stays a plain SpoolWriter
        t = time.thread_time()
        write_many(records)
        spooled[0] += time.thread_time() - t

    spool.write_many = timed  # type: ignore[method-assign]
    t0 = time.thread_time()
    batch = pipeline.COALESCE  # records per Recorder._process call: the tree's own
    for i in range(0, n, batch):
        rec._process(raws[i : i + batch])
    spool.close()
    total = time.thread_time() - t0
    del raws
    if premade is not None:
        premade.end()  # (its thread's batches made)
    out["make"] = made[0] + made[1]
    out["spool"] = spooled[0] - made[0]
    out["correlate"] = total - spooled[0] - out["decode"]
    assert session.records == n, (session.records, n)

    meta = RunMeta(
        session_id=case,
        command=session.command,
        cwd=session.cwd,
        pid=10,
        cgroup="/sys/fs/cgroup/unified/evidence/bench",  # not the work directory: the same bytes each run
        started_ns=0,
        finished_ns=2_000 + n,
        exit_code=0,
        detail="full",
        host={},
        capabilities={},
        headers={},
    )
    bundle = work / f"{case}.tar.gz"
    t0 = time.thread_time()
    manifest = write_bundle(
        bundle,
        meta,
        lambda: read_spool(spool.path),
        behaviour=behaviour,
        lines=lambda: read_spool_lines(spool.path),
        **({} if premade is None else {"premade": premade.made()}),
    )
    out["write"] = time.thread_time() - t0  # this thread's: the deflate thread's is compress's
    assert manifest["events"] == n + 2, manifest["events"]
    out["sha256"] = hashlib.sha256(bundle.read_bytes()).hexdigest()

    with tarfile.open(bundle, "r:gz") as tar:
        member = tar.extractfile("events.ndjson")
        assert member is not None
        events = member.read()
    # the writer's Deflater over the same bytes, fed as the writer feeds it: CPU of every thread
    # (the deflating pool and the sha256 thread: time.process_time), and its wall beside it
    t0, w0 = time.process_time(), time.monotonic()
    with tempfile.TemporaryFile(dir=work) as deflated:
        deflater = Deflater(deflated)
        for i in range(0, len(events), 1 << 16):
            deflater.feed(events[i : i + (1 << 16)])
        deflater.finish()
    out["compress"] = time.process_time() - t0
    out["compress_wall"] = time.monotonic() - w0
    out["events_sha256"] = hashlib.sha256(events).hexdigest()  # what trees must agree on
    out["events_mb"] = len(events) / 1e6
    out["bundle_mb"] = bundle.stat().st_size / 1e6
    bundle.unlink()
    spool.path.unlink()
    return out


def _child(case: str, n: int, tree: str | None) -> dict[str, Any]:
    env = dict(os.environ)
    code = (
        "import sys, json\n"
        + (f"sys.path.insert(0, {tree!r})\n" if tree else "")
        + f"sys.path.insert(0, {str(HERE)!r})\n"
        + "import stages, tempfile, pathlib, evidence\n"
        + "with tempfile.TemporaryDirectory() as w:\n"
        + f"    r = stages.measure({case!r}, {n}, pathlib.Path(w))\n"
        + "r['tree'] = str(pathlib.Path(evidence.__file__).resolve().parent.parent)\n"
        + "print(json.dumps(r))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"stages: {case} failed under {tree or 'this tree'}:\n{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--cases", default="one,distinct")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tree", action="append", default=[], help="another checkout, measured side by side")
    args = ap.parse_args()
    trees: list[str | None] = [None, *args.tree]
    for case in args.cases.split(","):
        runs: dict[str | None, list[dict[str, Any]]] = {t: [] for t in trees}
        for _ in range(args.repeat):
            for tree in trees:  # interleaved: the machine's load falls on each alike
                runs[tree].append(_child(case, args.n, tree))
        print(f"\n{case}: {args.n:,} opens, --detail full (CPU s, median of {args.repeat}; events/s)")
        print(f"  {'tree':<28}" + "".join(f"{s:>18}" for s in STAGES) + f"{'all':>12}  bundle sha256")
        for tree in trees:
            med = {s: statistics.median(r[s] for r in runs[tree]) for s in STAGES}
            label = (runs[tree][0]["tree"] if tree else "this tree")[-28:]
            cells = "".join(
                f"{med[s]:7.2f} {args.n / med[s] / 1e3:7.0f}k " if med[s] else f"{'-':>7} {'-':>8} "
                for s in STAGES
            )
            shas = {r["sha256"] for r in runs[tree]}
            sha = next(iter(shas))[:16] if len(shas) == 1 else "DIFFERS BETWEEN RUNS"
            print(f"  {label:<28}{cells}{sum(med.values()):10.2f}s  {sha}")
        first = runs[None][0]
        walls = statistics.median(r.get("compress_wall", 0.0) for r in runs[None])
        print(
            f"  events.ndjson {first['events_mb']:.0f} MB, bundle {first['bundle_mb']:.1f} MB, compress wall {walls:.2f} s"
        )
        if any(len({r["sha256"] for r in rs}) != 1 for rs in runs.values()):
            print("  BUNDLES DIFFER between runs of one tree")
            return 1
        if len({r["events_sha256"] for rs in runs.values() for r in rs}) != 1:
            print("  EVENTS DIFFER between trees (bundles may: a tree of another compression)")
            return 1
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "stages"
    sys.exit(main())
