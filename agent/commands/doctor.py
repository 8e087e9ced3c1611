"""`evidence doctor [--json] [--bundle-dir DIR]`: what this machine offers the recorder, and what to
do when something is missing. Exit 0 when `evidence run` can record here, 1 when something it needs
is missing, or when a directory where bundles or spools wait (the agent's bundle directory,
`evidence run`'s spools) can be read or written by others: a bundle has argv and file names, and is
its owner's alone (the agent makes its directories 0700 when it starts, and refuses one that others
can write)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

from evidence.agent.recorder import kernel

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    required: bool
    fix: str = ""


def configure(p: argparse.ArgumentParser) -> None:
    from evidence.agent.daemon.settings import DEFAULT_BUNDLE_DIR

    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.add_argument(
        "--bundle-dir",
        metavar="DIR",
        type=Path,
        default=Path(os.environ.get("EVIDENCE_BUNDLE_DIR") or DEFAULT_BUNDLE_DIR),
        help=f"the agent's bundle directory (default: $EVIDENCE_BUNDLE_DIR or {DEFAULT_BUNDLE_DIR})",
    )


def private_dir_check(name: str, path: Path) -> Check:
    """Whether `path` is a directory only its owner (root) may enter, as bundles and spools need:
    absent is fine (it is made 0700)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return Check(name, True, f"{path} (not made yet: it will be 0700)", True)
    except OSError as e:
        return Check(name, False, f"{path}: {e.strerror}", True, "check the path")
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISDIR(st.st_mode):
        return Check(name, False, f"{path} is not a directory", True, "remove it, or choose another")
    if st.st_uid != 0:
        return Check(name, False, f"{path} belongs to uid {st.st_uid}", True, f"chown root {path}")
    if mode & 0o077:
        who = "written" if mode & 0o022 else "read"
        return Check(
            name,
            False,
            f"{path} can be {who} by others (mode {mode:o}): their bundles and file names",
            True,
            f"chmod 700 {path}" + ("" if mode & 0o022 else " (the agent does when it starts)"),
        )
    return Check(name, True, f"{path} (mode {mode:o})", True)


def checks(bundle_dir: Path | None = None) -> list[Check]:
    from evidence.agent.commands.run import RUN_SPOOL_DIR
    from evidence.agent.daemon.settings import DEFAULT_BUNDLE_DIR

    out: list[Check] = []
    root = os.geteuid() == 0
    out.append(
        Check(
            "root",
            root,
            "running as root" if root else f"uid {os.geteuid()}",
            True,
            "run as root (BPF, cgroups and tracefs need it)",
        )
    )
    try:
        from evidence.agent.recorder.cgroups import find_cgroup2_mount

        cg = str(find_cgroup2_mount())
        out.append(Check("cgroup v2", True, cg, True))
    except Exception as e:  # noqa: BLE001 - reported, not raised
        out.append(Check("cgroup v2", False, str(e), True, "mount -t cgroup2 none /sys/fs/cgroup"))
    tracefs = kernel.mount_tracefs() if root else (kernel.TRACEFS / "events").is_dir()
    out.append(
        Check(
            "tracefs",
            tracefs,
            str(kernel.TRACEFS) if tracefs else "not mounted",
            True,
            "mount -t tracefs tracefs /sys/kernel/tracing",
        )
    )
    btf = kernel.BTF_PATH.exists()
    out.append(
        Check(
            "BTF",
            btf,
            str(kernel.BTF_PATH) if btf else "missing",
            True,
            "a kernel built with CONFIG_DEBUG_INFO_BTF=y",
        )
    )
    try:
        import bcc  # noqa: F401

        out.append(Check("BCC", True, "python3-bpfcc importable", True))
    except ImportError:
        out.append(
            Check(
                "BCC",
                False,
                "cannot import bcc",
                True,
                "apt-get install python3-bpfcc (the PyPI package named bcc is an unrelated project)",
            )
        )
    if root:
        from evidence.probes.headers import ensure_headers

        h = ensure_headers()
        if h.path is None:
            out.append(
                Check(
                    "kernel headers",
                    False,
                    f"none for {h.kernel}",
                    True,
                    "apt-get install linux-headers-$(uname -r) or the distro's generic headers",
                )
            )
        else:
            detail = f"{h.headers} for kernel {h.kernel}" + (
                "" if h.match else " (mismatch: used for helpers only, no struct layouts)"
            )
            out.append(
                Check(
                    "kernel headers",
                    True,
                    detail,
                    True,
                    "" if h.match else "install headers matching the kernel for an exact match",
                )
            )
    out.append(Check("lockdown", True, kernel.lockdown_mode(), False))
    for ptype, (name, attach) in kernel.PROG_TYPES.items():
        ok, why = kernel.prog_type_loads(ptype, attach) if root else (False, "needs root")
        needed = name in ("tracepoint", "raw_tracepoint", "cgroup_sock_addr")
        fix = (
            ""
            if ok
            else ("the recorder needs it" if needed else "not used: the probes use tracepoints instead")
        )
        out.append(Check(f"bpf prog {name}", ok, why, needed, fix))
    ok, why = kernel.ringbuf_available() if root else (False, "needs root")
    out.append(Check("bpf ringbuf", ok, why, True, "kernel 5.8 or newer"))
    kprobes = (kernel.TRACEFS / "kprobe_events").exists()
    out.append(
        Check(
            "kprobes",
            kprobes,
            "available" if kprobes else "CONFIG_KPROBES off",
            False,
            "" if kprobes else "not needed: tracepoints only",
        )
    )
    abi = kernel.landlock_abi()
    out.append(
        Check(
            "landlock",
            abi > 0,
            f"ABI {abi}" if abi else "unavailable",
            False,
            "" if abi else "boot with lsm=...,landlock to enforce file policies",
        )
    )
    isolation = (
        "signals, abstract unix sockets and ptrace confined to the run"
        if abi >= 6
        else "ptrace confined to the run; signals are not (Landlock ABI < 6)"
        if abi
        else "no_new_privs only: a job can ptrace or signal processes of its uid outside the run"
    )
    out.append(
        Check(
            "job isolation",
            abi >= 6,
            isolation,
            False,
            "" if abi >= 6 else "a kernel with Landlock ABI 6 (Linux 6.12) or later scopes signals",
        )
    )
    out.append(Check("32-bit system calls", True, _compat_detail(), False))
    for i, c in enumerate(out):
        if c.name == "kernel headers" and c.ok and os.environ.get("BCC_KERNEL_SOURCE"):
            where = f"; joined under {os.environ['BCC_KERNEL_SOURCE']} for BCC, /lib/modules untouched"
            out[i] = dataclasses.replace(c, detail=c.detail + where)
    sock_addr = next((c for c in out if c.name == "bpf prog cgroup_sock_addr"), None)
    out.append(
        Check(
            "connect enforcement", bool(sock_addr and sock_addr.ok), "cgroup/connect4,6 and sendmsg4,6", False
        )
    )
    out += governance_checks(root)
    out.append(private_dir_check("bundle directory", bundle_dir or DEFAULT_BUNDLE_DIR))
    out.append(private_dir_check("run spools", RUN_SPOOL_DIR))
    return out


