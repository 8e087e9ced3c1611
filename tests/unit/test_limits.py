"""agent/recorder/limits.py without root: where controllers are, what apply writes (on directory
trees standing in for cgroup files), degradations, the watcher's deltas and the OOM victims' join."""

from __future__ import annotations

from pathlib import Path

from evidence.agent.recorder.limits import (
    Hierarchy,
    LimitEvent,
    LimitWatcher,
    apply,
    name_victims,
    parse_counters,
    parse_hierarchies,
)
from evidence.policy.governance import LimitsPolicy

HYBRID_MOUNTS = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
HYBRID_CGROUP = "9:name=systemd:/\n8:pids:/\n4:memory:/process_api/abc\n1:cpu:/\n0::/\n"
UNIFIED_MOUNTS = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def _limits(**kw: object) -> LimitsPolicy:
    return LimitsPolicy.model_validate(kw)


def test_hybrid_host_keeps_memory_pids_cpu_on_v1() -> None:
    h = parse_hierarchies(HYBRID_MOUNTS, HYBRID_CGROUP, "hugetlb\n")
    assert h == {
        "cpu": Hierarchy("cpu", 1, Path("/sys/fs/cgroup/cpu"), "/"),
        "memory": Hierarchy("memory", 1, Path("/sys/fs/cgroup/memory"), "/process_api/abc"),
        "pids": Hierarchy("pids", 1, Path("/sys/fs/cgroup/pids"), "/"),
    }


def test_unified_host_and_a_host_without_controllers() -> None:
    h = parse_hierarchies(UNIFIED_MOUNTS, "0::/user.slice/x\n", "cpuset cpu io memory pids\n")
    assert {k: (v.version, str(v.mount), v.own) for k, v in h.items()} == {
        "cpu": (2, "/sys/fs/cgroup", "/user.slice/x"),
        "memory": (2, "/sys/fs/cgroup", "/user.slice/x"),
        "pids": (2, "/sys/fs/cgroup", "/user.slice/x"),
    }
    assert parse_hierarchies(UNIFIED_MOUNTS, "0::/\n", "cpuset io\n") == {}
    assert parse_hierarchies("", "", None) == {}


def _v2_tree(tmp_path: Path, files: tuple[str, ...]) -> Path:
    cg = tmp_path / "v2" / "evidence" / "run1"
    cg.mkdir(parents=True)
    (cg.parent / "cgroup.subtree_control").write_text("")
    for f in files:
        (cg / f).write_text("max\n")
    return cg


def test_apply_on_v2_writes_the_files_and_enables_a_missing_controller(tmp_path: Path) -> None:
    cg = _v2_tree(tmp_path, ("memory.max", "memory.swap.max", "cpu.max"))
    hier = {c: Hierarchy(c, 2, tmp_path / "v2") for c in ("memory", "pids", "cpu")}  # type: ignore[arg-type]
    applied = apply(_limits(memory="1GiB", cpu=1.5, pids=100), cg, hier)
    assert (cg / "memory.max").read_text() == str(1 << 30)
    assert (cg / "memory.swap.max").read_text() == "0"
    assert (cg / "cpu.max").read_text() == "150000 100000"
    # pids.max was missing: the parent was asked to enable pids for its children (a real kernel then
    # shows the file; this tree does not, and the write makes it)
    assert (cg.parent / "cgroup.subtree_control").read_text() == "+pids"
    assert (cg / "pids.max").read_text() == "100"
    assert applied.degradations == [] and applied.v1_dirs() == []
    assert applied.in_force() == {
        "memory": {"value": 1 << 30, "by": "cgroup v2"},
        "pids": {"value": 100, "by": "cgroup v2"},
        "cpu_millis": {"value": 1500, "by": "cgroup v2"},
    }


def test_what_cannot_be_applied_is_a_degradation(tmp_path: Path) -> None:
    cg = _v2_tree(tmp_path, ())
    (cg.parent / "cgroup.subtree_control").unlink()
    (cg.parent / "cgroup.subtree_control").mkdir()  # a write to it fails (EISDIR)
    hier = {"memory": Hierarchy("memory", 2, tmp_path / "v2")}
    applied = apply(_limits(memory=4096, pids=5, wall="10s"), cg, hier)
    reasons = {d.limit: d.reason for d in applied.degradations}
    assert reasons["pids"] == "no pids controller on this host"
    assert reasons["memory"].startswith("cannot set the memory limit (cgroup v2): ")
    assert applied.placements == {}
    rec = applied.degradations[0].record(5)
    assert rec["k"] == "degradation" and rec["component"] == "limits" and rec["t"] == 5
    assert "is not enforced" in rec["impact"]
    assert applied.in_force() == {"wall_ms": {"value": 10_000, "by": "watcher"}}


