"""agent.daemon backend pieces that need no kernel: the observed spool, the untrack handover, process depths,
bundle names, and recovery of spools left by an agent that died."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from evidence.agent.daemon.runs import process_depths
from evidence.agent.daemon.wrappers import HandoverProbes, ObservedSpool
from evidence.agent.recorder.recovery import recover_spools, unique_path
from evidence.bundle.spool import SpoolWriter, read_spool
from evidence.files import private_dir
from tests.kernel.util import read_bundle


def test_observed_spool_writes_the_prelude_first_and_counts(tmp_path: Path) -> None:
    seen: list[str] = []
    spool = ObservedSpool(
        SpoolWriter(tmp_path / "s.spool.zst"), lambda recs: seen.extend(r["k"] for r in recs)
    )
    spool.write_many([{"k": "open", "t": 2}])  # arrives while the inventory is being taken
    assert seen == []
    spool.set_prelude([{"k": "inventory", "t": 1}])
    spool.write({"k": "exec", "t": 3})
    spool.flush()
    spool.close()
    spool.close()
    spool.flush()  # after close: nothing, no error
    assert [r["k"] for r in read_spool(tmp_path / "s.spool.zst")] == ["inventory", "open", "exec"]
    assert seen == ["inventory", "open", "exec"]


def test_observed_spool_without_prelude_still_writes_what_it_held(tmp_path: Path) -> None:
    spool = ObservedSpool(SpoolWriter(tmp_path / "s.spool.zst"), lambda recs: None)
    spool.write_many([{"k": "open", "t": 2}])
    spool.close()
    assert [r["k"] for r in read_spool(tmp_path / "s.spool.zst")] == ["open"]


class FakeProbes:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def untrack(self, cg: int) -> None:
        self.calls.append(("untrack", cg))

    def clear_cache(self) -> None:
        self.calls.append(("clear", None))

    def poll(self, ms: int) -> None:
        self.calls.append(("poll", ms))


def test_handover_skips_exactly_one_untrack() -> None:
    inner = FakeProbes()
    p = HandoverProbes(inner)
    p.keep(7)
    p.untrack(7)  # the old window's finish: the new window keeps the cgroup
    p.untrack(7)  # the new window's own finish later: a real untrack
    p.untrack(8)
    p.poll(50)  # everything else passes through
    assert inner.calls == [("clear", None), ("untrack", 7), ("untrack", 8), ("poll", 50)]


def test_depths_follow_parents_inside_the_inventory() -> None:
    inv = [{"pid": 10, "ppid": 1}, {"pid": 11, "ppid": 10}, {"pid": 12, "ppid": 11}, {"pid": 20, "ppid": 5}]
    assert process_depths(inv) == {10: 0, 11: 1, 12: 2, 20: 0}
    assert process_depths([{"pid": 3, "ppid": 4}, {"pid": 4, "ppid": 3}]).keys() == {3, 4}  # a cycle ends


def test_unique_path(tmp_path: Path) -> None:
    p = tmp_path / "ns_pod_uid-1.tar.gz"
    assert unique_path(p) == p
    p.touch()
    (tmp_path / "ns_pod_uid-1-2.tar.gz").touch()
    assert unique_path(p) == tmp_path / "ns_pod_uid-1-3.tar.gz"


def _dead_agent_spool(spool_dir: Path, sid: str, n: int, meta: dict[str, Any] | None) -> None:
    spool_dir.mkdir(exist_ok=True)
    w = SpoolWriter(spool_dir / f"{sid}.spool.zst")
    w.write(
        {
            "k": "inventory",
            "t": 1_000,
            "pid": 5,
            "ppid": 1,
            "argv": ["sh"],
            "cwd": "/",
            "exe": "/bin/sh",
            "sockets": [],
        }
    )
    for i in range(n):
        w.write({"k": "exec", "t": 2_000 + i, "pid": 100 + i, "ppid": 5, "depth": 1, "filename": "/bin/true",
                 "argv": ["true"], "argv_truncated": False, "cwd": "/", "result": 0})  # fmt: skip
    w.flush()
    w.write({"k": "exec", "t": 9_999, "pid": 1, "ppid": 1, "depth": 0, "filename": "/lost"})  # never flushed
    w._raw.flush()  # the process dies here: no close, the zstd frame is unfinished
    if meta is not None:
        (spool_dir / f"{sid}.run.json").write_text(json.dumps(meta))


def test_recover_spools_of_a_dead_agent(tmp_path: Path) -> None:
    spool_dir, bundles = tmp_path / "spool", tmp_path / "bundles"
    meta = {"session_id": "s1", "cgroup": "/sys/fs/cgroup/x", "started_ns": 500, "labels": {"job": "1"},
            "bundle_name": "ns_pod_uid-2.tar.gz", "attached_late": True, "command": [], "cwd": ""}  # fmt: skip
    _dead_agent_spool(spool_dir, "s1", 3, meta)
    _dead_agent_spool(spool_dir, "s2", 1, None)  # no recovery record: still a bundle
    (spool_dir / "gone.run.json").write_text("{}")  # a run whose spool never existed
    (spool_dir / "bad.spool.zst").write_bytes(b"not zstd at all")
    bundles.mkdir()
    (bundles / ".evidence-abc.tmp").write_bytes(b"half a bundle")
    out = recover_spools(spool_dir, bundles)
    assert [p.name for p in out] == ["ns_pod_uid-2.tar.gz", "s2.tar.gz"]
    manifest, events = read_bundle(bundles / "ns_pod_uid-2.tar.gz")
    assert (
        manifest["cut_short"] is True
        and manifest["labels"] == {"job": "1"}
        and manifest["session_id"] == "s1"
    )
    assert [e["type"].rsplit(".", 1)[-1] for e in events].count("exec") == 3  # up to the last flush
    assert [e["data"]["component"] for e in events if e["type"] == "dev.evidence.degradation"] == ["agent"]
    assert sorted(p.name for p in spool_dir.iterdir()) == ["failed"]
    assert sorted(p.name for p in (spool_dir / "failed").iterdir()) == ["bad.spool.zst"]  # kept, not lost
    assert sorted(p.name for p in bundles.iterdir()) == ["ns_pod_uid-2.tar.gz", "s2.tar.gz"]


def test_spools_wait_in_a_directory_only_the_recorder_can_enter(tmp_path: Path) -> None:
    """A job that could replace its run's spool would write the bundle: the spool directory is
    0700 and the recorder's own, never a symlink."""
    d = tmp_path / "lib" / "spool"
    assert private_dir(d) == d and (d.stat().st_mode & 0o777) == 0o700
    d.chmod(0o777)
    with pytest.raises(OSError, match="writable by others"):
        private_dir(d)  # what others could write in it is not trusted: refused, left alone
    assert (d.stat().st_mode & 0o777) == 0o777
    d.chmod(0o755)
    assert private_dir(d) == d
    link = tmp_path / "link"
    link.symlink_to(d)
    with pytest.raises(OSError, match="not a directory"):
        private_dir(link)
    (d / "s.spool.zst").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FileExistsError):  # a spool is always a new file, never through a link
        SpoolWriter(d / "s.spool.zst")


