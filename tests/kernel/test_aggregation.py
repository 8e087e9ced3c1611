"""In-kernel pairing and aggregation, end to end with real BPF: a repeated open counted exactly by
the kernel (count, first and last time) with one record through the ring buffer; paths resolved
against cwd and dirfds exactly as before while repeats are not records; the per-run cap on distinct
keys and the full-map fallback, with exact accounting; full detail keeps every operation; a flood's
bundle verifies and says what it did not keep."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from evidence.agent.recorder.cgroups import RunCgroup
from evidence.agent.recorder.kernel import mount_tracefs
from evidence.agent.recorder.recording import Recorder
from evidence.bundle.format import parse_time
from evidence.probes.headers import ensure_headers
from evidence.probes.loader import RecorderProbes, detect_config
from tests.kernel.util import PY, evidence, in_cgroup, of_type, read_bundle, record

BUSYBOX = "/bin/busybox"  # static: it opens nothing of its own, so every open counted is the script's


@pytest.fixture(scope="module")
def recorder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recorder]:
    mount_tracefs()
    ensure_headers()
    rec = Recorder(tmp_path_factory.mktemp("spool"))
    yield rec
    rec.close()


def _run(rec: Recorder, tmp_path: Path, argv: list[str], **start: Any) -> tuple[dict, list[dict], int]:
    """Record argv (started straight into a new cgroup) with `rec`: (manifest, events, records read
    from the ring buffer while it ran)."""
    cg = RunCgroup.create(f"agg-test-{os.getpid()}-{time.monotonic_ns()}")
    try:
        session = rec.start(cg.path, argv, str(tmp_path), **start)
        before = rec.stats["records"]
        p = subprocess.run(in_cgroup(cg.procs_file(), *argv), capture_output=True, check=False)
        cg.wait_empty()
        manifest = rec.finish(session, tmp_path / "run.tar.gz", exit_code=p.returncode)
        records = rec.stats["records"] - before
    finally:
        cg.remove()
    lint = evidence("lint", str(tmp_path / "run.tar.gz"))
    assert lint.returncode in (0, 1), lint.stdout + lint.stderr
    _, events = read_bundle(tmp_path / "run.tar.gz")
    return manifest, events, records


def _counts(events: list[dict], prefix: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in of_type(events, "file.open"):
        if e["data"]["path"].startswith(prefix):
            out[e["data"]["path"]] = out.get(e["data"]["path"], 0) + e["data"]["count"]
    return out


def _loop(paths: list[str], times: int) -> list[str]:
    """A busybox script that opens each path `times` times, in turn (none exists: ENOENT)."""
    body = " ".join(paths)
    return [
        BUSYBOX,
        "sh",
        "-c",
        f"for r in $(seq {times}); do for p in {body}; do true < $p; done; done 2>/dev/null",
    ]


def test_a_repeated_open_is_counted_in_the_kernel(recorder: Recorder, tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import os, time
        t0 = time.time_ns()
        for i in range(5000):
            os.close(os.open('/etc/hostname', os.O_RDONLY))
        print(t0, time.time_ns())
        """
    )
    out = tmp_path / "times"
    manifest, events, records = _run(recorder, tmp_path, ["/bin/sh", "-c", f'{PY} -S -c "{code}" > {out}'])
    (ev,) = [e for e in of_type(events, "file.open") if e["data"]["path"] == "/etc/hostname"]
    assert ev["data"]["count"] == 5000 and ev["data"]["result"] == 0 and ev["data"]["access"] == ["read"]
    t0, t1 = (int(x) for x in out.read_text().split())
    first, last = parse_time(ev["data"]["first_time"]), parse_time(ev["data"]["last_time"])
    slack = 50_000_000  # the kernel's clock is mapped to wall time once per recorder
    assert t0 - slack <= first < last <= t1 + slack
    assert last - first >= (t1 - t0) // 2
    assert manifest["lost"]["total"] == 0
    assert records < 1000  # one record for the 5000 opens, not 5000 (or 10000)


def test_opens_named_by_the_kernel_are_counted_by_that_name(recorder: Recorder, tmp_path: Path) -> None:
    """A name with '..' is named by the kernel (the file it opened), and counted in the kernel by
    that name: 5,000 opens of /etc/ssh/../hostname and of /proc/self/fd/N/../hostname are few
    records, and exactly 10,000 opens of /etc/hostname (a summary keeps one of the names given)."""
    code = textwrap.dedent(
        """
        import os
        d = os.open('/etc/ssh', os.O_RDONLY | os.O_DIRECTORY)
        for name in ('/etc/ssh/../hostname', '/proc/self/fd/%d/../hostname' % d):
            for i in range(5000):
                os.close(os.open(name, os.O_RDONLY))
        """
    )
    manifest, events, records = _run(recorder, tmp_path, [PY, "-S", "-c", code])
    opened = [e["data"] for e in of_type(events, "file.open") if e["data"]["path"] == "/etc/hostname"]
    assert sum(o["count"] for o in opened) == 10000, opened
    assert {o["raw_path"] for o in opened} <= {"/etc/ssh/../hostname", "/proc/self/fd/3/../hostname"}
    assert manifest["lost"]["total"] == 0
    assert records < 1000


