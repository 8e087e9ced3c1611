"""The C hot path of full detail (src/fast/_fast.c) against the Python path it stands in for: the
same lines, content hashes, counts and caps decisions on generated record streams."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evidence.bundle import format as fmt
from evidence.bundle import premade, run_id, sink
from evidence.bundle.sink import Caps, EventSink
from evidence.probes import abi

needs_fast = pytest.mark.skipif(sink._fast is None, reason="the compiled module is not built (make setup)")


@needs_fast
def test_the_sink_uses_the_compiled_module() -> None:
    """Built (tests/unit/test_native.py fails under CI=true when it is not), the sink uses it."""
    assert EventSink(_Out(), "run-" + "0" * 32).use_fast


class _Out:
    def __init__(self) -> None:
        self.data: list[bytes] = []

    def feed(self, data: bytes) -> None:
        self.data.append(data)

    def compressed_bound(self) -> int:
        return sum(map(len, self.data)) // 20


class _Root:
    def __init__(self) -> None:
        self.lines: list[bytes] = []

    def add(self, chash: str) -> None:
        self.lines.append(chash.encode() + b"\n")

    def add_many(self, chashes: list[str]) -> None:
        for c in chashes:
            self.add(c)

    def add_lines(self, lines: bytes) -> None:
        self.lines.append(lines)


def _written(items: list[Any], fast: bool, caps: Caps | None = None) -> tuple[object, ...]:
    out, root = _Out(), _Root()
    s = EventSink(out, "run-" + "5" * 32, {"team": "a\u00e9"}, caps, root)
    s.use_fast = fast
    capped: dict[str, int] = {}
    try:
        s.write_full(items, capped)
    except Exception as e:  # the same failure either way (a string that is not UTF-8)
        return (type(e).__name__,)
    return b"".join(out.data), b"".join(root.lines), s.counts, s.seq, s.size, capped


_text = st.text(
    alphabet=st.one_of(
        st.characters(max_codepoint=0x7F),
        st.sampled_from(["\u00e9", "\u2028", "\U0001f600", "\x00", "\x1f", "\x7f", '"', "\\", "/", "\ud800"]),
    ),
    max_size=12,
)
_ints = st.one_of(st.integers(-(2**31), 2**31), st.integers(-(2**70), 2**70))
_value = st.one_of(
    st.none(), st.booleans(), _ints, _text, st.lists(st.one_of(_text, _ints), max_size=3), st.floats(0, 1)
)
# a time: mostly a run's (nanoseconds this century, a few seconds apart), now and then an odd one
_time = st.one_of(
    st.integers(1_700_000_000_000_000_000, 1_700_000_005_000_000_000),
    st.integers(-(2**65), 2**65),
)
_open = st.fixed_dictionaries(
    {
        "k": st.just("open"),
        "t": _time,
        "pid": st.integers(1, 2**22),
        "ppid": st.integers(0, 2**22),
        "exe": st.one_of(st.none(), _text),
        "path": st.one_of(_text, _text.map(lambda s: "/etc/" + s)),
        "raw_path": _text,
        "dirfd": st.one_of(st.none(), st.integers(0, 1000)),
        "flags": st.lists(st.sampled_from(["O_RDONLY", "O_WRONLY", "O_CREAT", "O_CLOEXEC"]), max_size=3),
        "access": st.lists(st.sampled_from(["read", "write", "create"]), max_size=2),
        "mode": st.one_of(st.none(), st.integers(0, 0o7777)),
        "result": st.one_of(st.integers(0, 100), st.sampled_from(["ENOENT", "EACCES"])),
    },
    optional={
        "nlink": st.integers(2, 9),
        "cgroup": _text,
        "container": _text,
        "mntns": st.just("other"),
        "n": st.integers(2, 5),
        "tl": _time,
        "extra": st.one_of(_value, st.dictionaries(_text, _value, max_size=2)),
    },
)
_exit = st.fixed_dictionaries(
    {
        "k": st.just("exit"),
        "t": _time,
        "pid": st.integers(1, 99),
        "ppid": st.integers(0, 99),
        "exe": st.one_of(st.none(), _text),
        "exit_code": st.integers(0, 255),
        "signal": st.none(),
    }
)
_item = st.one_of(_open, _open, _exit, _time, _time, _time)


@needs_fast
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_item, max_size=40))
def test_c_and_python_write_the_same_bytes(items: list[Any]) -> None:
    while items and isinstance(items[0], int):  # a repeat follows a record
        items.pop(0)
    assert _written(items, True) == _written(items, False)


def _spool_lines(items: list[Any]) -> list[Any]:
    """`items` as a recorder spools them: each record, and each repeat (a time: the record before
    it at that time), as its spool line (orjson's JSON); a record orjson refuses stays a record."""
    import orjson

    out: list[Any] = []
    prev: dict[str, Any] | None = None
    for it in items:
        rec = dict(prev or {}, t=it) if isinstance(it, int) else it
        prev = rec if not isinstance(it, int) else prev
        try:
            out.append(orjson.dumps(rec) + b"\n")
        except TypeError:  # past 64 bits, not UTF-8: never in a spool
            out.append(it)
    return out


@needs_fast
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_item, max_size=40))
def test_c_makes_the_same_events_from_spool_lines(items: list[Any]) -> None:
    """open_lines (src/fast/lines.h): the events of records given as their spool lines are the
    Python path's of the records, whatever C takes and leaves (another kind, a float, an object,
    "n", a time past 64 bits), and C takes the plain opens' lines."""
    from evidence.bundle import canonical

    while items and isinstance(items[0], int):  # a repeat follows a record
        items.pop(0)
    lines = _spool_lines(items)
    assert _written(lines, True) == _written(items, False) == _written(lines, False)
    s = EventSink(_Out(), "run-" + "5" * 32)
    plain = {
        "k": "open", "t": 1_700_000_000_000_000_000, "pid": 1, "ppid": 0, "exe": None, "path": "/a",
        "raw_path": "/a", "dirfd": None, "flags": ["O_RDONLY"], "access": ["read"], "mode": None, "result": 0,
    }  # fmt: skip
    took = sink._fast.open_lines(
        [canonical.dumps_unchecked(plain)] * 2, 0, 0, s._id, s._runid, s._source + b',"subject":',
        s._core_mid, s._type(fmt.FILE_OPEN), False,
    )  # fmt: skip
    assert took[0] == 2