def test_apply_on_v1_makes_a_cgroup_below_its_own_and_removes_it(tmp_path: Path) -> None:
    own = tmp_path / "memory" / "process_api" / "abc"
    own.mkdir(parents=True)
    cpu = tmp_path / "cpu"
    cpu.mkdir()
    hier = {
        "memory": Hierarchy("memory", 1, tmp_path / "memory", "/process_api/abc"),
        "cpu": Hierarchy("cpu", 1, cpu, "/"),
    }
    applied = apply(_limits(memory="64MiB", cpu=0.5), tmp_path / "v2" / "run7", hier)
    assert applied.v1_dirs() == sorted([own / "run7", cpu / "run7"])
    assert (own / "run7" / "memory.limit_in_bytes").read_text() == str(64 << 20)
    assert not (own / "run7" / "memory.memsw.limit_in_bytes").exists()  # no swap accounting: skipped
    assert (cpu / "run7" / "cpu.cfs_quota_us").read_text() == "50000"
    assert applied.written == {
        "memory/memory.limit_in_bytes": str(64 << 20),
        "cpu/cpu.cfs_period_us": "100000",
        "cpu/cpu.cfs_quota_us": "50000",
    }
    for d in applied.v1_dirs():  # a real cgroup directory has only kernel files: rmdir works
        for f in d.iterdir():
            f.unlink()
    applied.remove()
    assert not (own / "run7").exists() and not (cpu / "run7").exists()


def test_counters_and_the_watcher_reports_only_what_grew(tmp_path: Path) -> None:
    assert parse_counters("low 0\nhigh 2\nmax 7\noom_kill 1\nbad\nx y\n") == {
        "low": 0,
        "high": 2,
        "max": 7,
        "oom_kill": 1,
    }
    cg = _v2_tree(tmp_path, ("memory.max", "pids.max"))
    (cg / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 0\noom_kill 1\n")  # before the run
    (cg / "pids.events").write_text("max 0\n")
    hier = {c: Hierarchy(c, 2, tmp_path / "v2") for c in ("memory", "pids")}  # type: ignore[arg-type]
    applied = apply(_limits(memory="1MiB", pids=3, wall="2s"), cg, hier)
    now = [100.0]
    watcher = LimitWatcher(applied, clock=lambda: now[0], clock_ns=lambda: int(now[0] * 1e9))
    assert watcher.poll() == []
    (cg / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 1\noom_kill 3\n")
    (cg / "pids.events").write_text("max 4\n")
    now[0] = 101.0
    got = {(e.limit, e.kind): e.count for e in watcher.poll()}
    assert got == {("memory", "oom_kill"): 2, ("memory", "memory_max"): 6, ("pids", "fork_refused"): 4}
    assert watcher.wall_left() == 1.0
    now[0] = 102.0
    assert [(e.kind, e.t) for e in watcher.poll()] == [("wall", 102_000_000_000)]
    now[0] = 500.0
    assert watcher.poll() == [] and watcher.wall_left() == 0.0  # the wall event is told once
    assert LimitEvent("wall", "wall", 1, 0).describe() == "the run reached limits.wall and is killed"


def test_oom_victims_are_joined_from_exit_records() -> None:
    ev = LimitEvent("memory", "oom_kill", 2, t=200)
    exits = [
        {"pid": 10, "signal": "SIGKILL", "t": 150},
        {"pid": 11, "signal": "SIGKILL", "t": 199},
        {"pid": 12, "signal": "SIGKILL", "t": 90},  # before the previous poll
        {"pid": 13, "signal": "SIGTERM", "t": 160},
        {"pid": 14, "signal": "SIGKILL", "t": 201},  # after this poll
        {"pid": 15, "signal": "SIGKILL", "t": 170},  # killed by evidence itself
        {"pid": 16, "signal": None, "t": 170},
    ]
    named = name_victims(ev, exits, since=100, killed_by_us=[15])
    assert named.pids == (10, 11) and named.certain
    one = name_victims(LimitEvent("memory", "oom_kill", 1, t=200), exits, since=100, killed_by_us=[15])
    assert one.pids == (10, 11) and not one.certain  # two candidates for one kill
    fork = LimitEvent("pids", "fork_refused", 3, t=5)
    assert name_victims(fork, exits, since=0) is fork
    # a victim scheduled only after the poll that counted its kill (a busy machine): named up to `until`
    late = name_victims(
        LimitEvent("memory", "oom_kill", 3, t=200), exits, since=100, killed_by_us=[15], until=300
    )
    assert late.pids == (10, 11, 14) and late.certain
