"""Full detail's lines made while the run records (bundle/premade.py): the bundle is byte for byte
the one made from the spool at the end, whatever the feeds, and the writer falls back to the spool
whenever what the lines assumed does not hold."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from evidence.agent.recorder.pipeline import _line_around_time
from evidence.bundle import format as fmt
from evidence.bundle import premade as premade_module
from evidence.bundle.premade import PLACEHOLDER, Premade
from evidence.bundle.reader import open_bundle
from evidence.bundle.spool import SpoolWriter, read_spool, read_spool_lines
from evidence.bundle.writer import RECORDING_ITEMS, Behaviour, Caps, write_bundle
from tests.unit import conftest_bundles as cb


def _items(n: int, seed: int, plain_lines: bool = True) -> list[dict[str, Any] | bytes]:
    """What a recorder spools: records, plain opens as their spool line (pipeline.py: process_opens;
    not for a signed run's, `plain_lines` False), and repeated opens as their spool line (pipeline.py)."""
    rng = random.Random(seed)
    out: list[dict[str, Any] | bytes] = []
    odd = ["/w/\u00e9\u4e2d\U0001f600", '/w/q"b\\s', "/w/ctl\x01\x1f\x7f", "/w/\u2028l", "/w/\0nul"]
    for i in range(n):
        r = rng.random()
        if r < 0.4 and out:
            last = out[-1] if isinstance(out[-1], dict) else orjson.loads(out[-1])
            if last["k"] == "open":  # a repeat of it, as the pipeline spools it: its line, its own time
                head, tail = _line_around_time(last)
                out.append(head + b"%d" % (cb.T0 + 10 * i) + tail)
                continue
        if r < 0.55 and plain_lines and premade_module._fast is not None:  # (the C path's only)
            plain = cb.open_(10 * i, f"/w/d{i % 3}/f{i}", ["read"], result="ENOENT" if i % 2 else 0)
            out.append(orjson.dumps(plain) + b"\n")
        elif r < 0.7:
            out.append(cb.open_(10 * i, f"/w/d{i % 3}/f{i}", ["read"], result="ENOENT" if i % 2 else 0))
        elif r < 0.8:
            out.append(cb.open_(10 * i, rng.choice(odd), ["write", "create"]))
        elif r < 0.9:
            out.append(cb.connect(10 * i, f"10.0.0.{i % 7}", 443))
        else:
            out.append(cb.exec_(10 * i, 200 + i, 100, "/bin/true", ["/bin/true", f"a{i}"]))
    return out


def _spool(tmp: Path, items: list[dict[str, Any] | bytes], premade: Premade | None, seed: int) -> Path:
    """`items` spooled in random runs of writes (the correlator's batches), `premade` fed as the
    recorder feeds it."""
    path = tmp / f"s{seed}-{premade is not None}.spool.zst"
    rng = random.Random(seed)
    with SpoolWriter(path) as w:
        if premade is not None:
            w.events = premade.add
        i = 0
        while i < len(items):
            k = rng.choice([1, 2, 7, 300, 1500])
            w.write_many(items[i : i + k])  # type: ignore[arg-type]
            i += k
    return path


def _never() -> Iterator[Any]:
    raise AssertionError("the spool was read: the premade lines were not used")


def _write(tmp: Path, name: str, spool: Path, premade: Premade | None, **over: Any) -> tuple[bytes, dict]:
    meta = over.pop("meta", None) or cb.meta(detail="full")
    behaviour = Behaviour(meta.roots, RECORDING_ITEMS)
    behaviour.add_many(list(read_spool(spool)))  # as the recorder fed it while spooling
    reads = over.pop("reads", True)
    out = tmp / name
    manifest = write_bundle(
        out,
        meta,
        (lambda: read_spool(spool)) if reads else _never,
        behaviour=behaviour,
        lines=(lambda: read_spool_lines(spool)) if reads else _never,
        premade=premade.made() if premade is not None else None,
        **over,
    )
    return out.read_bytes(), manifest


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("n", [0, 1, 5000])
def test_premade_lines_are_the_bundle_made_from_the_spool(tmp_path: Path, seed: int, n: int) -> None:
    items = _items(n, seed)
    premade = Premade(tmp_path, {}, 1)
    spool = _spool(tmp_path, items, premade, seed)
    fast, manifest = _write(tmp_path, "fast.tar.gz", spool, premade, reads=False)
    slow, _ = _write(tmp_path, "slow.tar.gz", spool, None)
    assert fast == slow
    assert manifest["events"] == n + 2
    events = list(open_bundle(tmp_path / "fast.tar.gz").events())  # verifies: hashes, seq, run id
    assert all(e["runid"] == manifest["run_id"] for e in events)


# the premade's own thread is the compiled module's (tests/unit/test_native.py fails under CI without it)
needs_fast = pytest.mark.skipif(premade_module._fast is None, reason="the compiled module is not built")


@needs_fast
@pytest.mark.parametrize("seed", [4, 5])
def test_a_signed_runs_premade_lines_are_made_from_its_records_alike(tmp_path: Path, seed: int) -> None:
    """A signed bundle's premade lines are made on the correlator's thread from the records (its
    trace reads them), the others' on the premade's own thread from the spool lines: the same bytes."""
    items = _items(3000, seed, plain_lines=False)
    signed, threaded = Premade(tmp_path, {}, 1, signed=True), Premade(tmp_path, {}, 1)
    assert not signed.from_lines and threaded.from_lines
    bundles = []
    for k, premade in enumerate((signed, threaded)):
        spool = _spool(tmp_path, items, premade, seed + 10 * k)
        bundles.append(_write(tmp_path, f"b{k}.tar.gz", spool, premade, reads=False)[0])
    assert bundles[0] == bundles[1]


@needs_fast
def test_a_premade_whose_thread_dies_gives_up_and_never_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What its thread's own catch misses (a BaseException) gives the lines up: the correlator's
    add() and end() go on, never waiting on a queue nobody reads."""
    premade = Premade(tmp_path, {}, 1)

    def dies(items: Any, **how: Any) -> None:
        raise SystemExit("thread dies")

    monkeypatch.setattr(premade, "_add", dies)
    items = _items(3000, 7)
    for k in range(0, len(items), 100):  # (more batches than the queue holds)
        premade.add(items[k : k + 100])  # type: ignore[arg-type]
    assert not premade.end()
    assert premade.failed
    premade.close()


@needs_fast
def test_a_premade_closed_with_batches_queued_stops_its_thread(tmp_path: Path) -> None:
    """close() while the thread has a batch queued: the thread makes nothing more and is gone."""
    premade = Premade(tmp_path, {}, 1)
    items = _items(5000, 6)
    for k in range(0, len(items), 500):
        premade.add(items[k : k + 500])  # type: ignore[arg-type]
    thread = premade._thread
    assert thread is not None
    premade.close()
    assert not thread.is_alive() and premade._thread is None
    assert premade.failed and not premade.end()


def test_no_line_holds_the_placeholders_bytes_but_in_its_places(tmp_path: Path) -> None:
    """Every control character and every byte that UTF-8 lacks, in names and labels, is escaped
    in canonical JSON (or not a byte of it): the placeholder's bytes are only in its places, three a
    line, so translating them touches nothing else."""
    every = "".join(map(chr, range(32))) + "\x7f\xff\u00ff\U0010ffff"
    premade = Premade(tmp_path, {"team": every}, 1)
    premade.add([cb.open_(1, "/w/" + every, ["read"]), cb.open_(2, every * 3, ["read"])])
    assert premade.end()
    lines = b"".join(premade.lines.read(1 << 20)).split(b"\n")[:-1]  # (\r is a placeholder byte)
    placeholder_bytes = set(PLACEHOLDER[4:])
    assert len(lines) == 2
    for line in lines:
        assert line.count(PLACEHOLDER) == 3
        assert not placeholder_bytes & set(line.replace(PLACEHOLDER, b""))
    premade.close()


@pytest.mark.parametrize(
    "what",
    ["labels", "degradation", "signed", "events cap", "compressed cap", "failed"],
)
def test_what_the_lines_assumed_does_not_hold_the_spool_makes_them(tmp_path: Path, what: str) -> None:
    items = _items(3000, 9)
    meta = cb.meta(detail="full")
    caps = None
    over: dict[str, Any] = {}
    premade = Premade(tmp_path, {}, 1)
    if what == "labels":  # labels changed during the run (the agent's API)
        meta = cb.meta(detail="full", labels={"stage": "late"})
    elif what == "degradation":  # a degradation said after the run started: one more head event
        meta = cb.meta(detail="full", degradations=[{"component": "recorder", "reason": "r", "impact": "i"}])
    elif what == "signed":
        from evidence.bundle.signing import generate, load_signer

        over["signer"] = load_signer(generate(tmp_path / "key")[0])
    elif what == "events cap":
        caps = Caps(events=1000)
        premade = Premade(tmp_path, {}, 1, caps)
    elif what == "compressed cap":  # the premade lines are made without it: checked on the real bytes
        caps = Caps(compressed=60_000)
        premade = Premade(tmp_path, {}, 1, caps)
    spool = _spool(tmp_path, items, premade, 9)
    if what == "failed":
        premade.add([b"not a line\n"])  # a line that is no repeated open: parsed, fails, given up
        assert not premade.end()  # (said when its lines end: they may be made on a thread)
        assert premade.failed
    fast, manifest = _write(tmp_path, "fast.tar.gz", spool, premade, meta=meta, caps=caps, **over)
    slow, _ = _write(tmp_path, "slow.tar.gz", spool, None, meta=meta, caps=caps, **over)
    assert fast == slow
    if "cap" in what:
        assert manifest["lost"]["by_kind"].get("over_cap:file.open", 0) > 0
    list(open_bundle(tmp_path / "fast.tar.gz").events())  # verifies


def test_a_premade_never_stops_the_spool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A premade whose file fails (its disk full: /dev/full) gives up, at the latest when its lines
    end (they are compressed, and zstandard writes when it has made a block); the spool, opened after
    it, keeps every record."""
    full = open("/dev/full", "w+b")  # noqa: SIM115 - the premade's to close
    made = iter([full])
    real = premade_module.tempfile.TemporaryFile
    monkeypatch.setattr(premade_module.tempfile, "TemporaryFile", lambda **kw: next(made, None) or real(**kw))
    premade = Premade(tmp_path, {}, 1)
    assert premade.lines.file is full
    items = _items(3000, 4)
    spool = _spool(tmp_path, items, premade, 4)
    assert not premade.end()
    assert premade.failed
    assert sum(1 for _ in read_spool_lines(spool)) == len(items)
    fast, manifest = _write(tmp_path, "fast.tar.gz", spool, premade)
    assert manifest["events"] == len(items) + 2
    assert fmt.FILE_OPEN in manifest["counts"]


def test_a_premade_file_closed_under_it_never_writes_into_another(tmp_path: Path) -> None:
    """Its file closed under it, and the descriptor's number taken by the spool opened next: the
    premade's writes (its compressing thread's, src/fast/zfile.h) never go to the spool, which keeps
    every record whole; the bundle is still written, with every event."""
    premade = Premade(tmp_path, {}, 1)
    premade.lines.file.close()
    items = _items(3000, 4)
    spool = _spool(tmp_path, items, premade, 4)
    premade.end()
    assert sum(1 for _ in read_spool_lines(spool)) == len(items)
    fast, manifest = _write(tmp_path, "fast.tar.gz", spool, premade)
    slow, _ = _write(tmp_path, "slow.tar.gz", spool, None)
    assert manifest["events"] == len(items) + 2
    assert fast == slow


@pytest.mark.parametrize("when", ["before its records", "after its first records"])
def test_a_degradation_or_labels_said_during_the_run(tmp_path: Path, when: str) -> None:
    """Said before any record came (a run's set-up), the lines are made with them and used; said
    after, the writer makes them from the spool. The same bytes either way."""
    items = _items(2000, 5)
    degradations = [{"component": "policy", "reason": "r", "impact": "i"}]
    meta = cb.meta(detail="full", labels={"team": "a"}, degradations=degradations)
    premade = Premade(tmp_path, {}, 1)
    cut = 0 if when == "before its records" else 700
    path = tmp_path / "s.spool.zst"
    with SpoolWriter(path) as w:
        w.events = premade.add
        w.write_many(items[:cut])  # type: ignore[arg-type]
        premade.restart({"team": "a"}, 2)  # what Session.degrade and update_labels call
        w.write_many(items[cut:])  # type: ignore[arg-type]
    assert premade.made().usable(meta.labels, 2, None) == (cut == 0)
    fast, _ = _write(tmp_path, "fast.tar.gz", path, premade, meta=meta, reads=cut != 0)
    slow, _ = _write(tmp_path, "slow.tar.gz", path, None, meta=meta)
    assert fast == slow


def test_a_session_restarts_its_premade_when_it_degrades(tmp_path: Path) -> None:
    from evidence.agent.recorder.correlate import Correlator
    from evidence.agent.recorder.session import Session
    from evidence.bundle.format import Degradation

    premade = Premade(tmp_path, {}, 1)
    spool = SpoolWriter(tmp_path / "x.spool.zst")
    session = Session(
        slot=1, session_id="s", cgroup_path=tmp_path, cgroup_id=1, command=["x"], cwd="/",
        detail="full", labels={}, spool=spool, correlator=Correlator(0), started_ns=0, premade=premade,
    )  # fmt: skip
    session.degrade(Degradation(component="dns", reason="r", impact="i"))
    session.update_labels({"k": "v"})
    assert (premade.head, premade.labels, premade.sink.seq) == (2, {"k": "v"}, 2)
    spool.close()
    premade.close()


@pytest.mark.parametrize("during", [True, False])
@pytest.mark.parametrize("files", [1000, 3])
@pytest.mark.parametrize("n", [300, 5000])
def test_a_signed_full_bundle_takes_the_premade_lines_and_its_trace_is_its_events(
    tmp_path: Path, n: int, files: int, during: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Signed, the premade lines are taken, its trace fed as they were made (`during`: the recorder
    knew it would sign) or from the spool read again: the same bytes as made from the spool, and
    the attestation's runtime trace is what the bundle's own events make (every event fed in
    order, as a reader would: past the trace's budgets too, where each open and repeat of a path
    not listed counts)."""
    from evidence.bundle import attestation, runtime_trace
    from evidence.bundle.signing import generate, load_signer
    from tests.unit.test_runtime_trace import statement_of

    monkeypatch.setattr(runtime_trace, "MAX_FILES_BY_NAME", files)

    items = _items(n, 11)
    premade = Premade(tmp_path, {}, 1, signed=during)
    spool = _spool(tmp_path, items, premade, 11)
    signer = load_signer(generate(tmp_path / "key")[0])
    fast, manifest = _write(tmp_path, "fast.tar.gz", spool, premade, signer=signer)
    slow, _ = _write(tmp_path, "slow.tar.gz", spool, None, signer=signer)
    assert fast == slow
    trace = runtime_trace.Trace()
    bundle = open_bundle(tmp_path / "fast.tar.gz")
    trace.feed_events(bundle.events())
    want = runtime_trace.predicate(manifest, attestation.predicate(manifest), trace)  # type: ignore[arg-type]
    assert statement_of(tmp_path / "fast.tar.gz")["predicate"] == orjson.loads(orjson.dumps(want))
