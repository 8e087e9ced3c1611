"""The mmap ring-buffer reader against a real BPF ring buffer: records in order, none lost when read
in time, wrap-around across the end of the data area, and exact loss counts when it overflows."""

from __future__ import annotations

import os
import subprocess

from evidence.agent.recorder.cgroups import RunCgroup
from evidence.agent.recorder.decode import decode
from evidence.agent.recorder.kernel import mount_tracefs
from evidence.probes.headers import ensure_headers
from evidence.probes.loader import RecorderProbes, detect_config
from tests.kernel.util import in_cgroup


def _run_in(cg: RunCgroup, *cmd: str) -> None:
    subprocess.run(in_cgroup(cg.procs_file(), *cmd), check=True)


def test_bulk_reader_wraps_and_counts_overflow() -> None:
    mount_tracefs()
    ensure_headers()
    probes = RecorderProbes(detect_config(ringbuf_pages=16))  # 64 KiB: wraps and overflows quickly
    cg = RunCgroup.create(f"ringbuf-test-{os.getpid()}")
    try:
        ring = probes.ring()
        probes.reset_lost(1)
        probes.track(cg.id, 1)
        seen = 0
        for _ in range(20):  # ~20 x 200 opens+results, read after each: wraps the 64 KiB area many times
            _run_in(
                cg,
                "/usr/bin/python3",
                "-S",
                "-c",
                "import os\nfor i in range(200): os.close(os.open('/etc/hostname', 0))",
            )
            recs = [decode(r) for r in ring.read()]
            seen += sum(1 for r in recs if r["kind"] == "open" and r["path"] == "/etc/hostname")
        assert seen == 20 * 200
        assert ring.stitched > 0  # records that wrapped past the end were put together whole
        assert probes.read_lost(1) == {}
        # now overflow it: nobody reads while 5000 opens happen
        _run_in(
            cg,
            "/usr/bin/python3",
            "-S",
            "-c",
            "import os\nfor i in range(5000): os.close(os.open('/etc/hostname', 0))",
        )
        got = [decode(r) for r in ring.read()]
        opens = sum(1 for r in got if r["kind"] == "open" and r["path"] == "/etc/hostname")
        lost = probes.read_lost(1)
        assert lost.get("open", 0) > 0
        assert opens + lost["open"] >= 5000  # every open is either read or counted as lost
        ts = [r["ts"] for r in got]
        assert ts == sorted(ts)
    finally:
        probes.untrack(cg.id)
        cg.wait_empty()
        cg.remove()
        probes.close()
