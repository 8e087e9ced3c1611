"""Resource limits on a run's cgroup (policy `limits`): memory, pids and cpu, on cgroup v2 or on v1
hierarchies, and what the kernel says was hit.

Where each controller lives is read from /proc/self/mountinfo: on a unified host all three are in
the v2 hierarchy (the run's own cgroup: memory.max + memory.swap.max, pids.max, cpu.max); on a
hybrid host such as a Debian VM with systemd's hybrid layout, memory, pids and cpu are v1
hierarchies of their own, where a process's v2 cgroup says nothing. There the run gets a cgroup of
its own in each v1 hierarchy that holds a controller it limits, named after its v2 cgroup and made
below the cgroup this process is in (so the limits already set above keep applying); it takes
memory.limit_in_bytes (and memory.memsw.limit_in_bytes, so swap does not stretch it), pids.max,
cpu.cfs_period_us/cpu.cfs_quota_us. Processes must be put into those v1 cgroups as well as the v2
one: `AppliedLimits.enter(pid)` (the launcher's child, before it execs the command: what it forks
inherits them). A job that is not root cannot leave them (their cgroup.procs are root's).

What cannot be applied (no such controller, the v2 controller not enabled for the run's cgroup and
not enableable, a write refused) is a `LimitDegradation`; the caller records it as a degradation
(or refuses to start with --fail-closed).

`LimitWatcher.poll()` reads the counters (v2 memory.events oom_kill and max, v1
memory.oom_control oom_kill (its memory.failcnt stayed 0 through an OOM kill on this
kernel: not read), pids.events max, cpu.stat nr_throttled) and the
wall clock, and returns what grew since the last poll as `LimitEvent`s. The kernel does not say in
those files which process the OOM killer chose; `name_victims` joins them with the run's exit
records: the processes of the limited cgroup that died of SIGKILL between the poll that saw the
counter still low and the one that saw it grow, that evidence did not kill itself, are the
candidates; when there are as many as kills counted, they are the victims.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypedDict

from evidence.bundle.record_types import DegradationRecord
from evidence.policy.governance import LimitsPolicy

logger = logging.getLogger(__name__)

Controller = Literal["memory", "pids", "cpu"]
CONTROLLERS: tuple[Controller, ...] = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000
COMPONENT = "limits"


@dataclass(frozen=True)
class Hierarchy:
    """Where a controller is: cgroup `version`, the hierarchy's mount point, and the path (relative
    to the mount) of the cgroup this process is in there."""

    controller: Controller
    version: Literal[1, 2]
    mount: Path
    own: str = "/"


def parse_hierarchies(mountinfo: str, proc_cgroup: str, v2_controllers: str | None) -> dict[str, Hierarchy]:
    """Controller -> hierarchy, from the texts of /proc/self/mountinfo, /proc/self/cgroup and the v2
    root's cgroup.controllers (None when there is no v2 mount). A controller on a v1 hierarchy is
    taken from there (the kernel binds a controller to one hierarchy at a time)."""
    v1_paths: dict[str, str] = {}
    v2_path = "/"
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2_path = parts[2] or "/"
        for name in parts[1].split(","):
            v1_paths[name] = parts[2] or "/"
    out: dict[str, Hierarchy] = {}
    v2_mount: Path | None = None
    for line in mountinfo.splitlines():
        pre, _, post = line.partition(" - ")
        fields, post_fields = pre.split(), post.split()
        if len(fields) < 5 or len(post_fields) < 3:
            continue
        mount = Path(fields[4].replace("\\040", " "))
        if post_fields[0] == "cgroup2":
            if v2_mount is None or str(mount) == "/sys/fs/cgroup":
                v2_mount = mount
        elif post_fields[0] == "cgroup":
            options = post_fields[2].split(",")
            for ctl in CONTROLLERS:
                if ctl in options and ctl not in out:
                    out[ctl] = Hierarchy(ctl, 1, mount, v1_paths.get(ctl, "/"))
    if v2_mount is not None and v2_controllers is not None:
        offered = v2_controllers.split()
        for c in CONTROLLERS:
            if c in offered and c not in out:
                out[c] = Hierarchy(c, 2, v2_mount, v2_path)
    return out


def detect() -> dict[str, Hierarchy]:
    """This host's hierarchies for memory, pids and cpu (missing: not available)."""
    mountinfo = Path("/proc/self/mountinfo").read_text()
    proc_cgroup = Path("/proc/self/cgroup").read_text()
    v2_controllers = None
    for line in mountinfo.splitlines():
        pre, _, post = line.partition(" - ")
        if post.split()[:1] == ["cgroup2"]:
            with contextlib.suppress(OSError):
                v2_controllers = (
                    Path(pre.split()[4].replace("\\040", " ")) / "cgroup.controllers"
                ).read_text()
            break
    return parse_hierarchies(mountinfo, proc_cgroup, v2_controllers)


