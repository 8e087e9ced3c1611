"""A run's command gets System V IPC and a /dev/shm of its own (agent/recorder/exec_helper.py
private_ipc): the job, as nobody, sees an empty private /dev/shm and none of the host's segments,
cannot get back into the host's namespaces, and what it leaves there dies with the run. Names in
its /dev/shm mean the job's files to the exec supervisor (which joins the job's mount namespace)
and to the program hashes (read through the run's root): a host file planted under the same name
is never the one judged or hashed. Through an agent: the same with a root client; an unprivileged
client's command keeps the host's (a degradation, or a refusal with --fail-closed), or, with
--net, gets its own inside the client's user namespace, where the supervisor judges from outside."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from evidence.agent.recorder.launch import IPC_PRIVATE, IPC_SHARED
from tests.kernel.test_daemon import Agent
from tests.kernel.util import PY, as_user, evidence, of_type, read_bundle

pytestmark = pytest.mark.kernel

NOBODY = 65534


@pytest.fixture
def place() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="evidence-private-ipc-"))
    d.chmod(0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def host_shm() -> Iterator[Path]:
    """A file in the host's /dev/shm anyone may read and write."""
    path = Path(f"/dev/shm/evidence-host-{uuid.uuid4().hex}")
    path.write_text("the host's secret\n")
    path.chmod(0o666)
    yield path
    path.unlink(missing_ok=True)


@pytest.fixture
def host_segment() -> Iterator[int]:
    """A System V segment made on the host (ipcmk), anyone may attach it."""
    out = subprocess.run(["ipcmk", "-M", "4096", "-p", "0666"], capture_output=True, text=True, check=True)
    seg = int(out.stdout.split()[-1])
    yield seg
    subprocess.run(["ipcrm", "-m", str(seg)], check=False, capture_output=True)


def _run(
    place: Path, *command: str, policy: str | None = None
) -> tuple[Any, dict[str, Any], list[dict[str, Any]]]:
    bundle = place / "run.tar.gz"
    bundle.unlink(missing_ok=True)
    extra: list[str] = []
    if policy is not None:
        (place / "policy.yaml").write_text(textwrap.dedent(policy))
        extra = ["--policy", str(place / "policy.yaml"), "--workspace", str(place)]
    proc = evidence("run", "--bundle", str(bundle), *extra, "--", *as_user(NOBODY, *command), cwd=place)
    assert bundle.exists(), proc.stderr
    manifest, events = read_bundle(bundle)
    return proc, manifest, events


LOOK = """\
import ctypes, json, os, sys
host_file, host_seg = sys.argv[1], int(sys.argv[2])
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
out = {"shm": sorted(os.listdir("/dev/shm")), "ipc": os.readlink("/proc/self/ns/ipc"),
       "mnt": os.readlink("/proc/self/ns/mnt")}
try:
    out["host_file"] = open(host_file).read()
except OSError as e:
    out["host_file"] = e.errno
attached = libc.shmat(host_seg, None, 0)
out["attach"] = ctypes.get_errno() if attached in (None, ctypes.c_void_p(-1).value) else "attached"
out["segments"] = open("/proc/sysvipc/shm").read().splitlines()[1:]
for line in open("/proc/self/mountinfo"):
    f = line.split()
    if f[4] == "/dev/shm":
        out["shm_mount"] = [f[5], line.split(" - ")[1].split()[0]]
with open("/dev/shm/left-by-the-job", "w") as f:
    f.write("mine")
seg = libc.shmget(0, 1 << 20, 0o1600)  # IPC_PRIVATE, never removed
out["made"] = seg
print(json.dumps(out), flush=True)
"""


def _ns_alive(link: str) -> bool:
    """Whether any process on the host is in the namespace `link` (as /proc/PID/ns/* reads)."""
    kind = link.split(":")[0]
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.readlink(f"/proc/{pid}/ns/{kind}") == link:
                    return True
            except OSError:
                continue
    return False


