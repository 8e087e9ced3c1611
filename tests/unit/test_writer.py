"""The bundle writer: determinism, hashes, summary aggregation, run id."""

from __future__ import annotations

import hashlib
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from evidence.bundle import format as fmt
from evidence.bundle.spool import SpoolWriter, read_spool
from evidence.bundle.writer import RunMeta, write_bundle
from tests.unit import conftest_bundles as cb


def _open(t: int, path: str, result: int | str = 0, pid: int = 7, access=("read",)) -> dict:
    return {
        "k": "open",
        "t": t,
        "pid": pid,
        "ppid": 1,
        "exe": "/bin/cat",
        "path": path,
        "raw_path": path,
        "dirfd": None,
        "flags": ["O_RDONLY"],
        "access": list(access),
        "mode": None,
        "result": result,
    }


RECORDS = [
    {
        "k": "exec",
        "t": 100,
        "pid": 7,
        "ppid": 1,
        "depth": 0,
        "filename": "/bin/cat",
        "argv": ["cat", "/etc/x"],
        "argv_truncated": False,
        "cwd": "/",
        "result": 0,
    },
    _open(110, "/etc/x"),
    _open(120, "/etc/x", pid=8),
    _open(130, "/etc/missing", "ENOENT"),
    _open(140, "/etc/x"),
    {
        "k": "connect",
        "t": 150,
        "pid": 7,
        "ppid": 1,
        "exe": "/bin/cat",
        "family": "AF_INET",
        "address": "127.0.0.1",
        "port": 80,
        "result": "ECONNREFUSED",
    },
    {"k": "exit", "t": 160, "pid": 7, "ppid": 1, "exe": "/bin/cat", "exit_code": 0, "signal": None},
]
META = RunMeta(
    session_id="s1",
    command=["cat", "/etc/x"],
    cwd="/",
    pid=7,
    cgroup="/cg",
    started_ns=50,
    finished_ns=200,
    exit_code=0,
    detail="summary",
    host={},
    capabilities={},
    headers={},
    lost={"open": 2},
)


def _read(path: Path) -> tuple[list[tarfile.TarInfo], dict, list[dict], bytes]:
    with tarfile.open(path, "r:gz") as tar:
        members = tar.getmembers()
        manifest = json.loads(tar.extractfile("manifest.json").read())
        raw = tar.extractfile("events.ndjson").read()
    return members, manifest, [json.loads(x) for x in raw.splitlines()], raw


def test_same_records_same_bytes(tmp_path: Path) -> None:
    a, b = tmp_path / "a.tar.gz", tmp_path / "b.tar.gz"
    write_bundle(a, META, lambda: RECORDS)
    write_bundle(b, META, lambda: RECORDS)
    assert a.read_bytes() == b.read_bytes()


def test_tar_and_gzip_metadata_are_fixed(tmp_path: Path) -> None:
    out = tmp_path / "x.tar.gz"
    write_bundle(out, META, lambda: RECORDS)
    data = out.read_bytes()
    assert data[4:8] == b"\0\0\0\0"  # gzip mtime
    members, *_ = _read(out)
    assert [m.name for m in members] == ["manifest.json", "events.ndjson"]
    for m in members:
        assert (m.mtime, m.uid, m.gid, m.mode, m.uname, m.gname, m.isfile()) == (0, 0, 0, 0o644, "", "", True)


def test_manifest_hashes_and_counts(tmp_path: Path) -> None:
    out = tmp_path / "x.tar.gz"
    manifest = write_bundle(out, META, lambda: RECORDS)
    _, on_disk, events, raw = _read(out)
    assert on_disk == manifest
    assert manifest["files"]["events.ndjson"] == {"sha256": hashlib.sha256(raw).hexdigest(), "size": len(raw)}
    assert manifest["root_hash"] == fmt.root_hash(fmt.content_hash(e) for e in events)
    assert [e["seq"] for e in events] == list(range(len(events)))
    assert all(
        e["id"] == f"{manifest['run_id']}:{e['seq']}" and e["runid"] == manifest["run_id"] for e in events
    )
    assert manifest["events"] == len(events)
    assert manifest["lost"] == {"total": 2, "by_kind": {"open": 2}}
    assert events[0]["type"] == fmt.RUN_STARTED and events[-1]["type"] == fmt.RUN_FINISHED
    loss = [e for e in events if e["type"] == fmt.LOSS]
    assert loss and loss[0]["data"] == {"kind": "open", "count": 2, "where": "kernel"}
    assert sum(manifest["counts"].values()) == len(events)
    # every event's data matches its model
    for e in events:
        fmt.DATA_MODELS[e["type"]].model_validate(e["data"])
    fmt.Manifest.model_validate(manifest)


