"""Kubernetes pods and containers seen through the cgroup tree (no API server, no kubelet client).

The kubelet lays out one cgroup per pod and one per container under a `kubepods` root, with either
cgroup driver:

    systemd:  kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<UID_>.slice/cri-containerd-<ID>.scope
              kubepods.slice/kubepods-pod<UID_>.slice/crio-<ID>.scope            (guaranteed: no QoS level)
    cgroupfs: kubepods/besteffort/pod<UID>/<ID>
              kubepods/pod<UID>/<ID>                                             (guaranteed)

In systemd names the pod UID has `_` where the UID has `-` (systemd reserves `-` as the slice
separator). A kubelet started with --cgroup-root (kind, some distributions) nests that layout one
level deeper (`kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable.slice/...`); the
parser looks for the pod component anywhere in the path, so both work.

Namespace and pod name come from the kubelet's log directory /var/log/pods/<ns>_<name>_<uid>
(neither a namespace nor a pod name may contain `_`), and a container's name from the
/var/log/containers/<pod>_<ns>_<container>-<id>.log links.

Which pod and container a cgroup path names is agent/recorder/pod_cgroups.py's (the recorder names
records' containers with it too). Everything here is pure apart from `scan_tree`, `pod_metadata`, `container_name`, `DirWatch` and
`KubeWatcher`, which read (and watch) directories they are given (tests pass a tree under tmp_path).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import logging
import os
import re
import select
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from evidence.agent.recorder.pod_cgroups import KUBEPODS_ROOT, canonical_uid
from evidence.agent.recorder.pod_cgroups import PodRef as PodRef  # (re-exported: the watcher's events)
from evidence.agent.recorder.pod_cgroups import parse_cgroup_path as parse_cgroup_path

logger = logging.getLogger(__name__)

EventKind = Literal["pod-appeared", "pod-gone", "container-appeared", "container-gone"]

DEFAULT_POD_LOGS = Path("/var/log/pods")
DEFAULT_CONTAINER_LOGS = Path("/var/log/containers")

_QOS_DIR = re.compile(r"(?:burstable|besteffort|(?:.+-)?kubepods-(?:burstable|besteffort)\.slice)")


@dataclasses.dataclass(frozen=True)
class PodMeta:
    namespace: str
    name: str
    uid: str


@dataclasses.dataclass(frozen=True)
class KubeEvent:
    kind: EventKind
    ref: PodRef


def parse_proc_cgroup(text: str) -> str | None:
    """The cgroup v2 path from the text of /proc/PID/cgroup (the '0::' line), or None."""
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    return None


def scan_tree(cgroup_root: Path) -> dict[str, PodRef]:
    """Every pod and container cgroup under cgroup_root: {relative path: PodRef}.

    Only the kubepods roots (at depth 1 or 2) are walked, never the whole hierarchy, and the walk
    stops at container cgroups. Directories that vanish while being read are skipped.
    """
    found: dict[str, PodRef] = {}
    for kp in _kubepods_roots(cgroup_root):
        for qos_or_pod in _subdirs(kp):
            rel = _rel(cgroup_root, qos_or_pod)
            ref = parse_cgroup_path(rel)
            if ref is not None:
                _scan_pod(cgroup_root, qos_or_pod, ref, found)
            elif _QOS_DIR.fullmatch(qos_or_pod.name):
                for pod_dir in _subdirs(qos_or_pod):
                    ref = parse_cgroup_path(_rel(cgroup_root, pod_dir))
                    if ref is not None and ref.container_id is None:
                        _scan_pod(cgroup_root, pod_dir, ref, found)
    return found


def _scan_pod(cgroup_root: Path, pod_dir: Path, ref: PodRef, found: dict[str, PodRef]) -> None:
    found[ref.pod_path] = ref
    for child in _subdirs(pod_dir):
        cref = parse_cgroup_path(_rel(cgroup_root, child))
        if cref is not None and cref.container_id is not None:
            found[cref.path] = cref


def _kubepods_roots(cgroup_root: Path) -> list[Path]:
    roots = []
    for d in _subdirs(cgroup_root):
        if KUBEPODS_ROOT.fullmatch(d.name):
            roots.append(d)
        elif d.name.endswith(".slice") or d.name == "kubelet":
            roots.extend(c for c in _subdirs(d) if KUBEPODS_ROOT.fullmatch(c.name))
    return sorted(roots)


def _subdirs(d: Path) -> list[Path]:
    try:
        with os.scandir(d) as it:
            return sorted(Path(e.path) for e in it if e.is_dir(follow_symlinks=False))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []


def _rel(root: Path, p: Path) -> str:
    return p.relative_to(root).as_posix()


def pod_metadata(pod_uid: str, pods_root: Path = DEFAULT_POD_LOGS) -> PodMeta | None:
    """Namespace and name of a pod from the kubelet's log directory <ns>_<name>_<uid>, or None."""
    uid = canonical_uid(pod_uid)
    try:
        with os.scandir(pods_root) as it:
            names = [e.name for e in it]
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None
    for name in names:
        parts = name.split("_")
        if len(parts) == 3 and parts[2] == uid and parts[0] and parts[1]:
            return PodMeta(namespace=parts[0], name=parts[1], uid=uid)
    return None


