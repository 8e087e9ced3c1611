"""A simulated Kubernetes node: a kubepods cgroup tree, kubelet-style pod log dirs, and real containers
started by runc on a busybox root filesystem, with `evidence agent --kubernetes` watching.

The tree lives under a cgroup of the test's own on the cgroup2 mount (the agent's cgroup_root points
there); one pod uses the systemd driver's names, the other the cgroupfs driver's (runc's cgroupfs
driver makes either, the names are only names). The pod log dirs are in tmp (pod_logs setting).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from evidence.agent.recorder.cgroups import find_cgroup2_mount
from tests.kernel.test_daemon import Agent
from tests.kernel.util import of_type, read_bundle

pytestmark = pytest.mark.kernel

RUNC = shutil.which("runc")
BUSYBOX = shutil.which("busybox")


class Node:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.mount = find_cgroup2_mount()
        self.name = f"evidence-test-node-{uuid.uuid4().hex[:8]}"
        self.root = self.mount / self.name
        self.root.mkdir()
        self.pod_logs = tmp / "log" / "pods"
        self.container_logs = tmp / "log" / "containers"
        self.pod_logs.mkdir(parents=True)
        self.container_logs.mkdir(parents=True)
        self.runc_state = tmp / "runc-state"
        self.containers: list[str] = []

    def pod(self, namespace: str, name: str, driver: str) -> tuple[str, str]:
        """Make a pod cgroup and its log dir: (pod uid, pod cgroup path relative to root)."""
        uid = str(uuid.uuid4())
        if driver == "systemd":
            rel = f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid.replace('-', '_')}.slice"
        else:
            rel = f"kubepods/burstable/pod{uid}"
        (self.root / rel).mkdir(parents=True)
        (self.pod_logs / f"{namespace}_{name}_{uid}").mkdir()
        return uid, rel

    def container_path(self, pod_rel: str, cid: str) -> str:
        return (
            f"{pod_rel}/cri-containerd-{cid}.scope"
            if pod_rel.startswith("kubepods.slice")
            else f"{pod_rel}/{cid}"
        )

    def run_container(
        self, pod_rel: str, files: dict[str, str], script: str
    ) -> tuple[str, subprocess.Popen[bytes]]:
        """Start a container (runc run, foreground) in the pod: (container id, the runc process)."""
        cid = hashlib.sha256(uuid.uuid4().bytes).hexdigest()
        bundle = self.tmp / f"ctr-{cid[:12]}"
        rootfs = bundle / "rootfs"
        for d in ("bin", "proc", "dev", "sys", "tmp", "etc"):
            (rootfs / d).mkdir(parents=True)
        shutil.copy(BUSYBOX or "/bin/busybox", rootfs / "bin" / "busybox")
        subprocess.run(["chroot", str(rootfs), "/bin/busybox", "--install", "-s", "/bin"], check=True)
        for path, text in files.items():
            (rootfs / path.lstrip("/")).write_text(text)
        subprocess.run([RUNC or "runc", "spec"], cwd=bundle, check=True)
        spec = json.loads((bundle / "config.json").read_text())
        spec["process"]["terminal"] = False
        spec["process"]["args"] = ["/bin/sh", "-c", script]
        spec["root"]["readonly"] = False
        spec["linux"]["namespaces"] = [n for n in spec["linux"]["namespaces"] if n["type"] != "network"]
        spec["linux"]["cgroupsPath"] = f"/{self.name}/{self.container_path(pod_rel, cid)}"
        (bundle / "config.json").write_text(json.dumps(spec))
        self.containers.append(cid)
        proc = subprocess.Popen(
            [RUNC or "runc", "--root", str(self.runc_state), "run", "--bundle", str(bundle), cid[:32]],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        return cid, proc

    def remove_pod(self, pod_rel: str) -> None:
        """What the kubelet does when a pod is gone: rmdir its cgroup (containers first)."""
        pod = self.root / pod_rel
        for dirpath, _d, _f in sorted(os.walk(pod), key=lambda t: -t[0].count("/")):
            _rmdir(Path(dirpath))

    def cleanup(self) -> None:
        for cid in self.containers:
            subprocess.run(
                [RUNC or "runc", "--root", str(self.runc_state), "delete", "-f", cid[:32]],
                capture_output=True,
            )
        # runc's cgroupfs driver also made the path in every v1 hierarchy of a hybrid host
        for hierarchy in [self.mount, *Path("/sys/fs/cgroup").iterdir()]:
            top = hierarchy / self.name
            if not top.is_dir():
                continue
            for dirpath, _d, _f in sorted(os.walk(top), key=lambda t: -t[0].count("/")):
                d = Path(dirpath)
                if (d / "cgroup.kill").exists():
                    (d / "cgroup.kill").write_text("1")
                _rmdir(d)


def _rmdir(d: Path) -> None:
    for _ in range(100):
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    if RUNC is None or BUSYBOX is None:
        why = "needs runc and busybox (apt-get install runc busybox-static; scripts/setup.sh does)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"kernel test cannot run under CI: {why}")
        pytest.skip(why)
    n = Node(tmp_path)
    yield n
    n.cleanup()


def _agent(node: Node, **settings: str) -> Agent:
    env = {
        "EVIDENCE_CGROUP_ROOT": str(node.root),
        "EVIDENCE_POD_LOGS": str(node.pod_logs),
        "EVIDENCE_POLL_INTERVAL": "0.2",
        **{f"EVIDENCE_{k.upper()}": v for k, v in settings.items()},
    }
    return Agent(node.tmp, "--kubernetes", env=env)


def _wait(what: str, check, timeout: float = 30.0, agent: Agent | None = None):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}" + (f"\n{agent.output()}" if agent else ""))


def _pod_runs(agent: Agent) -> dict[str, dict]:
    return {r["labels"]["k8s/pod-uid"]: r for r in agent.client.runs() if "k8s/pod-uid" in r["labels"]}


def _opens(events: list[dict]) -> set[str]:
    return {e["data"]["path"] for e in of_type(events, "file.open")}


def test_one_bundle_per_pod_with_its_own_container(node: Node) -> None:
    uid_a, pod_a = node.pod("team-a", "web-a", "systemd")
    uid_b, pod_b = node.pod("team-b", "db-b", "cgroupfs")
    agent = _agent(node)
    try:
        runs = _wait("a run per pod", lambda: len(_pod_runs(agent)) == 2 and _pod_runs(agent), agent=agent)
        assert runs[uid_a]["cgroup"] == str(node.root / pod_a)
        assert (
            runs[uid_a]["labels"]["k8s/namespace"] == "team-a" and runs[uid_a]["labels"]["k8s/pod"] == "web-a"
        )
        assert (
            runs[uid_b]["labels"]["k8s/qos"] == "burstable"
            and runs[uid_a]["labels"]["k8s/qos"] == "besteffort"
        )
        assert runs[uid_a]["attached_late"] is False  # nothing ran in the pod yet

        # both containers at once; each reads a file only its own root filesystem has
        script = "cat /etc/{f}; ls /; sleep 1.5"
        cid_a, ra = node.run_container(pod_a, {"/etc/pod-a.txt": "A\n"}, script.format(f="pod-a.txt"))
        cid_b, rb = node.run_container(pod_b, {"/etc/pod-b.txt": "B\n"}, script.format(f="pod-b.txt"))
        (node.container_logs / f"web-a_team-a_app-{cid_a}.log").touch()
        out_a, out_b = ra.communicate(timeout=60)[0], rb.communicate(timeout=60)[0]
        assert ra.returncode == 0 and out_a.startswith(b"A\n"), out_a
        assert rb.returncode == 0 and out_b.startswith(b"B\n"), out_b

        node.remove_pod(pod_a)
        bundle_a = agent.bundles / f"team-a_web-a_{uid_a}-1.tar.gz"
        _wait("pod a's bundle", bundle_a.exists, agent=agent)
        assert uid_b in _pod_runs(agent) and uid_a not in _pod_runs(agent)  # b is still recorded
        node.remove_pod(pod_b)
        bundle_b = agent.bundles / f"team-b_db-b_{uid_b}-1.tar.gz"
        _wait("pod b's bundle", bundle_b.exists, agent=agent)
    finally:
        assert agent.stop() == 0, agent.output()

    manifest_a, events_a = read_bundle(bundle_a)
    manifest_b, events_b = read_bundle(bundle_b)
    for manifest, events, mine, other, cid in (
        (manifest_a, events_a, "/etc/pod-a.txt", "/etc/pod-b.txt", cid_a),
        (manifest_b, events_b, "/etc/pod-b.txt", "/etc/pod-a.txt", cid_b),
    ):
        assert manifest["cut_short"] is False and manifest["lost"]["total"] == 0
        execs = [e["data"] for e in of_type(events, "process.exec") if e["data"]["result"] == 0]
        assert any(x["filename"] == "/bin/sh" and x["argv"][:2] == ["/bin/sh", "-c"] for x in execs)
        assert ["cat", mine] in [x["argv"] for x in execs]
        # every event of the container names it
        cat = next(x for x in execs if x["argv"] == ["cat", mine])
        assert cat["container"] == cid, cat
        opened = [e["data"] for e in of_type(events, "file.open") if e["data"]["path"] == mine]
        assert opened and all(o["container"] == cid for o in opened)
        assert mine in _opens(events)
        assert other not in _opens(events) and ["cat", other] not in [x["argv"] for x in execs]

    labels = manifest_a["labels"]
    assert (
        labels["k8s/pod-uid"] == uid_a
        and labels["k8s/namespace"] == "team-a"
        and labels["k8s/pod"] == "web-a"
    )
    container = json.loads(labels[f"k8s/container/{cid_a}"])
    assert container["runtime"] == "containerd" and container["name"] == "app"
    assert container["cgroup"] == node.container_path(pod_a, cid_a) and container["cgroup_id"] > 0
    container_b = json.loads(manifest_b["labels"][f"k8s/container/{cid_b}"])
    assert container_b["runtime"] is None and container_b["cgroup"] == node.container_path(pod_b, cid_b)
    assert not any(k.startswith("k8s/container/") and cid_b in k for k in labels)
    assert of_type(events_a, "run.started")[0]["data"]["labels"] == labels


def test_long_lived_pod_is_cut_into_chained_windows(node: Node) -> None:
    uid, pod = node.pod("batch", "loop", "systemd")
    agent = _agent(node, window_seconds="1.5")
    try:
        _wait("the pod's run", lambda: uid in _pod_runs(agent), agent=agent)
        n = 25
        script = f"i=0; while [ $i -lt {n} ]; do cat /etc/tick.txt; sleep 0.2; i=$((i+1)); done"
        _cid, proc = node.run_container(pod, {"/etc/tick.txt": "t\n"}, script)
        out = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0 and out.count(b"t\n") == n, out
        node.remove_pod(pod)
        _wait("the pod's run to end", lambda: uid not in _pod_runs(agent), agent=agent)
    finally:
        assert agent.stop() == 0, agent.output()  # waits for the last window's bundle
    found = list(agent.bundles.glob(f"batch_loop_{uid}-*.tar.gz"))
    bundles = sorted(found, key=lambda p: int(p.name.removesuffix(".tar.gz").rsplit("-", 1)[1]))
    assert len(bundles) >= 3, [b.name for b in bundles]
    cats = 0
    previous = None
    for i, path in enumerate(bundles, start=1):
        assert path.name == f"batch_loop_{uid}-{i}.tar.gz"
        manifest, events = read_bundle(path)
        assert manifest["labels"]["k8s/window"] == str(i)
        if previous is None:
            assert "previous_bundle_sha256" not in manifest["labels"]
        else:
            assert (
                manifest["labels"]["previous_bundle_sha256"]
                == hashlib.sha256(previous.read_bytes()).hexdigest()
            )
            assert manifest["attached_late"] is True
        cats += sum(
            1
            for e in of_type(events, "process.exec")
            if e["data"]["argv"] == ["cat", "/etc/tick.txt"] and e["data"]["result"] == 0
        )
        assert manifest["lost"]["total"] == 0
        previous = path
    assert cats == n  # no exec lost or counted twice across the cuts


def test_a_pod_shorter_than_the_scan_interval_is_recorded_from_its_start(node: Node) -> None:
    """inotify wakes the scan when a pod's cgroup is made or removed: with scans 60 s apart, a pod
    that lives a second is still recorded, from its container's first exec, and its bundle is
    written as soon as the kubelet removes it."""
    agent = _agent(node, poll_interval="60")
    try:
        _wait("the first scan", lambda: agent.client.health().get("status") == "ready", agent=agent)
        uid, pod = node.pod("ci", "job-7", "systemd")
        # the kubelet makes the pod's cgroup, then its sandbox and containers: some time passes
        # before the first container runs; the agent must be recording by then
        _wait("the pod's run", lambda: uid in _pod_runs(agent), timeout=5.0, agent=agent)
        _cid, proc = node.run_container(pod, {"/etc/job.txt": "J\n"}, "cat /etc/job.txt")
        out = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0 and out == b"J\n", out
        node.remove_pod(pod)
        bundle = agent.bundles / f"ci_job-7_{uid}-1.tar.gz"
        _wait("the pod's bundle", bundle.exists, timeout=5.0, agent=agent)
    finally:
        assert agent.stop() == 0, agent.output()
    manifest, events = read_bundle(bundle)
    assert manifest["attached_late"] is False and manifest["lost"]["total"] == 0
    execs = [e["data"] for e in of_type(events, "process.exec") if e["data"]["result"] == 0]
    assert execs[0]["argv"] == ["/bin/sh", "-c", "cat /etc/job.txt"]  # from the container's first exec
    assert ["cat", "/etc/job.txt"] in [x["argv"] for x in execs]
    assert "/etc/job.txt" in _opens(events)
