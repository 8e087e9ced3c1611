"""Landlock enforcement of the file part of a policy.

Three steps: `abi_version()` asks the kernel which Landlock ABI it offers; `plan(policy, abi)` turns
the policy into Landlock path rules, the costs of expressing deny-inside-allow, and the degradations
that truly cannot be expressed (it reads the file system but changes nothing); the plan is applied
in the process that becomes the command, before it execs (`apply(plan)`, or `evidence run`'s
launcher with `plan.rule_pairs()`), by policy/landlock_syscalls.py: it only opens the planned paths
with O_PATH, adds the rules and calls landlock_restrict_self.

Landlock can only allow. A deny inside an allowed tree (deny ~/.ssh inside allow ~) is expressed by
allowing, instead of the tree, every entry along the denied path except the denied one ("sibling
expansion"). What that costs is stated in `LandlockPlan.costs`: the intermediate directories
themselves get no access (they cannot be listed; nothing can be created, renamed or removed
directly in them), and entries added to them after the start are not covered.
"""

from __future__ import annotations

import dataclasses
import glob as _glob
import logging
import os
import stat
from typing import TypedDict

from evidence.policy.landlock_syscalls import SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL, abi_version, restrict
from evidence.policy.model import FsPolicy, PathRule, Policy
from evidence.policy.paths import under

__all__ = [
    "SCOPE_ABSTRACT_UNIX_SOCKET",
    "SCOPE_SIGNAL",
    "LandlockPlan",
    "LandlockRule",
    "abi_version",
    "apply",
    "plan",
]

logger = logging.getLogger(__name__)


# File system access rights (include/uapi/linux/landlock.h).
EXECUTE = 1 << 0
WRITE_FILE = 1 << 1
READ_FILE = 1 << 2
READ_DIR = 1 << 3
REMOVE_DIR = 1 << 4
REMOVE_FILE = 1 << 5
MAKE_CHAR = 1 << 6
MAKE_DIR = 1 << 7
MAKE_REG = 1 << 8
MAKE_SOCK = 1 << 9
MAKE_FIFO = 1 << 10
MAKE_BLOCK = 1 << 11
MAKE_SYM = 1 << 12
REFER = 1 << 13  # ABI 2
TRUNCATE = 1 << 14  # ABI 3
IOCTL_DEV = 1 << 15  # ABI 5

RIGHT_NAMES = {
    EXECUTE: "execute",
    WRITE_FILE: "write_file",
    READ_FILE: "read_file",
    READ_DIR: "read_dir",
    REMOVE_DIR: "remove_dir",
    REMOVE_FILE: "remove_file",
    MAKE_CHAR: "make_char",
    MAKE_DIR: "make_dir",
    MAKE_REG: "make_reg",
    MAKE_SOCK: "make_sock",
    MAKE_FIFO: "make_fifo",
    MAKE_BLOCK: "make_block",
    MAKE_SYM: "make_sym",
    REFER: "refer",
    TRUNCATE: "truncate",
    IOCTL_DEV: "ioctl_dev",
}

# Rights that make sense on a file that is not a directory (others make landlock_add_rule fail).
FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV


def handled_fs(abi: int) -> int:
    """Every file-system right the ABI knows: all of them are handled, so anything not granted is denied."""
    if abi <= 0:
        return 0
    rights = (1 << 13) - 1  # ABI 1: EXECUTE .. MAKE_SYM
    if abi >= 2:
        rights |= REFER
    if abi >= 3:
        rights |= TRUNCATE
    if abi >= 5:
        rights |= IOCTL_DEV
    return rights


def scopes(abi: int) -> int:
    return SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0


def group_rights(group: str, abi: int) -> int:
    """Rights granted by each allow list. write and exec imply read. Device nodes cannot be made."""
    read = READ_FILE | READ_DIR | IOCTL_DEV
    if group == "read":
        rights = read
    elif group == "exec":
        rights = read | EXECUTE
    elif group == "write":
        rights = (
            (
                read
                | WRITE_FILE
                | REMOVE_DIR
                | REMOVE_FILE
                | MAKE_DIR
                | MAKE_REG
                | MAKE_SOCK
                | MAKE_FIFO
                | MAKE_SYM
            )
            | REFER
            | TRUNCATE
        )
    else:
        raise ValueError(f"unknown group {group!r}")
    return rights & handled_fs(abi)


def rights_names(rights: int) -> list[str]:
    return [name for bit, name in sorted(RIGHT_NAMES.items()) if rights & bit]


# ---------------------------------------------------------------------------------------------------
# The planner (pure: reads the file system, changes nothing)


@dataclasses.dataclass(frozen=True)
class LandlockRule:
    path: str
    access: int
    groups: tuple[str, ...]  # the policy lists the rule comes from (read, write, exec)
    is_dir: bool


