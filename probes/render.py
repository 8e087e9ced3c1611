"""Render the probes' BPF C: pure functions from a config to C text (no BCC, no root).

The .bpf.c files are package data with UPPERCASE tokens; `render` (record.bpf.c) and `render_guard`
(connect_guard.bpf.c, tokens written `__NAME__`) replace each one and fail if any is left unfilled,
so a typo can never reach the compiler as an undefined macro. record.bpf.c lists the files it is
made of (`#include "bpf/..."` lines, joined here in that order) and the generated header of the
kernel/user ABI (`#include "abi.h"`: probes/abi.py's render_header, their one definition).
"""

from __future__ import annotations

import dataclasses
import re
from importlib import resources

from evidence.probes import abi

_TOKENS = (
    "ARGS_BYTES",
    "MAX_ARGS",
    "MAX_RUNS",
    "CGROUP_DEPTH",
    "RINGBUF_PAGES",
    "WAKEUP_EVERY",
    "INFLIGHT_MAX",
    "INFLIGHT_RUN",
    "AGG_MAX",
    "TASK_PID_OFF",
    "TASK_TGID_OFF",
    "TASK_EXIT_CODE_OFF",
    "TASK_MM_OFF",
    "MM_ARG_START_OFF",
    "MM_ARG_END_OFF",
    "MM_EXE_FILE_OFF",
    "FILE_INODE_OFF",
    "TASK_FILES_OFF",
    "FILES_FDT_OFF",
    "FDT_MAX_FDS_OFF",
    "FDT_FD_OFF",
    "TASK_CGROUPS_OFF",
    "CSS_SET_DFL_CGRP_OFF",
    "CGROUP_KN_OFF",
    "KERNFS_NODE_ID_OFF",
    "TASK_FS_OFF",
    "FS_PWD_OFF",
    "PATH_DENTRY_OFF",
    "DENTRY_INODE_OFF",
    "FILE_PATH_OFF",
    "PATH_MNT_OFF",
    "FS_ROOT_OFF",
    "DENTRY_PARENT_OFF",
    "DENTRY_NAME_OFF",
    "QSTR_LEN_OFF",
    "QSTR_NAME_OFF",
    "VFSMOUNT_ROOT_OFF",
    "MOUNT_MNT_OFF",
    "MOUNT_PARENT_OFF",
    "MOUNT_MOUNTPOINT_OFF",
    "INODE_NLINK_OFF",
    "INODE_MODE_OFF",
    "INODE_INO_OFF",
    "INODE_SB_OFF",
    "INODE_SIZE_OFF",
    "SB_DEV_OFF",
    "INODE_CTIME_SEC_OFF",
    "INODE_CTIME_NSEC_OFF",
    "FILE_PRIVATE_DATA_OFF",
    "SOCKET_SK_OFF",
    "SOCK_COOKIE_OFF",
)


_TOKEN_SET = frozenset(_TOKENS)
_WORD = re.compile(r"\b[A-Z][A-Z0-9_]*\b")


class RenderError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
    offsets: dict[str, int]  # from probes.btf.probe_offsets()
    args_bytes: int = 8192  # argv bytes captured per exec (power of two, <= 8192)
    max_args: int = 128  # arguments read per failed exec attempt
    max_runs: int = 1024  # concurrent run slots (slot 0 means "not tracked")
    cgroup_depth: int = 32  # cgroup levels searched for a tracked ancestor
    ringbuf_pages: int = 16384  # 64 MiB with 4 KiB pages (power of two): a 300k-open burst fits
    wakeup_every: int = 64  # records per CPU between consumer wakeups
    inflight_max: int = 16384  # threads with a call between enter and exit (allocated on demand)
    inflight_per_run: int = 4096  # ... of them held by one run: past it, the run's own calls are lost
    agg_max: int = 262144  # aggregation keys of all runs (allocated on demand; past it: one record each)
    have_group_dead: bool = True  # sched_process_exit has group_dead (6.16+)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def template(name: str = "record.bpf.c") -> str:
    return resources.files("evidence.probes").joinpath(name).read_text()


# parts record.bpf.c includes that are made here, not read from a file
GENERATED = {"abi.h": abi.render_header}
_INCLUDE = re.compile(r'^#include "([^"]+)"\n', re.MULTILINE)


