"""Kubernetes: one run per pod, cut into windows, finished when the pod goes.

`PodRuns` follows KubeWatcher's events (agent/daemon/k8s.py). A pod's cgroup is tracked, so its
containers, child cgroups, are covered by the pod's run: their records carry `cgroup` (the path below
the pod's) and, when the scope name says so, `container` (the id). The run's labels list the pod
(`k8s/...`) and every container seen during the window (id, cgroup id, runtime, name). A window is
cut (`RecorderBackend.rotate`, no gap) after `window_seconds` or `window_bytes` of spool; bundles are
named `<namespace>_<pod>_<uid>-<window>.tar.gz`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from evidence.agent.daemon import k8s
from evidence.agent.recorder.recovery import unique_path

if TYPE_CHECKING:
    from evidence.agent.daemon.backend import RecorderBackend

logger = logging.getLogger(__name__)

POD_LABEL = "k8s/"


@dataclasses.dataclass
class _PodRun:
    """The run of one pod's current window."""

    ref: k8s.PodRef
    session_id: str
    window: int
    started: float  # monotonic
    containers: dict[str, k8s.PodRef] = dataclasses.field(default_factory=dict)
    meta: k8s.PodMeta | None = None


class PodRuns:
    """Follows KubeWatcher's events: a run per pod, cut into windows, finished when the pod goes."""

    def __init__(
        self,
        backend: RecorderBackend,
        cgroup_root: Path,
        pod_logs: Path,
        *,
        window_seconds: float,
        window_bytes: int,
        poll_interval: float = 2.0,
    ) -> None:
        self.backend = backend
        self.cgroup_root = Path(cgroup_root)
        self.pod_logs = Path(pod_logs)
        self.container_logs = self.pod_logs.parent / "containers"
        self.window_seconds = window_seconds
        self.window_bytes = window_bytes
        self.watcher = k8s.KubeWatcher(self.cgroup_root, poll_interval)
        self.pods: dict[str, _PodRun] = {}  # pod cgroup path (relative) -> run
        self._container_info: dict[str, dict[str, Any]] = {}  # container id -> label data

    # names and labels

    def _meta(self, pod: _PodRun) -> k8s.PodMeta | None:
        if pod.meta is None:
            pod.meta = k8s.pod_metadata(pod.ref.pod_uid, self.pod_logs)
        return pod.meta

    def _bundle_name(self, pod: _PodRun) -> str:
        meta = self._meta(pod)
        ns, name = (meta.namespace, meta.name) if meta else ("unknown", "unknown")
        return f"{ns}_{name}_{pod.ref.pod_uid}-{pod.window}.tar.gz"

    def _labels(self, pod: _PodRun) -> dict[str, str]:
        labels = {
            f"{POD_LABEL}pod-uid": pod.ref.pod_uid,
            f"{POD_LABEL}qos": pod.ref.qos,
            f"{POD_LABEL}pod-cgroup": pod.ref.pod_path,
            f"{POD_LABEL}window": str(pod.window),
        }
        meta = self._meta(pod)
        if meta is not None:
            labels[f"{POD_LABEL}namespace"] = meta.namespace
            labels[f"{POD_LABEL}pod"] = meta.name
        for cid, ref in pod.containers.items():
            labels[f"{POD_LABEL}container/{cid}"] = self._container_label(ref)
        return labels

    def _container_label(self, ref: k8s.PodRef) -> str:
        """The container's cgroup (path, id), runtime and name, as canonical JSON. The cgroup id is
        read when the container is first seen (it is gone by the time its pod's bundle is written)."""
        cid = ref.container_id or ""
        info = self._container_info.setdefault(cid, {"runtime": ref.runtime, "cgroup": ref.container_path})
        if "cgroup_id" not in info:
            try:
                info["cgroup_id"] = os.stat(self.cgroup_root / (ref.container_path or "")).st_ino
            except OSError:
                info["cgroup_id"] = None
        if info.get("name") is None:
            info["name"] = k8s.container_name(cid, self.container_logs)
        return json.dumps(info, sort_keys=True, separators=(",", ":"))

    def _next_window(self, uid: str) -> int:
        """1 + the highest window number of this pod's bundles already on disk (agent restarts)."""
        best = 0
        for p in self.backend.bundle_dir.glob(f"*_{uid}-*.tar.gz"):
            tail = p.name.removesuffix(".tar.gz").rsplit("-", 1)[-1]
            if tail.isdigit():
                best = max(best, int(tail))
        return best + 1

    # events

    def poll(self) -> None:
        for ev in self.watcher.poll():
            try:
                self.handle(ev)
            except Exception as e:
                logger.error("%s %s: %s", ev.kind, ev.ref.path, e)
        self.cut_windows()

    def handle(self, ev: k8s.KubeEvent) -> None:
        ref = ev.ref
        if ev.kind == "pod-appeared":
            pod = _PodRun(ref, "", self._next_window(ref.pod_uid), time.monotonic())
            run = self.backend.start_run(
                self.cgroup_root / ref.pod_path,
                self._labels(pod),
                extensions={"poduid": ref.pod_uid},
            )
            pod.session_id = run.session.session_id
            run.bundle_name = self._bundle_name(pod)
            self.pods[ref.pod_path] = pod
            logger.info("pod %s: recording as run %s", ref.pod_uid, pod.session_id)
        elif ev.kind == "container-appeared":
            owner = self.pods.get(ref.pod_path)
            if owner is not None and ref.container_id:
                owner.containers[ref.container_id] = ref
                self.backend.update_labels(owner.session_id, self._labels(owner), self._bundle_name(owner))
        elif ev.kind == "pod-gone":
            gone = self.pods.pop(ref.pod_path, None)
            if gone is not None:
                self._finish(gone)
                for cid in gone.containers:
                    self._container_info.pop(cid, None)

    def _finish(self, pod: _PodRun) -> Path:
        name = self._bundle_name(pod)
        self.backend.update_labels(pod.session_id, self._labels(pod), name)
        path = unique_path(self.backend.bundle_dir / name)
        self.backend.finish(pod.session_id, path)
        logger.info("pod %s: bundle %s", pod.ref.pod_uid, path)
        return path

    def cut_windows(self) -> None:
        now = time.monotonic()
        for pod in list(self.pods.values()):
            run = self.backend.run(pod.session_id)
            if run is None:
                continue
            if now - pod.started < self.window_seconds and run.spool.size() < self.window_bytes:
                continue
            name = self._bundle_name(pod)
            self.backend.update_labels(pod.session_id, self._labels(pod), name)
            path = unique_path(self.backend.bundle_dir / name)
            # containers still there carry over into the next window
            live = {
                cid: r
                for cid, r in pod.containers.items()
                if (self.cgroup_root / (r.container_path or "")).is_dir()
            }
            nxt = _PodRun(pod.ref, "", pod.window + 1, now, live, pod.meta)
            try:
                new, sha = self.backend.rotate(pod.session_id, path, self._labels(nxt))
            except Exception as e:
                logger.error("pod %s: cutting window %d failed: %s", pod.ref.pod_uid, pod.window, e)
                continue
            nxt.session_id = new.session.session_id
            new.bundle_name = self._bundle_name(nxt)
            self.pods[pod.ref.pod_path] = nxt
            logger.info("pod %s: window %d in %s (sha256 %s)", pod.ref.pod_uid, pod.window, path, sha)

    def loop(self, stop: threading.Event) -> None:
        """Scan, then wait for the next scan: poll_interval, or less when the tree changes."""
        try:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    self.poll()
                    self.watcher.wait(
                        max(0.0, self.watcher.poll_interval - (time.monotonic() - started)), stop
                    )
                except Exception:
                    logger.exception("kubernetes scan failed")
                    stop.wait(max(0.0, self.watcher.poll_interval - (time.monotonic() - started)))
        finally:
            self.watcher.close()
