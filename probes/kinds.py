"""The kinds of the probes' records and loss counts, defined once: record.bpf.c gets them as
`#define`s (render.py writes them in place of its RECORD_KINDS line), the decoder and the loader
name them from here. Pure: no BCC, no root."""

from __future__ import annotations

from typing import NamedTuple

EV_EXEC = 1  # an exec attempt, with its argv
EV_EXEC_OK = 2  # an exec that succeeded (sched_process_exec)
EV_FORK = 3
EV_EXIT = 4
EV_OPEN = 5
EV_CONNECT = 6
EV_CHDIR = 7
EV_FCHDIR = 8
EV_DUP = 9
EV_RET = 10  # an exec's result: the only result that is a record of its own
K_OPEN_PAST_CAP = 11  # lost[] only: past the run's cap on distinct summary keys (counted, not kept)
K_CONNECT_PAST_CAP = 12
K_AGG_MAP_FULL = 13  # lost[] only, not loss: recorded one by one because the aggregation map was full
EV_CHANGE = 14
EV_NS = 15
EV_DNS = 16
EV_SIGSYS = 17  # a system call the run's seccomp filter refused: a 32-bit entry (SIGSYS)
EV_KINDS = 18  # one past the last kind: each run slot's row in `lost`


class Kind(NamedTuple):
    macro: str  # its name in record.bpf.c
    value: int
    name: str  # a record's "kind" (decode.py), a loss count's key (loader.py)
    comment: str = ""  # after its #define
    before: tuple[str, ...] = ()  # comment lines before its #define


KINDS = (
    Kind("EV_EXEC", EV_EXEC, "exec"),
    Kind("EV_EXEC_OK", EV_EXEC_OK, "exec_ok"),
    Kind("EV_FORK", EV_FORK, "fork"),
    Kind("EV_EXIT", EV_EXIT, "exit"),
    Kind("EV_OPEN", EV_OPEN, "open"),
    Kind("EV_CONNECT", EV_CONNECT, "connect"),
    Kind("EV_CHDIR", EV_CHDIR, "chdir"),
    Kind("EV_FCHDIR", EV_FCHDIR, "fchdir"),
    Kind("EV_DUP", EV_DUP, "dup"),
    Kind("EV_RET", EV_RET, "ret"),
    Kind(
        "K_OPEN_PAST_CAP",
        K_OPEN_PAST_CAP,
        "open_past_cap",
        before=(
            "lost[] kinds that are not records: what a run did past its cap on distinct summary keys (not",
            "kept, counted), and operations recorded one by one because the aggregation map was full",
        ),
    ),
    Kind("K_CONNECT_PAST_CAP", K_CONNECT_PAST_CAP, "connect_past_cap"),
    Kind("K_AGG_MAP_FULL", K_AGG_MAP_FULL, "agg_map_full"),
    Kind(
        "EV_CHANGE",
        EV_CHANGE,
        "change",
        "a file change that is not an open: rename, unlink, link, chmod, ... (op)",
    ),
    Kind(
        "EV_NS",
        EV_NS,
        "namespace",
        "a namespace, mount, chroot or ptrace call (op; see ---- namespaces and mounts)",
    ),
    Kind("EV_DNS", EV_DNS, "dns", "a DNS message sent or received (see ---- dns)"),
    Kind("EV_SIGSYS", EV_SIGSYS, "sigsys", "a 32-bit system call refused (see ---- refused system calls)"),
)
# kinds that only count (lost[]), never a record in the ring buffer
COUNT_ONLY = frozenset((K_OPEN_PAST_CAP, K_CONNECT_PAST_CAP, K_AGG_MAP_FULL))
# a record's kind -> its name (decode.py)
RECORD_NAMES = {k.value: k.name for k in KINDS if k.value not in COUNT_ONLY}
# a kind's number -> its name in loss counts (loader.py: index 0 is no kind)
LOSS_NAMES = ["none", *(k.name for k in sorted(KINDS, key=lambda k: k.value))]


def c_defines() -> str:
    """The kinds as record.bpf.c's #define lines (render.py puts them in place of RECORD_KINDS)."""
    lines = []
    for k in KINDS:
        lines += [f"// {c}" for c in k.before]
        lines.append(f"#define {k.macro} {k.value}" + (f"  // {k.comment}" if k.comment else ""))
    lines.append(f"#define EV_KINDS {EV_KINDS}")
    return "\n".join(lines)