def container_name(container_id: str, containers_root: Path = DEFAULT_CONTAINER_LOGS) -> str | None:
    """A container's name from /var/log/containers/<pod>_<ns>_<container>-<id>.log, or None."""
    suffix = f"-{container_id}.log"
    try:
        with os.scandir(containers_root) as it:
            names = [e.name for e in it]
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None
    for name in names:
        if name.endswith(suffix):
            parts = name[: -len(suffix)].split("_")
            if len(parts) == 3 and parts[2]:
                return parts[2]
    return None


def diff(before: dict[str, PodRef], after: dict[str, PodRef]) -> list[KubeEvent]:
    """Events that turn `before` into `after`: containers gone, pods gone, pods appeared,
    containers appeared, in that order (so a consumer always sees a pod before its containers and
    after them), each group sorted by path for determinism."""
    gone = [before[p] for p in sorted(before.keys() - after.keys())]
    came = [after[p] for p in sorted(after.keys() - before.keys())]
    events = [KubeEvent("container-gone", r) for r in gone if r.container_id]
    events += [KubeEvent("pod-gone", r) for r in gone if not r.container_id]
    events += [KubeEvent("pod-appeared", r) for r in came if not r.container_id]
    events += [KubeEvent("container-appeared", r) for r in came if r.container_id]
    return events


def watch_dirs(cgroup_root: Path, found: dict[str, PodRef]) -> set[Path]:
    """The directories in which a pod or a container cgroup appears or goes away: cgroup_root,
    the parents of kubepods roots, the kubepods roots, their QoS directories, and every pod's."""
    dirs = {cgroup_root}
    for kp in _kubepods_roots(cgroup_root):
        dirs.add(kp)
        dirs.add(kp.parent)
        dirs.update(d for d in _subdirs(kp) if _QOS_DIR.fullmatch(d.name))
    dirs.update(d for d in _subdirs(cgroup_root) if d.name.startswith("kubelet"))
    dirs.update(cgroup_root / ref.pod_path for ref in found.values() if ref.container_id is None)
    return dirs


# inotify(7)
_IN_MOVED_FROM, _IN_MOVED_TO, _IN_CREATE, _IN_DELETE = 0x40, 0x80, 0x100, 0x200
_IN_ONLYDIR = 0x01000000
_IN_NONBLOCK, _IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC


class DirWatch:
    """inotify on a set of directories: `wait` returns as soon as an entry is made or removed in
    one of them. cgroupfs delivers these for mkdir and rmdir, which is how runtimes make and remove
    pod and container cgroups. Only a trigger: where inotify is missing or full, waits just time out
    (the periodic scan stays the ground truth)."""

    def __init__(self) -> None:
        self._fd = -1
        self._full = False
        try:
            self._libc = ctypes.CDLL(None, use_errno=True)
            fd = self._libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        except (OSError, AttributeError) as e:
            logger.warning("no inotify (%s): pods are found by the periodic scan only", e)
            return
        if fd < 0:
            logger.warning(
                "no inotify (%s): pods are found by the periodic scan only", os.strerror(ctypes.get_errno())
            )
            return
        self._fd = fd

    def watch(self, dirs: set[Path]) -> None:
        """Watch these directories too (watching one again costs a system call and changes nothing;
        a directory removed is no longer watched)."""
        if self._fd < 0:
            return
        mask = _IN_CREATE | _IN_DELETE | _IN_MOVED_FROM | _IN_MOVED_TO | _IN_ONLYDIR
        for d in dirs:
            if self._libc.inotify_add_watch(self._fd, os.fsencode(d), mask) < 0:
                err = ctypes.get_errno()
                if err == errno.ENOSPC and not self._full:
                    self._full = True
                    logger.warning(
                        "inotify watch limit reached (fs.inotify.max_user_watches): some pods are "
                        "found by the periodic scan only, and one that comes and goes between two "
                        "scans is missed"
                    )
                elif err not in (errno.ENOENT, errno.ENOTDIR, errno.ENOSPC):  # ENOENT: gone meanwhile
                    logger.debug("cannot watch %s: %s", d, os.strerror(err))

    def wait(self, timeout: float) -> bool:
        """True as soon as something changed (the events are read and dropped), False at timeout."""
        if self._fd < 0:
            time.sleep(timeout)
            return False
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        if not poller.poll(timeout * 1000):
            return False
        with contextlib.suppress(BlockingIOError):
            while os.read(self._fd, 65536):
                pass
        return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class KubeWatcher:
    """Scans the cgroup tree and reports pods and containers as they appear and go away.

    A scan of the tree (a few hundred directories) is the ground truth: a missed inotify event
    cannot lose a pod. It runs every `poll_interval` seconds, and at once when inotify says that a
    directory where pods or containers live gained or lost an entry (`wait`), so that a pod is
    recorded from its start and a pod that lives less than the interval is not missed. The first
    `poll()` reports everything already there as appeared.
    """

    def __init__(self, cgroup_root: str | Path, poll_interval: float = 2.0) -> None:
        self.cgroup_root = Path(cgroup_root)
        self.poll_interval = poll_interval
        self._known: dict[str, PodRef] = {}
        self._dirs = DirWatch()

    @property
    def known(self) -> dict[str, PodRef]:
        return dict(self._known)

    def poll(self) -> list[KubeEvent]:
        self._dirs.watch({self.cgroup_root})  # before the scan: what appears during it wakes the next
        current = scan_tree(self.cgroup_root)
        self._dirs.watch(watch_dirs(self.cgroup_root, current))
        events = diff(self._known, current)
        self._known = current
        for ev in events:
            logger.debug("%s %s", ev.kind, ev.ref.path)
        return events

    def wait(self, timeout: float, stop: threading.Event) -> None:
        """Until the next scan is due: `timeout` seconds, a change in the tree, or `stop`."""
        deadline = time.monotonic() + timeout
        while not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or self._dirs.wait(min(left, 0.25)):
                return

    def watch(self, stop: threading.Event) -> Iterator[KubeEvent]:
        """Yield events until `stop` is set; on stop, nothing more is reported (open runs are the
        caller's to finish)."""
        try:
            while not stop.is_set():
                started = time.monotonic()
                yield from self.poll()
                self.wait(max(0.0, self.poll_interval - (time.monotonic() - started)), stop)
        finally:
            self.close()

    def close(self) -> None:
        self._dirs.close()
