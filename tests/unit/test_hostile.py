"""A corpus of hostile bundles: each must give exit 2 with a one-line message through the CLI, never
a traceback; and property tests: any mutation of a valid bundle gives exit 0, 1 or 2."""

from __future__ import annotations

import gzip
import io
import tarfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evidence.bundle import canonical
from evidence.bundle import format as fmt
from evidence.cli import main
from tests.unit.conftest_bundles import gz, line, members, pack, rebuild, tar_bytes, tarinfo, write

Maker = Callable[[Path, dict[str, Any], list[bytes]], Path]


def _m(manifest: dict[str, Any]) -> bytes:
    return canonical.dumps(manifest)


def _events(lines: list[bytes]) -> bytes:
    return b"".join(x + b"\n" for x in lines)


def _ev(lines: list[bytes], i: int) -> dict[str, Any]:
    ev: dict[str, Any] = orjson.loads(lines[i])
    return ev


def _with(lines: list[bytes], i: int, **changes: Any) -> list[bytes]:
    ev = _ev(lines, i)
    ev.update(changes)
    return lines[:i] + [line(ev)] + lines[i + 1 :]


def _with_data(lines: list[bytes], i: int, **changes: Any) -> list[bytes]:
    ev = _ev(lines, i)
    ev["data"] = {**ev["data"], **changes}
    return lines[:i] + [line(ev)] + lines[i + 1 :]