@needs_fast
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_open, st.lists(st.one_of(_time, st.just(None)), min_size=1, max_size=3000))
def test_c_and_python_agree_across_batches_and_caps(rec: dict[str, Any], times: list[int | None]) -> None:
    """Runs longer than a batch (_FULL_BATCH), plain opens among repeats, and caps reached midway."""
    items: list[Any] = [rec]
    for k, t in enumerate(times):
        items.append(t if t is not None else dict(rec, t=1_700_000_000_000_000_000 + k, path=f"/p/{k}"))
    for caps in (None, Caps(events=1500), Caps(decompressed=200_000), Caps(line=300)):
        assert _written(items, True, caps) == _written(items, False, caps)


@needs_fast
@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=5))
def test_c_formats_any_time_as_format_time(times: list[int]) -> None:
    """The C clock (gmtime_r, src/fast/_fast.c clock_set), from records and from spool lines,
    writes every time the recorder can hold (1970 to 2262) as format.format_time does."""
    import orjson

    recs = [{"k": "open", "t": t, "pid": 1, "ppid": 0, "exe": None, "path": "/a", "result": 0} for t in times]
    want = _written(recs, False)
    assert _written(recs, True) == want
    assert _written([orjson.dumps(r) + b"\n" for r in recs], True) == want