def test_names_that_differ_in_their_last_byte_are_counted_apart(recorder: Recorder, tmp_path: Path) -> None:
    """The kernel counts a repeat under the keyed hash of its name, which reads the name 8 bytes
    at a time and masks the last, partial word. Names one byte apart, of every length across two
    word boundaries, each opened 30 times (ENOENT: the key has no inode to tell them apart), with a
    longer name opened before each of them in every other round, so that the bytes past the
    shorter name in the probe's buffer change from one round to the next: each name is counted
    exactly 30 times, none under another's event."""
    base = str(tmp_path / "w")
    names = [base + "x" * k + last for k in range(17) for last in "yz"]
    longer = base + "L" * 60
    body = " ".join(names)
    script = (
        f"for r in $(seq 30); do for p in {body}; do "
        f"if [ $((r % 2)) = 1 ]; then true < {longer}; fi; true < $p; done; done 2>/dev/null"
    )
    manifest, events, _ = _run(recorder, tmp_path, [BUSYBOX, "sh", "-c", script])
    counts = _counts(events, base)
    assert counts == {**{n: 30 for n in names}, longer: 15 * len(names)}
    assert manifest["lost"]["total"] == 0


def test_paths_resolve_as_before_while_repeats_are_not_records(tmp_path: Path) -> None:
    """A dirfd number that named B and then A again (through an open the kernel only counted), a
    child using an inherited dirfd, and chdir back and forth: every open resolves as it did."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "x").write_text("x")
    code = textwrap.dedent(
        f"""
        import os
        A, B = {str(a)!r}, {str(b)!r}
        for i in range(3):
            os.close(os.open(A, os.O_RDONLY | os.O_DIRECTORY))
            os.close(os.open(B, os.O_RDONLY | os.O_DIRECTORY))
        fa = os.open(A, os.O_RDONLY | os.O_DIRECTORY)
        os.close(os.open('x', os.O_RDONLY, dir_fd=fa))
        if os.fork() == 0:
            os.close(os.open('x', os.O_RDONLY, dir_fd=fa))
            os._exit(0)
        os.wait()
        for d in (A, B, A):
            os.chdir(d)
            os.close(os.open('x', os.O_RDONLY))
        """
    )
    proc, manifest, events = record(tmp_path, PY, "-c", code)
    assert proc.returncode == 0, proc.stderr
    assert _counts(events, str(tmp_path)) == {
        str(a): 4,
        str(b): 3,
        f"{a}/x": 4,  # through fa twice (parent and child), via the cwd twice
        f"{b}/x": 1,
    }
    assert manifest["lost"]["total"] == 0


def _all_opens(events: list[dict]) -> int:
    return sum(e["data"]["count"] for e in of_type(events, "file.open"))


def test_the_distinct_key_cap_counts_what_it_does_not_keep(recorder: Recorder, tmp_path: Path) -> None:
    paths = [f"/nonexistent/cap/{i}" for i in range(40)]
    script = _loop(paths, 3)
    (tmp_path / "full").mkdir()
    _, full, _ = _run(recorder, tmp_path / "full", script, detail="full")
    manifest, events, _ = _run(recorder, tmp_path, script, max_distinct=10)
    kept = _counts(events, "/nonexistent/cap/")
    # a key is kept whole (every occurrence counted) or not at all; the first ones are kept
    assert set(kept.values()) == {3} and list(kept) == paths[: len(kept)]
    assert len(of_type(events, "file.open")) == 10
    past = manifest["lost"]["by_kind"]["open_past_cap"]
    assert _all_opens(events) + past == len(of_type(full, "file.open"))  # exact: kept + not kept
    assert manifest["lost"]["by_kind"] == {"open_past_cap": past} and past >= 30 * 3
    (loss,) = of_type(events, "loss")
    assert loss["data"]["kind"] == "open_past_cap" and loss["data"]["count"] == past


def test_a_finished_runs_keys_leave_the_map_and_its_slot_is_not_reused_before(
    recorder: Recorder, tmp_path: Path
) -> None:
    """A run's keys are removed from the kernel's aggregation map on a thread of their own while
    its bundle is written, and its slot goes to no other run before that: runs back to back, the
    same opens, each counts exactly its own (3, then 5, never 8); then the map holds no key."""
    paths = [f"/nonexistent/reuse/{i}" for i in range(300)]
    for n in (3, 5, 2):
        (tmp_path / str(n)).mkdir()
        _, events, _ = _run(recorder, tmp_path / str(n), _loop(paths, n))
        assert _counts(events, "/nonexistent/reuse/") == dict.fromkeys(paths, n)
    agg = recorder.probes.bpf[b"agg"]
    deadline = time.monotonic() + 120  # a bound on a hang, not a timing: the kernel is busy
    while agg.items_raw()[0] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert agg.items_raw()[0] == b""


def test_a_full_aggregation_map_falls_back_to_one_record_each(tmp_path: Path) -> None:
    mount_tracefs()
    ensure_headers()
    rec = Recorder(tmp_path / "spool", probes=RecorderProbes(detect_config(agg_max=4)))
    try:
        paths = [f"/nonexistent/full/{i}" for i in range(20)]
        manifest, events, _ = _run(rec, tmp_path, _loop(paths, 3))
    finally:
        rec.close()
    assert _counts(events, "/nonexistent/full/") == {p: 3 for p in paths}  # exact either way
    assert manifest["lost"]["total"] == 0
    (deg,) = [e["data"] for e in of_type(events, "degradation") if e["data"]["component"] == "recorder"]
    fallbacks = int(deg["reason"].split(": ")[1].split()[0])
    # 4 keys fit in the map (their repeats counted there), every other open was a record
    assert 16 * 3 <= fallbacks <= _all_opens(events) - 4


def test_full_detail_records_every_operation(recorder: Recorder, tmp_path: Path) -> None:
    manifest, events, records = _run(
        recorder, tmp_path, _loop(["/nonexistent/full-detail"], 50), detail="full"
    )
    opens = [e for e in of_type(events, "file.open") if e["data"]["path"] == "/nonexistent/full-detail"]
    assert len(opens) == 50 and {e["data"]["count"] for e in opens} == {1}
    assert [e["data"]["result"] for e in opens] == ["ENOENT"] * 50
    assert manifest["lost"]["total"] == 0 and records >= 50


def test_a_floods_bundle_verifies_and_states_what_was_not_kept(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import os
        for i in range(20000):
            try:
                os.open(f'/nonexistent/flood/{i}', os.O_RDONLY)
            except OSError:
                pass
        """
    )
    bundle = tmp_path / "run.tar.gz"
    env = {**os.environ, "EVIDENCE_MAX_DISTINCT": "1000"}
    proc = evidence("run", "--bundle", str(bundle), "--", PY, "-c", code, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "past its cap of 1000 distinct summary keys" in proc.stderr
    lint = evidence("lint", "--format", "json", str(bundle))
    assert lint.returncode in (0, 1), lint.stdout + lint.stderr
    assert "EV001" in lint.stdout  # the loss is a finding
    manifest, events = read_bundle(bundle)
    past = manifest["lost"]["by_kind"]["open_past_cap"]
    kept = sum(_counts(events, "/nonexistent/flood/").values())
    assert kept + past == 20000 and 0 < kept < 1000
    assert json.loads(lint.stdout) is not None


@pytest.mark.parametrize("detail", ["summary", "full"])
def test_the_run_id_fed_while_spooling_is_the_one_a_pass_over_the_spool_gives(
    recorder: Recorder, tmp_path: Path, detail: str
) -> None:
    """The recorder feeds the run id's sets as it spools (repeated opens of a full-detail run go to
    the spool as lines, which feed nothing): the bundle's run id is the one a pass over every
    record spooled gives, with the run's roots replaced by their placeholders."""
    import orjson

    from evidence.bundle.writer import Behaviour

    work = tmp_path / "ws"
    work.mkdir()
    (work / "a").write_text("a")
    spooled: list[dict] = []
    lines = 0
    start = rec_start = recorder.start

    def teeing(*args: Any, **kw: Any) -> Any:
        session = rec_start(*args, **kw)
        feed = session.spool.feed

        def tee(recs: list) -> None:
            nonlocal lines
            lines += sum(isinstance(r, bytes) for r in recs)
            spooled.extend(orjson.loads(r) if isinstance(r, bytes) else dict(r) for r in recs)
            feed(recs)

        session.spool.feed = tee
        return session

    recorder.start = teeing  # type: ignore[method-assign]
    try:
        # the repeats in batches of their own (a batch with an exec is all records): a pause on each
        # side of the loop, longer than the consumer's poll, or a fast loop lands in the exec's batch
        code = (
            "import os, time\ntime.sleep(0.2)\n"
            f"for i in range(5000): os.close(os.open('{work}/a', os.O_RDONLY))\ntime.sleep(0.2)"
        )
        argv = ["/bin/sh", "-c", f'{PY} -S -c "{code}"; cat {work}/none {work}/a >/dev/null 2>&1']
        manifest, events, _ = _run(recorder, tmp_path, argv, detail=detail, roots={"${WORKSPACE}": str(work)})
    finally:
        recorder.start = start  # type: ignore[method-assign]
    opens = [e for e in of_type(events, "file.open") if e["data"]["path"] == f"{work}/a"]
    assert sum(e["data"]["count"] for e in opens) == 5001
    assert (lines > 1000) == (detail == "full")  # full detail: the repeats spooled as lines
    reference = Behaviour({"${WORKSPACE}": str(work)})
    reference.add_many(spooled)
    assert manifest["run_id"] == reference.run_id(argv)
    other = Behaviour({})  # the placeholder is part of it: without the roots, another run id
    other.add_many(spooled)
    assert manifest["run_id"] != other.run_id(argv)


def test_a_call_in_flight_when_the_run_ends_is_recorded_without_a_result(
    recorder: Recorder, tmp_path: Path
) -> None:
    """A run finished while a process of it waits in an open (a FIFO without a writer): the call is
    taken out of the kernel's table of calls in flight and recorded, its result NO_RESULT (the
    loader read the record's size from the wrong field of struct call, and found none)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cg = RunCgroup.create(f"agg-test-{os.getpid()}-{time.monotonic_ns()}")
    argv = [BUSYBOX, "cat", str(fifo)]
    p = None
    try:
        session = recorder.start(cg.path, argv, str(tmp_path))
        p = subprocess.Popen(in_cgroup(cg.procs_file(), *argv))
        deadline = time.monotonic() + 10
        while "fifo" not in Path(f"/proc/{p.pid}/wchan").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        recorder.finish(session, tmp_path / "run.tar.gz", exit_code=None)
    finally:
        if p is not None:
            p.kill()
            p.wait()
        cg.wait_empty()
        cg.remove()
    _, events = read_bundle(tmp_path / "run.tar.gz")
    opens = [e["data"] for e in of_type(events, "file.open") if e["data"]["path"] == str(fifo)]
    assert [o["result"] for o in opens] == ["NO_RESULT"], opens


def test_a_job_with_many_threads_loses_only_its_own_calls(tmp_path: Path) -> None:
    """The calls-in-flight table is the machine's (an agent records many runs with it): a job whose
    threads (alive, each after one open) would fill it takes at most its run's share, its own calls
    past it are counted as its loss, and another run at the same time loses nothing. Small sizes
    (16 entries, 4 a run) stand for the real ones (16,384 and 4,096)."""
    rec = Recorder(
        tmp_path / "spool", probes=RecorderProbes(detect_config(inflight_max=16, inflight_per_run=4))
    )
    many = textwrap.dedent(
        """
        import os, threading, time
        def one():
            os.close(os.open('/etc/hostname', os.O_RDONLY))
            time.sleep(4)
        ts = [threading.Thread(target=one) for _ in range(20)]
        for t in ts: t.start()
        for t in ts: t.join()
        """
    )
    few = "import os; os.close(os.open('/etc/passwd', os.O_RDONLY))"
    cgs = [RunCgroup.create(f"agg-test-{os.getpid()}-{i}-{time.monotonic_ns()}") for i in range(2)]
    try:
        sessions = [
            rec.start(cg.path, [PY, "-S", "-c", c], str(tmp_path))
            for cg, c in zip(cgs, (many, few), strict=True)
        ]
        hog = subprocess.Popen(in_cgroup(cgs[0].procs_file(), PY, "-S", "-c", many))
        time.sleep(1.5)  # its threads hold what they can of the table now
        other = subprocess.run(in_cgroup(cgs[1].procs_file(), PY, "-S", "-c", few), check=True)
        assert hog.wait() == 0
        manifests = []
        for i, (cg, session) in enumerate(zip(cgs, sessions, strict=True)):
            cg.wait_empty()
            manifests.append(rec.finish(session, tmp_path / f"run{i}.tar.gz", exit_code=0))
    finally:
        rec.close()
        for cg in cgs:
            cg.remove()
    assert other.returncode == 0
    assert manifests[1]["lost"]["total"] == 0, manifests[1]["lost"]
    _, events = read_bundle(tmp_path / "run1.tar.gz")
    assert any(e["data"]["path"] == "/etc/passwd" for e in of_type(events, "file.open"))
    # 20 threads, one open each, and a share of 4 (its main thread holds one already)
    assert manifests[0]["lost"]["by_kind"].get("open", 0) >= 20 - 4, manifests[0]["lost"]
