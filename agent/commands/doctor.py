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
import os
import stat
import sys
from pathlib import Path
from typing import Any

from evidence.agent.recorder import kernel


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
    out.append(private_dir_check("bundle directory", bundle_dir or DEFAULT_BUNDLE_DIR))
    out.append(private_dir_check("run spools", RUN_SPOOL_DIR))
    return out


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