@needs_fast
def test_c_path_makes_what_the_writer_always_made() -> None:
    """A plain open and its repeats: the C path's line is canonical JSON of the whole event."""
    rec = {
        "k": "open",
        "t": 1_700_000_000_123_456_789,
        "pid": 3,
        "ppid": 1,
        "exe": "/bin/x",
        "path": '/a/"b\x01',
        "raw_path": "a",
        "dirfd": None,
        "flags": ["O_RDONLY"],
        "access": ["read"],
        "mode": None,
        "result": "ENOENT",
    }
    data, _, counts, seq, _, _ = _written([rec, 1_700_000_001_000_000_000], True)
    assert counts == {fmt.FILE_OPEN: 2} and seq == 2
    first = data.split(b"\n")[0]
    assert b'"path":"/a/\\"b\\u0001"' in first
    assert b'"time":"2023-11-14T22:13:20.123456789Z"' in first


# ---- the run id's behaviour (bundle/run_id.py): plain opens' file items, and a spill's lines


def _behaviour(recs: list[Any], fast: bool, roots: dict[str, str], tmp: Any) -> tuple[object, ...]:
    try:
        return _made_run_id(recs, fast, roots, tmp)
    except TypeError as e:  # the same failure either way (a string that is not UTF-8)
        return (type(e).__name__,)


def _made_run_id(recs: list[Any], fast: bool, roots: dict[str, str], tmp: Any) -> tuple[object, ...]:
    b = run_id.Behaviour(roots, budget=7, tmp_dir=tmp)  # spilled to disk every few items
    if not fast:
        b.fast_roots = None
    saved, run_id._fast = run_id._fast, (run_id._fast if fast else None)
    try:
        for k in range(0, len(recs), 5):
            b.add_many(recs[k : k + 5])
        return (b.run_id(["cmd"]),)
    finally:
        run_id._fast = saved


_path = st.one_of(
    _text,
    st.sampled_from(["/home/u", "/home/u/x", "/home/ux", "/tmp/r/a", "/proc/12/fd/3", "/w/tmp1234abcd"]),
    st.text(alphabet="0123456789abcdef/", min_size=30, max_size=40),
)
_opened = st.fixed_dictionaries(
    {
        "k": st.just("open"),
        "path": _path,
        "access": st.lists(st.sampled_from(["read", "write", "create"]), max_size=2).flatmap(
            lambda a: st.sampled_from([a, tuple(a)])  # the correlator's are tuples (calls.py)
        ),
        "result": st.one_of(st.integers(-(2**65), 2**65), st.sampled_from(["ENOENT", "EACCES"])),
    }
)
_other = st.fixed_dictionaries(
    {
        "k": st.just("exec"),
        "filename": _path,
        "argv": st.lists(_text, max_size=3),
        "result": st.integers(0, 3),
    }
)


@needs_fast
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(_opened, _opened, _other, st.just(b"line")), max_size=60))
def test_c_and_python_make_the_same_run_id(tmp_path: Any, recs: list[Any]) -> None:
    """A spool line adds nothing (a repeat's; a plain open's, whose item process_opens added as it
    made it: test_c_and_python_correlate_the_same_records compares those run ids)."""
    for roots in ({}, {"${WORKSPACE}": "/home/u", "${TMPDIR}": "/tmp/r"}):
        fast = _behaviour(recs, True, roots, tmp_path)
        assert fast == _behaviour(recs, False, roots, tmp_path)


@needs_fast
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_opened, max_size=40))
def test_the_line_set_holds_each_item_once_and_spills_them_sorted(tmp_path: Any, recs: list[Any]) -> None:
    """_fast.LineSet: an item's line (repr, a tab, canonical JSON) once however often it comes, as
    the Python path writes it, and a spill writes them sorted as Python sorts bytes, then holds none."""
    lines = sink._fast.LineSet()
    added, rest = lines.add_files(recs + recs, ())
    want = set()
    for r in recs:
        if r not in rest:
            item = (r["path"], tuple(r["access"]), r["result"])
            want.add(
                repr(item).encode("utf-8", "surrogatepass")
                + b"\t"
                + run_id.canonical.dumps_unchecked(item)
                + b"\n"
            )
    assert added == len(lines) == len(want)
    assert sorted(lines.lines()) == sorted(want)
    path = tmp_path / "run"
    with open(path, "wb") as f:
        lines.spill(f.fileno())
    with open(path, "rb") as f:  # (one zstandard frame, as _SpillSet reads it back)
        assert b"".join(run_id._run_lines(f)) == b"".join(sorted(want))
    assert len(lines) == 0 and lines.lines() == []