def governance_checks(root: bool) -> list[Check]:
    """What a policy's `commands`, `approvals` and `limits` need (issue 24), each probed for real,
    with what is lost without it. None is required to record: a run whose policy needs a missing
    one gets a degradation (or, with --fail-closed, does not start)."""
    ok, why = user_notification()
    out = [
        Check(
            "seccomp user notification",
            ok,
            why,
            False,
            ""
            if ok
            else "without it `commands` rules and approvals are not enforced (a degradation; "
            "--fail-closed refuses such a policy): Linux 5.5+ and apt-get install python3-seccomp",
        )
    ]
    ok, why = send_signal_helper() if root else (False, "needs root")
    out.append(
        Check(
            "bpf_send_signal",
            ok,
            why,
            False,
            ""
            if ok
            else "without it the exec check at sched_process_exec cannot kill an exec that is not "
            "the one decided (the race after an allowed exec stays open: a degradation); Linux 5.3+",
        )
    )
    ok, why = private_ipc() if root else (False, "needs root")
    out.append(
        Check(
            "private IPC and /dev/shm",
            ok,
            why,
            False,
            ""
            if ok
            else "without it a run's command shares the host's System V IPC and /dev/shm, and what it "
            "leaves there outlives the run (a degradation; --fail-closed refuses): evidence needs "
            "CAP_SYS_ADMIN (a privileged container)",
        )
    )
    from evidence.agent.recorder import limits

    try:
        found = limits.detect()
    except OSError as e:
        found = {}
        logger.debug("cgroup hierarchies: %s", e)
    for ctl in limits.CONTROLLERS:
        h = found.get(ctl)
        out.append(
            Check(
                f"limits: {ctl}",
                h is not None,
                f"cgroup v{h.version} at {h.mount}" if h is not None else "no hierarchy offers it",
                False,
                ""
                if h is not None
                else f"without it `limits` that need the {ctl} controller are not applied (a degradation): "
                f"enable it in cgroup.subtree_control, or mount a v1 {ctl} hierarchy",
            )
        )
    return out


def private_ipc() -> tuple[bool, str]:
    """Whether a run's command can be given System V IPC and a /dev/shm of its own, tried for real
    as the launcher does it (exec_helper.private_ipc: new IPC and mount namespaces, a tmpfs on
    /dev/shm) in a child process, whose namespaces die with it."""
    code = "from evidence.agent.recorder.exec_helper import private_ipc; private_ipc()"
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"the probe could not run: {e}"
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return False, lines[-1] if lines else f"the probe exited {done.returncode}"
    return True, "an IPC namespace and a mount namespace with a tmpfs on /dev/shm were made"


