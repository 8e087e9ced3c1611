"""The floor under a loop of opens, measured beside `evidence run` in one run (bench/bench.py).

How much of a traced open's cost is the tracepoints', how much any recorder's, how much
evidence's own: the 300k open/close loop, in a cgroup made here, run untraced, with programs that
do nothing on openat's two syscall tracepoints, with a minimal recorder of the cgroup's opens
(bench/floor.bpf.c), and under `evidence run`, interleaved round by round. Each is the loop's own
time (the in-loop figure), so the fixed start of `evidence run` is not in it. Needs root, BCC and
tracefs, as `evidence run` does; the programs are loaded through evidence's probe loader.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROWS = ("untraced", "empty programs on openat", "a minimal recorder", "evidence run")


def in_loop(
    loop_s: Callable[[list[str]], float], workload: list[str], evidence: list[str], repeat: int
) -> dict[str, list[float]]:
    """Each row's in-loop seconds, `repeat` rounds. `loop_s` runs a command and returns the loop
    time it printed; `workload` is the loop's command, `evidence` the `evidence run ... --` prefix."""
    from evidence.agent.recorder import kernel
    from evidence.agent.recorder.cgroups import RunCgroup, cgroup_id
    from evidence.probes import objcache
    from evidence.probes.headers import ensure_headers

    kernel.mount_tracefs()
    headers = ensure_headers()
    source = (HERE / "floor.bpf.c").read_text()
    cg = RunCgroup.create(f"evidence-bench-floor-{os.getpid()}")
    try:
        inside = ["/bin/sh", "-c", 'echo $$ > "$1" && shift && exec "$@"', "sh", cg.procs_file(), *workload]
        out: dict[str, list[float]] = {row: [] for row in ROWS}
        for _ in range(repeat):
            out[ROWS[0]].append(loop_s(inside))
            for row, text in ((ROWS[1], "#define EMPTY 1\n" + source), (ROWS[2], source)):
                obj = objcache.load(text, str(headers.path) if headers.path else None)  # attached
                try:
                    obj[b"floor_run"][cgroup_id(cg.path).to_bytes(8, "little")] = (1).to_bytes(4, "little")
                    out[row].append(loop_s(inside))
                finally:
                    obj.cleanup()
                time.sleep(0.2)
            out[ROWS[3]].append(loop_s([*evidence, *workload]))
        return out
    finally:
        cg.wait_empty()
        cg.remove()