_line = st.one_of(
    st.integers(0, 2**70).map(lambda t: b'{"k":"open","t":%d,"pid":1}\n' % t),
    st.sampled_from(
        [b'{"k":"open","t": 5,"pid":1}\n', b'{"k":"open","t":1_0,"x":2}\n', b'{"k":"exit","t":3}\n']
    ),
)


@needs_fast
@given(st.lists(st.one_of(_line, _exit), max_size=20))
def test_c_and_python_mark_repeats_alike(recs: list[Any]) -> None:
    """A repeated open's spool line as its time (bundle/premade.py _marked), the same either way."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(premade, "_fast", None)
        python = premade._marked(recs)
    assert premade._marked(recs) == python


# ---- correlation: Recorder._process's plain opens (agent/recorder/pipeline.py, correlate.py)


_raw_path = st.one_of(
    st.sampled_from(
        [
            b"/etc/hostname",
            b"/etc/passwd",
            b"/a/b/../c",
            b"/a/./d",
            b"//x//y",
            b"/proc/self/fd/3",
            b"/dev/fd/4",
            b"/sys/fs/cgroup/other/cgroup.procs",
            b"/",
            b"/t/",
            b"/t/.",
            b"/t/..",
            b"rel",
            b"../up",
            b"/a\xffb/c",
            b"/a/\x01\n",
        ]
    ),
    st.binary(max_size=6).map(lambda b: b"/d%d/" % (len(b) % 3) + b.replace(b"\0", b"")),
)


@st.composite
def _raws(draw: st.DrawFn) -> list[bytes]:
    from tests.unit.test_fast_path import chdir_raw, dup_raw, open_raw

    out: list[bytes] = []
    for k in range(draw(st.integers(0, 40))):
        what = draw(st.integers(0, 9))
        if what == 0:
            out.append(chdir_raw(draw(st.sampled_from([b"/srv", b"/", b"x"])), ts=k, tgid=10))
        elif what == 1:
            out.append(dup_raw(draw(st.integers(3, 6)), draw(st.integers(3, 6)), ts=k))
        elif what == 2 and out:
            out.append(out[-1])  # a repeat, byte for byte
        else:
            out.append(
                open_raw(
                    draw(_raw_path),
                    ts=1_700_000_000_000_000_000 + k,
                    ret=draw(st.sampled_from([3, 4, 5, -2, -13, -4096])),
                    dfd=draw(st.sampled_from([-100, -100, 3])),
                    oflags=draw(st.sampled_from([0, 0, 1, 2, 0o100, 0o1101, 0o2000000, 0o10000000])),
                    mode=draw(st.sampled_from([0, 0o644])),
                    flags=draw(
                        st.sampled_from(
                            [
                                0,
                                0,
                                0,
                                abi.F_FIRST,
                                abi.F_STATE,
                                abi.F_OTHER_NS,
                                abi.F_IN_ROOT,
                                abi.F_FNAME_FAULT,
                            ]
                        )
                    ),
                    tgid=draw(st.sampled_from([10, 10, 11, 12])),
                    cgid=draw(st.sampled_from([7, 7, 8])),
                    run=draw(st.sampled_from([1, 1, 1, 2])),
                    rino=draw(st.sampled_from([0, 5])),
                    nlink=draw(st.sampled_from([0, 1, 2])),
                )
            )
    return out


def _spooled_by(raws: list[bytes], cut: int, fast: bool, tmp: Any) -> tuple[object, ...]:
    from evidence.agent.recorder import correlate, pipeline
    from tests.unit.test_fast_path import spooled, stopped_recorder

    with pytest.MonkeyPatch.context() as m:
        if not fast:
            m.setattr(pipeline, "_fast", None)
            m.setattr(correlate, "_fast", None)
        (tmp / "s.spool.zst").unlink(missing_ok=True)
        rec, session, spool = stopped_recorder(tmp)
        session.correlator.fast = fast
        # a process whose parent's pid is past 63 bits (put_value does not write it, orjson does):
        # its opens' lines are not made in C, their records are dicts, their names made strings then
        session.correlator.add_root(12, 2**63, "/home/u", exe="/bin/sh")
        rec._process(raws[:cut])
        rec._process(raws[cut:])
        spool.close()
        procs = {pid: (p.fds, p.cwd) for pid, p in session.correlator.procs.items()}
        # (the run id: the C path adds plain opens' items as it makes their lines, Python's the records')
        run = session.behaviour.run_id(["x"]) if session.behaviour is not None else None
        return spooled(spool.path), procs, rec.stats, session.correlator._dirs, run


@needs_fast
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_raws(), st.integers(0, 40))
def test_c_and_python_correlate_the_same_records(tmp_path: Any, raws: list[bytes], cut: int) -> None:
    """The spool, the descriptor tables and the caches after the same raw records, either way."""
    assert _spooled_by(raws, cut, True, tmp_path) == _spooled_by(raws, cut, False, tmp_path)


# ---- the ring buffer's reader (probes/ringbuf.py RingBuffer.read)


def _ring(size: int, start: int, records: list[tuple[bytes, int]]) -> tuple[Any, bytearray]:
    """A RingBuffer over plain memory (no map): `records` (payload, header flags) written from
    consumer position `start`, wrapping past the end of the data area as the kernel's do."""
    from evidence.probes.ringbuf import RingBuffer

    data = bytearray(size)
    pos = start
    for payload, flags in records:
        off = pos & (size - 1)
        data[off : off + 4] = (len(payload) | flags).to_bytes(4, "little")
        for k, b in enumerate(payload):
            data[(off + 8 + k) & (size - 1)] = b
        pos += (len(payload) + 8 + 7) & ~7
    ring = RingBuffer.__new__(RingBuffer)
    ring.size, ring.mask, ring.stitched = size, size - 1, 0
    ring._data = memoryview(data)
    ring._cons_pos = memoryview(bytearray(start.to_bytes(8, "little"))).cast("Q")
    ring._prod_pos = memoryview(bytearray(pos.to_bytes(8, "little"))).cast("Q")
    return ring, data