def test_run_meta_and_manifest_share_the_run_fields(tmp_path: Path) -> None:
    """RunMeta and Manifest declare the run's own fields once (format.RunInfo); the writer copies them."""
    assert set(fmt.RunInfo.model_fields) <= set(fmt.Manifest.model_fields) & set(RunMeta.model_fields)
    meta = META.model_copy(update={"signal": "SIGTERM", "labels": {"a": "b"}, "policy": {"mode": "enforce"}})
    manifest = write_bundle(tmp_path / "x.tar.gz", meta, lambda: RECORDS)
    # (`artifacts` is left out of a manifest without them: its bytes are those of older bundles)
    assert {k: manifest.get(k) for k in fmt.RunInfo.model_fields} == meta.model_dump(
        include=set(fmt.RunInfo.model_fields)
    )
    assert list(fmt.Manifest.model_fields)[:2] == ["format", "format_version"]  # checked first by the reader
    with pytest.raises(ValueError, match="detail"):
        RunMeta(**{**META.model_dump(), "detail": "verbose"})


def test_summary_counts_are_exact_and_full_keeps_each(tmp_path: Path) -> None:
    _, _, events, _ = _read_after(tmp_path, META)
    opens = [e for e in events if e["type"] == fmt.FILE_OPEN]
    x = [e for e in opens if e["subject"] == "/etc/x"]
    assert len(x) == 1 and x[0]["data"]["count"] == 3
    assert x[0]["data"]["first_time"] == fmt.format_time(110) and x[0]["data"][
        "last_time"
    ] == fmt.format_time(140)
    full = META.model_copy(update={"detail": "full"})
    _, _, events, _ = _read_after(tmp_path, full, "full.tar.gz")
    assert len([e for e in events if e["subject"] == "/etc/x"]) == 3


def _read_after(tmp_path: Path, meta: RunMeta, name: str = "s.tar.gz"):
    out = tmp_path / name
    write_bundle(out, meta, lambda: RECORDS)
    return _read(out)


def test_run_id_ignores_pids_times_and_temp_names(tmp_path: Path) -> None:
    m1 = write_bundle(tmp_path / "1.tar.gz", META, lambda: RECORDS)
    shifted = [{**r, "t": r["t"] + 999, "pid": r["pid"] + 50} for r in RECORDS]
    m2 = write_bundle(tmp_path / "2.tar.gz", META.model_copy(update={"session_id": "other"}), lambda: shifted)
    assert m1["run_id"] == m2["run_id"]
    tmp_a = [*RECORDS, _open(170, "/tmp/tmpab12cd_9/out")]
    tmp_b = [*RECORDS, _open(170, "/tmp/tmpzz99xx_1/out")]
    assert (
        write_bundle(tmp_path / "3.tar.gz", META, lambda: tmp_a)["run_id"]
        == write_bundle(tmp_path / "4.tar.gz", META, lambda: tmp_b)["run_id"]
    )
    other = [*RECORDS, _open(170, "/etc/shadow")]
    assert write_bundle(tmp_path / "5.tar.gz", META, lambda: other)["run_id"] != m1["run_id"]


def test_spool_round_trip_and_bundle_from_spool(tmp_path: Path) -> None:
    spool = tmp_path / "s.zst"
    with SpoolWriter(spool) as w:
        w.write_many(RECORDS[:3])
        w.flush()
        w.write(RECORDS[3])
        w.write_many(RECORDS[4:])
    assert list(read_spool(spool)) == RECORDS
    a = write_bundle(tmp_path / "from-spool.tar.gz", META, lambda: read_spool(spool))
    b = write_bundle(tmp_path / "from-list.tar.gz", META, lambda: RECORDS)
    assert (
        a == b
        and (tmp_path / "from-spool.tar.gz").read_bytes() == (tmp_path / "from-list.tar.gz").read_bytes()
    )


