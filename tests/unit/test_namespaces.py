"""Namespace, mount, chroot and ptrace calls: decoding (saved kernel records), correlation (flag
names, paths, mntns "other", ptrace targets), the writer's summary keys, lint's EV010-EV012 and show."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import orjson
import pytest

from evidence.agent.recorder import decode as d
from evidence.agent.recorder.calls import namespace_flags
from evidence.agent.recorder.correlate import Correlator
from evidence.cli import main
from tests.unit.conftest_bundles import change, members, namespace, open_, records, write

RAW = json.loads((Path(__file__).parent.parent / "data" / "raw_records.json").read_text())


def ev(kind: str, tgid: int = 10, ts: int = 1, flags: int = 0, **kw: Any) -> dict[str, Any]:
    ids = {
        "dino": 0,
        "dino2": 0,
        "rino": 0,
        "kname": None,
        "nlink": 0,
    }  # what descriptors named (decode.py): not read
    return {"kind": kind, "ts": ts, "run": 1, "tgid": tgid, "tid": tgid, "flags": flags, **ids, **kw}


def ns(
    op: str, ns_flags: int = 0, ret: int = 0, path: str | None = None, path2: str | None = None, **kw: Any
) -> dict[str, Any]:
    base = dict(
        ret=ret, op=op, ns_flags=ns_flags, target=0, dfd=-100, dfd2=-100, fstype=None, path=path, path2=path2
    )
    return ev("namespace", **{**base, **kw})


def test_saved_kernel_records_hold_the_namespace_calls_and_the_mark() -> None:
    decoded = [r["decoded"] for r in RAW]
    calls = {r["op"]: r for r in decoded if r["kind"] == "namespace"}
    assert calls["unshare"]["ns_flags"] == 0x20000 and calls["unshare"]["ret"] == 0
    assert calls["mount"]["path"] == "none" and calls["mount"]["path2"] == "/"
    assert calls["ptrace"]["target"] == 0x3FFFFFFF and calls["ptrace"]["ret"] == -3  # ESRCH
    assert calls["process_vm_writev"]["target"] == 0x3FFFFFFF
    # the unshare's own record is not marked (filled at entry); every later record of it is, but
    # its exit (the mark is cleared as the process goes)
    assert not calls["unshare"]["flags"] & d.F_OTHER_NS
    after = decoded[decoded.index(calls["unshare"]) + 1 :]
    mine = [r for r in after if r["tgid"] == calls["unshare"]["tgid"] and r["kind"] != "exit"]
    assert mine and all(r["flags"] & d.F_OTHER_NS for r in mine)
    before = decoded[: decoded.index(calls["unshare"])]
    assert not any(r["flags"] & d.F_OTHER_NS for r in before)
    hostname = [r for r in after if r["kind"] == "open" and r["path"] == "/etc/hostname"]
    assert hostname and hostname[0]["exe_tok"] == 0 == hostname[0]["tok"]  # never aggregated


def test_a_namespace_record_decodes_with_its_paths_and_type() -> None:
    buf = b"/src\0/etc/hostname\0"
    raw = (
        d.HDR.pack(5, 7, 1, 2, 2, d.EV_NS, d.F_OTHER_NS)
        + struct.pack("<qQQiiQQ16sHHH2x", 0, 0x1000, 0, -100, -100, 0, 0, b"none", 4, 5, 14)
        + buf
    )
    out = d.decode(raw)
    assert out["op"] == "mount" and out["ns_flags"] == 0x1000 and out["fstype"] == "none"
    assert out["path"] == "/src" and out["path2"] == "/etc/hostname" and out["flags"] & d.F_OTHER_NS


@pytest.mark.parametrize(
    ("op", "flags", "names"),
    [
        ("unshare", 0x10020000, ["CLONE_NEWNS", "CLONE_NEWUSER"]),
        ("clone", 0x40000000, ["CLONE_NEWNET"]),
        ("clone", 0x80 | 0x20000000, ["CLONE_NEWTIME", "CLONE_NEWPID"]),  # clone3's
        ("mount", 0x1000 | 0x4000, ["MS_BIND", "MS_REC"]),
        ("ptrace", 0x4206, ["PTRACE_SEIZE"]),
        ("setns", 0, []),
        ("mount", 0x1000 | 0x800000, ["MS_BIND", "0x800000"]),
    ],
)
def test_flag_names(op: str, flags: int, names: list[str]) -> None:
    assert namespace_flags(op, flags) == names


def test_correlation_names_paths_marks_and_ptrace_targets() -> None:
    c = Correlator(0)
    c.add_root(10, 1, "/ws")
    c.tgid_of = lambda tid: {555: 10}.get(tid)  # 555: a thread of the run's process 10
    other = d.F_OTHER_NS
    out = []
    for e in (
        ns("unshare", 0x10020000),
        ns("mount", 0x1000, path="x", path2="/etc/hostname", fstype="none", flags=other),
        ns("mount", 0x4000 | 0x40000, path="none", path2="/", flags=other),
        ev(
            "open",
            ret=3,
            exe_tok=0,
            tok=0,
            dfd=-100,
            oflags=0,
            mode=0,
            sc=0,
            path="/etc/hostname",
            flags=other,
        ),
        ev("open", ret=3, exe_tok=0, tok=0, dfd=-100, oflags=0, mode=0, sc=0, path="/etc/passwd"),
        ns("ptrace", 16, ret=-1, target=999),
        ns("ptrace", 16, target=555),
        ns("process_vm_writev", target=10),
    ):
        out += c.feed(e)
    u, bind, private, marked, plain, outside, thread, own = out
    assert u["k"] == "namespace" and u["flags"] == ["CLONE_NEWNS", "CLONE_NEWUSER"] and "mntns" not in u
    assert (
        bind["paths"] == ["/ws/x", "/etc/hostname"] and bind["fstype"] == "none" and bind["mntns"] == "other"
    )
    assert private["paths"] == ["none", "/"]  # a name, not a path: not resolved
    assert marked["path"] == "/etc/hostname" and marked["mntns"] == "other" and "mntns" not in plain
    assert outside["target_pid"] == 999 and outside["target_in_run"] is False and outside["result"] == "EPERM"
    assert thread["target_in_run"] is True and own["target_in_run"] is True


def _lint(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict[str, Any]]:
    code = main(["lint", "--format", "json", *extra, str(path)])
    return code, orjson.loads(capsys.readouterr().out)


def test_lint_warns_on_a_bind_mount_and_on_events_in_another_namespace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recs = [
        *records(),
        namespace(9100, "unshare", ["CLONE_NEWNS", "CLONE_NEWUSER"]),
        namespace(
            9200, "mount", ["MS_BIND"], ["/tmp/x", "/etc/hostname"], exe="/usr/bin/mount", mntns="other"
        ),
        {**open_(9300, "/etc/hostname", ["read"], exe="/usr/bin/cat"), "mntns": "other"},
    ]
    code, doc = _lint(write(tmp_path / "a.tar.gz", recs), capsys, "--fail-on", "warn")
    assert code == 1
    msgs = [f["message"] for f in doc["findings"] if f["rule"] == "EV010"]
    assert any("/usr/bin/unshare (pid 101) did unshare CLONE_NEWNS,CLONE_NEWUSER" in m for m in msgs)
    assert any("mount MS_BIND /tmp/x /etc/hostname" in m for m in msgs)
    assert any("file.open events in another mount namespace (first: /etc/hostname)" in m for m in msgs)
    assert all(f["severity"] == "warning" for f in doc["findings"] if f["rule"] == "EV010")


@pytest.mark.parametrize(
    "rec",
    [
        namespace(9100, "unshare", ["CLONE_NEWNET"]),  # no new mount or user namespace
        namespace(9100, "unshare", ["CLONE_NEWNS"], result="EPERM"),  # failed: nothing changed
        namespace(9100, "ptrace", ["PTRACE_ATTACH"], target_pid=101, target_in_run=True),
    ],
)
def test_lint_stays_quiet(rec: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = _lint(write(tmp_path / "a.tar.gz", [*records(), rec]), capsys, "--fail-on", "warn")
    assert doc["findings"] == [] and code == 0


@pytest.mark.parametrize(("result", "rule", "code"), [(0, "EV011", 1), ("EPERM", "EV012", 0)])
def test_lint_on_ptrace_outside_the_run(
    result: Any, rule: str, code: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = namespace(
        9100,
        "ptrace",
        ["PTRACE_ATTACH"],
        exe="/usr/bin/gdb",
        target_pid=4242,
        target_in_run=False,
        result=result,
    )
    got, doc = _lint(write(tmp_path / "a.tar.gz", [*records(), rec]), capsys)
    assert got == code and [f["rule"] for f in doc["findings"]] == [rule]
    assert (
        "/usr/bin/gdb (pid 101)" in doc["findings"][0]["message"]
        and "pid 4242" in doc["findings"][0]["message"]
    )


def test_summary_keeps_another_namespace_apart(tmp_path: Path) -> None:
    recs = [
        *records(),
        open_(9100, "/etc/hostname", ["read"]),
        {**open_(9200, "/etc/hostname", ["read"]), "mntns": "other"},
        change(9300, "unlink", "/home/ci/work/a"),
        {**change(9400, "unlink", "/home/ci/work/a"), "mntns": "other"},
    ]
    _, lines = members(write(tmp_path / "a.tar.gz", recs))
    evs = [orjson.loads(x) for x in lines]
    host = [e["data"] for e in evs if e["subject"] == "/etc/hostname"]
    assert sorted(h.get("mntns", "run") for h in host) == ["other", "run"]
    assert all(h["count"] == 1 for h in host)
    unlinks = [
        e["data"] for e in evs if e["type"].endswith("file.change") and e["subject"] == "/home/ci/work/a"
    ]
    assert len(unlinks) == 2


def test_show_lists_namespace_calls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recs = [
        *records(),
        namespace(9100, "mount", ["MS_BIND"], ["/tmp/x", "/etc/hostname"], exe="/usr/bin/mount"),
        namespace(9200, "ptrace", ["PTRACE_ATTACH"], target_pid=4242, target_in_run=False, result="EPERM"),
    ]
    path = write(tmp_path / "a.tar.gz", recs)
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Namespaces, mounts and ptrace (2):" in out
    assert "/usr/bin/mount (pid 101): mount MS_BIND /tmp/x /etc/hostname (0)" in out
    assert "ptrace PTRACE_ATTACH pid 4242 (outside the run) (EPERM)" in out


@pytest.mark.parametrize("form", ["markdown", "html"])
def test_markdown_and_html_list_namespace_calls(
    form: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = namespace(9100, "mount", ["MS_BIND"], ["/tmp/x", "/etc/hostname"], exe="/usr/bin/mount")
    path = write(tmp_path / "a.tar.gz", [*records(), rec])
    assert main(["show", "--format", form, str(path)]) == 0
    out = capsys.readouterr().out
    assert "Namespaces, mounts and ptrace" in out and "mount MS_BIND /tmp/x /etc/hostname" in out


def test_a_target_in_the_run_cgroup_never_seen_is_in_the_run() -> None:
    c = Correlator(0)
    c.add_root(10, 1, "/")
    c.cgroup_mount, c.run_cgroup = "/sys/fs/cgroup", "/sys/fs/cgroup/evidence/run1"
    c.cgroup_of = {77: "/evidence/run1/inner", 78: "/evidence/run10", 79: "/user.slice"}.get
    got = {pid: c.feed(ns("ptrace", 16, target=pid))[0]["target_in_run"] for pid in (77, 78, 79, 80)}
    assert got == {77: True, 78: False, 79: False, 80: False}
    (vm,) = c.feed(ns("process_vm_writev", ret=0, target=79))
    assert vm["written"] == 0 and vm["result"] == 0


def test_a_memory_write_of_nothing_is_not_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = namespace(9100, "process_vm_writev", [], target_pid=4242, target_in_run=False, written=0)
    code, doc = _lint(write(tmp_path / "a.tar.gz", [*records(), rec]), capsys)
    assert code == 0 and [f["rule"] for f in doc["findings"]] == ["EV012"]
    rec = {**rec, "written": 8}
    code, doc = _lint(write(tmp_path / "b.tar.gz", [*records(), rec]), capsys)
    assert code == 1 and [f["rule"] for f in doc["findings"]] == ["EV011"]


def test_an_exec_in_another_namespace_is_hashed_through_its_root() -> None:
    asked: list[tuple[int, str]] = []

    def hash_of(pid: int, path: str, ident: Any = None) -> dict[str, Any]:
        asked.append((pid, path))
        return {"sha256": "0" * 64, "size": 1, "hash_source": "path"}

    c = Correlator(0, hash_of=hash_of)
    c.add_root(10, 1, "/")
    ok = dict(dfd=0, at_flags=0, old_tid=0, argc=1, argv=["true"], filename="/usr/bin/true")
    c.feed(ev("exec_ok", **ok))
    c.feed(ev("exec_ok", flags=d.F_OTHER_NS, **ok))
    assert asked == [(10, "/usr/bin/true"), (10, "/proc/10/root/usr/bin/true")]