def test_a_private_directory_is_private_whatever_the_umask(tmp_path: Path) -> None:
    """Bundles, spools and undelivered events are the recorder's alone: a directory made for them is
    0700 (its missing parents 0755) under umask 0 too; one an older agent made readable (0755, its
    bundles 0644) is made 0700, its files 0600 (a symlink's target is left alone)."""
    old = os.umask(0)
    try:
        d = private_dir(tmp_path / "a" / "b" / "bundles")
    finally:
        os.umask(old)
    assert (d.stat().st_mode & 0o777) == 0o700
    assert (d.parent.stat().st_mode & 0o777) == (d.parent.parent.stat().st_mode & 0o777) == 0o755
    d.chmod(0o755)
    (d / "old.tar.gz").write_bytes(b"x")
    (d / "old.tar.gz").chmod(0o644)
    outside = tmp_path / "outside"
    outside.write_bytes(b"y")
    outside.chmod(0o644)
    (d / "link.tar.gz").symlink_to(outside)
    assert private_dir(d) == d
    assert (d.stat().st_mode & 0o777) == 0o700 and ((d / "old.tar.gz").stat().st_mode & 0o777) == 0o600
    assert (outside.stat().st_mode & 0o777) == 0o644
    assert not (tmp_path / "elsewhere").exists()


