"""The bundle writer: determinism, hashes, summary aggregation, run id."""

from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path

import pytest

from bundle import format as fmt
from bundle.spool import SpoolWriter, read_spool
from bundle.writer import RunMeta, write_bundle


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


def test_summary_counts_are_exact_and_full_keeps_each(tmp_path: Path) -> None:
    _, _, events, _ = _read_after(tmp_path, META)
    opens = [e for e in events if e["type"] == fmt.FILE_OPEN]
    x = [e for e in opens if e["subject"] == "/etc/x"]
    assert len(x) == 1 and x[0]["data"]["count"] == 3
    assert x[0]["data"]["first_time"] == fmt.format_time(110) and x[0]["data"][
        "last_time"
    ] == fmt.format_time(140)
    full = RunMeta(**{**META.__dict__, "detail": "full"})
    _, _, events, _ = _read_after(tmp_path, full, "full.tar.gz")
    assert len([e for e in events if e["subject"] == "/etc/x"]) == 3


def _read_after(tmp_path: Path, meta: RunMeta, name: str = "s.tar.gz"):
    out = tmp_path / name
    write_bundle(out, meta, lambda: RECORDS)
    return _read(out)


def test_run_id_ignores_pids_times_and_temp_names(tmp_path: Path) -> None:
    m1 = write_bundle(tmp_path / "1.tar.gz", META, lambda: RECORDS)
    shifted = [{**r, "t": r["t"] + 999, "pid": r["pid"] + 50} for r in RECORDS]
    m2 = write_bundle(
        tmp_path / "2.tar.gz", RunMeta(**{**META.__dict__, "session_id": "other"}), lambda: shifted
    )
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
