"""The recorder's fast path for opens (Correlator.open_record, the repeat cache in Recorder._process)
makes exactly the records of the general path: decode() then feed(). No kernel: raw records as the
probes write them, fed through both."""

from __future__ import annotations

import json
import struct
import threading
from pathlib import Path
from typing import Any

from evidence.agent.recorder import decode as d
from evidence.agent.recorder import recording
from evidence.agent.recorder.correlate import Correlator
from evidence.bundle.run_id import Behaviour
from evidence.bundle.spool import SpoolWriter, read_spool
from evidence.bundle.writer import RECORDING_ITEMS
from tests.unit.test_recording_flush import FakeProbes

RAW = [
    bytes.fromhex(r["hex"])
    for r in json.loads((Path(__file__).parent.parent / "data" / "raw_records.json").read_text())
]
CGID = 7


def open_raw(
    path: bytes,
    ts: int = 1,
    ret: int = 3,
    dfd: int = -100,
    oflags: int = 0,
    mode: int = 0,
    flags: int = 0,
    tgid: int = 10,
    cgid: int = CGID,
    run: int = 1,
    dino: int = 0,
    rino: int = 0,
    kname: bytes | None = None,
    nlink: int = 0,
) -> bytes:
    body = (
        struct.pack("<qQQiIHHHHQQ", ret, 0, 0, dfd, oflags, mode, nlink, 0, len(path) + 1, dino, rino)
        + path
        + b"\0"
    )
    if kname is not None:  # the kernel's name of the file opened follows the path
        flags |= d.F_KNAME
        body += kname + b"\0"
    return d.HDR.pack(ts, cgid, run, tgid, tgid, d.EV_OPEN, flags) + body


def chdir_raw(path: bytes, ts: int = 1, tgid: int = 10) -> bytes:
    body = struct.pack("<qQQiIHHHHQQ", 0, 0, 0, -100, 0, 0, 0, 0, len(path) + 1, 0, 0) + path + b"\0"
    return d.HDR.pack(ts, CGID, 1, tgid, tgid, d.EV_CHDIR, 0) + body


def dup_raw(oldfd: int, newfd: int, ts: int = 1, tgid: int = 10, rino: int = 0) -> bytes:
    return d.HDR.pack(ts, CGID, 1, tgid, tgid, d.EV_DUP, 0) + struct.pack("<qiiQ", newfd, oldfd, newfd, rino)


def correlator() -> Correlator:
    c = Correlator(1000)
    c.add_root(10, 1, "/home/u", exe="/bin/sh")
    c.cgroup_name = lambda cgid: None if cgid == CGID else f"sub/{cgid}"
    c.container_of = lambda name: "c0ffee" if name == "sub/8" else None
    c.cgroup_mount = "/sys/fs/cgroup"
    c.run_cgroup = "/sys/fs/cgroup/run"
    return c


def general(raws: list[bytes]) -> list[dict[str, Any]]:
    """The records the general path makes: decode(), then feed()."""
    c = correlator()
    out: list[dict[str, Any]] = []
    for raw in raws:
        out += c.feed(d.decode(raw))
    return out


MIXED = [
    open_raw(b"/etc/hostname", ts=1),
    open_raw(b"/etc/hostname", ts=2),  # a repeat: the same record at its own time
    open_raw(b"/etc/hostname", ts=3, ret=-2),  # same path, another result
    open_raw(b"a.txt", ts=4),  # relative: the cwd
    chdir_raw(b"/srv", ts=5),
    open_raw(b"a.txt", ts=6),  # the same bytes after a chdir: another file
    open_raw(b"a.txt", ts=7),
    open_raw(b"c", ts=8, dfd=3, ret=4),  # through a descriptor
    open_raw(b"c", ts=9, dfd=77, ret=-9),  # an unknown descriptor
    dup_raw(4, 3, ts=10),
    open_raw(b"c", ts=11, dfd=3, ret=4),  # the same bytes, fd 3 now names another directory
    open_raw(b"x", ts=12, flags=d.F_FNAME_FAULT, ret=-14),
    open_raw(b"/etc/passwd", ts=13, flags=d.F_OTHER_NS),
    open_raw(b"/etc/passwd", ts=14, cgid=8),  # a nested cgroup, in a container
    open_raw(b"/etc/passwd", ts=15, cgid=9),
    open_raw(b"/sys/fs/cgroup/other/cgroup.procs", ts=16, oflags=1, ret=5),  # a way out: two records
    open_raw(b"/sys/fs/cgroup/other/cgroup.procs", ts=17, oflags=1, ret=5),
    open_raw(b"new", ts=18, oflags=0o101, mode=0o640, ret=6),
    open_raw(b"/tmp/linked", ts=18, oflags=1, ret=7, nlink=2),  # a write to a file with another name
    open_raw(b"a\xffb/../c", ts=19, ret=-2),
    open_raw(b"l/../passwd", ts=19, kname=b"/etc/passwd"),  # named by the kernel
    open_raw(b"l/../passwd", ts=19, kname=b"/etc/passwd"),
    open_raw(b"/etc/hostname", ts=20, tgid=11),  # a process first seen now
]