@dataclass(frozen=True)
class LimitDegradation:
    """A limit of the policy that is not in force on this host, and why."""

    limit: str
    reason: str

    @property
    def impact(self) -> str:
        return f"limits.{self.limit} is not enforced: the run may use more than the policy allows"

    def record(self, t: int) -> DegradationRecord:
        """The spool's degradation record (bundle/record_types.DegradationRecord)."""
        return {
            "k": "degradation",
            "t": t,
            "component": COMPONENT,
            "reason": self.reason,
            "impact": self.impact,
        }


@dataclass(frozen=True)
class Placement:
    """The cgroup directory that holds one controller's limit for the run."""

    controller: Controller
    version: Literal[1, 2]
    path: Path
    made: bool  # a v1 cgroup made for the run (entered by enter(), removed by remove())


class LimitInForce(TypedDict):
    """A limit in force, for the manifest: its value and what holds it ("cgroup v2", "watcher")."""

    value: int
    by: str


@dataclass
class AppliedLimits:
    """What `apply` set: the placements, what it wrote, and what could not be applied."""

    limits: LimitsPolicy
    placements: dict[str, Placement] = field(default_factory=dict)
    written: dict[str, str] = field(default_factory=dict)  # file (relative to its controller) -> value
    degradations: list[LimitDegradation] = field(default_factory=list)

    def v1_dirs(self) -> list[Path]:
        return sorted({p.path for p in self.placements.values() if p.made})

    def enter(self, pid: int) -> None:
        """Put a process into the run's v1 cgroups (its v2 cgroup is the caller's business)."""
        for path in self.v1_dirs():
            (path / "cgroup.procs").write_text(f"{pid}\n")

    def in_force(self) -> dict[str, LimitInForce]:
        """For the manifest: each limit in force and the cgroup version that holds it (wall: the
        watcher), as JSON with no floats."""
        out: dict[str, LimitInForce] = {}
        for name, value in self.limits.summary().items():
            ctl = "cpu" if name == "cpu_millis" else name
            if ctl == "wall_ms":
                out[name] = {"value": value, "by": "watcher"}
            elif ctl in self.placements:
                out[name] = {"value": value, "by": f"cgroup v{self.placements[ctl].version}"}
        return out

    def remove(self, timeout: float = 5.0) -> None:
        """Remove the v1 cgroups made for the run, killing what is left in them first."""
        for path in self.v1_dirs():
            deadline = time.monotonic() + timeout
            while True:
                try:
                    os.rmdir(path)
                    break
                except OSError as e:
                    if e.errno == errno.ENOENT:
                        break
                    if e.errno != errno.EBUSY or time.monotonic() > deadline:
                        logger.warning("cannot remove cgroup %s: %s", path, e.strerror)
                        break
                with contextlib.suppress(OSError):
                    for pid in (path / "cgroup.procs").read_text().split():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(pid), signal.SIGKILL)
                time.sleep(0.02)


def _wanted(limits: LimitsPolicy) -> dict[Controller, list[tuple[str, str]]]:
    """Controller -> [(v2 file, value)], and the v1 files are derived in _v1_files."""
    out: dict[Controller, list[tuple[str, str]]] = {}
    if limits.memory is not None:
        out["memory"] = [("memory.max", str(limits.memory)), ("memory.swap.max", "0")]
    if limits.pids is not None:
        out["pids"] = [("pids.max", str(limits.pids))]
    if limits.cpu_millis is not None:
        out["cpu"] = [("cpu.max", f"{limits.cpu_millis * CPU_PERIOD_US // 1000} {CPU_PERIOD_US}")]
    return out


