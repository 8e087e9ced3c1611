"""cgroup v2: find the mount, make a run's cgroup, move processes, kill leftovers, remove it."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import time
from pathlib import Path

from evidence.errors import SetupError

logger = logging.getLogger(__name__)

EVIDENCE_DIR = "evidence"


def find_cgroup2_mount(mountinfo: str | None = None) -> Path:
    """The cgroup v2 mount point: /sys/fs/cgroup on a unified host, /sys/fs/cgroup/unified on a
    hybrid one, or wherever /proc/self/mountinfo says."""
    text = mountinfo if mountinfo is not None else Path("/proc/self/mountinfo").read_text()
    found: list[str] = []
    for line in text.splitlines():
        pre, _, post = line.partition(" - ")
        fields = pre.split()
        if post.split()[:1] == ["cgroup2"] and len(fields) >= 5:
            found.append(fields[4].replace("\\040", " "))
    if not found:
        raise SetupError("no cgroup v2 mount found", "mount one: mount -t cgroup2 none /sys/fs/cgroup")
    for preferred in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        if preferred in found:
            return Path(preferred)
    return Path(found[0])


def cgroup_id(path: str | Path) -> int:
    """The kernel's cgroup id, as bpf_get_current_cgroup_id() returns it: the cgroup dir's inode."""
    return os.stat(path).st_ino


def cgroup_of_pid(pid: int, mount: Path) -> Path:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        if hier == "0" and controllers == "":
            return mount / rel.lstrip("/")
    raise SetupError(f"process {pid} has no cgroup v2 membership")


def isolation_home(pid: int, mount: Path) -> tuple[Path | None, Path | None, str | None]:
    """Where a cgroup made for process `pid` alone should go, as (its cgroup, home, why not):

    - `home` is the cgroup below which the run's cgroup goes: the one the process is in, so that
      the limits set there and above (memory, pids, cpu) go on applying to it;
    - home is None when the process is in the root cgroup (no limits to keep: why is None), or
      when a cgroup below its own could not hold the command, or would not hold it: a process may
      move itself to any cgroup it can write to below the nearest ancestor whose cgroup.procs it
      can write, so below a cgroup delegated to the job (not root's, or writable by group or
      others), below one in a cgroup namespace of the job's own, or for a job running as root, the
      command could leave the run's cgroup, and the recording with it. Then `why` says which, and
      the caller uses a cgroup outside the client's (which the job cannot reach) instead.

    `cgroup` is the process's cgroup (None if it cannot be read), for the caller's checks."""
    try:
        cgroup = Path(os.path.normpath(cgroup_of_pid(pid, mount)))
    except (OSError, SetupError) as e:
        return None, None, f"the cgroup of process {pid} cannot be read: {getattr(e, 'strerror', None) or e}"
    if cgroup == mount:
        return cgroup, None, None
    if mount not in cgroup.parents:  # a path with '..': the process is outside our cgroup namespace
        return cgroup, None, f"the cgroup of process {pid} is outside this agent's view of the hierarchy"
    try:
        kind = (cgroup / "cgroup.type").read_text().strip()
        uids = _uids(pid)
        same_ns = os.stat(f"/proc/{pid}/ns/cgroup").st_ino == os.stat("/proc/self/ns/cgroup").st_ino
    except OSError as e:
        return cgroup, None, f"process {pid} or its cgroup cannot be read: {e.strerror}"
    if kind != "domain":
        return cgroup, None, f"its cgroup {cgroup} is {kind}: a process cannot move below it"
    if 0 in uids:
        return (
            cgroup,
            None,
            "the client runs as root: it could move the command out of a cgroup below its own",
        )
    if not same_ns:
        return (
            cgroup,
            None,
            (
                "the client has a cgroup namespace of its own: inside it, the command could leave a cgroup below its own"
            ),
        )
    for d in (cgroup, *cgroup.parents):
        if d == mount.parent:
            break
        try:
            st = os.stat(d / "cgroup.procs")
        except OSError as e:
            return cgroup, None, f"{d} cannot be read: {e.strerror}"
        if st.st_uid != 0 or st.st_mode & 0o022:
            return (
                cgroup,
                None,
                (
                    f"{d} is delegated (its cgroup.procs is uid {st.st_uid}'s, mode {st.st_mode & 0o777:o}): "
                    "the command could leave a cgroup below it"
                ),
            )
    return cgroup, cgroup, None


def _uids(pid: int) -> set[int]:
    """The real, effective, saved and filesystem uids of a process."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return {int(u) for u in line.split()[1:]}
    raise FileNotFoundError(f"no Uid line for process {pid}")