class LandlockSummary(TypedDict):
    """What the manifest's policy says of Landlock (`policy.landlock`; docs/bundle-format.md)."""

    abi: int
    enforced: bool
    handled_fs: list[str]
    scoped: list[str]  # abstract_unix_socket, signal
    rules: int
    expanded_directories: list[str]
    costs: list[str]
    degradations: list[dict[str, str]]  # {"component", "reason", "impact"}


@dataclasses.dataclass(frozen=True)
class LandlockPlan:
    abi: int
    handled_fs: int
    scoped: int
    rules: tuple[LandlockRule, ...]
    costs: tuple[str, ...]
    degradations: tuple[dict[str, str], ...]  # {"component", "reason", "impact"} like bundle Degradation
    intermediates: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # dir -> groups

    @property
    def enforced(self) -> bool:
        return self.abi > 0 and self.handled_fs != 0

    def rule_pairs(self) -> list[tuple[str, int]]:
        """(path, rights) for each rule: what the launcher needs to apply the plan."""
        return [(r.path, r.access) for r in self.rules]

    def summary(self) -> LandlockSummary:
        """JSON-able summary for the bundle manifest."""
        return {
            "abi": self.abi,
            "enforced": self.enforced,
            "handled_fs": rights_names(self.handled_fs),
            "scoped": [
                n
                for b, n in ((SCOPE_ABSTRACT_UNIX_SOCKET, "abstract_unix_socket"), (SCOPE_SIGNAL, "signal"))
                if self.scoped & b
            ],
            "rules": len(self.rules),
            "expanded_directories": sorted(self.intermediates),
            "costs": list(self.costs),
            "degradations": [dict(d) for d in self.degradations],
        }

    def explain(self, path: str, access: str) -> str | None:
        """Why Landlock may refuse an access the policy allows: the cost of a sibling expansion."""
        path = os.path.normpath(path)
        parent = os.path.dirname(path)
        if (
            access in ("write", "create")
            and parent in self.intermediates
            and "write" in self.intermediates[parent]
        ):
            return f"landlock: {parent} is expanded entry by entry (a denied path lies beneath it): no new entries in it"
        if path in self.intermediates:
            return f"landlock: {path} is expanded entry by entry (a denied path lies beneath it): it cannot be listed"
        if parent in self.intermediates:
            return f"landlock: {parent} is expanded entry by entry: entries added after the start are not covered"
        return None


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


HARDLINK_SCAN_LIMIT = 10000  # entries looked at per denied tree


def _hard_linked(root: str, costs: list[str]) -> list[tuple[str, int]]:
    """Regular files in a denied path (a file or a tree) that have more than one link."""
    st = _lstat(root)
    if st is None:
        return []
    if stat.S_ISREG(st.st_mode):
        return [(root, st.st_nlink)] if st.st_nlink > 1 else []
    if not stat.S_ISDIR(st.st_mode):
        return []
    found: list[tuple[str, int]] = []
    seen = 0
    for dirpath, dirnames, filenames in os.walk(root, onerror=lambda e: None):
        for name in filenames:
            seen += 1
            fst = _lstat(os.path.join(dirpath, name))
            if fst is not None and stat.S_ISREG(fst.st_mode) and fst.st_nlink > 1:
                found.append((os.path.join(dirpath, name), fst.st_nlink))
        seen += len(dirnames)
        if seen > HARDLINK_SCAN_LIMIT:
            costs.append(
                f"{root}: more than {HARDLINK_SCAN_LIMIT} entries; not all were checked for hard links"
            )
            break
    return found


def _expand(rules: tuple[PathRule, ...]) -> tuple[list[str], list[PathRule]]:
    """Literal paths for a list: globs expanded to their current matches. Returns (paths, globs)."""
    out: list[str] = []
    globs: list[PathRule] = []
    for r in rules:
        if r.glob:
            globs.append(r)
            out.extend(os.path.realpath(m) for m in sorted(_glob.glob(r.path, recursive=True)))
        else:
            out.append(r.path)
    return out, globs