def test_the_job_has_an_empty_dev_shm_and_ipc_of_its_own(
    place: Path, host_shm: Path, host_segment: int
) -> None:
    import json

    proc, manifest, events = _run(place, PY, "-c", LOOK, str(host_shm), str(host_segment))
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["shm"] == [], got  # empty: not the host's
    assert got["host_file"] == 2, got  # ENOENT: the host's file is not there to reach
    assert got["attach"] == 22, got  # EINVAL: no such segment in its namespace
    assert got["segments"] == [], got
    options, fstype = got["shm_mount"]
    assert fstype == "tmpfs" and "nosuid" in options and "nodev" in options, got
    assert got["ipc"] != os.readlink("/proc/self/ns/ipc") and got["mnt"] != os.readlink("/proc/self/ns/mnt")
    # what it left: not on the host, and gone with the run (no process is in its namespaces)
    assert not Path("/dev/shm/left-by-the-job").exists()
    assert got["made"] >= 0 and not _ns_alive(got["ipc"]) and not _ns_alive(got["mnt"]), got
    assert manifest["capabilities"]["ipc"] == IPC_PRIVATE
    said = [d for d in of_type(events, "degradation") if "IPC" in d["data"]["reason"]]
    assert not said, said


def test_a_nobody_job_cannot_get_back_to_the_hosts_namespaces(place: Path, host_shm: Path) -> None:
    script = f"""
        nsenter -t 1 -m -i true; echo nsenter=$?
        umount /dev/shm; echo umount=$?
        mount -t tmpfs none /dev/shm; echo mount=$?
        unshare -Urm sh -c 'umount -l /dev/shm; ls -A /dev/shm; cat {host_shm}'; echo userns=$?
        cat /proc/1/root{host_shm}; echo proc_root=$?
        {PY} -c 'import ctypes, os; fd = os.open("/proc/1/ns/ipc", os.O_RDONLY); print("setns", ctypes.CDLL(None).setns(fd, 0))'; echo setns=$?
        ls -A /dev/shm | wc -l
    """
    proc, _, _ = _run(place, "/bin/sh", "-c", textwrap.dedent(script))
    out = proc.stdout + proc.stderr
    assert "the host's secret" not in out, out
    for step in ("nsenter", "umount", "mount", "proc_root"):
        assert f"{step}=0" not in proc.stdout, out
    assert "setns 0" not in proc.stdout, out
    assert proc.stdout.split()[-1] == "0", out  # still its own, empty


# a symlink in /dev/shm named the same on the host and in the job, to two different programs
SWAP = """\
default: allow
rules:
  - {name: no-id, program: [id], decision: deny, message: "no id"}
"""


def test_command_rules_judge_the_file_the_jobs_own_dev_shm_name_leads_to(place: Path) -> None:
    name = f"/dev/shm/evidence-link-{uuid.uuid4().hex}"
    other = f"/dev/shm/evidence-link-{uuid.uuid4().hex}"
    os.symlink("/usr/bin/true", name)  # the host's: allowed
    os.symlink("/usr/bin/id", other)  # the host's: refused
    try:
        script = f"ln -s /usr/bin/id {name}; ln -s /usr/bin/true {other}; {name}; echo id=$?; {other}; echo true=$?"
        proc, _, events = _run(
            place, "/bin/sh", "-c", script, policy="version: 1\ncommands:\n" + textwrap.indent(SWAP, "  ")
        )
    finally:
        os.unlink(name)
        os.unlink(other)
    assert "id=126" in proc.stdout and "true=0" in proc.stdout, proc.stdout + proc.stderr
    refused = [e["data"] for e in of_type(events, "policy.denial") if e["data"]["operation"] == "exec"]
    assert [(d["target"], d["rule"]) for d in refused] == [("/usr/bin/id", "commands.rules[0] (no-id)")], (
        refused
    )
    kills = [e for e in of_type(events, "policy.violation")]
    assert not kills, kills


ONLY_SHM_TOOLS = """\
version: 1
commands:
  default: deny
  rules:
    - {name: base, program: [setpriv, dash, cp], decision: allow}
    - {name: shm, program: ["/dev/shm/evidence-tool-*"], decision: allow}
"""


