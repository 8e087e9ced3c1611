"""KubeWatcher against a real kubepods-style tree made under the real cgroup2 mount.

cgroupfs differs from a plain directory tree in ways that matter here: directories come with
interface files, `rmdir` is the only way to remove one (deepest first, and only when empty of
processes), and a cgroup holding a process cannot go away. The watcher must see all of it.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from evidence.agent.daemon import k8s
from evidence.agent.daemon.k8s import KubeWatcher
from evidence.agent.recorder.cgroups import find_cgroup2_mount
from evidence.errors import SetupError

pytestmark = pytest.mark.kernel


def _cgroup2_mount() -> Path | None:
    try:
        return find_cgroup2_mount()
    except SetupError:
        return None


@pytest.fixture
def test_root() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("needs root (CAP_SYS_ADMIN over the cgroup2 mount) to create cgroups")
    mount = _cgroup2_mount()
    if mount is None:
        pytest.skip("no cgroup2 mount in /proc/self/mounts")
    root = mount / f"evidence-test-k8s-{uuid.uuid4().hex[:8]}"
    try:
        root.mkdir()
    except OSError as e:
        pytest.skip(f"cannot create a cgroup under {mount}: {e}")
    yield root
    # rmdir deepest first; a cgroup can only be removed once it has no children and no processes
    for dirpath, _dirs, _files in sorted(os.walk(root), key=lambda t: -t[0].count("/")):
        os.rmdir(dirpath)


def test_watcher_follows_a_real_cgroup_tree(test_root: Path) -> None:
    uid = str(uuid.uuid4())
    pod = f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid.replace('-', '_')}.slice"
    cid = uuid.uuid4().hex + uuid.uuid4().hex
    container = f"{pod}/cri-containerd-{cid}.scope"
    guaranteed_pod = f"kubepods/pod{uid}"
    cfs_container = f"{guaranteed_pod}/{cid}"

    w = KubeWatcher(test_root, poll_interval=0.01)
    assert w.poll() == []
    for rel in (container, cfs_container):
        (test_root / rel).mkdir(parents=True)
    assert (test_root / container / "cgroup.procs").exists()  # a real cgroup, not a plain dir
    events = w.poll()
    assert {(e.kind, e.ref.path) for e in events} == {
        ("pod-appeared", pod),
        ("container-appeared", container),
        ("pod-appeared", guaranteed_pod),
        ("container-appeared", cfs_container),
    }
    ref = next(e.ref for e in events if e.ref.path == container)
    assert (ref.qos, ref.pod_uid, ref.container_id, ref.runtime) == ("burstable", uid, cid, "containerd")

    # A process in the container: its /proc/PID/cgroup maps back to the same PodRef.
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        (test_root / container / "cgroup.procs").write_text(str(proc.pid))
        rel = k8s.parse_proc_cgroup(Path(f"/proc/{proc.pid}/cgroup").read_text())
        assert rel is not None
        mount_rel = test_root.relative_to(_cgroup2_mount() or Path("/")).as_posix()
        assert rel == f"/{mount_rel}/{container}"
        assert k8s.parse_cgroup_path(rel) == dataclasses.replace(
            ref, pod_path=f"{mount_rel}/{pod}", container_path=f"{mount_rel}/{container}"
        )
        with pytest.raises(OSError):
            (test_root / container).rmdir()  # busy: the container is still there
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=10)
    assert w.poll() == []

    # the pod goes away the way the kubelet removes it: deepest first
    (test_root / container).rmdir()
    assert [(e.kind, e.ref.path) for e in w.poll()] == [("container-gone", container)]
    (test_root / pod).rmdir()
    (test_root / cfs_container).rmdir()
    (test_root / guaranteed_pod).rmdir()
    assert [(e.kind, e.ref.path) for e in w.poll()] == [
        ("container-gone", cfs_container),
        ("pod-gone", pod),  # sorted by path: "kubepods.slice" < "kubepods/"
        ("pod-gone", guaranteed_pod),
    ]
    assert w.known == {}