def plan(policy: Policy | FsPolicy | None, abi: int) -> LandlockPlan:
    """Turn the fs part of a policy into Landlock rules for the given ABI."""
    fs = policy.fs if isinstance(policy, Policy) else policy
    degradations: list[dict[str, str]] = []
    costs: list[str] = []
    if fs is None:
        return LandlockPlan(abi, 0, 0, (), (), ())
    if abi <= 0:
        degradations.append(
            {
                "component": "landlock",
                "reason": "Landlock is not available on this kernel",
                "impact": "the fs rules of the policy are not enforced (denials can only be reported)",
            }
        )
        return LandlockPlan(abi, 0, 0, (), (), tuple(degradations))

    denies, deny_globs = _expand(fs.deny)
    deny_set = set(denies)
    write_roots, _ = _expand(fs.write)

    for g in deny_globs:
        head = g.path.split("*")[0].split("?")[0].split("[")[0].rsplit("/", 1)[0] or "/"
        if any(under(w, head) or under(head, w) for w in write_roots):
            degradations.append(
                {
                    "component": "landlock",
                    "reason": f"fs.deny glob {g.text!r} lies in a writable tree",
                    "impact": "only the files that match it at start are denied; files created later that match stay reachable",
                }
            )
        else:
            costs.append(
                f"fs.deny glob {g.text!r}: the files that match it at start are denied (nothing can create new ones)"
            )
    for d in denies:
        for path, nlink in _hard_linked(d, costs):
            degradations.append(
                {
                    "component": "landlock",
                    "reason": f"denied file {path} has {nlink} hard links",
                    "impact": "Landlock rules are by path: its other links stay reachable where they are allowed",
                }
            )
    if abi < 3 and fs.write:
        degradations.append(
            {
                "component": "landlock",
                "reason": f"Landlock ABI {abi} cannot control truncate (needs ABI 3)",
                "impact": "files outside fs.write can be truncated with truncate(2)",
            }
        )
    if abi < 2:
        costs.append(f"Landlock ABI {abi}: renaming or linking files across directories is always refused")
    if abi < 5:
        costs.append(f"Landlock ABI {abi}: ioctl on device files is not controlled (needs ABI 5)")

    grants: dict[str, int] = {}
    groups_of: dict[str, set[str]] = {}
    intermediates: dict[str, set[str]] = {}
    expanded_because: dict[str, set[str]] = {}
    missing: set[str] = set()

    def emit(path: str, group: str) -> None:
        grants[path] = grants.get(path, 0) | group_rights(group, abi)
        groups_of.setdefault(path, set()).add(group)

    def grant(path: str, group: str, depth: int = 0) -> None:
        inner = [d for d in denies if d != path and under(d, path)]
        st = _lstat(path)
        if st is None:
            missing.add(path)
            return
        if not inner or not stat.S_ISDIR(st.st_mode) or depth > 64:
            emit(path, group)
            return
        intermediates.setdefault(path, set()).add(group)
        expanded_because.setdefault(path, set()).update(inner)
        try:
            names = sorted(os.listdir(path))
        except OSError as e:
            costs.append(f"{path}: cannot be listed ({e.strerror}): its entries get no access")
            return
        for name in names:
            child = os.path.join(path, name)
            if child in deny_set:
                continue
            cst = _lstat(child)
            if cst is None:
                continue
            if stat.S_ISLNK(cst.st_mode):
                # Opening through a symlink is decided by its target's rules; a rule on the link
                # itself would grant nothing (and must not grant the target).
                continue
            if any(under(d, child) for d in inner):
                grant(child, group, depth + 1)
            else:
                emit(child, group)

    for group in ("read", "write", "exec"):
        roots, _ = _expand(getattr(fs, group))
        for root in roots:
            if root in deny_set:
                continue  # the same path denied and allowed: deny wins
            grant(root, group)

    for path, groups in sorted(intermediates.items()):
        beneath = ", ".join(sorted(os.path.relpath(d, path) for d in expanded_because[path]))
        what = "cannot be listed"
        if "write" in groups:
            what += ", and nothing can be created, renamed or removed directly in it"
        costs.append(
            f"{path}: {'/'.join(sorted(groups))} granted entry by entry because {beneath} is denied beneath it: "
            f"{path} itself {what}; entries added to it after the start get no access"
        )
    if missing:
        costs.append("not granted because they do not exist at start: " + ", ".join(sorted(missing)))

    rules = []
    for path in sorted(grants):
        st = _lstat(path)
        is_dir = st is not None and stat.S_ISDIR(st.st_mode)
        access = grants[path] if is_dir else grants[path] & FILE_RIGHTS
        if access:
            rules.append(LandlockRule(path, access, tuple(sorted(groups_of[path])), is_dir))
    return LandlockPlan(
        abi=abi,
        handled_fs=handled_fs(abi),
        scoped=scopes(abi),
        rules=tuple(rules),
        costs=tuple(costs),
        degradations=tuple(degradations),
        intermediates={p: tuple(sorted(g)) for p, g in sorted(intermediates.items())},
    )


# ---------------------------------------------------------------------------------------------------
# The kernel side


def apply(plan: LandlockPlan) -> None:
    """Restrict the calling process (and everything it will exec) to the plan. Raises OSError.
    `evidence run` does this in its command launcher (agent/recorder/exec_helper.py), not here."""
    if plan.enforced:
        restrict(plan.abi, plan.handled_fs, plan.scoped, plan.rule_pairs(), FILE_RIGHTS)