@needs_fast
@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 2**40),
    st.lists(
        st.tuples(st.binary(min_size=0, max_size=200), st.sampled_from([0, 0, 0, 1 << 30, 1 << 31])),
        max_size=12,
    ),
    st.integers(1, 20),
)
def test_c_and_python_read_the_ring_alike(start: int, records: list[tuple[bytes, int]], most: int) -> None:
    """Records in order, a discarded one skipped, a reserved one where reading stops, a record that
    wraps put together, at most `most` at a time; the consumer position after them."""
    start -= start % 8
    total = sum((len(p) + 15) & ~7 for p, _ in records)
    size = 256
    while size < total + 8:
        size *= 2
    got = []
    for fast in (False, True):
        ring, _ = _ring(size, start, records)
        ring.fast_read = sink._fast.ring_read if fast else None
        reads = [ring.read(most) for _ in range(3)]
        got.append((reads, ring._cons_pos[0], ring.stitched))
    assert got[0] == got[1]


@pytest.mark.parametrize("budget", [997, 10**9])
def test_a_run_id_of_many_items_is_the_reference_one(tmp_path: Any, budget: int) -> None:
    """Past the hash's batches of items (4,096) and through sorted runs on disk, fed in the
    recorder's batches: the run id of one canonical document of every set sorted by repr."""
    from tests.unit.test_writer import META, _flood, _open, _reference_run_id

    meta = META.model_copy(update={"roots": {"${WORKSPACE}": "/w"}})
    # plain opens the C path takes (outside the roots), and the flood's (under them: Python's)
    recs = _flood(3000) + [_open(5000 + i, f"/d/{i % 7000}", i % 2) for i in range(9000)]
    b = run_id.Behaviour(meta.roots, budget=budget, tmp_dir=tmp_path)
    for k in range(0, len(recs), 1000):
        b.add_many(recs[k : k + 1000])
    assert b.run_id(meta.command) == _reference_run_id(meta, recs)