class RunCgroup:
    """A cgroup made for one run, below <mount>/evidence/."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.id = cgroup_id(path)

    @classmethod
    def create(cls, name: str, mount: Path | None = None) -> RunCgroup:
        """<mount>/evidence/<name>, made for a run."""
        mount = mount or find_cgroup2_mount()
        parent = mount / EVIDENCE_DIR
        try:
            parent.mkdir(mode=0o755, exist_ok=True)  # never left to the umask (0: writable by all)
        except OSError as e:
            raise SetupError(f"cannot create a cgroup under {parent}: {e.strerror}", "run as root") from e
        return cls.create_in(parent, name)

    @classmethod
    def create_in(cls, parent: Path, name: str) -> RunCgroup:
        """<parent>/<name>, made for a run (the parent exists)."""
        path = parent / name
        try:
            path.mkdir(mode=0o755)
        except OSError as e:
            raise SetupError(f"cannot create a cgroup under {parent}: {e.strerror}", "run as root") from e
        return cls(path)

    def procs_file(self) -> str:
        return str(self.path / "cgroup.procs")

    def pids(self) -> list[int]:
        out: list[int] = []
        for dirpath, _dirs, _files in os.walk(self.path):
            try:
                out += [int(x) for x in Path(dirpath, "cgroup.procs").read_text().split()]
            except OSError:
                continue
        return out

    def populated(self) -> bool:
        try:
            for line in (self.path / "cgroup.events").read_text().splitlines():
                if line.startswith("populated "):
                    return line.split()[1] == "1"
        except OSError:
            pass
        return bool(self.pids())

    def kill(self) -> int:
        """Kill every process left in the cgroup (and below). Returns how many there were."""
        left = self.pids()
        if not left:
            return 0
        try:
            (self.path / "cgroup.kill").write_text("1")
        except OSError:
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        return len(left)

    def wait_empty(self, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while self.populated():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def remove(self) -> None:
        for dirpath, _dirs, _files in sorted(os.walk(self.path), key=lambda w: -len(w[0])):
            for _ in range(50):
                try:
                    os.rmdir(dirpath)
                    break
                except OSError as e:
                    if e.errno == errno.ENOENT:
                        break
                    if e.errno != errno.EBUSY:
                        logger.warning("cannot remove cgroup %s: %s", dirpath, e.strerror)
                        break
                    time.sleep(0.02)


class CgroupNames:
    """cgroup id -> path relative to a run's cgroup (None for the run's own), for the records of
    processes in nested cgroups (containers, a job's own sub-cgroups). Unknown ids are looked up by
    walking the run's subtree once per miss; a cgroup already gone is named by its id."""

    def __init__(self, root: Path, root_id: int, limit: int = 65536) -> None:
        self.root = root
        self.root_id = root_id
        self.limit = limit
        self._names: dict[int, str | None] = {root_id: None}

    def __call__(self, cgid: int) -> str | None:
        try:
            return self._names[cgid]
        except KeyError:
            pass
        for dirpath, _dirs, _files in os.walk(self.root):
            try:
                ino = os.stat(dirpath).st_ino
            except OSError:
                continue
            if len(self._names) < self.limit:
                self._names.setdefault(ino, os.path.relpath(dirpath, self.root))
        if cgid not in self._names:
            if len(self._names) >= self.limit:
                return f"cgroup-id:{cgid}"
            self._names[cgid] = f"cgroup-id:{cgid}"
        return self._names[cgid]