def test_failed_write_leaves_no_partial_file(tmp_path: Path) -> None:
    out = tmp_path / "x.tar.gz"
    out.write_bytes(b"previous bundle")

    def broken():
        yield RECORDS[0]
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        write_bundle(out, META, broken)
    assert out.read_bytes() == b"previous bundle"
    assert [p.name for p in tmp_path.iterdir()] == ["x.tar.gz"]


def test_time_format_round_trip() -> None:
    t = 1_795_000_000_123_456_789
    assert fmt.format_time(t) == "2026-11-18T11:06:40.123456789Z"
    assert fmt.parse_time(fmt.format_time(t)) == t


def test_past_the_caps_records_are_counted_and_the_bundle_still_verifies(tmp_path: Path) -> None:
    """Every bundle the writer makes is one the reader accepts: past a cap, records are counted by
    kind as lost (where: writer), and the closing events are always written."""
    from evidence.bundle.reader import open_bundle
    from evidence.bundle.writer import Caps

    recs = [cb.open_(1000 + i, f"/w/file-{i}", ["read"]) for i in range(50)] + [
        cb.connect(9000, "10.0.0.1", 443)
    ]
    out = tmp_path / "capped.tar.gz"
    manifest = write_bundle(out, cb.meta(detail="full"), lambda: iter(recs), caps=Caps(events=20))
    assert manifest["events"] == 20 + 3  # 20 (run.started among them) + two loss events and run.finished
    assert manifest["lost"]["by_kind"] == {"over_cap:file.open": 31, "over_cap:network.connect": 1}
    assert manifest["lost"]["total"] == 32
    events = list(open_bundle(out).events())  # verifies
    loss = [e["data"] for e in events if e["type"] == "dev.evidence.loss"]
    assert {(d["kind"], d["count"], d["where"]) for d in loss} == {
        ("over_cap:file.open", 31, "writer"),
        ("over_cap:network.connect", 1, "writer"),
    }
    assert events[-1]["type"] == "dev.evidence.run.finished"
    # a size cap works the same way
    small = write_bundle(
        tmp_path / "small.tar.gz", cb.meta(detail="full"), lambda: iter(recs), caps=Caps(decompressed=4000)
    )
    assert small["lost"]["total"] > 0 and small["files"]["events.ndjson"]["size"] <= 4000 + 2000
    list(open_bundle(tmp_path / "small.tar.gz").events())


def test_an_event_longer_than_a_line_may_be_is_counted_not_written(tmp_path: Path) -> None:
    """A job can make a path of megabytes (a deep working directory): the bundle must stay readable."""
    from evidence.bundle.reader import open_bundle

    deep = "/w/" + "/".join(["a" * 250] * 4300) + "/hidden-write"
    recs = [cb.open_(1000, deep, ["write", "create"]), cb.open_(2000, "/w/ok", ["read"])]
    out = tmp_path / "deep.tar.gz"
    manifest = write_bundle(out, cb.meta(), lambda: iter(recs))
    assert manifest["lost"]["by_kind"] == {"over_cap:file.open": 1}
    paths = [e["data"].get("path") for e in open_bundle(out).events()]  # verifies
    assert "/w/ok" in paths and deep not in paths


@pytest.mark.parametrize("labels", [None, {"team": "ci", "ünï": 'q"uote\\'}])
def test_each_line_is_the_canonical_json_of_its_event(tmp_path: Path, labels: dict | None) -> None:
    """The sink puts a line together from canonical parts: the bytes must be exactly those of
    canonical.dumps(event), and the root hash the one made from fmt.content_hash of each event."""
    from evidence.bundle import canonical

    odd = ["/w/\u00e9\u4e2d\U0001f600", '/w/q"b\\s', "/w/ctl\x01\x1f\x7f", "/w/\u2028line"]
    recs = [cb.open_(1000 + i, p, ["read"]) for i, p in enumerate(odd)] + [cb.connect(9000, "::1", 443)]
    meta = cb.meta(detail="full", labels=labels or {})
    out = tmp_path / "b.tar.gz"
    manifest = write_bundle(out, meta, lambda: iter(recs))
    _, _, events, raw = _read(out)
    assert raw.splitlines() == [canonical.dumps(e) for e in events]
    assert manifest["root_hash"] == fmt.root_hash(fmt.content_hash(e) for e in events)
    assert {e["subject"] for e in events} >= set(odd)