@needs_fast
@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.one_of(st.binary(max_size=40), st.just(premade.PLACEHOLDER), st.just(b"\n")), max_size=30),
    st.integers(0, 80),
    st.one_of(
        st.text("0123456789abcdef", min_size=32, max_size=32).map(
            lambda d: premade.translation_for("run-" + d)
        ),
        st.binary(min_size=256, max_size=256),
    ),
)
def test_c_and_python_put_the_run_id_alike(pieces: list[bytes], cut: int, table: bytes | None) -> None:
    """_fast.translate is bytes.translate: lines with placeholders cut anywhere (a piece of the
    premade file ends where it ends), bytes below 0x20 and 0xff outside them, any other table."""
    assert table is not None
    data = b"".join(pieces)
    for part in (data, data[cut:], data[:cut]):
        assert sink._fast.translate(part, table) == part.translate(table)
        assert premade.put_run_id(part, table) == part.translate(table)


def _merged(
    tmp_path: Any, runs: list[list[bytes]], held: list[bytes], cut: bool, packed: int = 0
) -> tuple[bytes, bytes]:
    """(the Python path's items joined by commas, the C path's) of sorted runs on disk and held;
    every `packed`th run (0: none) one zstandard frame, as the C path's spill writes it."""
    import tempfile

    import zstandard

    part = run_id._SpillSet(run_id.Behaviour())
    for k, lines in enumerate(runs):
        data = b"".join(sorted(lines))
        data = data[:-1] if cut and data else data  # (a last line without its newline)
        f = tempfile.TemporaryFile(dir=tmp_path)  # noqa: SIM115 - closed below
        f.write(zstandard.ZstdCompressor(level=1).compress(data) if packed and k % packed == 0 else data)
        f.seek(0)
        part.runs.append(f)
    part.lines = sorted(held)
    python = b",".join(part.canonical_items())
    got: list[bytes] = []
    sink._fast.merge_items([f.fileno() for f in part.runs], tuple(part._sorted()), got.append)
    part.close()
    return python, b"".join(got)


_run_line = st.builds(
    lambda k, v: k.encode("utf-8", "surrogatepass") + b"\t" + v + b"\n",
    st.text(st.characters(blacklist_characters="\t\n"), max_size=6),
    st.binary(max_size=12).map(lambda b: b.replace(b"\n", b"")),
)


@needs_fast
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(st.lists(_run_line, max_size=25), max_size=6),
    st.lists(_run_line, max_size=25),
    st.booleans(),
    st.integers(0, 2),
)
def test_c_and_python_merge_the_run_ids_runs_alike(
    tmp_path: Any, runs: list[list[bytes]], held: list[bytes], cut: bool, packed: int
) -> None:
    """_fast.merge_items is canonical_items joined: the same lines in several runs and held (taken
    once), keys that are prefixes of others, empty runs, a run's last line without its newline,
    runs as lines and runs as a zstandard frame (lineset_spill's) side by side."""
    python, c = _merged(tmp_path, runs, held, cut, packed)
    assert c == python


