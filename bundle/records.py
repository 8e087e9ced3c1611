"""A recorder record and the event it becomes: one mapping, used by the bundle writer and by the
agent's live stream (agent/daemon/delivery.py), so that a live event and the bundle's event for the
same record never differ.

A record is a dict as the recorder spools it (bundle/spool.py): `k` its kind, `t` its time (ns),
for a summary record `n` and `tl` (how many occurrences it stands for, up to which time, counted by
the recorder's kernel), and the event's data fields. Its type, per kind: bundle/record_types.py.
"""

from __future__ import annotations

from typing import Any, Final, cast

from evidence.bundle import format as fmt
from evidence.bundle.record_types import SpoolRecord, SummaryRecord

# the event type of each record kind
KIND_TYPE = {
    "exec": fmt.PROCESS_EXEC,
    "exit": fmt.PROCESS_EXIT,
    "open": fmt.FILE_OPEN,
    "change": fmt.FILE_CHANGE,
    "connect": fmt.NETWORK_CONNECT,
    "denial": fmt.POLICY_DENIAL,
    "approval": fmt.POLICY_APPROVAL,
    "limit": fmt.POLICY_LIMIT,
    "violation": fmt.POLICY_VIOLATION,
    "audit": fmt.POLICY_AUDIT,
    "inventory": fmt.INVENTORY,
    "degradation": fmt.DEGRADATION,
    "dns": fmt.NETWORK_DNS,
    "namespace": fmt.PROCESS_NAMESPACE,
}

# Kinds aggregated in summary mode, with the fields that make a record distinct: one event per key,
# with its count and first and last times.
SUMMARY_KEYS: dict[str, tuple[str, ...]] = {
    "open": ("exe", "path", "access", "result", "nlink", "cgroup", "container", "mntns"),
    "change": (
        "exe", "operation", "path", "target", "mode", "uid", "gid", "result", "nlink", "cgroup", "container",
        "mntns",
    ),
    "connect": ("exe", "family", "address", "port", "result", "cgroup", "container", "mntns"),
    "denial": ("exe", "operation", "target", "rule", "enforced", "result"),
    "dns": (
        "exe", "server", "port", "name", "type", "result", "answers", "malformed", "cgroup", "container",
        "unsolicited", "source", "source_port", "configured_resolver",
    ),
}  # fmt: skip
# kinds whose events carry count, first_time and last_time (a denial carries its count only)
_COUNTED: Final = ("open", "change", "connect", "dns")  # a tuple: mypy narrows by it

Key = tuple[Any, ...]


def summary_key(rec: SpoolRecord) -> Key | None:
    """What makes a record distinct in summary mode; None for kinds that are not aggregated."""
    fields = SUMMARY_KEYS.get(rec["k"])
    if fields is None:
        return None
    # one call a record of the spool (a list comprehension: this is the writer's hottest line)
    return (rec["k"], *[tuple(v) if type(v) is list else v for v in map(rec.get, fields)])


def occurrences(rec: SummaryRecord) -> tuple[int, int, int]:
    """(count, first time, last time) that one record stands for."""
    t = rec["t"]
    return rec.get("n", 1), t, rec.get("tl", t)


def subject(rec: SpoolRecord) -> str:
    # each test of `k` narrows the record's type (mypy cannot narrow through a local copy of it);
    # the most frequent kinds first
    if rec["k"] == "open" or rec["k"] == "change":
        return str(rec["path"])
    if rec["k"] == "exec":
        return str(rec["filename"])
    if rec["k"] == "exit" or rec["k"] == "inventory":
        return str(rec.get("exe") or f"pid:{rec['pid']}")
    if rec["k"] == "connect":
        if rec["family"] == "AF_INET6":
            return f"[{rec['address']}]:{rec['port']}"
        if rec.get("port") is not None:
            return f"{rec['address']}:{rec['port']}"
        return str(rec["address"])
    if rec["k"] == "denial":
        return str(rec["target"])
    if rec["k"] == "degradation":
        return str(rec["component"])
    if rec["k"] in ("approval", "audit"):
        return str(rec["program"])
    if rec["k"] == "limit":
        return f"limits.{rec['limit']}"
    if rec["k"] == "violation":
        return str(rec["exe"] or "?")
    if rec["k"] == "dns":
        return str(rec["name"] if rec.get("name") is not None else rec["server"])
    if rec["k"] == "namespace":
        if rec.get("target_pid") is not None and rec["operation"] != "clone":
            return f"{rec['operation']} pid:{rec['target_pid']}"
        return " ".join((rec["operation"], *rec["paths"]))
    raise ValueError(f"unknown record kind {rec['k']!r}")


def data(rec: SpoolRecord, totals: tuple[int, int, int] | list[int] | None = None) -> dict[str, Any]:
    """The event's data (JSON values, as bundle/format.py's data models describe them). `totals`:
    (count, first, last) over every record of the record's summary key; without it, what this one
    record stands for (a live event shows a record alone)."""
    out = cast("dict[str, Any]", rec.copy())  # a copy less four keys: far cheaper than a comprehension
    del out["k"], out["t"]
    if "n" in out:
        del out["n"]
    if "tl" in out:
        del out["tl"]
    if rec["k"] in _COUNTED:  # narrows the record's type: occurrences() reads its count
        count, first, last = totals if totals else occurrences(rec)
        out["count"] = count
        out["first_time"] = fmt.format_time(first)
        out["last_time"] = out["first_time"] if last == first else fmt.format_time(last)
    elif rec["k"] == "denial" and totals:
        out["count"] = totals[0]
    return out


def to_event(
    rec: SpoolRecord, totals: tuple[int, int, int] | list[int] | None = None
) -> tuple[str, str, int, dict[str, Any]]:
    """(type, subject, time ns, data) of the event a record becomes."""
    return KIND_TYPE[rec["k"]], subject(rec), rec["t"], data(rec, totals)