def test_open_record_makes_the_records_feed_makes() -> None:
    c = correlator()
    fast: list[dict[str, Any]] = []
    for raw in [*RAW, *MIXED]:
        if raw[d.KIND_OFF : d.KIND_OFF + 2] == d.OPEN_KIND:
            ts, cgid, _, tgid, _, _, flags, ret, _, _, dfd, oflags, mode, nlink, _, plen, dino, rino = (
                d.OPEN_REC.unpack_from(raw)
            )
            off = d.OPEN_PATH_OFF
            kname = raw[off + plen :] if flags & d.F_KNAME else b""
            fast += c.open_record(
                ts,
                cgid,
                tgid,
                flags,
                ret,
                dfd,
                oflags,
                mode,
                raw[off : off + plen],
                dino,
                rino,
                kname=kname,
                nlink=nlink,
            )
        else:
            fast += c.feed(d.decode(raw))
    want = general([*RAW, *MIXED])
    assert fast == want
    assert json.dumps(fast) == json.dumps(want)  # the same keys in the same order: the same spool bytes
    paths = [r.get("path") for r in want if r["k"] == "open"]
    assert "/home/u/a.txt" in paths and "/srv/a.txt" in paths and "/etc/passwd" in paths
    assert (
        "/srv/a\\xffb/../c" in paths
    )  # a failed open's '..' after a component stays (it may follow a symlink)
    assert any(r.get("container") == "c0ffee" for r in want)
    assert any(r.get("mntns") == "other" for r in want)
    assert sum(r["k"] == "degradation" for r in want) == 2


def spooled(path: Path) -> list[dict[str, Any]]:
    return list(read_spool(path))


def stopped_recorder(tmp_path: Path) -> tuple[recording.Recorder, recording.Session, SpoolWriter]:
    """A Recorder whose threads are stopped (its queue and _process run in the test alone), with
    one full-detail run in slot 1 spooling to a plain SpoolWriter."""
    rec = recording.Recorder(tmp_path, probes=FakeProbes())  # type: ignore[arg-type]
    rec.close()
    behaviour = Behaviour({}, RECORDING_ITEMS, tmp_path)  # fed by the spool, as Recorder.start sets it
    spool = SpoolWriter(tmp_path / "s.spool.zst", feed=behaviour.add_many)
    session = recording.Session(
        slot=1,
        session_id="s",
        cgroup_path=tmp_path,
        cgroup_id=CGID,
        command=["x"],
        cwd="/home/u",
        detail="full",
        labels={},
        spool=spool,
        correlator=correlator(),
        started_ns=0,
        behaviour=behaviour,
    )
    rec._sessions[1] = session
    return rec, session, spool


def process(
    tmp_path: Path, batches: list[list[bytes]], observed: list[Any] | None = None
) -> list[dict[str, Any]]:
    """The records a full-detail run's spool gets from Recorder._process over `batches` (with an
    observer that keeps what it is shown in `observed`, if given)."""
    rec, session, spool = stopped_recorder(tmp_path)
    if observed is not None:
        session.observer = lambda recs: observed.extend(recs) or []
    for batch in batches:
        rec._process(batch)
    spool.close()
    assert session.records == len(spooled(spool.path))
    return spooled(spool.path)


def test_process_spools_what_the_general_path_makes(tmp_path: Path) -> None:
    raws = [*RAW, *MIXED, *(open_raw(b"/etc/hostname", ts=100 + i) for i in range(50))]
    stray = open_raw(b"/etc/hostname", ts=99, run=2)  # no such run: counted, not spooled
    got = process(tmp_path, [raws[:40], [stray, *raws[40:]]])
    want = json.loads(json.dumps(general(raws)))  # as the spool gives them back: tuples as lists
    assert got == want
    assert [r["t"] for r in got[-50:]] == [1100 + i for i in range(50)]


def test_repeats_of_a_relative_open_follow_the_cwd(tmp_path: Path) -> None:
    raws = [open_raw(b"a", ts=1), open_raw(b"a", ts=2), chdir_raw(b"/v", ts=3), open_raw(b"a", ts=4)]
    got = process(tmp_path, [raws])
    assert [(r["path"], r["t"]) for r in got] == [("/home/u/a", 1001), ("/home/u/a", 1002), ("/v/a", 1004)]


