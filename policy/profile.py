"""`evidence profile BUNDLE > policy.yaml`: a policy that allows exactly what a recorded run did.

What counts as done: file opens, file changes (rename, unlink, link, mkdir, ...: write access to
the directory that holds the name; truncate, chmod, chown: to the file), execs and connects whose result is not a permission refusal
(EACCES/EPERM: the run did not do those), plus would-block denials of a dry run (the run did them).
Failed lookups such as ENOENT are kept: programs probe paths, and the same probes happen again.

Generalisation, so that an identical second run is not blocked by names that differ between runs:
- anything under the workspace becomes `${WORKSPACE}`, under the run's private tmp `${TMPDIR}`;
- reads and execs under a system tree (/usr, /lib, /etc, /opt, /proc, /sys, ...) allow the top of
  that tree; device files are allowed one by one (/dev/pts and /dev/shm as directories);
- other reads, and file creations, allow their directory (`${HOME}/...` under the home directory);
  a write to an existing file outside those roots allows that file only;
- connects allow the exact address and port (`10.0.0.1/32:443`, `[2001:db8::1]/128:443`), or, when
  the run's own DNS lookups (dev.evidence.network.dns) answered with that address, the names it
  asked for with the port (`registry.example:443`): a policy resolves host names when it is loaded,
  so an address a CDN gives out on the next run is allowed too (see docs/policy-format.md for what
  resolving once at load means). Only answers credited to the run's queries (not `unsolicited`)
  from its configured resolvers (`configured_resolver`) count: a job that answers its own query, or
  asks a server of its choosing, does not get a name allowed for an address of its choosing (nor
  do bundles made before those fields: their connects are allowed by address).
Events of a process in another mount namespace (`mntns: "other"`: it unshared, entered a namespace,
mounted or chrooted, or is a child of one) are not turned into file or exec rules: their paths are
names in that namespace (a file bind-mounted over /etc/hostname), and allowing the same names on the
host would allow other files. Nor are would-block denials of their opens and execs (matched by pid
and path). The policy says how many were left out in its header, and so does a warning. Their
connects are kept: an address is not a path.
When any program was executed, /lib and /lib64 join the exec list: the kernel opens the dynamic
loader itself, which leaves no open event. The deny list is the shipped default's secret paths,
except those the run did touch. The result is checked with the policy's own evaluation before it is
printed: every recorded access must be allowed by it. The command is bundle/commands/profile.py.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any, TypedDict

from evidence.bundle.format import has_dotdot
from evidence.bundle.normalize import canonical_address
from evidence.bundle.read_types import EventJSON, ManifestJSON
from evidence.bundle.text import printable
from evidence.policy.commands import ExecsSeen, render_commands, unallowed_programs
from evidence.policy.model import Policy, is_host_name, parse_policy
from evidence.policy.paths import canonical_path, under

logger = logging.getLogger(__name__)

SYSTEM_TREES = (
    "usr",
    "lib",
    "lib32",
    "lib64",
    "libx32",
    "bin",
    "sbin",
    "etc",
    "opt",
    "proc",
    "sys",
    "snap",
    "nix",
)
DEVICE_DIRS = ("/dev/pts", "/dev/shm", "/dev/mqueue", "/dev/fd")
REFUSED = ("EACCES", "EPERM")
SECRET_DENY = (
    "${HOME}/.ssh",
    "${HOME}/.aws",
    "${HOME}/.config/gcloud",
    "${HOME}/.kube",
    "${HOME}/.docker",
    "${HOME}/.gnupg",
    "${HOME}/.netrc",
    "${HOME}/.git-credentials",
    "/etc/shadow",
    "/etc/gshadow",
)

FILE_OPEN = "dev.evidence.file.open"
FILE_CHANGE = "dev.evidence.file.change"
# changes that add or remove a name: they need write access to the directory that holds it
_NAMING = frozenset(("rename", "unlink", "rmdir", "link", "symlink", "mkdir", "mknod"))
PROCESS_EXEC = "dev.evidence.process.exec"
NETWORK_CONNECT = "dev.evidence.network.connect"
NETWORK_DNS = "dev.evidence.network.dns"
POLICY_DENIAL = "dev.evidence.policy.denial"


class Activity:
    """What a run did, as paths per access and network targets."""

    def __init__(self) -> None:
        self.read: set[tuple[str, bool]] = set()  # (path, is a directory)
        self.write: set[tuple[str, bool]] = set()  # (path, created: the directory must allow it)
        self.exec: set[str] = set()
        self.connects: set[tuple[str, int | None]] = set()  # (address, port)
        self.resolved: dict[str, set[str]] = {}  # a name the run looked up -> the addresses it got
        self.other_ns = 0  # file and exec events in another mount namespace, left out
        self.unplaced: set[str] = set()  # names with a '..' after a component (where they led is not known)

    def accesses(self) -> Iterable[tuple[str, str]]:
        for p, _ in self.read:
            yield p, "read"
        for p, _ in self.write:
            yield p, "write"
        for p in self.exec:
            yield p, "exec"


def collect(events: Iterable[EventJSON]) -> Activity:
    act = Activity()
    other_paths: set[tuple[Any, str]] = set()  # (pid, path) of opens and execs in another namespace
    dry_denials: list[EventJSON] = []
    for ev in events:
        etype, data = ev.get("type"), ev.get("data") or {}
        if data.get("mntns") == "other" and etype in (FILE_OPEN, FILE_CHANGE, PROCESS_EXEC):
            act.other_ns += 1
            path = data.get("filename") if etype == PROCESS_EXEC else data.get("path")
            other_paths.add((data.get("pid"), str(path)))
        elif etype == FILE_OPEN:
            if data.get("result") in REFUSED:
                continue
            path = str(data["path"])
            is_dir = "O_DIRECTORY" in (data.get("flags") or [])
            access = data.get("access") or []
            if "read" in access or not access:
                act.read.add((path, is_dir))
            if "write" in access or "create" in access:
                act.write.add((path, "create" in access or is_dir))
            if "exec" in access:
                act.exec.add(path)
        elif etype == FILE_CHANGE:
            if data.get("result") in REFUSED:
                continue
            op = data.get("operation")
            if op in _NAMING:  # (path, True): the directory that holds it must allow the change
                act.write.add((str(data["path"]), True))
                if op in ("rename", "link") and data.get("target"):
                    act.write.add((str(data["target"]), True))
            else:  # truncate, chmod, chown: the file itself
                act.write.add((str(data["path"]), False))
        elif etype == PROCESS_EXEC:
            if data.get("result") not in REFUSED:
                act.exec.add(str(data["filename"]))
        elif etype == NETWORK_CONNECT:
            if data.get("result") in REFUSED or data.get("family") not in ("AF_INET", "AF_INET6"):
                continue
            act.connects.add((str(data["address"]), data.get("port")))
        elif etype == NETWORK_DNS:
            name = data.get("name")
            credited = data.get("configured_resolver") is True and not data.get("unsolicited")
            if credited and data.get("result") == "NOERROR" and isinstance(name, str) and is_host_name(name):
                act.resolved.setdefault(name, set()).update(
                    canonical_address(a) for a in data.get("addresses") or []
                )
        elif etype == POLICY_DENIAL and data.get("enforced") is False:
            dry_denials.append(ev)  # after the pass: its open may come later at the same time
    for denial in dry_denials:
        data = denial["data"]
        op, target = data.get("operation"), str(data.get("target"))
        if op in ("connect", "sendmsg"):
            act.connects.add(_split_target(target))
        elif (data.get("pid"), target) in other_paths:
            act.other_ns += 1
        elif op == "read":
            act.read.add((target, False))
        elif op in ("write", "create"):
            act.write.add((target, False))
        elif op == "exec":
            act.exec.add(target)
    # a '..' after a component that may be a symlink: no rule can be made for where it led
    for paths in (act.read, act.write):
        for entry in [e for e in paths if has_dotdot(e[0])]:
            paths.discard(entry)
            act.unplaced.add(entry[0])
    act.unplaced.update(p for p in act.exec if has_dotdot(p))
    act.exec.difference_update(act.unplaced)
    return act


def _split_target(target: str) -> tuple[str, int | None]:
    if target.startswith("["):
        addr, _, rest = target[1:].partition("]")
        return addr, int(rest[1:]) if rest.startswith(":") else None
    if target.count(":") == 1:
        addr, port = target.split(":")
        return addr, int(port)
    return target, None


class _Generaliser:
    def __init__(self, variables: dict[str, str]) -> None:
        # longest root first, so a tmp inside the workspace maps to ${TMPDIR}
        self.roots = sorted(
            ((v, k) for k, v in variables.items() if v and v != "/"), key=lambda vk: -len(vk[0])
        )

    def _subst(self, path: str) -> str:
        for root, name in self.roots:
            if name in ("WORKSPACE", "TMPDIR") and under(path, root):
                return "${" + name + "}"
        for root, name in self.roots:
            if name == "HOME" and under(path, root):
                return "${HOME}" + path[len(root) :]
        return path

    def entry(self, path: str, is_dir: bool, kind: str) -> str:
        """The allow entry for a path. For reads is_dir says the path is a directory; for writes it
        says the file was created (so its directory must allow it), else the file itself is enough."""
        path = os.path.normpath(path)
        for root, name in self.roots:
            if name in ("WORKSPACE", "TMPDIR") and under(path, root):
                return "${" + name + "}"
        if path.startswith("/dev/"):
            for d in DEVICE_DIRS:
                if under(path, d):
                    return d
            return path
        top = path.split("/")[1] if path.count("/") >= 1 else ""
        if kind in ("read", "exec") and top in SYSTEM_TREES:
            return "/" + top
        if kind == "write":
            return self._subst(os.path.dirname(path) or "/" if is_dir else path)
        directory = path if is_dir else os.path.dirname(path) or "/"
        return self._subst(directory)


def _minimal(entries: Iterable[str], variables: dict[str, str]) -> list[str]:
    """Drop entries that another entry of the list already covers."""

    def expand(text: str) -> str:
        for k, v in variables.items():
            text = text.replace("${" + k + "}", v)
        return text

    uniq = sorted(set(entries))
    out = []
    for e in uniq:
        ex = expand(e)
        if not any(o != e and under(ex, expand(o)) for o in uniq):
            out.append(e)
    return sorted(out, key=lambda t: (not t.startswith("/"), t))


def _net_entries(act: Activity) -> list[str]:
    """The net.allow entries of the run's connects: by the names the run looked up where its DNS
    answers gave the address, else by address."""
    names_of: dict[str, set[str]] = {}
    for name, addresses in act.resolved.items():
        for a in addresses:
            names_of.setdefault(a, set()).add(name)
    out: set[str] = set()
    for address, port in act.connects:
        names = names_of.get(canonical_address(address))
        if names:
            out.update(f"{n}:{port}" if port else n for n in names)
        else:
            out.add(_net_entry(address, port))
    return sorted(out)


def _net_entry(address: str, port: int | None) -> str:
    addr = ipaddress.ip_address(address.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if addr.version == 4:
        return f"{addr}/32:{port}" if port else f"{addr}/32"
    return f"[{addr}]/128:{port}" if port else f"{addr}/128"


class RecordedEnv(TypedDict, total=False):
    """The `env` section of a recorded policy (the manifest's policy, policy/model.py's summary)."""

    strip_secrets: bool
    strip_exec_influence: bool
    allow: list[str]
    strip: list[str]


def render_policy(
    fs: dict[str, list[str]],
    net_allow: list[str],
    env: RecordedEnv,
    header: list[str],
    commands: list[str] | None = None,
) -> str:
    lines = [f"# {h}" for h in header]
    lines.append("version: 1")
    lines.append("fs:")
    for name in ("read", "write", "exec", "deny"):
        items = fs.get(name, [])
        if not items:
            lines.append(f"  {name}: []")
            continue
        lines.append(f"  {name}:")
        lines.extend(f"    - {json.dumps(i)}" for i in items)
    lines.append("net:")
    lines.append("  default: deny")
    if net_allow:
        lines.append("  allow:")
        lines.extend(f"    - {json.dumps(a)}" for a in net_allow)
    else:
        lines.append("  allow: []")
    lines.append("  deny: []")
    lines.append("env:")
    lines.append(f"  strip_secrets: {'true' if env.get('strip_secrets', True) else 'false'}")
    lines.append(f"  strip_exec_influence: {'true' if env.get('strip_exec_influence') else 'false'}")
    lines.append(f"  allow: {json.dumps(list(env.get('allow', [])))}")
    if env.get("strip"):
        lines.append(f"  strip: {json.dumps(list(env['strip']))}")
    lines.extend(commands or [])
    return "\n".join(lines) + "\n"


def build_profile(
    manifest: ManifestJSON,
    events: Iterable[EventJSON],
    *,
    workspace: str | None = None,
    tmpdir: str | None = None,
    home: str | None = None,
) -> tuple[str, Policy]:
    """(policy YAML text, the loaded policy) allowing what the run recorded in a bundle did."""
    recorded = manifest.get("policy") or {}
    rvars = recorded.get("variables") or {}
    variables = {
        "WORKSPACE": canonical_path(
            workspace or rvars.get("WORKSPACE") or manifest.get("cwd") or os.getcwd()
        ),
        "TMPDIR": canonical_path(tmpdir or rvars.get("TMPDIR") or "/nonexistent-tmpdir"),
        "HOME": canonical_path(home or rvars.get("HOME") or os.path.expanduser("~")),
    }
    execs = ExecsSeen()
    act = collect(execs.watch(events))
    if not act.read and not act.write and not act.exec:
        logger.warning("the bundle has no file or exec events: the profile allows no file access")
    gen = _Generaliser(variables)
    read = {gen.entry(p, d, "read") for p, d in act.read}
    write = {gen.entry(p, d, "write") for p, d in act.write}
    exe = {gen.entry(p, False, "exec") for p in act.exec}
    if act.exec:
        exe |= {"/lib", "/lib64"}
    net_allow = _net_entries(act)
    fs = {
        "write": _minimal(write, variables),
        "exec": _minimal(exe, variables),
    }
    # write and exec imply read: list only what they do not cover
    covered = [e for e in fs["write"] + fs["exec"]]
    fs["read"] = [r for r in _minimal(read, variables) if r not in covered]
    deny = list(SECRET_DENY)
    default_env: RecordedEnv = {"strip_secrets": True, "strip_exec_influence": False, "allow": []}
    env: RecordedEnv = recorded.get("env") or default_env
    # the command is the job's own text: escaped, so that a newline in it cannot add lines to the policy
    command = printable(" ".join(manifest.get("command", [])))
    header = [
        f"Generated by `evidence profile` from run {manifest.get('run_id', '?')}: {command}"[:200],
        "It allows what that run did; an identical run under it is not blocked. See docs/policy-format.md.",
    ]
    if act.other_ns:
        left_out = (
            f"{act.other_ns} file and exec events of processes in another mount namespace (mntns: other) "
            "are not allowed here: their paths name files in that namespace, not these"
        )
        header[1] = "It allows what that run did in its own mount namespace. See docs/policy-format.md."
        header.append(left_out)
        logger.warning("%s (an identical run may be blocked there)", left_out)
    if act.unplaced:
        left_out = (
            f"{len(act.unplaced)} names with '..' after a component that may be a symlink "
            f"(e.g. {printable(min(act.unplaced))}) are not allowed here: where they led is not known"
        )
        header.append(left_out)
        logger.warning("%s (an identical run may be blocked there)", left_out)
    for _ in range(len(deny) + 1):
        fs["deny"] = deny
        text = render_policy(fs, net_allow, env, header, render_commands(execs))
        # host names resolve to what the run's own lookups answered: the check is of the run as recorded
        policy = parse_policy(text, name="profile.yaml", variables=variables, resolve=_recorded(act))
        blocking = _blocking_denies(policy, act)
        if unallowed_programs(policy.commands, execs):  # pragma: no cover - a rule for each program
            raise AssertionError(f"profile does not allow {unallowed_programs(policy.commands, execs)}")
        if not blocking:
            return text, policy
        deny = [d for i, d in enumerate(deny) if i not in blocking]
    raise AssertionError("profile: could not build a policy that allows the run")  # pragma: no cover


def _recorded(act: Activity) -> Callable[[str], list[str]]:
    def resolve(host: str) -> list[str]:
        return sorted(act.resolved.get(host.rstrip(".").lower(), ()))

    return resolve


def _blocking_denies(policy: Policy, act: Activity) -> set[int]:
    """Indexes of deny entries that refuse something the run did (the run touched a secret path)."""
    out: set[int] = set()
    for path, access in act.accesses():
        d = policy.check_file(path, access)
        if d is not None and d.rule.startswith("fs.deny["):
            out.add(int(d.rule[len("fs.deny[") : d.rule.index("]")]))
        elif d is not None:
            raise AssertionError(f"profile does not allow {access} {path}: {d.rule}")  # pragma: no cover
    for addr, port in act.connects:
        d = policy.check_connect("AF_INET6" if ":" in addr else "AF_INET", addr, port)
        if d is not None:  # pragma: no cover - every connect has its own allow entry
            raise AssertionError(f"profile does not allow connect {addr}:{port}: {d.rule}")
    return out