def test_recover_leaves_a_live_run_alone_and_completes_a_finished_one(tmp_path: Path) -> None:
    """`evidence run` holds its run record locked while it lives: recovery does not take its spool.
    A run that ended but whose bundle could not be written becomes a complete bundle with its exit
    code; without a bundle directory, it goes where the run's --bundle named if only root can write
    there, else into root's own directory."""
    from evidence.agent.recorder.recovery import hold, leftovers

    spool_dir, wanted = tmp_path / "spool", tmp_path / "out"
    wanted.mkdir()
    base = {"cgroup": "/sys/fs/cgroup/x", "started_ns": 500, "labels": {}, "command": ["make"], "cwd": "/w",
            "attached_late": False, "detail": "summary"}  # fmt: skip
    _dead_agent_spool(spool_dir, "live", 1, {**base, "session_id": "live"})
    from evidence.bundle.reader import open_bundle
    from evidence.bundle.signing import generate, load_public_key

    key, pub, _ = generate(tmp_path / "key")  # the run asked for its bundle to be signed
    _dead_agent_spool(
        spool_dir, "ended", 2,
        {**base, "session_id": "ended", "bundle_name": "run.tar.gz", "bundle_path": str(wanted / "run.tar.gz"),
         "exit_code": 7, "signal": None, "finished_ns": 10_000, "sign_key": str(key)},
    )  # fmt: skip
    lock = hold(spool_dir / "live.run.json")
    try:
        assert [p.name for p in leftovers(spool_dir)] == ["ended.spool.zst"]
        out = recover_spools(spool_dir, None, recorder="evidence run")
        # the run asked for tmp_path/out, under /tmp, which others can write: a job could have
        # swapped it, so root writes into its own directory instead
        assert out == [spool_dir.parent / "recovered" / "run.tar.gz"]
        assert not (wanted / "run.tar.gz").exists()
        assert (spool_dir / "live.spool.zst").exists() and (spool_dir / "live.run.json").exists()
    finally:
        os.close(lock)
    from evidence.bundle.reader import read_manifest

    got = spool_dir.parent / "recovered" / "run.tar.gz"
    signed = open_bundle(got)
    events = list(signed.events())  # verifies
    signed.check_signature(load_public_key(pub))  # signed as the run asked
    manifest = read_manifest(got)
    assert manifest["exit_code"] == 7 and manifest["cut_short"] is False and manifest["command"] == ["make"]
    (d,) = [e["data"] for e in events if e["type"] == "dev.evidence.degradation"]
    assert d["component"] == "evidence run" and "could not be written" in d["reason"]
    # once its recorder is gone, the other run is recovered too (cut short)
    assert [p.name for p in recover_spools(spool_dir, tmp_path / "b", recorder="evidence run")] == [
        "live.tar.gz"
    ]


@pytest.mark.parametrize(("argv", "differs"), [(["true"], False), (["sh", "-c", "cat SECRET"], True)])
def test_a_recovered_run_says_what_the_kernel_executed(
    tmp_path: Path, argv: list[str], differs: bool
) -> None:
    """A run whose command it started (its record says `claimed`) is recovered as the recorder
    would have written it: the first exec of its first process is the command, the claim beside it,
    a difference a `command` degradation (lint EV014)."""
    from evidence.bundle.reader import read_events, read_manifest

    spool_dir, bundles = tmp_path / "spool", tmp_path / "bundles"
    spool_dir.mkdir()
    with SpoolWriter(spool_dir / "s.spool.zst") as w:
        w.write({"k": "exec", "t": 2_000, "pid": 100, "ppid": 5, "depth": 0, "filename": "/bin/x",
                 "argv": argv, "argv_truncated": False, "cwd": "/", "result": 0})  # fmt: skip
    meta = {"session_id": "s", "cgroup": "/x", "started_ns": 500, "command": ["true"], "claimed": True,
            "pid": 100, "cwd": "/", "attached_late": False, "detail": "summary"}  # fmt: skip
    (spool_dir / "s.run.json").write_text(json.dumps(meta))
    (out,) = recover_spools(spool_dir, bundles)
    manifest = read_manifest(out)
    assert manifest["command"] == argv and manifest["claimed_command"] == ["true"]
    components = [e["data"]["component"] for e in read_events(out) if e["type"] == "dev.evidence.degradation"]
    assert ("command" in components) == differs


def test_a_recovered_run_keeps_its_journaled_records(tmp_path: Path) -> None:
    """Records made outside the ring buffer are journaled as they are made (Session.add_records):
    recovery adds them after the spool's, up to a line cut off mid-write, and removes the journal."""
    spool_dir, bundles = tmp_path / "spool", tmp_path / "bundles"
    meta = {"session_id": "s1", "cgroup": "/sys/fs/cgroup/x", "started_ns": 500, "labels": {},
            "command": [], "cwd": ""}  # fmt: skip
    _dead_agent_spool(spool_dir, "s1", 2, meta)
    journaled = {"k": "exec", "t": 3_000, "pid": 200, "ppid": 5, "depth": 1, "filename": "/bin/false",
                 "argv": ["false"], "argv_truncated": False, "cwd": "/", "result": 0}  # fmt: skip
    (spool_dir / "s1.records.ndjson").write_bytes(json.dumps(journaled).encode() + b'\n{"k": "exe')
    bundles.mkdir()
    recover_spools(spool_dir, bundles)
    _, events = read_bundle(bundles / "s1.tar.gz")
    execs = [e["data"] for e in events if e["type"].endswith(".exec")]
    assert [d["filename"] for d in execs][-1] == "/bin/false" and len(execs) == 3
    assert not (spool_dir / "s1.records.ndjson").exists()