def test_a_program_in_the_jobs_dev_shm_is_judged_and_hashed_as_its_own_file(place: Path) -> None:
    """Allowed by its name under a default deny: the supervisor, in the job's mount namespace,
    finds the job's file there (from outside, the name leads elsewhere and would count as foreign:
    refused); its record has the hash of what ran, not of the host's script of the same name."""
    name = f"/dev/shm/evidence-tool-{uuid.uuid4().hex}"
    Path(name).write_text("#!/bin/sh\necho the host's\n")  # the host's, under the same name: a script
    os.chmod(name, 0o755)
    script = f"cp /usr/bin/sleep {name} && {name} 0.5; echo rc=$?"
    try:
        proc, _, events = _run(place, "/bin/sh", "-c", script, policy=ONLY_SHM_TOOLS)
        plain, _, plain_events = _run(place, "/bin/sh", "-c", script)
    finally:
        os.unlink(name)
    want = hashlib.sha256(Path("/usr/bin/sleep").read_bytes()).hexdigest()
    for p, evs in ((proc, events), (plain, plain_events)):
        assert "rc=0" in p.stdout and "the host's" not in p.stdout, p.stdout + p.stderr
        ran = [e["data"] for e in of_type(evs, "process.exec") if e["data"].get("filename") == name]
        assert ran and all(d.get("result") == 0 for d in ran), ran
        assert ran[-1].get("sha256") == want and "interpreter" not in ran[-1], ran[-1]
    assert not [e for e in of_type(events, "policy.denial")], of_type(events, "policy.denial")


# ---------------------------------------------------------------------------------------------------
# through an agent


@pytest.fixture(scope="module")
def agent() -> Iterator[Agent]:
    d = Path(tempfile.mkdtemp(prefix="evidence-pipc-agent-"))
    d.chmod(0o755)
    a = Agent(d, env={"EVIDENCE_ALLOWED_UIDS": str(NOBODY), "EVIDENCE_SOCKET_GID": str(NOBODY)})
    yield a
    assert a.stop() == 0, a.output()
    shutil.rmtree(d, ignore_errors=True)


def _via_agent(
    agent: Agent, place: Path, command: list[str], *extra: str, client_uid: int = 0
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], list[dict[str, Any]]]:
    bundle = place / f"agent-{uuid.uuid4().hex[:6]}.tar.gz"
    user = {} if client_uid == 0 else {"user": client_uid, "group": client_uid, "extra_groups": []}
    proc = subprocess.run(
        [sys.executable, "-m", "evidence", "run", "--agent", str(agent.socket), "--bundle", str(bundle),
         *extra, "--", *command],
        cwd=place, capture_output=True, text=True, timeout=120, **user,  # type: ignore[call-overload]
    )  # fmt: skip
    if not bundle.exists():
        return proc, {}, []
    manifest, events = read_bundle(bundle)
    return proc, manifest, events


def test_through_an_agent_a_root_clients_command_gets_its_own(
    agent: Agent, place: Path, host_shm: Path, host_segment: int
) -> None:
    import json

    name = f"/dev/shm/evidence-link-{uuid.uuid4().hex}"
    os.symlink("/usr/bin/true", name)
    try:
        proc, manifest, events = _via_agent(
            agent, place, as_user(NOBODY, PY, "-c", LOOK, str(host_shm), str(host_segment))
        )
        policy = place / "policy.yaml"
        policy.write_text("version: 1\ncommands:\n" + textwrap.indent(SWAP, "  "))
        script = f"ln -s /usr/bin/id {name}; {name}; echo id=$?"
        ruled, _, ruled_events = _via_agent(
            agent,
            place,
            as_user(NOBODY, "/bin/sh", "-c", script),
            "--policy",
            str(policy),
            "--workspace",
            str(place),
        )
    finally:
        os.unlink(name)
    assert proc.returncode == 0, proc.stderr + agent.output()
    got = json.loads(proc.stdout)
    assert got["shm"] == [] and got["host_file"] == 2 and got["attach"] == 22 and got["segments"] == [], got
    assert manifest["capabilities"]["ipc"] == IPC_PRIVATE
    assert not _ns_alive(got["ipc"]) and not _ns_alive(got["mnt"]), got
    assert "id=126" in ruled.stdout, ruled.stdout + ruled.stderr
    refused = [
        e["data"]["target"]
        for e in of_type(ruled_events, "policy.denial")
        if e["data"]["operation"] == "exec"
    ]
    assert refused == ["/usr/bin/id"], refused