@needs_fast
@pytest.mark.parametrize("size", [(1 << 18) - 1, 1 << 18, (1 << 18) + 1, 1 << 19])
def test_a_spilled_run_that_fills_the_merges_buffer_is_read_whole(tmp_path: Any, size: int) -> None:
    """A LineSet's spill whose lines fill merge_items' read buffer exactly (256 KiB, then twice
    that): the frame's end decoded with the buffer's last byte is its end, not a run cut short (a
    job picks its names' lengths)."""

    def opened(path: str) -> dict[str, Any]:
        return {"k": "open", "path": path, "access": ("read",), "result": 0}

    def line_size(path: str) -> int:
        one = sink._fast.LineSet()
        one.add_files([opened(path)], ())
        return len(one.lines()[0])

    c = line_size("")  # an item's line: twice its name's length and this
    n = 4000 + (size - 4000 * c) % 2  # (the names' lengths fill an even number of bytes)
    base = [opened(f"/w/f{i:06d}") for i in range(n - 1)]
    pad = (size - (n - 1) * line_size("/w/f000000") - c) // 2
    lines = sink._fast.LineSet()
    lines.add_files([*base, opened("/w/g" + "x" * (pad - 4))], ())
    assert sum(map(len, lines.lines())) == size
    want = b",".join(line[line.index(b"\t") + 1 : -1] for line in sorted(lines.lines()))
    with open(tmp_path / "run", "w+b") as f:
        lines.spill(f.fileno())
        got: list[bytes] = []
        sink._fast.merge_items([f.fileno()], (), got.append)
    assert b"".join(got) == want


@needs_fast
def test_a_spilled_run_cut_short_is_an_error_not_its_lines(tmp_path: Any) -> None:
    """A run written as a zstandard frame (the C path's spill) and cut short: merge_items raises,
    and never hashes the lines it could read as if they were all."""
    import zstandard

    frame = zstandard.ZstdCompressor(level=1).compress(
        b"".join(b"'%06d'\t[%d]\n" % (i, i) for i in range(50_000))
    )
    with open(tmp_path / "run", "w+b") as f:
        f.write(frame[: len(frame) // 2])
        f.flush()
        with pytest.raises(OSError):
            sink._fast.merge_items([f.fileno()], (), lambda piece: None)


@needs_fast
def test_merged_runs_past_the_read_and_the_hash_pieces(tmp_path: Any) -> None:
    """Lines longer than a read (256 KiB) and more than a MiB of items (handed over in pieces)."""
    lines = [b"'%07d'\t[\"%s\"]\n" % (i, b"x" * (i % 90)) for i in range(40_000)]
    lines += [b"'long%d'\t" % k + b"y" * (300_000 + k) + b"\n" for k in range(3)]
    runs = [lines[k::3] for k in range(3)] + [lines[::7]]
    python, c = _merged(tmp_path, runs, lines[::11], False, packed=2)
    assert len(python) > 2 << 20
    assert c == python


@needs_fast
@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=40), st.integers(0, 2**14), st.booleans())
def test_c_and_python_read_a_spilled_batch_alike(records: list[bytes], cut: int, whole: bool) -> None:
    """A batch the poller spilled (its lengths, then its records) comes back the same from C and
    from Python: whole, or cut short anywhere (each record as far as the bytes go; fewer bytes than
    the lengths: ValueError from both)."""
    import array

    from evidence.agent.recorder import pipeline

    data = array.array("I", map(len, records)).tobytes() + b"".join(records)
    if not whole:
        data = data[:cut]

    def read(fast: object) -> object:
        saved = pipeline._fast
        pipeline._fast = fast
        try:
            return pipeline._split(data, len(records))
        except ValueError:
            return ValueError
        finally:
            pipeline._fast = saved

    assert read(sink._fast) == read(None)
    if whole:
        assert read(sink._fast) == records


@needs_fast
@given(st.lists(st.binary(max_size=600), max_size=20))
def test_deferred_content_hashes_are_sha256_of_each_core(cores: list[bytes]) -> None:
    """hash_cores (the hashes opens and repeats defer to the premade file's thread): each core's
    sha256 in hex and a newline, in order; ends that are not the cores' are refused, not read."""
    import hashlib
    import struct

    ends, at = [], 0
    for c in cores:
        at += len(c)
        ends.append(at)
    packed = struct.pack(f"{len(ends)}N", *ends)  # (native: size_t)
    want = b"".join(hashlib.sha256(c).hexdigest().encode() + b"\n" for c in cores)
    assert sink._fast.hash_cores(b"".join(cores), packed) == want
    with pytest.raises(ValueError):
        sink._fast.hash_cores(b"".join(cores), packed + struct.pack("N", at + 1))
    with pytest.raises(ValueError):
        sink._fast.hash_cores(b"", packed + b"x")


