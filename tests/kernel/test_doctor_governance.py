"""`evidence doctor`'s checks for command governance, probed on this kernel for real: a seccomp
listener can be made (also by nobody, as the launcher of an unprivileged job makes it), a
tracepoint program calling bpf_send_signal loads while one calling a helper that does not exist is
refused (the probe tells the two apart), and the controllers limits need are found where the host
keeps them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from evidence.agent.commands.doctor import (
    governance_checks,
    private_ipc,
    send_signal_helper,
    user_notification,
)
from evidence.agent.recorder import limits
from tests.kernel.util import as_user

NOBODY = 65534


def test_each_check_is_probed_and_says_what_is_lost_without_it() -> None:
    assert user_notification()[0]
    assert send_signal_helper() == (True, "a tracepoint program calling it loads")
    ok, why = send_signal_helper(helper=100_000)  # the control: no such helper
    assert not ok and "EINVAL" in why
    checks = {c.name: c for c in governance_checks(root=True)}
    assert checks["seccomp user notification"].ok and checks["bpf_send_signal"].ok
    assert checks["private IPC and /dev/shm"].ok and not checks["private IPC and /dev/shm"].required
    found = limits.detect()
    for ctl in limits.CONTROLLERS:
        c = checks[f"limits: {ctl}"]
        assert c.ok == (ctl in found) and not c.required
        if c.ok:
            assert c.detail == f"cgroup v{found[ctl].version} at {found[ctl].mount}"


def test_nobody_can_make_the_listener_and_doctor_json_carries_the_checks() -> None:
    code = "from evidence.agent.commands.doctor import user_notification as u; ok, why = u(); print(ok, why)"
    out = subprocess.run(
        as_user(NOBODY, sys.executable, "-c", code), capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert out.startswith("True a listener for execve/execveat was made")
    doc = json.loads(
        subprocess.run(
            [sys.executable, "-m", "evidence", "doctor", "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
    )
    names = {c["name"]: c for c in doc["checks"]}
    for name in (
        "private IPC and /dev/shm",
        "seccomp user notification",
        "bpf_send_signal",
        "limits: memory",
        "limits: pids",
        "limits: cpu",
    ):
        assert name in names and names[name]["required"] is False


def test_private_ipc_is_tried_for_real_and_a_nobody_cannot_make_it() -> None:
    """The probe makes the namespaces as the launcher does, in a child whose namespaces die with it
    (the host's /dev/shm stays as it was); as nobody the kernel refuses, and the check says why."""
    before = _shm_mounts()
    assert private_ipc() == (
        True,
        "an IPC namespace and a mount namespace with a tmpfs on /dev/shm were made",
    )
    assert _shm_mounts() == before
    code = "from evidence.agent.commands.doctor import private_ipc as p; ok, why = p(); print(ok, why)"
    out = subprocess.run(
        as_user(NOBODY, sys.executable, "-c", code), capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert out.startswith("False ") and "Operation not permitted" in out, out


def _shm_mounts() -> list[str]:
    return [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if " /dev/shm " in line]