def test_the_compressed_cap_holds_when_text_does_not_compress(tmp_path: Path) -> None:
    """The compressed-size estimate starts only near the cap (text never grows much when deflated):
    random paths, which compress badly, still stop at the cap, and the bundle verifies."""
    import random

    from evidence.bundle.reader import open_bundle
    from evidence.bundle.writer import Caps

    rng = random.Random(7)
    recs = [cb.open_(1000 + i, "/w/" + rng.randbytes(300).hex(), ["read"]) for i in range(400)]
    out = tmp_path / "c.tar.gz"
    manifest = write_bundle(out, cb.meta(detail="full"), lambda: iter(recs), caps=Caps(compressed=60_000))
    assert manifest["lost"]["by_kind"].get("over_cap:file.open", 0) > 0
    assert out.stat().st_size <= 60_000 + 8_000
    events = list(open_bundle(out).events())  # verifies
    written = sum(1 for e in events if e["type"] == fmt.FILE_OPEN)
    assert written + manifest["lost"]["by_kind"]["over_cap:file.open"] == 400


def _reference_run_id(meta: RunMeta, recs: list[dict]) -> str:
    """The run id as the writer made it before its sets could go to disk: every set in memory,
    sorted by repr, one canonical document."""
    from evidence.bundle import canonical
    from evidence.bundle.writer import Behaviour

    b = Behaviour(meta.roots, budget=10**9)
    for r in recs:
        b.add(r)
    doc: dict = {"command": b.norm.argv(meta.command)}
    for name, part in (("execs", b.execs), ("files", b.files), ("connects", b.nets), ("denials", b.denials)):
        doc[name] = sorted(part.items, key=repr)
    for name, part in (("changes", b.changes), ("namespaces", b.namespaces)):
        if part:
            doc[name] = sorted(part.items, key=repr)
    return "run-" + hashlib.sha256(canonical.dumps(doc)).hexdigest()[:32]


def _flood(n: int) -> list[dict]:
    recs: list[dict] = []
    for i in range(n):
        recs.append(
            {
                "k": "exec", "t": 1000 + i, "pid": 10 + i, "ppid": 1, "depth": 1, "filename": "/bin/true",
                "argv": ["/bin/true", f"arg-{i % (n // 2 + 1)}", "\u00e9\t\"q"], "argv_truncated": False,
                "cwd": "/", "result": 0,
            }
        )  # fmt: skip
        recs.append(_open(2000 + i, f"/w/f{i % 7}/\u4e2d{i}", "ENOENT" if i % 3 else 0))
        if i % 5 == 0:
            recs.append(cb.connect(3000 + i, f"10.0.{i % 9}.1", 443))
    recs.append(
        {"k": "change", "t": 9000, "pid": 7, "ppid": 1, "exe": "/bin/mv", "operation": "rename",
         "path": "/w/a", "target": "/w/b", "mode": None, "uid": None, "gid": None, "result": 0}
    )  # fmt: skip
    return recs


@pytest.mark.parametrize("memory", [3, 50, 10**9])
def test_a_bounded_writer_writes_the_same_bundle(tmp_path: Path, memory: int) -> None:
    """Past its memory budget, the writer puts the run id's sets on disk and streams a summary's
    events in a second pass: the run id and the bundle are byte for byte what an unbounded writer
    makes, for summary and full detail."""
    from evidence.bundle import writer

    recs = _flood(400)
    for detail in ("summary", "full"):
        meta = META.model_copy(update={"detail": detail})
        run_id, body = writer._read(meta, lambda: iter(recs), memory=memory)
        assert run_id == _reference_run_id(meta, recs)
        events = list(body)
        ref_id, ref_body = writer._read(meta, lambda: iter(recs), memory=10**9)
        assert (run_id, events) == (ref_id, list(ref_body))


def test_the_writer_holds_at_most_its_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    from evidence.bundle.writer import Behaviour

    b = Behaviour(META.roots, budget=100)
    most = 0
    for r in _flood(2000):
        b.add(r)
        most = max(most, b.held)
    assert most <= 100
    assert b.execs.runs and b.files.runs  # the biggest sets went to disk
    assert b.run_id(META.command) == _reference_run_id(META, _flood(2000))