def _raw(p: Path, entries: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    p.write_bytes(gz(tar_bytes(entries)))
    return p


def _valid_entries(m: dict[str, Any], lines: list[bytes]) -> list[tuple[tarfile.TarInfo, bytes]]:
    mb, eb = _m(m), _events(lines)
    return [(tarinfo(fmt.MANIFEST_NAME, len(mb)), mb), (tarinfo(fmt.EVENTS_NAME, len(eb)), eb)]


def _bomb_padding(p: Path, m: dict[str, Any], lines: list[bytes]) -> Path:
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    p.write_bytes(
        c.compress(tar_bytes(_valid_entries(m, lines))) + c.compress(bytes(50 * 1024 * 1024)) + c.flush()
    )
    return p


def _huge_member(p: Path, m: dict[str, Any], lines: list[bytes]) -> Path:
    mb = _m(m)
    ti = tarinfo(fmt.EVENTS_NAME, fmt.MAX_DECOMPRESSED + 512)
    head = tar_bytes([(tarinfo(fmt.MANIFEST_NAME, len(mb)), mb)])[: -1024 * 0 or None]
    data = head[: 512 + ((len(mb) + 511) // 512) * 512] + ti.tobuf(format=tarfile.GNU_FORMAT)
    p.write_bytes(gzip.compress(data + bytes(1024 * 1024), mtime=0))
    return p


def _truncated(p: Path, m: dict[str, Any], lines: list[bytes]) -> Path:
    data = gz(tar_bytes(_valid_entries(m, lines)))
    p.write_bytes(data[: len(data) // 2])
    return p


def _truncated_tar(p: Path, m: dict[str, Any], lines: list[bytes]) -> Path:
    tar = tar_bytes(_valid_entries(m, lines))
    p.write_bytes(gz(tar[:1200]))
    return p


def _no_end_marker(p: Path, m: dict[str, Any], lines: list[bytes]) -> Path:
    mb, eb = _m(m), _events(lines)
    blob = b""
    for name, data in ((fmt.MANIFEST_NAME, mb), (fmt.EVENTS_NAME, eb)):
        blob += tarinfo(name, len(data)).tobuf(format=tarfile.USTAR_FORMAT) + data + bytes((-len(data)) % 512)
    p.write_bytes(gz(blob))
    return p


def _trailing_gzip(p: Path, m: dict[str, Any], lines: list[bytes]) -> Path:
    p.write_bytes(gz(tar_bytes(_valid_entries(m, lines))) + gz(b"more"))
    return p


def _not_gzip(p: Path, m: dict[str, Any], lines: list[bytes]) -> Path:
    p.write_bytes(tar_bytes(_valid_entries(m, lines)))
    return p


def _link(kind: bytes, name: str = fmt.EVENTS_NAME) -> Maker:
    def make(p: Path, m: dict[str, Any], lines: list[bytes]) -> Path:
        mb = _m(m)
        return _raw(
            p, [(tarinfo(fmt.MANIFEST_NAME, len(mb)), mb), (tarinfo(name, 0, kind, "/etc/passwd"), b"")]
        )

    return make


def _named(name: str, first: bool = False) -> Maker:
    def make(p: Path, m: dict[str, Any], lines: list[bytes]) -> Path:
        entries = [(name, b"x")] + [(fmt.MANIFEST_NAME, _m(m)), (fmt.EVENTS_NAME, _events(lines))]
        return pack(p, entries if first else entries[1:] + entries[:1])

    return make


def _pax(p: Path, m: dict[str, Any], lines: list[bytes]) -> Path:
    mb, eb = _m(m), _events(lines)
    ti = tarinfo(fmt.MANIFEST_NAME, len(mb))
    ti.pax_headers = {"path": fmt.MANIFEST_NAME, "comment": "x"}
    p.write_bytes(gz(tar_bytes([(ti, mb), (tarinfo(fmt.EVENTS_NAME, len(eb)), eb)], tarfile.PAX_FORMAT)))
    return p


def _bad_checksum(p: Path, m: dict[str, Any], lines: list[bytes]) -> Path:
    tar = bytearray(tar_bytes(_valid_entries(m, lines)))
    tar[0:1] = b"X"  # name changes, checksum does not
    p.write_bytes(gz(bytes(tar)))
    return p


def _manifest_edit(**changes: Any) -> Maker:
    def make(p: Path, m: dict[str, Any], lines: list[bytes]) -> Path:
        return rebuild(p, {**m, **changes}, lines, fix_root="root_hash" not in changes)

    return make


def _lines(edit: Callable[[list[bytes]], list[bytes]], **kw: Any) -> Maker:
    def make(p: Path, m: dict[str, Any], lines: list[bytes]) -> Path:
        return rebuild(p, m, edit(list(lines)), **kw)

    return make


def _renumber(lines: list[bytes]) -> list[bytes]:
    out = []
    for i, raw in enumerate(lines):
        ev = orjson.loads(raw)
        out.append(line({**ev, "seq": i, "id": f"{ev['runid']}:{i}"}))
    return out


def _depth_bomb(lines: list[bytes]) -> list[bytes]:
    ev = lines[1]
    deep = b"[" * 5000 + b"]" * 5000
    return [lines[0], ev.replace(b'"data":{', b'"data":{"a":' + deep + b",", 1)] + lines[2:]


def _mild_depth(lines: list[bytes]) -> list[bytes]:
    deep = b"[" * 100 + b"]" * 100
    return [lines[0], lines[1].replace(b'"data":{', b'"data":{"a":' + deep + b",", 1)] + lines[2:]


HOSTILE: dict[str, tuple[Maker, str]] = {
    "traversal-name": (_named("../evil", first=True), "escapes the archive"),
    "traversal-nested": (_named("a/../../evil", first=True), "escapes the archive"),
    "absolute-name": (_named("/etc/cron.d/evil", first=True), "absolute path"),
    "symlink-member": (_link(tarfile.SYMTYPE), "symbolic link"),
    "hardlink-member": (_link(tarfile.LNKTYPE), "hard link"),
    "chardev-member": (_link(tarfile.CHRTYPE), "character device"),
    "blockdev-member": (_link(tarfile.BLKTYPE), "block device"),
    "fifo-member": (_link(tarfile.FIFOTYPE), "FIFO"),
    "directory-member": (_link(tarfile.DIRTYPE, "dir/"), "directory"),
    "pax-header": (_pax, "pax extended header"),
    "gzip-bomb-padding": (_bomb_padding, "after the end of the tar archive"),
    "gzip-bomb-member": (_huge_member, "larger than the limit"),
    "giant-line": (_lines(lambda ls: [ls[0], b'{"x":"' + b"a" * (2 * 1024 * 1024) + b'"}'] + ls[1:]), "longer than"),
    "truncated-gzip": (_truncated, "truncated gzip stream"),
    "truncated-tar": (_truncated_tar, "truncated tar archive"),
    "no-end-marker": (_no_end_marker, "no end-of-archive marker"),
    "trailing-gzip-member": (_trailing_gzip, "after the end of the gzip stream"),
    "not-gzip": (_not_gzip, "corrupt gzip stream"),
    "bad-tar-checksum": (_bad_checksum, "checksum mismatch"),
    "second-manifest": (_named(fmt.MANIFEST_NAME), "duplicate member"),
    "manifest-not-first": (lambda p, m, ls: pack(p, [(fmt.EVENTS_NAME, _events(ls)), (fmt.MANIFEST_NAME, _m(m))]), "must be the first member"),
    "extra-member": (_named("notes.txt"), "unexpected member"),
    "extra-member-first": (_named("notes.txt", first=True), "unexpected member"),
    "no-events-member": (lambda p, m, ls: pack(p, [(fmt.MANIFEST_NAME, _m(m))]), "has no events.ndjson"),
    "empty-archive": (lambda p, m, ls: pack(p, []), "empty archive"),
    "manifest-not-json": (lambda p, m, ls: pack(p, [(fmt.MANIFEST_NAME, b"{nope"), (fmt.EVENTS_NAME, b"")]), "invalid JSON"),
    "manifest-dup-key": (lambda p, m, ls: pack(p, [(fmt.MANIFEST_NAME, b'{"a":1,"a":2}'), (fmt.EVENTS_NAME, b"")]), "duplicate JSON key"),
    "manifest-whitespace": (lambda p, m, ls: pack(p, [(fmt.MANIFEST_NAME, orjson.dumps(m, option=orjson.OPT_INDENT_2)), (fmt.EVENTS_NAME, _events(ls))]), "not canonical JSON"),
    "manifest-wrong-format": (_manifest_edit(format="other"), "manifest.json: format"),
    "manifest-extra-field": (_manifest_edit(evil=1), "manifest.json: evil"),
    "manifest-float": (_manifest_edit(capabilities={"x": 1.5}), "float"),
    "manifest-bad-run-id": (_manifest_edit(run_id="../x", source=fmt.source_for("../x")), "not a valid run id"),
    "manifest-bad-time": (_manifest_edit(started_at="yesterday"), "started_at"),
    "manifest-extra-file": (lambda p, m, ls: pack(p, [(fmt.MANIFEST_NAME, _m({**m, "files": {**m["files"], "x": m["files"][fmt.EVENTS_NAME]}})), (fmt.EVENTS_NAME, _events(ls))]), "files must list exactly"),
    "manifest-count-mismatch": (_manifest_edit(events=999), "manifest says 999 events"),
    "manifest-counts-by-type": (_manifest_edit(counts={fmt.RUN_STARTED: 1}), "manifest counts"),
    "manifest-lost-total": (_manifest_edit(lost={"total": 5, "by_kind": {}}), "lost.total"),
    "manifest-size-mismatch": (lambda p, m, ls: pack(p, [(fmt.MANIFEST_NAME, _m({**m, "files": {fmt.EVENTS_NAME: {**m["files"][fmt.EVENTS_NAME], "size": 3}}})), (fmt.EVENTS_NAME, _events(ls))]), "the manifest says 3"),
    "tampered-hash": (_lines(lambda ls: _with_data(ls, 2, pid=999), fix_files=False, fix_root=False), "sha256 does not match"),
    "tampered-root-hash": (_manifest_edit(root_hash="ab" * 32), "root hash"),
    "tampered-event-and-hash": (_lines(lambda ls: _with_data(ls, 2, pid=999), fix_root=False), "root hash"),
    "reordered-seq": (_lines(lambda ls: [ls[0], ls[2], ls[1], *ls[3:]]), "leaves a gap"),
    "duplicated-seq": (_lines(lambda ls: [ls[0], ls[1], ls[1], *ls[2:]]), "repeats or goes back"),
    "missing-event": (_lines(lambda ls: [ls[0], *ls[2:]]), "leaves a gap"),
    "seq-not-int": (_lines(lambda ls: _with(ls, 1, seq="1")), "not an integer"),
    "seq-bool": (_lines(lambda ls: _with(ls, 1, seq=True)), "not an integer"),
    "wrong-run-id": (_lines(lambda ls: _with(ls, 1, runid="run-other")), "differs from the manifest's run_id"),
    "bad-id": (_lines(lambda ls: _with(ls, 1, id="whatever")), "is not"),
    "wrong-source": (_lines(lambda ls: _with(ls, 1, source="urn:x")), "source"),
    "wrong-specversion": (_lines(lambda ls: _with(ls, 1, specversion="0.3")), "specversion"),
    "wrong-datacontenttype": (_lines(lambda ls: _with(ls, 1, datacontenttype="text/plain")), "datacontenttype"),
    "bad-time": (_lines(lambda ls: _with(ls, 1, time="2023-11-14 22:13:20")), "time"),
    "unknown-type": (_lines(lambda ls: _with(ls, 1, type="dev.evidence.evil")), "unknown event type"),
    "extra-attribute": (_lines(lambda ls: _with(ls, 1, evil="x")), "unknown attribute"),
    "missing-subject": (_lines(lambda ls: [ls[0], line({k: v for k, v in _ev(ls, 1).items() if k != "subject"}), *ls[2:]]), "lacks attribute 'subject'"),
    "missing-data": (_lines(lambda ls: [ls[0], line({k: v for k, v in _ev(ls, 1).items() if k != "data"}), *ls[2:]]), "lacks attribute 'data'"),
    "missing-data-field": (_lines(lambda ls: [ls[0], line({**_ev(ls, 1), "data": {k: v for k, v in _ev(ls, 1)["data"].items() if k != "pid"}}), *ls[2:]]), "lacks field 'pid'"),
    "wrong-data-type": (_lines(lambda ls: _with_data(ls, 1, pid="1")), "pid: expected an integer"),
    "bool-as-int": (_lines(lambda ls: _with_data(ls, 1, pid=True)), "pid: expected an integer"),
    "float-in-data": (_lines(lambda ls: _with_data(ls, 1, pid=1.5)), "floats are not allowed"),
    "bad-literal": (_lines(lambda ls: _with(ls, 0, data={**_ev(ls, 0)["data"], "detail": "verbose"})), "detail"),
    "extra-data-field": (_lines(lambda ls: _with_data(ls, 1, evil=1)), "unknown field 'evil'"),
    "data-not-object": (_lines(lambda ls: _with(ls, 1, data=[1])), "is not an object"),
    "non-object-line": (_lines(lambda ls: [ls[0], b"[1,2,3]", *ls[1:]]), "is not a JSON object"),
    "not-json-line": (_lines(lambda ls: [ls[0], b"hello", *ls[1:]]), "invalid JSON"),
    "empty-line": (_lines(lambda ls: [ls[0], b"", *ls[1:]]), "invalid JSON"),
    "duplicate-json-key": (_lines(lambda ls: [ls[0], ls[1].replace(b'{"data":', b'{"data":{},"data":', 1), *ls[2:]]), "duplicate JSON key"),
    "invalid-utf8": (_lines(lambda ls: [ls[0], ls[1].replace(b"/usr/bin/make", b"/usr/bin/m\xffke"), *ls[2:]]), "invalid UTF-8"),
    "lone-surrogate": (_lines(lambda ls: [ls[0], ls[1].replace(b"/usr/bin/make", b"/usr/bin/\\ud800"), *ls[2:]]), "invalid JSON"),
    "not-canonical-line": (_lines(lambda ls: [ls[0], ls[1].replace(b'"data":{', b'"data": {', 1), *ls[2:]]), "not canonical"),
    "json-depth-bomb": (_lines(_depth_bomb), "deeper than 64"),
    "json-depth-mild": (_lines(_mild_depth), "deeper than 64"),
    "huge-int": (_lines(lambda ls: [ls[0], ls[1].replace(b'"pid":101', b'"pid":123456789012345678901234567890', 1), *ls[2:]]), "not canonical|pid"),
    "first-not-started": (_lines(lambda ls: _renumber(ls[1:])), "first event must be"),
    "second-started": (_lines(lambda ls: _renumber([ls[0], *ls])), "second dev.evidence.run.started"),
    "event-after-finished": (_lines(lambda ls: _renumber([*ls[:2], ls[-1], *ls[2:-1]])), "after dev.evidence.run.finished"),
    "started-mismatch": (_lines(lambda ls: _with(ls, 0, data={**_ev(ls, 0)["data"], "cwd": "/elsewhere"})), "differs from the manifest"),
    "no-final-newline": (lambda p, m, ls: rebuild(p, m, ls).parent / p.name if False else pack(p, [(fmt.MANIFEST_NAME, _m({**m, "files": {fmt.EVENTS_NAME: {"sha256": m["files"][fmt.EVENTS_NAME]["sha256"], "size": len(_events(ls)) - 1}}})), (fmt.EVENTS_NAME, _events(ls)[:-1])]), "does not end with a newline"),
}  # fmt: skip


@pytest.fixture(scope="module")
def valid(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[bytes]]:
    path = write(tmp_path_factory.mktemp("valid") / "a.tar.gz")
    return members(path)


def test_corpus_is_large_enough() -> None:
    assert len(HOSTILE) >= 30


@pytest.mark.parametrize("case", sorted(HOSTILE))
@pytest.mark.parametrize("command", ["lint", "show", "diff"])
def test_hostile_bundle_exits_2_with_one_line(
    case: str,
    command: str,
    valid: tuple[dict[str, Any], list[bytes]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    make, expected = HOSTILE[case]
    manifest, lines = valid
    path = make(tmp_path / f"{case}.tar.gz", dict(manifest), list(lines))
    good = write(tmp_path / "good.tar.gz")
    argv = {"lint": ["lint", str(path)], "show": ["show", str(path)], "diff": ["diff", str(good), str(path)]}[
        command
    ]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith("evidence: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    import re

    assert re.search(expected, err), err
    if command != "lint":
        assert out == ""  # nothing from an unverified bundle is printed


def test_hostile_json_lists_all_reasons(
    tmp_path: Path, valid: tuple[dict[str, Any], list[bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    manifest, lines = valid
    path = rebuild(
        tmp_path / "x.tar.gz", {**manifest, "root_hash": "ab" * 32, "events": 5}, lines, fix_root=False
    )
    assert main(["lint", "--format", "json", str(path)]) == 2
    doc = orjson.loads(capsys.readouterr().out)
    assert doc["verified"] is False
    assert len(doc["problems"]) == 2


# --- property tests: any mutation is handled -------------------------------------------------------


def _bundle_bytes(tmp: Path) -> bytes:
    return write(tmp / "p.tar.gz").read_bytes()


def _tar_of(data: bytes) -> bytes:
    with gzip.GzipFile(fileobj=io.BytesIO(data)) as g:
        return g.read()


def _check(tmp: Path, data: bytes) -> None:
    p = tmp / "m.tar.gz"
    p.write_bytes(data)
    for argv in (["lint", str(p)], ["show", str(p)]):
        assert main(argv) in (0, 1, 2)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, bytes, list[bytes], dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("prop")
    data = _bundle_bytes(tmp)
    manifest, lines = members(tmp / "p.tar.gz")
    return data, _tar_of(data), lines, manifest


_settings = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@_settings
@given(st.data())
def test_any_byte_mutation_of_the_gzip_is_handled(pristine: Any, tmp_path: Path, data: st.DataObject) -> None:
    raw = bytearray(pristine[0])
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    _check(tmp_path, bytes(raw))


@_settings
@given(st.data())
def test_any_mutation_of_the_tar_is_handled(pristine: Any, tmp_path: Path, data: st.DataObject) -> None:
    tar = bytearray(pristine[1])
    op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
    i = data.draw(st.integers(0, len(tar) - 1))
    if op == "flip":
        tar[i] ^= data.draw(st.integers(1, 255))
    elif op == "cut":
        del tar[i : i + data.draw(st.integers(1, 600))]
    else:
        tar[i:i] = data.draw(st.binary(min_size=1, max_size=64))
    _check(tmp_path, gz(bytes(tar)))


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.text(max_size=8)
    | st.floats(allow_nan=False),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=8,
)


@_settings
@given(st.data())
def test_any_mutation_of_an_event_is_handled(pristine: Any, tmp_path: Path, data: st.DataObject) -> None:
    _, _, lines, manifest = pristine
    i = data.draw(st.integers(0, len(lines) - 1))
    ev = orjson.loads(lines[i])
    where = data.draw(st.sampled_from(["top", "data"]))
    target = ev if where == "top" or not isinstance(ev.get("data"), dict) else ev["data"]
    key = data.draw(st.sampled_from(sorted(target)) | st.text(max_size=6))
    if data.draw(st.booleans()):
        target[key] = data.draw(_json)
    else:
        target.pop(key, None)
    try:
        new = orjson.dumps(ev, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:
        return
    fix = data.draw(st.booleans())
    p = rebuild(
        tmp_path / "e.tar.gz", manifest, [*lines[:i], new, *lines[i + 1 :]], fix_root=fix, fix_files=fix
    )
    assert main(["lint", str(p)]) in (0, 1, 2)
    assert main(["diff", str(p), str(p)]) in (0, 1, 2)
