"""Where a cgroup sits in the tree the kubelet lays out (agent/daemon/k8s.py describes it): which
pod and container a cgroup path names. Pure; the recorder names a record's container with it, the
daemon's pod watcher finds pods with it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

QoS = Literal["guaranteed", "burstable", "besteffort"]
Runtime = Literal["containerd", "cri-o", "docker"]

# A pod UID is a UUID (API pods) or a 32-hex-digit hash (static pods, whose UID the kubelet derives).
_UID = r"(?:[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}|[0-9a-f]{32})"
_SYSTEMD_POD = re.compile(rf"(?:.*-)?kubepods(?:-(burstable|besteffort))?-pod({_UID})\.slice")
_CGROUPFS_POD = re.compile(rf"pod({_UID})")
_SYSTEMD_CONTAINER = re.compile(r"(cri-containerd|crio|docker)-([0-9a-f]{12,64})\.scope")
_CGROUPFS_CONTAINER = re.compile(r"(?:(cri-containerd|crio|docker)-)?([0-9a-f]{12,64})")
_RUNTIMES: dict[str, Runtime] = {"cri-containerd": "containerd", "crio": "cri-o", "docker": "docker"}
KUBEPODS_ROOT = re.compile(r"(?:kubepods|kubepods\.slice|.+-kubepods\.slice)")


@dataclasses.dataclass(frozen=True)
class PodRef:
    """Where a cgroup sits in the kubepods tree. `container_id` is None for the pod's own cgroup."""

    qos: QoS
    pod_uid: str  # canonical form, with '-' (as the API server shows it)
    pod_path: str  # the pod's cgroup, relative to the cgroup2 mount, no leading '/'
    container_id: str | None = None
    runtime: Runtime | None = None  # None when the name does not say (cgroupfs driver, bare id)
    container_path: str | None = None

    @property
    def path(self) -> str:
        """The cgroup this reference names: the container's if there is one, else the pod's."""
        return self.container_path or self.pod_path


def canonical_uid(raw: str) -> str:
    return raw.replace("_", "-")


def parse_cgroup_path(path: str) -> PodRef | None:
    """PodRef for a cgroup path relative to the cgroup2 mount (a leading '/' is fine, as in
    /proc/PID/cgroup), or None when the path is not inside a pod. Components below the container
    (a container that made cgroups of its own) are ignored: the container is the one that owns them.
    """
    parts = [p for p in path.strip().split("/") if p]
    for i, part in enumerate(parts):
        qos: QoS
        m = _SYSTEMD_POD.fullmatch(part)
        if m:
            qos = m.group(1) or "guaranteed"  # type: ignore[assignment]
            uid = canonical_uid(m.group(2))
            container_re = _SYSTEMD_CONTAINER
        else:
            m = _CGROUPFS_POD.fullmatch(part)
            if not m or i == 0:
                continue
            parent = parts[i - 1]
            if parent in ("burstable", "besteffort"):
                if i < 2 or not KUBEPODS_ROOT.fullmatch(parts[i - 2]):
                    continue
                qos = parent  # type: ignore[assignment]
            elif KUBEPODS_ROOT.fullmatch(parent):
                qos = "guaranteed"
            else:
                continue
            uid = canonical_uid(m.group(1))
            container_re = _CGROUPFS_CONTAINER
        pod_path = "/".join(parts[: i + 1])
        if i + 1 < len(parts):
            c = container_re.fullmatch(parts[i + 1])
            if c is None:
                # crio-conmon-<id>.scope and other helpers: inside the pod, but no container.
                return PodRef(qos=qos, pod_uid=uid, pod_path=pod_path)
            runtime = _RUNTIMES.get(c.group(1) or "")
            return PodRef(
                qos=qos,
                pod_uid=uid,
                pod_path=pod_path,
                container_id=c.group(2),
                runtime=runtime,
                container_path="/".join(parts[: i + 2]),
            )
        return PodRef(qos=qos, pod_uid=uid, pod_path=pod_path)
    return None