def test_through_an_agent_an_unprivileged_clients_command_shares_and_says_so(
    agent: Agent, place: Path, host_shm: Path
) -> None:
    proc, manifest, events = _via_agent(agent, place, ["/bin/cat", str(host_shm)], client_uid=NOBODY)
    assert proc.returncode == 0 and "the host's secret" in proc.stdout, proc.stderr
    assert manifest["capabilities"]["ipc"] == IPC_SHARED
    said = [d["data"] for d in of_type(events, "degradation") if d["data"]["component"] == "isolation"]
    assert any("/dev/shm" in d["reason"] and "outlives the run" in d["impact"] for d in said), said
    # --fail-closed refuses it: nothing runs
    policy = place / "policy.yaml"
    policy.write_text("version: 1\n")
    policy.chmod(0o644)
    marker = place / "ran"
    refused, _, _ = _via_agent(
        agent, place, ["/bin/sh", "-c", f"touch {marker}"], "--policy", str(policy), "--fail-closed",
        client_uid=NOBODY,
    )  # fmt: skip
    assert refused.returncode == 2 and not marker.exists(), refused.stderr
    assert "IPC" in refused.stderr, refused.stderr


def test_through_an_agent_an_unprivileged_client_with_net_gets_its_own(
    agent: Agent, place: Path, host_shm: Path
) -> None:
    proc, manifest, _ = _via_agent(
        agent,
        place,
        ["/bin/sh", "-c", f"ls -A /dev/shm | wc -l; cat {host_shm}"],
        "--net",
        "none",
        client_uid=NOBODY,
    )
    assert proc.returncode != 0 and proc.stdout.split()[0] == "0", proc.stdout + proc.stderr
    assert "the host's secret" not in proc.stdout
    assert manifest["capabilities"]["ipc"] == IPC_PRIVATE


def test_the_hosts_later_mounts_reach_the_job_and_the_jobs_do_not_reach_the_host(place: Path) -> None:
    """The job's mount namespace is a slave of the host's: a mount the host makes while the run
    runs (below a shared mount) appears in it; one the job makes (as root: nobody cannot) does
    not appear on the host."""
    top = place / "shared"
    top.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "none", str(top)], check=True)
    try:
        subprocess.run(["mount", "--make-shared", str(top)], check=True)
        for d in ("late", "theirs"):
            (top / d).mkdir()
        script = f"""
            mount -t tmpfs none {top}/theirs && touch {top}/theirs/by-the-job
            touch {top}/started
            i=0; while [ ! -e {top}/late/marker ] && [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done
            cat {top}/late/marker
        """
        bundle = place / "mounts.tar.gz"
        job = subprocess.Popen(
            [sys.executable, "-m", "evidence", "run", "--bundle", str(bundle), "--", "/bin/sh", "-c", script],
            cwd=place, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            for _ in range(600):
                if (top / "started").exists() or job.poll() is not None:
                    break
                subprocess.run(["sleep", "0.05"], check=True)
            subprocess.run(["mount", "-t", "tmpfs", "none", str(top / "late")], check=True)
            (top / "late" / "marker").write_text("the host's later mount\n")
            out, err = job.communicate(timeout=120)
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
        assert "the host's later mount" in out, out + err
        assert not (top / "theirs" / "by-the-job").exists()  # the job's tmpfs stayed the job's
    finally:
        subprocess.run(["umount", "-R", str(top)], check=False)
