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


# The job: CHUNKS x K opens, waiting after each chunk for the test to say it has read them, so the
# ring never holds more than a chunk (a few KiB of its 256 KiB) and cannot fill, whatever the CPUs do.
_CHUNKED_OPENS = """\
import os, sys
chunks, k = int(sys.argv[1]), int(sys.argv[2])
for _ in range(chunks):
    for _ in range(k):
        os.close(os.open('/etc/hostname', 0))
    if os.read(0, 1) != b'x':
        break
"""


def test_reading_while_the_producer_writes_loses_nothing_past_a_lap() -> None:
    """The consumer position is published with one store. The consumer used to write it with
    struct.pack_into, which zeroes the 8 bytes first: a reservation that read that 0 once the
    producer had gone round the ring saw it full and dropped the record, the ring nearly empty
    (`open10`: 17-40 lost per million). Here the test reads the ring in a tight loop while the job
    writes, so positions are published all the time, and the job never runs ahead of it by more
    than a chunk: any loss is that bug, not a full ring. Before the fix it lost one within the first
    40-90 chunks every time (the first lap ends near chunk 30)."""
    mount_tracefs()
    ensure_headers()
    chunks, k = 400, 100
    probes = RecorderProbes(detect_config(ringbuf_pages=64))  # 256 KiB: a lap every ~3,000 opens
    cg = RunCgroup.create(f"ringbuf-lap-test-{os.getpid()}")
    job: subprocess.Popen[bytes] | None = None
    try:
        ring = probes.ring()
        probes.reset_lost(1)
        probes.track(cg.id, 1)
        job = subprocess.Popen(
            in_cgroup(cg.procs_file(), "/usr/bin/python3", "-S", "-c", _CHUNKED_OPENS, str(chunks), str(k)),
            stdin=subprocess.PIPE,
        )
        assert job.stdin is not None
        seen = acked = 0
        lost: dict[str, int] = {}
        while acked < chunks and not lost:
            recs = ring.read()  # publishes the consumer position, records or none
            for raw in recs:
                r = decode(raw)
                seen += r["kind"] == "open" and r["path"] == "/etc/hostname"
            if seen >= (acked + 1) * k:
                job.stdin.write(b"x")
                job.stdin.flush()
                acked += 1
            elif not recs:
                lost = probes.read_lost(1)  # a lost open never arrives: stop waiting for it
                if job.poll() is not None:
                    break  # it died: the asserts below say how far it got
        assert lost == {}
        assert seen == chunks * k
        assert ring.position > 8 * ring.size  # the producer went round the ring many times
        job.stdin.close()
        assert job.wait() == 0
    finally:
        if job is not None and job.poll() is None:
            job.kill()
            job.wait()
        probes.untrack(cg.id)
        cg.wait_empty()
        cg.remove()
        probes.close()


def test_detached_programs_record_nothing_at_once() -> None:
    """detach_programs (what `evidence run` does before it hands the perf events to its
    `evidence-detach` child): the programs stop on every process at once, without waiting for the
    perf events' grace periods: a tracked cgroup's opens reach the ring buffer before, not after."""
    mount_tracefs()
    ensure_headers()
    probes = RecorderProbes()
    cg = RunCgroup.create(f"detach-test-{os.getpid()}")
    script = "import os\nfor i in range(100): os.close(os.open('/etc/hostname', 0))"
    try:
        assert probes.bpf.links, "the programs are attached through links on this kernel"
        ring = probes.ring()
        probes.track(cg.id, 1)
        _run_in(cg, "/usr/bin/python3", "-S", "-c", script)
        before = [decode(r) for r in ring.read()]
        assert sum(1 for r in before if r["kind"] == "open" and r["path"] == "/etc/hostname") >= 1
        probes.bpf.detach_programs()
        assert not probes.bpf.links
        assert probes.bpf.tracepoint_fds  # the perf events are still open
        _run_in(cg, "/usr/bin/python3", "-S", "-c", script)
        after = [decode(r) for r in ring.read()]
        assert after == []
    finally:
        probes.untrack(cg.id)
        cg.wait_empty()
        cg.remove()
        probes.close()
