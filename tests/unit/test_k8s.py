"""agent.k8s: cgroup path parsing for both drivers and three runtimes, pod metadata, the watcher."""

from __future__ import annotations

from pathlib import Path

import pytest

from evidence.agent.daemon import k8s
from evidence.agent.daemon.k8s import KubeWatcher, PodRef, parse_cgroup_path

UID = "0b6a3c2e-1f7d-4b8e-9a5c-3d2e1f0a9b8c"
UID_ = UID.replace("-", "_")
CID = "4f" * 32
STATIC_UID = "d41d8cd98f00b204e9800998ecf8427e"


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (
            f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope",
            PodRef(
                qos="burstable",
                pod_uid=UID,
                pod_path=f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice",
                container_id=CID,
                runtime="containerd",
                container_path=f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope",
            ),
        ),
        (
            f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/crio-{CID}.scope",
            PodRef(
                qos="besteffort",
                pod_uid=UID,
                pod_path=f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice",
                container_id=CID,
                runtime="cri-o",
                container_path=f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/crio-{CID}.scope",
            ),
        ),
        (
            f"kubepods.slice/kubepods-pod{UID_}.slice/docker-{CID}.scope",
            PodRef(
                qos="guaranteed",
                pod_uid=UID,
                pod_path=f"kubepods.slice/kubepods-pod{UID_}.slice",
                container_id=CID,
                runtime="docker",
                container_path=f"kubepods.slice/kubepods-pod{UID_}.slice/docker-{CID}.scope",
            ),
        ),
        (
            f"/kubepods/besteffort/pod{UID}/{CID}",
            PodRef(
                qos="besteffort",
                pod_uid=UID,
                pod_path=f"kubepods/besteffort/pod{UID}",
                container_id=CID,
                runtime=None,
                container_path=f"kubepods/besteffort/pod{UID}/{CID}",
            ),
        ),
        (
            f"/kubepods/pod{UID}/{CID}",
            PodRef(
                qos="guaranteed",
                pod_uid=UID,
                pod_path=f"kubepods/pod{UID}",
                container_id=CID,
                container_path=f"kubepods/pod{UID}/{CID}",
            ),
        ),
        (
            f"/kubepods/burstable/pod{UID}",
            PodRef(qos="burstable", pod_uid=UID, pod_path=f"kubepods/burstable/pod{UID}"),
        ),
        (
            # kind / --cgroup-root=/kubelet with the systemd driver
            f"/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable.slice/kubelet-kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope",
            PodRef(
                qos="burstable",
                pod_uid=UID,
                pod_path=f"kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable.slice/kubelet-kubepods-burstable-pod{UID_}.slice",
                container_id=CID,
                runtime="containerd",
                container_path=f"kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable.slice/kubelet-kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope",
            ),
        ),
        (
            # static pods have a hash for a UID
            f"kubepods.slice/kubepods-pod{STATIC_UID}.slice",
            PodRef(
                qos="guaranteed",
                pod_uid=STATIC_UID,
                pod_path=f"kubepods.slice/kubepods-pod{STATIC_UID}.slice",
            ),
        ),
    ],
)
def test_parse_cgroup_path(path: str, expected: PodRef) -> None:
    assert parse_cgroup_path(path) == expected


def test_nested_cgroups_inside_a_container_belong_to_the_container() -> None:
    ref = parse_cgroup_path(f"kubepods/pod{UID}/{CID}/init.scope/deeper")
    assert ref is not None
    assert ref.container_id == CID
    assert ref.path == f"kubepods/pod{UID}/{CID}"


def test_conmon_scope_is_in_the_pod_but_not_a_container() -> None:
    ref = parse_cgroup_path(f"kubepods.slice/kubepods-pod{UID_}.slice/crio-conmon-{CID}.scope")
    assert ref is not None
    assert ref.container_id is None
    assert ref.pod_uid == UID


@pytest.mark.parametrize(
    "path",
    [
        "/",
        "",
        "/system.slice/containerd.service",
        "/user.slice/user-1000.slice/session-2.scope",
        f"/somewhere/pod{UID}/{CID}",  # a pod-like name outside any kubepods root
        f"/kubepods/unknownqos/pod{UID}/{CID}",
        "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podnot-a-uid.slice",
        "/kubepods/besteffort",
    ],
)
def test_paths_outside_pods_give_none(path: str) -> None:
    assert parse_cgroup_path(path) is None


def test_parse_proc_cgroup() -> None:
    text = f"12:pids:/\n1:name=systemd:/x\n0::/kubepods/pod{UID}/{CID}\n"
    assert k8s.parse_proc_cgroup(text) == f"/kubepods/pod{UID}/{CID}"
    assert k8s.parse_proc_cgroup("1:name=systemd:/\n") is None
    assert k8s.parse_proc_cgroup("0::/\n") == "/"