def _v1_files(limits: LimitsPolicy, ctl: Controller) -> list[tuple[str, str, bool]]:
    """(file, value, required) for a v1 hierarchy, in the order they must be written."""
    if ctl == "memory":
        assert limits.memory is not None
        # memsw >= memory at all times: raise memory first; memsw exists only with swap accounting
        return [
            ("memory.limit_in_bytes", str(limits.memory), True),
            ("memory.memsw.limit_in_bytes", str(limits.memory), False),
        ]
    if ctl == "pids":
        return [("pids.max", str(limits.pids), True)]
    assert limits.cpu_millis is not None
    return [
        ("cpu.cfs_period_us", str(CPU_PERIOD_US), True),
        ("cpu.cfs_quota_us", str(limits.cpu_millis * CPU_PERIOD_US // 1000), True),
    ]


def apply(
    limits: LimitsPolicy, cgroup: Path, hierarchies: Mapping[str, Hierarchy] | None = None
) -> AppliedLimits:
    """Set the policy's memory, pids and cpu limits for the run whose v2 cgroup is `cgroup` (made by
    the caller, before its first process enters it). v1 cgroups are made for it where a controller
    is on a v1 hierarchy; nothing raises for a limit that cannot be set: it is a degradation."""
    if hierarchies is None:
        hierarchies = detect()
    applied = AppliedLimits(limits)
    for ctl, files in _wanted(limits).items():
        where = hierarchies.get(ctl)
        if where is None:
            applied.degradations.append(LimitDegradation(ctl, f"no {ctl} controller on this host"))
            continue
        try:
            if where.version == 2:
                _apply_v2(applied, ctl, cgroup, files)
            else:
                _apply_v1(applied, ctl, where, cgroup.name, limits)
        except OSError as e:
            applied.degradations.append(
                LimitDegradation(
                    ctl, f"cannot set the {ctl} limit (cgroup v{where.version}): {e.strerror or e}"
                )
            )
    return applied


def _apply_v2(applied: AppliedLimits, ctl: Controller, cgroup: Path, files: list[tuple[str, str]]) -> None:
    first = cgroup / files[0][0]
    if not first.exists():  # the controller is not enabled for the run's cgroup: enable it in its parent
        (cgroup.parent / "cgroup.subtree_control").write_text(f"+{ctl}")
    for name, value in files:
        path = cgroup / name
        if name == "memory.swap.max" and not path.exists():
            continue  # no swap accounting: memory.max is the whole limit
        path.write_text(value)
        applied.written[f"{ctl}/{name}"] = value
    applied.placements[ctl] = Placement(ctl, 2, cgroup, made=False)


def _apply_v1(
    applied: AppliedLimits, ctl: Controller, where: Hierarchy, name: str, limits: LimitsPolicy
) -> None:
    own = where.mount / where.own.lstrip("/")
    path = own / name
    # the same directory may already hold another controller (a "cpu,cpuacct" mount): reuse it
    made = not any(p.path == path for p in applied.placements.values())
    if made:
        path.mkdir(mode=0o755)
    try:
        for fname, value, required in _v1_files(limits, ctl):
            f = path / fname
            if not required and not f.exists():
                continue
            f.write_text(value)
            applied.written[f"{ctl}/{fname}"] = value
    except OSError:
        if made:
            with contextlib.suppress(OSError):
                os.rmdir(path)
        raise
    applied.placements[ctl] = Placement(ctl, 1, path, made=made)


# ---------------------------------------------------------------------------------------------------
# What was hit

LimitKind = Literal["oom_kill", "memory_max", "fork_refused", "cpu_throttled", "wall"]


@dataclass(frozen=True)
class LimitEvent:
    """A limit reached, as counted by the kernel since the previous poll (`count` more times), at
    `t` (the poll's clock). `pids` are the processes it names when known (see name_victims)."""

    limit: Literal["memory", "pids", "cpu", "wall"]
    kind: LimitKind
    count: int
    t: int
    pids: tuple[int, ...] = ()
    certain: bool = False  # pids are the victims (as many as counted), not only candidates

    def describe(self) -> str:
        what = {
            "oom_kill": "processes killed by the OOM killer at limits.memory",
            "memory_max": "times memory use reached limits.memory",
            "fork_refused": "forks refused at limits.pids",
            "cpu_throttled": "periods throttled at limits.cpu",
            "wall": "the run reached limits.wall and is killed",
        }[self.kind]
        return f"{self.count} {what}" if self.kind != "wall" else what


def parse_counters(text: str) -> dict[str, int]:
    """`key value` lines (memory.events, pids.events, memory.oom_control, cpu.stat) -> ints."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


# (limit, kind, file, key) read for each placement's cgroup version
_COUNTERS: dict[int, list[tuple[Controller, LimitKind, str, str]]] = {
    2: [
        ("memory", "oom_kill", "memory.events", "oom_kill"),
        ("memory", "memory_max", "memory.events", "max"),
        ("pids", "fork_refused", "pids.events", "max"),
        ("cpu", "cpu_throttled", "cpu.stat", "nr_throttled"),
    ],
    1: [
        ("memory", "oom_kill", "memory.oom_control", "oom_kill"),
        ("pids", "fork_refused", "pids.events", "max"),
        ("cpu", "cpu_throttled", "cpu.stat", "nr_throttled"),
    ],
}


class LimitWatcher:
    """Polls what the run's limits counted and its wall time; `poll()` returns what is new.

    Call it from the recorder's loop (each second is plenty) and once more when the run's
    processes are gone; on a `wall` event the caller kills the run's cgroup, stating the reason."""

    def __init__(
        self,
        applied: AppliedLimits,
        *,
        started: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        """`clock` measures the wall limit; `clock_ns` stamps events (give the recorder's record
        clock, so that name_victims can compare them with exit records)."""
        self.applied = applied
        self.clock = clock
        self.clock_ns = clock_ns
        self.started = clock() if started is None else started
        self._seen: dict[tuple[str, str], int] = {}
        self._wall_told = False
        for event in self._read():  # counts from before the run (a reused cgroup) are not the run's
            self._seen[(event[0], event[1])] = event[2]

    def _read(self) -> list[tuple[Controller, LimitKind, int]]:
        out: list[tuple[Controller, LimitKind, int]] = []
        for ctl, place in self.applied.placements.items():
            for limit, kind, fname, key in _COUNTERS[place.version]:
                if limit != ctl:
                    continue
                try:
                    text = (place.path / fname).read_text()
                except OSError:
                    continue
                value = parse_counters(text).get(key)
                if value is not None:
                    out.append((limit, kind, value))
        return out

    def poll(self) -> list[LimitEvent]:
        now = self.clock()
        t = self.clock_ns()
        events: list[LimitEvent] = []
        for limit, kind, value in self._read():
            before = self._seen.get((limit, kind), 0)
            if value > before:
                events.append(LimitEvent(limit, kind, value - before, t))
            self._seen[(limit, kind)] = max(before, value)
        wall = self.applied.limits.wall_ms
        if wall is not None and not self._wall_told and (now - self.started) * 1000 >= wall:
            self._wall_told = True
            events.append(LimitEvent("wall", "wall", 1, t))
        return events

    def wall_left(self) -> float | None:
        """Seconds until the wall limit (None: no wall limit), for the caller's sleep."""
        wall = self.applied.limits.wall_ms
        return None if wall is None else max(0.0, wall / 1000 - (self.clock() - self.started))


def name_victims(
    event: LimitEvent,
    exits: Iterable[Mapping[str, Any]],
    since: int,
    killed_by_us: Iterable[int] = (),
    until: int | None = None,
) -> LimitEvent:
    """The OOM kill event with the processes it killed named from the run's exit records: those
    that died of SIGKILL at `since` (the previous poll's t) or later and by `until` (default
    `event.t`, this poll's), less the ones evidence killed itself (the wall limit, the end of the
    run). As many as counted: certain. A victim is counted when the kernel sends its SIGKILL and
    exits when it next runs: on a busy machine after the poll that saw the count, so a caller that
    has the later exits passes the next poll's `since` (or no bound) as `until`."""
    if event.kind != "oom_kill":
        return event
    end = event.t if until is None else until
    ours = set(killed_by_us)
    pids = tuple(
        sorted(
            int(e["pid"])
            for e in exits
            if e.get("signal") == "SIGKILL"
            and since <= int(e.get("t", -1)) <= end
            and e.get("pid") not in ours
        )
    )
    return LimitEvent(event.limit, event.kind, event.count, event.t, pids, certain=len(pids) == event.count)