@pytest.mark.parametrize("detail", ["summary", "full"])
def test_a_behaviour_fed_while_spooling_gives_the_same_bundle_in_one_pass(
    tmp_path: Path, detail: str
) -> None:
    """The recorder feeds the run id's Behaviour as it spools (SpoolWriter's feed, repeated opens as
    spool lines): the bundle is byte for byte the one a writer that reads the spool for it makes,
    and the records are read once, for summary and for full detail."""
    from evidence.bundle.writer import Behaviour

    meta = META.model_copy(update={"detail": detail, "roots": {"${WORKSPACE}": "/w"}})
    recs = _flood(300)
    behaviour = Behaviour(meta.roots, budget=40, tmp_dir=tmp_path)  # small: its sets go to disk too
    spool = tmp_path / "run.spool.zst"
    with SpoolWriter(spool, feed=behaviour.add_many) as w:
        for i in range(0, len(recs), 7):
            w.write_many(recs[i : i + 7])
        line = orjson.dumps(recs[1]) + b"\n"  # a repeat the recorder spools as a line, no record
        w.write_many([recs[1], line, line])
    reads = 0

    def records() -> Iterator[dict]:
        nonlocal reads
        reads += 1
        return read_spool(spool)

    fed, plain = tmp_path / "fed.tar.gz", tmp_path / "plain.tar.gz"
    m1 = write_bundle(fed, meta, records, behaviour=behaviour)
    assert reads == 1
    m2 = write_bundle(plain, meta, lambda: read_spool(spool))
    assert m1["run_id"] == m2["run_id"] == _reference_run_id(meta, list(read_spool(spool)))
    assert fed.read_bytes() == plain.read_bytes()


def test_a_behaviour_of_other_roots_or_used_before_is_not_trusted(tmp_path: Path) -> None:
    """A Behaviour made with other roots than the run's (they were set after it started), or whose
    run id was made already (a retry), is rebuilt from the records: the run id is still right."""
    from evidence.bundle.writer import Behaviour

    meta = META.model_copy(update={"detail": "full", "roots": {"${WORKSPACE}": "/w"}})
    recs = _flood(50)
    want = _reference_run_id(meta, recs)
    for roots, used in (({}, False), (meta.roots, True)):
        b = Behaviour(roots)
        b.add_many(recs)
        if used:
            b.run_id(meta.command)
        m = write_bundle(tmp_path / "b.tar.gz", meta, lambda: iter(recs), behaviour=b)
        assert m["run_id"] == want


def test_repeats_but_for_the_time_make_the_same_bytes_as_records_made_one_by_one(tmp_path: Path) -> None:
    """Full detail: a record that repeats the one before it but for its time has its event's data
    put together from the first one's canonical bytes cut at the time. Each line must still be
    canonical.dumps of to_event's event for its own record, also when a field holds the very text
    of a time (the record's own, or a sample the writer cuts at), and for kinds with no time in
    their data."""
    from evidence.bundle import canonical
    from evidence.bundle.records import to_event

    own = cb.T0 + 2000
    odd = [fmt.format_time(own), fmt.format_time(0), fmt.format_time(999_999_999_999), "/etc/x"]
    recs: list[dict] = []
    for i, path in enumerate(odd):
        recs += [cb.open_(2000 + 1000 * i + j, path, ["read"]) for j in range(4)]
    recs += [cb.exec_(9000 + j, 5, 1, "/bin/true", ["true"]) for j in range(3)]
    recs += [cb.open_(9500, "/etc/y", ["read"]), cb.open_(9600, "/etc/y", ["read"], pid=7)]
    meta = cb.meta(detail="full")
    out = tmp_path / "r.tar.gz"
    manifest = write_bundle(out, meta, lambda: iter([dict(r) for r in recs]))
    _, _, events, raw = _read(out)
    lines = raw.splitlines()
    assert lines == [canonical.dumps(e) for e in events]
    body = events[1 : 1 + len(recs)]
    for rec, e in zip(recs, body, strict=True):
        etype, subject, t_ns, data = to_event(dict(rec))  # type: ignore[arg-type]
        assert (e["type"], e["subject"], e["time"], e["data"]) == (
            etype,
            subject,
            fmt.format_time(t_ns),
            data,
        )
    assert manifest["root_hash"] == fmt.root_hash(fmt.content_hash(e) for e in events)


