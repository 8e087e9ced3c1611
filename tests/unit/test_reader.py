"""The streaming reader: valid bundles read back exactly; limits and integrity checks hold."""

from __future__ import annotations

import gzip
import hashlib
from pathlib import Path

import orjson
import pytest

from evidence.bundle import container, reader
from evidence.bundle import format as fmt
from evidence.bundle.writer import write_bundle
from evidence.errors import BundleError
from tests.unit.conftest_bundles import members, meta, pack, rebuild, records, write


def test_reads_back_what_the_writer_wrote(tmp_path: Path) -> None:
    path = write(tmp_path / "a.tar.gz")
    manifest, lines = members(path)
    b = reader.open_bundle(path)
    assert b.manifest == manifest
    assert b.run_id == manifest["run_id"]
    events = list(b.events())
    assert events == [orjson.loads(line) for line in lines]
    assert [e["seq"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == fmt.RUN_STARTED and events[-1]["type"] == fmt.RUN_FINISHED
    assert fmt.root_hash(fmt.content_hash(e) for e in events) == manifest["root_hash"]


def test_read_manifest_and_read_events_verify_first(tmp_path: Path) -> None:
    path = write(tmp_path / "a.tar.gz")
    assert reader.read_manifest(path)["events"] == len(list(reader.read_events(path)))
    manifest, lines = members(path)
    bad = rebuild(tmp_path / "bad.tar.gz", manifest, lines, fix_root=False, fix_files=False)
    # flip one byte of the last event's time: the sha256 only fails at the end of the stream
    lines[-1] = lines[-1].replace(b'"time":"2023', b'"time":"2024')
    bad = rebuild(tmp_path / "bad.tar.gz", manifest, lines, fix_root=False, fix_files=False)
    with pytest.raises(reader.VerificationError, match="sha256 does not match"):
        reader.read_events(bad)  # nothing is yielded: it fails before returning the iterator
    with pytest.raises(reader.VerificationError):
        reader.read_manifest(bad)


def test_events_stream_raises_at_the_end_for_a_late_integrity_problem(tmp_path: Path) -> None:
    path = write(tmp_path / "a.tar.gz")
    manifest, lines = members(path)
    manifest["root_hash"] = "0" * 64
    bad = rebuild(tmp_path / "bad.tar.gz", manifest, lines, fix_root=False)
    seen = []
    with pytest.raises(reader.VerificationError, match="root hash") as e:
        for ev in reader.open_bundle(bad).events():
            seen.append(ev)
    assert len(seen) == len(lines)
    assert e.value.exit_code == 2
    assert "\n" not in str(e.value)


def test_full_detail_and_empty_optional_fields(tmp_path: Path) -> None:
    path = tmp_path / "full.tar.gz"
    write_bundle(path, meta(detail="full"), lambda: iter(records()))
    events = list(reader.open_bundle(path).events())
    opens = [e for e in events if e["type"] == fmt.FILE_OPEN]
    assert len(opens) == 5  # the two Makefile reads are not aggregated in full detail


def test_missing_file_is_a_bundle_error(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="cannot read bundle"):
        reader.open_bundle(tmp_path / "nope.tar.gz")
    with pytest.raises(BundleError, match="not a regular file|cannot read"):
        reader.open_bundle(tmp_path)


def test_limits_are_enforced(tmp_path: Path) -> None:
    path = write(tmp_path / "a.tar.gz")
    size = path.stat().st_size
    with pytest.raises(reader.VerificationError, match="exceeds the limit"):
        reader.open_bundle(path, reader.Limits(compressed=size - 1))
    with pytest.raises(reader.VerificationError, match="larger than the limit|exceeds the limit"):
        reader.open_bundle(path, reader.Limits(decompressed=1000)).verify()
    with pytest.raises(reader.VerificationError, match="more than 3 events"):
        reader.open_bundle(path, reader.Limits(events=3)).verify()
    with pytest.raises(reader.VerificationError, match="longer than 100 bytes"):
        reader.open_bundle(path, reader.Limits(line=100)).verify()
    with pytest.raises(reader.VerificationError, match="larger than the limit"):
        reader.open_bundle(path, reader.Limits(manifest=10))


def test_gzip_bomb_stops_at_the_decompressed_limit(tmp_path: Path) -> None:
    # Member sizes and padding are capped before this counter is reached; it is the last line of
    # defence, so it is tested on the inflater itself.
    bomb = tmp_path / "bomb.gz"
    bomb.write_bytes(gzip.compress(bytes(10 * 1024 * 1024), mtime=0))
    with open(bomb, "rb") as f, pytest.raises(container.Fatal, match="exceeds the limit"):
        for _ in container.inflate(f, reader.Limits(decompressed=1024 * 1024)):
            pass


def test_time_ns_matches_format_time() -> None:
    for ns in (0, 1_700_000_000_123_456_789, 4_102_444_799_999_999_999):
        assert reader.time_ns(fmt.format_time(ns)) == ns == fmt.parse_time(fmt.format_time(ns))
    for bad in (
        "2023-13-01T00:00:00.000000000Z",
        "2023-01-01T00:00:00Z",
        "2023-01-01T24:00:00.000000000Z",
        5,
    ):
        with pytest.raises(ValueError):
            reader.time_ns(bad)  # type: ignore[arg-type]


def test_every_problem_is_listed(tmp_path: Path) -> None:
    path = write(tmp_path / "a.tar.gz")
    manifest, lines = members(path)
    manifest["counts"] = {"x": 1}
    manifest["root_hash"] = "1" * 64
    bad = rebuild(tmp_path / "bad.tar.gz", manifest, lines, fix_root=False)
    with pytest.raises(reader.VerificationError) as e:
        reader.open_bundle(bad).verify()
    assert len(e.value.problems) == 2
    assert "and 1 more" in str(e.value)


def test_file_hash_covers_the_bytes(tmp_path: Path) -> None:
    path = write(tmp_path / "a.tar.gz")
    manifest, lines = members(path)
    data = b"".join(line + b"\n" for line in lines)
    assert manifest["files"][fmt.EVENTS_NAME] == {
        "sha256": hashlib.sha256(data).hexdigest(),
        "size": len(data),
    }
    pack(
        tmp_path / "same.tar.gz",
        [(fmt.MANIFEST_NAME, orjson.dumps(manifest, option=orjson.OPT_SORT_KEYS)), (fmt.EVENTS_NAME, data)],
    )
    reader.open_bundle(tmp_path / "same.tar.gz").verify()