def user_notification() -> tuple[bool, str]:
    """Whether a seccomp listener can be made here, for real: a child installs the exec filter the
    launcher installs (execve/execveat to a listener, agent/recorder/exec_supervisor.py) and exits
    without exec'ing."""
    try:
        avail = Path("/proc/sys/kernel/seccomp/actions_avail").read_text().split()
    except OSError:
        avail = []
    if "user_notif" not in avail:
        return False, "the kernel offers no user_notif action (/proc/sys/kernel/seccomp/actions_avail)"
    try:
        import seccomp  # noqa: F401 - Debian's python3-seccomp
    except ImportError:
        return False, "python3-seccomp is not installed"
    from evidence.agent.recorder.exec_filter import install_exec_filter

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(install_exec_filter())
            code = 0
        except BaseException:  # noqa: BLE001 - the exit code says it
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) == 0:
        return True, "a listener for execve/execveat was made (libseccomp NOTIFY)"
    return False, "installing a notify filter failed in a test process"


BPF_FUNC_SEND_SIGNAL = 109
BPF_PROG_TYPE_TRACEPOINT = 5


def send_signal_helper(helper: int = BPF_FUNC_SEND_SIGNAL) -> tuple[bool, str]:
    """Whether a tracepoint program may call bpf_send_signal: the verifier is asked for real with a
    three-instruction program (r1 = 0; call bpf_send_signal; r0 = 0; exit), loaded and closed, never
    attached."""
    import ctypes
    import errno

    insns = (ctypes.c_uint64 * 4)(
        0x00000000_000001B7,  # r1 = 0 (signal 0: nothing would be sent)
        (helper << 32) | 0x85,  # call
        0x00000000_000000B7,  # r0 = 0
        0x00000000_00000095,  # exit
    )
    license_ = ctypes.create_string_buffer(b"GPL")
    attr = ctypes.create_string_buffer(128)
    base = ctypes.addressof(attr)
    ctypes.memmove(base, ctypes.byref(ctypes.c_uint32(BPF_PROG_TYPE_TRACEPOINT)), 4)
    ctypes.memmove(base + 4, ctypes.byref(ctypes.c_uint32(len(insns))), 4)
    ctypes.memmove(base + 8, ctypes.byref(ctypes.c_uint64(ctypes.addressof(insns))), 8)
    ctypes.memmove(base + 16, ctypes.byref(ctypes.c_uint64(ctypes.addressof(license_))), 8)
    rc = kernel._bpf(kernel.BPF_PROG_LOAD, attr)
    if rc == 0:
        return True, "a tracepoint program calling it loads"
    return False, f"a tracepoint program calling it is refused ({errno.errorcode.get(-rc, str(-rc))})"


def _compat_detail() -> str:
    """What a recorded command may do through a 32-bit system call entry, which the kernel's syscall
    tracepoints skip (policy/landlock_syscalls.py compat_filter)."""
    how = (
        "refused in every command evidence launches (seccomp: SIGSYS, recorded as a policy.denial, "
        "lint EV013); --allow-32bit runs them unrecorded (a degradation); processes an agent adopts "
        "(start --pid/--cgroup, pods) are not covered (a degradation)"
    )
    if os.uname().machine != "x86_64":
        return how
    return (
        "the kernel runs i386 code (IA32 emulation): " if _ia32_emulation() else "no IA32 emulation: "
    ) + how


def _ia32_emulation() -> bool:
    """Whether the running x86_64 kernel runs i386 system calls (CONFIG_IA32_EMULATION, and not
    turned off with ia32_emulation=false on its command line); unknown counts as yes."""
    import gzip

    try:
        cmdline = Path("/proc/cmdline").read_text().split()
        if "ia32_emulation=false" in cmdline or "ia32_emulation=0" in cmdline:
            return False
        with gzip.open("/proc/config.gz", "rt") as f:
            return any(line.startswith("CONFIG_IA32_EMULATION=y") for line in f)
    except OSError:
        return True


def run(args: argparse.Namespace) -> int:
    result = checks(args.bundle_dir)
    ready = all(c.ok for c in result if c.required)
    if args.json:
        doc: dict[str, Any] = {
            "ready": ready,
            "kernel": os.uname().release,
            "checks": [dataclasses.asdict(c) for c in result],
        }
        sys.stdout.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    else:
        width = max(len(c.name) for c in result)
        for c in result:
            mark = "ok  " if c.ok else ("FAIL" if c.required else "--  ")
            line = f"{mark} {c.name:<{width}}  {c.detail}"
            if c.fix and not c.ok:
                line += f"  -> {c.fix}"
            print(line)
        print("ready to record" if ready else "NOT ready to record: fix the FAIL lines above")
    return 0 if ready else 1