def join_parts(root: str) -> str:
    """record.bpf.c's `#include "..."` lines replaced by the files they name (package data, in the
    order the root lists them, each once): BCC compiles one text, not a tree of files."""
    seen: set[str] = set()

    def part(m: re.Match[str]) -> str:
        name = m.group(1)
        if name in seen:
            raise RenderError(f"{name} is included twice")
        seen.add(name)
        if name in GENERATED:
            return GENERATED[name]().rstrip("\n") + "\n\n"
        try:
            text = template(name)
        except OSError as e:
            raise RenderError(f"no part {name} beside record.bpf.c") from e
        if _INCLUDE.search(text):
            raise RenderError(f"{name} includes another part: only record.bpf.c lists them")
        return text.rstrip("\n") + "\n\n"

    return _INCLUDE.sub(part, root)


def render(config: ProbeConfig, source: str | None = None) -> str:
    if not _power_of_two(config.args_bytes) or config.args_bytes > 8192:
        raise RenderError("args_bytes must be a power of two <= 8192")
    if not _power_of_two(config.ringbuf_pages):
        raise RenderError("ringbuf_pages must be a power of two")
    if not 0 < config.inflight_per_run <= config.inflight_max:
        raise RenderError("inflight_per_run must be in 1..inflight_max")
    values = {
        "ARGS_BYTES": config.args_bytes,
        "MAX_ARGS": config.max_args,
        "MAX_RUNS": config.max_runs,
        "CGROUP_DEPTH": config.cgroup_depth,
        "RINGBUF_PAGES": config.ringbuf_pages,
        "WAKEUP_EVERY": config.wakeup_every,
        "INFLIGHT_MAX": config.inflight_max,
        "INFLIGHT_RUN": config.inflight_per_run,
        "AGG_MAX": config.agg_max,
        **config.offsets,
    }
    missing = [t for t in _TOKENS if t not in values]
    if missing:
        raise RenderError(f"no value for {', '.join(missing)}")
    text = join_parts(source if source is not None else template())

    def fill(m: re.Match[str]) -> str:
        word = m.group(0)
        return str(int(values[word])) if word in _TOKEN_SET else word

    # one pass over the C's upper-case words (every token is one, and each has a value: none is left)
    text = _WORD.sub(fill, text)
    defines = []
    if config.have_group_dead:
        defines.append("#define HAVE_GROUP_DEAD 1")
    return "\n".join(defines) + "\n" + text


# --- connect_guard.bpf.c ----------------------------------------------------------------------------

GUARD_TEMPLATE = "connect_guard.bpf.c"
GUARD_TOKENS = (
    "__MAX_ENTRIES__",
    "__DEFAULT_ALLOW__",
    "__DRY_RUN__",
    "__V4_CAPACITY__",
    "__V6_CAPACITY__",
    "__RINGBUF_PAGES__",
)
_GUARD_TOKEN_RE = re.compile(r"__[A-Z][A-Z0-9_]*__")


@dataclasses.dataclass(frozen=True)
class GuardConfig:
    default_allow: bool
    dry_run: bool
    max_entries: int = 16  # rules that can apply to one prefix (after covering rules are copied in)
    v4_capacity: int = 1024
    v6_capacity: int = 1024
    ringbuf_pages: int = 64  # a power of two

    def __post_init__(self) -> None:
        if self.ringbuf_pages <= 0 or self.ringbuf_pages & (self.ringbuf_pages - 1):
            raise ValueError("ringbuf_pages must be a power of two")
        if not 1 <= self.max_entries <= 64:
            raise ValueError("max_entries must be between 1 and 64")


def render_guard(config: GuardConfig, text: str | None = None) -> str:
    """connect_guard's C for a configuration; fails if a token is left unfilled."""
    text = template(GUARD_TEMPLATE) if text is None else text
    values = {
        "__MAX_ENTRIES__": str(config.max_entries),
        "__DEFAULT_ALLOW__": "1" if config.default_allow else "0",
        "__DRY_RUN__": "1" if config.dry_run else "0",
        "__V4_CAPACITY__": str(max(1, config.v4_capacity)),
        "__V6_CAPACITY__": str(max(1, config.v6_capacity)),
        "__RINGBUF_PAGES__": str(config.ringbuf_pages),
    }
    for token, value in values.items():
        text = text.replace(token, value)
    left = sorted(set(_GUARD_TOKEN_RE.findall(text)))
    if left:
        raise ValueError(f"connect_guard.bpf.c: tokens left unfilled: {', '.join(left)}")
    return text