def test_pod_metadata_and_container_name(tmp_path: Path) -> None:
    pods = tmp_path / "pods"
    (pods / f"ci-runners_runner-7f9c_{UID}" / "runner").mkdir(parents=True)
    (pods / "kube-system_other_11111111-2222-3333-4444-555555555555").mkdir()
    (pods / "not-a-pod-dir").mkdir()
    meta = k8s.pod_metadata(UID_, pods)  # the systemd spelling is accepted too
    assert meta == k8s.PodMeta(namespace="ci-runners", name="runner-7f9c", uid=UID)
    assert k8s.pod_metadata("99999999-2222-3333-4444-555555555555", pods) is None
    assert k8s.pod_metadata(UID, tmp_path / "missing") is None

    containers = tmp_path / "containers"
    containers.mkdir()
    (containers / f"runner-7f9c_ci-runners_runner-{CID}.log").symlink_to(pods / "x.log")
    assert k8s.container_name(CID, containers) == "runner"
    assert k8s.container_name("ab" * 32, containers) is None
    assert k8s.container_name(CID, tmp_path / "missing") is None


def _mk(root: Path, rel: str) -> None:
    (root / rel).mkdir(parents=True, exist_ok=True)


def test_watcher_sees_pods_and_containers_come_and_go_systemd(tmp_path: Path) -> None:
    pod = f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice"
    c1 = f"{pod}/cri-containerd-{'a1' * 32}.scope"
    c2 = f"{pod}/cri-containerd-{'b2' * 32}.scope"
    _mk(tmp_path, "system.slice/containerd.service")
    _mk(tmp_path, "kubepods.slice/kubepods-besteffort.slice")
    w = KubeWatcher(tmp_path, poll_interval=0.01)
    assert w.poll() == []

    _mk(tmp_path, c1)
    _mk(tmp_path, f"{c1}/nested")  # cgroups a container makes itself are not containers
    events = w.poll()
    assert [(e.kind, e.ref.path) for e in events] == [("pod-appeared", pod), ("container-appeared", c1)]
    assert events[1].ref.container_id == "a1" * 32 and events[1].ref.pod_uid == UID
    assert w.poll() == []

    _mk(tmp_path, c2)
    assert [(e.kind, e.ref.path) for e in w.poll()] == [("container-appeared", c2)]

    (tmp_path / c1 / "nested").rmdir()
    (tmp_path / c1).rmdir()
    assert [(e.kind, e.ref.path) for e in w.poll()] == [("container-gone", c1)]

    (tmp_path / c2).rmdir()
    (tmp_path / pod).rmdir()
    assert [(e.kind, e.ref.path) for e in w.poll()] == [("container-gone", c2), ("pod-gone", pod)]
    assert w.known == {}


def test_watcher_cgroupfs_driver_and_guaranteed_pods(tmp_path: Path) -> None:
    uid2 = "11111111-2222-3333-4444-555555555555"
    g_pod = f"kubepods/pod{UID}"
    b_pod = f"kubepods/besteffort/pod{uid2}"
    _mk(tmp_path, f"{g_pod}/{CID}")
    _mk(tmp_path, f"{b_pod}/{'cd' * 32}")
    _mk(tmp_path, "kubepods/burstable")
    events = KubeWatcher(tmp_path).poll()
    assert [(e.kind, e.ref.qos, e.ref.pod_uid, e.ref.container_id) for e in events] == [
        ("pod-appeared", "besteffort", uid2, None),
        ("pod-appeared", "guaranteed", UID, None),
        ("container-appeared", "besteffort", uid2, "cd" * 32),
        ("container-appeared", "guaranteed", UID, CID),
    ]


def test_watch_stops_when_asked(tmp_path: Path) -> None:
    import threading

    _mk(tmp_path, f"kubepods/pod{UID}/{CID}")
    stop = threading.Event()
    seen = []
    for ev in KubeWatcher(tmp_path, poll_interval=0.01).watch(stop):
        seen.append(ev.kind)
        if len(seen) == 2:
            stop.set()
    assert seen == ["pod-appeared", "container-appeared"]


def test_dir_watch_wakes_on_a_directory_made_or_removed(tmp_path: Path) -> None:
    qos = tmp_path / "kubepods" / "burstable"
    qos.mkdir(parents=True)
    w = k8s.DirWatch()
    try:
        w.watch({qos})
        assert w.wait(0.05) is False  # nothing happened
        (qos / "podx").mkdir()
        assert w.wait(5.0) is True
        assert w.wait(0.05) is False  # the events were read
        (qos / "podx").rmdir()
        assert w.wait(5.0) is True
        w.watch({tmp_path / "gone"})  # a directory that is not there: nothing to watch, no error
        assert w.wait(0.05) is False
    finally:
        w.close()


def test_watch_dirs_are_where_pods_and_containers_appear(tmp_path: Path) -> None:
    pod = "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0123abcd_0123_4567_89ab_0123456789ab.slice"
    (tmp_path / pod).mkdir(parents=True)
    (tmp_path / "system.slice").mkdir()
    found = k8s.scan_tree(tmp_path)
    assert k8s.watch_dirs(tmp_path, found) == {
        tmp_path,
        tmp_path / "kubepods.slice",
        tmp_path / "kubepods.slice/kubepods-burstable.slice",
        tmp_path / pod,
    }