@needs_fast
def test_the_c_reads_opens_in_the_layout_the_probes_write() -> None:
    """process_opens reads an open record's fields in place at OPEN_FORMAT's places, and takes none
    of another layout's: the probes' layout must be the one it knows, else full detail's opens all
    go the slow way without a word."""
    from evidence.agent.recorder import decode

    assert decode.OPEN_REC.format == sink._fast.OPEN_FORMAT
    assert decode.OPEN_REC.size == decode.OPEN_PATH_OFF


def _cores_and_ends(cores: list[bytes]) -> tuple[bytes, bytes]:
    import struct

    ends, at = [], 0
    for c in cores:
        at += len(c)
        ends.append(at)
    return b"".join(cores), struct.pack(f"{len(ends)}N", *ends)


@needs_fast
@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.one_of(st.binary(max_size=3000), st.lists(st.binary(max_size=300), max_size=8)),
        max_size=12,
    ),
    st.integers(1, 4),
)
def test_zfile_writes_its_pieces_and_deferred_hashes_as_one_frame(
    tmp_path: Path, pieces: list[bytes | list[bytes]], per_put: int
) -> None:
    """ZFile (the premade files' writer thread, src/fast/zfile.h): what is put, in order, in one
    zstandard frame that zstandard reads back; a deferred piece (cores, ends) as hash_cores makes
    its hashes. Puts of any size, one after the other, each waiting for the one queued before."""
    import tempfile

    import zstandard

    want = b""
    given_pieces: list[Any] = []
    for p in pieces:
        if isinstance(p, bytes):
            want += p
            given_pieces.append(p)
        else:
            cores, ends = _cores_and_ends(p)
            want += sink._fast.hash_cores(cores, ends)
            given_pieces.append((cores, ends))
    with tempfile.TemporaryFile(dir=tmp_path) as f:
        z = sink._fast.ZFile(f.fileno(), -3)
        for i in range(0, len(given_pieces), per_put):
            z.put(given_pieces[i : i + per_put])
        z.end()
        z.end()  # (once is enough: nothing more)
        f.seek(0)
        assert zstandard.ZstdDecompressor().stream_reader(f).read() == want
        with pytest.raises(ValueError):
            z.put([b"after its end"])


@needs_fast
def test_zfile_says_its_threads_error_and_refuses_what_it_cannot_write(tmp_path: Path) -> None:
    """A full disk (/dev/full) is raised by the next put or by end (OSError, ENOSPC), never lost; a
    piece that is neither bytes nor (cores, ends), or ends that are not the cores', is refused at
    once; close() without end() stops the thread."""
    import errno

    with open("/dev/full", "wb") as full:
        z = sink._fast.ZFile(full.fileno(), -3)
        with pytest.raises(OSError) as caught:  # noqa: PT012 - the error comes by a put or by end
            for _ in range(64):
                z.put([bytes(range(256)) * 4096])
            z.end()
        assert caught.value.errno == errno.ENOSPC
        z.close()
    with open(tmp_path / "f", "wb") as f:
        z = sink._fast.ZFile(f.fileno(), -3)
        with pytest.raises(TypeError):
            z.put([b"a", "text"])
        with pytest.raises(TypeError):
            z.put((b"a",))
        cores, ends = _cores_and_ends([b"x", b"yz"])
        with pytest.raises(ValueError):
            z.put([(cores[:2], ends)])
        z.put([b"kept", (cores, ends)])
        z.flush()
        z.close()
        z.close()
        with pytest.raises(ValueError):  # closed: nothing is written after, nor flushed
            z.put([b"after its close"])
        with pytest.raises(ValueError):
            z.flush()
    with pytest.raises(ValueError):
        sink._fast.ZFile(0, 10**6)  # not a zstandard level