def test_full_detail_read_from_the_spools_lines_is_the_same_bundle(tmp_path: Path) -> None:
    """The recorder hands the writer the spool's lines too: a line that is the one before it but for
    the digits of its time is taken as a repeat unparsed (writer._marked_lines); any other line is
    parsed. The bundle is byte for byte the one written from the parsed records."""
    from evidence.bundle import writer
    from evidence.bundle.spool import read_spool_lines

    own = cb.T0 + 2000
    recs: list[dict] = []
    for i, path in enumerate([fmt.format_time(own), "/etc/x", '/w/q"b\\s', "/w/\u4e2d"]):
        recs += [cb.open_(2000 + 1000 * i + j, path, ["read"]) for j in range(4)]
    recs += [cb.exec_(9000 + j, 5, 1, "/bin/true", ["true"]) for j in range(3)]
    recs += [
        {"k": "exit", "pid": 5, "t": cb.T0 + 9900 + j, "ppid": 1, "code": 0} for j in range(2)
    ]  # time not second
    spool = tmp_path / "s.spool.zst"
    with SpoolWriter(spool) as w:
        w.write_many(recs)
    lines = list(read_spool_lines(spool))
    marked = list(writer._marked_lines(lines))
    assert marked[:4] == [recs[0], recs[1]["t"], recs[2]["t"], recs[3]["t"]]
    assert marked[-2:] == recs[-2:]  # parsed: the time is not where the recorder puts it
    # every repeat but the exit's (its time is not second: its line is parsed, and it is a repeat
    # to the parsed records' test, writer._marked)
    repeats = [
        r["t"]
        for i, r in enumerate(recs[:-2])
        if i and r["k"] == recs[i - 1]["k"] and r.get("path") == recs[i - 1].get("path")
    ]
    assert [m for m in marked if type(m) is int] == repeats
    assert [m for m in writer._marked(read_spool(spool)) if type(m) is int] == [*repeats, recs[-1]["t"]]
    meta = cb.meta(detail="full")
    a, b = tmp_path / "a.tar.gz", tmp_path / "b.tar.gz"
    write_bundle(a, meta, lambda: read_spool(spool))
    write_bundle(b, meta, lambda: read_spool(spool), lines=lambda: read_spool_lines(spool))
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("batch", [1, 3, 7, 1024])
@pytest.mark.parametrize("cap", [None, 40])
def test_full_detail_in_batches_is_the_bundle_made_event_by_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch: int, cap: int | None
) -> None:
    """write_full makes full detail's events a batch at a time and takes a batch in at once when it
    fits under the caps: the bundle is byte for byte the one made event by event (each under _put's
    checks), whatever the batch size, with repeats (split at their time or not) across batch
    boundaries, and with a cap reached in the middle of a batch."""
    from evidence.bundle import sink, writer
    from evidence.bundle.spool import read_spool_lines
    from evidence.bundle.writer import Caps

    own = cb.T0 + 2000
    recs: list[dict] = []
    for i, path in enumerate(["/etc/x", fmt.format_time(own), '/w/q"b\\s', "/w/\u4e2d", "/etc/x"]):
        recs += [cb.open_(2000 + 1000 * i + j, path, ["read"]) for j in range(5 + 3 * i)]
        recs += [cb.open_(9000 + 1000 * i + j, f"/w/d/{i}/{j}", ["write"], result="ENOENT") for j in range(4)]
    recs += [cb.connect(90000 + j, "10.0.0.1", 443) for j in range(3)]
    spool = tmp_path / "s.spool.zst"
    with SpoolWriter(spool) as w:
        w.write_many(recs)
    meta = cb.meta(detail="full")
    caps = Caps() if cap is None else Caps(events=cap)

    def bundle(name: str) -> bytes:
        out = tmp_path / name
        write_bundle(out, meta, lambda: read_spool(spool), caps=caps, lines=lambda: read_spool_lines(spool))
        return out.read_bytes()

    monkeypatch.setattr(sink, "_FULL_BATCH", batch)
    batched = bundle("batched.tar.gz")
    monkeypatch.setattr(writer._EventSink, "_full_batch", lambda self, items, state: False)
    assert batched == bundle("each.tar.gz")
    if cap is not None:
        with tarfile.open(tmp_path / "batched.tar.gz") as tar:
            manifest = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
        assert manifest["lost"]["by_kind"]["over_cap:file.open"] > 0