REPEATS = [open_raw(b"/etc/hostname", ts=100 + i) for i in range(20)]
EXEC = next(r for r in RAW if r[d.KIND_OFF : d.KIND_OFF + 2] == struct.pack("<H", d.EV_EXEC_OK))


def test_repeats_are_spool_lines_of_the_same_bytes(tmp_path: Path) -> None:
    # full detail, no observer, a plain SpoolWriter: repeats go to the spool as lines
    got = process(tmp_path, [REPEATS])
    assert got == json.loads(json.dumps(general(REPEATS)))


def test_an_observer_is_shown_records_never_lines(tmp_path: Path) -> None:
    seen: list[Any] = []
    got = process(tmp_path, [REPEATS, [*REPEATS, EXEC]], observed=seen)
    assert all(isinstance(r, dict) for r in seen) and len(seen) == len(got) == 41
    assert got == json.loads(json.dumps(general([*REPEATS, *REPEATS, EXEC])))


def test_lines_become_records_again_when_an_exec_is_in_the_batch(tmp_path: Path) -> None:
    batch = [*REPEATS[:10], EXEC, *REPEATS[10:]]
    assert process(tmp_path, [batch]) == json.loads(json.dumps(general(batch)))


def test_waiting_batches_are_processed_together_up_to_a_barrier(tmp_path: Path) -> None:
    rec, _, spool = stopped_recorder(tmp_path)
    barrier = threading.Event()
    for item in ([REPEATS[0]], REPEATS[1:5], barrier, REPEATS[5:]):
        rec._queue.put(item)
    first = rec._queue.get()
    assert isinstance(first, list)
    assert rec._process_waiting(first) == [barrier]  # what was read before the barrier is spooled first
    assert rec.stats["batches"] == 1 and rec.stats["records"] == 5
    assert rec._queue.get_nowait() == REPEATS[5:]
    spool.close()
    assert [r["t"] for r in spooled(spool.path)] == [1100 + i for i in range(5)]


def test_counted_opens_make_no_record_and_leaving_the_run_is_said_once() -> None:
    """An open the kernel counted already (F_STATE) only updates the descriptor table; a write to
    another cgroup's procs still says the process may leave the run, once per process and file;
    the set that remembers it holds only those, however many files are written."""
    c = correlator()
    for i in range(1000):
        raw = open_raw(f"/home/u/out{i}".encode(), ts=i, oflags=0o1, flags=d.F_STATE, rino=0x1000 + i)
        assert c.open_record(*_fields(raw)) == []
    assert c.procs[10].fds[3] == ("/home/u/out999", 0x1000 + 999)
    procs = open_raw(b"/sys/fs/cgroup/cgroup.procs", ts=2000, oflags=0o1, flags=d.F_STATE)
    (said,) = c.open_record(*_fields(procs))
    assert said["k"] == "degradation" and "/sys/fs/cgroup/cgroup.procs" in said["reason"]
    assert c.open_record(*_fields(procs)) == []  # said once
    assert c._left == {(10, "/sys/fs/cgroup/cgroup.procs")}


def _fields(raw: bytes) -> tuple[Any, ...]:
    ts, cgid, _, tgid, _, _, flags, ret, _, _, dfd, oflags, mode, _, _, plen, dino, rino = (
        d.OPEN_REC.unpack_from(raw)
    )
    return (
        ts,
        cgid,
        tgid,
        flags,
        ret,
        dfd,
        oflags,
        mode,
        raw[d.OPEN_PATH_OFF : d.OPEN_PATH_OFF + plen],
        dino,
        rino,
    )


def test_records_made_outside_the_ring_are_journaled_and_early_ones_replaced(tmp_path: Path) -> None:
    """Session.add_records journals as it goes (what `evidence recover` adds to a killed run's
    spool); journal_early records (limit events not named yet) go at rejournal; drop_journal at the
    end."""
    _, session, _ = stopped_recorder(tmp_path)
    session.journal = tmp_path / "s.records.ndjson"
    denial: Any = {"k": "denial", "t": 1}
    early: Any = {"k": "limit", "t": 2, "pids": []}
    named: Any = {"k": "limit", "t": 2, "pids": [7]}
    session.add_records([denial])
    session.journal_early([early])
    lines = [json.loads(x) for x in session.journal.read_text().splitlines()]
    assert lines == [denial, early]
    session.add_records([named])
    session.rejournal()
    assert [json.loads(x) for x in session.journal.read_text().splitlines()] == [denial, named]
    assert session.extra_records == [denial, named]
    session.drop_journal()
    assert not (tmp_path / "s.records.ndjson").exists() and session.journal is None
