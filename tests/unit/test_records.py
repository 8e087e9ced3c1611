"""One mapping from a record to its event (bundle/records.py), used by the bundle writer and by the
agent's live stream: the same record gives the same type, subject and data in both."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from evidence.agent.daemon.delivery import live_event
from evidence.bundle import format as fmt
from evidence.bundle import records
from tests.unit.conftest_bundles import (
    T0,
    approval,
    change,
    connect,
    denial,
    exec_,
    members,
    open_,
    violation,
    write,
)


def _all_kinds() -> list[dict[str, Any]]:
    return [
        exec_(1000, 101, 100, "/usr/bin/make", ["make"], depth=0),
        open_(2000, "/w/Makefile", ["read"]),
        change(2500, "rename", "/w/a", target="/w/b"),
        connect(3000, "::1", 8443, family="AF_INET6"),
        connect(3100, "/run/x.sock", None, family="AF_UNIX"),
        denial(3500, "/etc/passwd"),
        approval(3600),
        approval(3700, "allowed", via="terminal", by_uid=1000, reason=None),
        violation(3800, "no_pin"),
        dict(k="inventory", t=T0 + 4000, pid=101, exe="/usr/bin/make", ppid=100, argv=["make"], cwd="/w"),
        dict(k="degradation", t=T0 + 4500, component="landlock", reason="not here", impact="no file rules"),
        dict(k="exit", t=T0 + 5000, pid=101, ppid=100, exe=None, exit_code=0),
    ]


def test_the_live_stream_and_the_bundle_give_a_record_the_same_event(tmp_path: Path) -> None:
    recs = _all_kinds()
    bundle = write(tmp_path / "full.tar.gz", recs, detail="full")
    _, lines = members(bundle)
    written = [orjson.loads(x) for x in lines]
    body = [e for e in written if e["type"] not in (fmt.RUN_STARTED, fmt.RUN_FINISHED)]
    assert len(body) == len(recs)
    for seq, (rec, event) in enumerate(zip(recs, body, strict=True)):
        live = live_event("sess-1", seq, rec)
        assert (live["type"], live["subject"], live["time"], live["data"]) == (
            event["type"],
            event["subject"],
            event["time"],
            event["data"],
        ), rec["k"]
    subjects = {e["type"]: e["subject"] for e in body}
    assert subjects[fmt.PROCESS_EXIT] == "pid:101"  # an exit without exe is named by its pid
    assert "[::1]:8443" in [e["subject"] for e in body] and "/run/x.sock" in [e["subject"] for e in body]


def test_a_summary_event_totals_every_record_of_its_key(tmp_path: Path) -> None:
    first = open_(2000, "/w/Makefile", ["read"])
    kernel_counted = {**open_(2500, "/w/Makefile", ["read"]), "n": 40, "tl": T0 + 9000}
    other = open_(2600, "/w/Makefile", ["read"], result="EACCES")  # another result: another key
    bundle = write(tmp_path / "s.tar.gz", [first, kernel_counted, other])
    _, lines = members(bundle)
    opens = [orjson.loads(x)["data"] for x in lines if orjson.loads(x)["type"] == fmt.FILE_OPEN]
    assert [(d["result"], d["count"]) for d in opens] == [(0, 41), ("EACCES", 1)]
    assert opens[0]["first_time"] == fmt.format_time(T0 + 2000)
    assert opens[0]["last_time"] == fmt.format_time(T0 + 9000)
    assert "n" not in opens[0] and "tl" not in opens[0]
    # alone (the live stream), a kernel-counted record says what it stands for
    assert records.data(kernel_counted)["count"] == 40
    assert records.summary_key(first) == records.summary_key(kernel_counted) != records.summary_key(other)
    assert records.summary_key(exec_(1, 1, 0, "/bin/x", ["x"])) is None


def test_every_record_kind_becomes_an_event_the_format_accepts() -> None:
    assert set(records.KIND_TYPE.values()) <= set(fmt.DATA_MODELS)
    assert set(records.SUMMARY_KEYS) <= set(records.KIND_TYPE)
    for rec in _all_kinds():
        etype, _, _, data = records.to_event(rec)
        fmt.DATA_MODELS[etype].model_validate(data)
