"""Correlation over decoded records: the process tree, cwd and dirfd resolution, results."""

from __future__ import annotations

import json
from pathlib import Path

from evidence.agent.recorder import decode as d
from evidence.agent.recorder.calls import NO_RESULT, decode_open_flags, split_status
from evidence.agent.recorder.correlate import Correlator

RAW = json.loads((Path(__file__).parent.parent / "data" / "raw_records.json").read_text())


def ev(kind: str, tgid: int = 10, tid: int | None = None, ts: int = 1, **kw):  # a decoded record
    # dino, dino2, rino: what a descriptor named (decode.py), 0 unless given: not read
    ids = {"dino": 0, "dino2": 0, "rino": 0, "kname": None, "nlink": 0}
    return {"kind": kind, "ts": ts, "run": 1, "tgid": tgid, "tid": tid or tgid, "flags": 0, **ids, **kw}


def ret(sc: int, value: int, tgid: int = 10, **kw):  # an exec's result record
    return ev("ret", tgid, sc=sc, ret=value, **kw)


def feed(c: Correlator, *evs):
    out = []
    for e in evs:
        out += c.feed(e)
    return out


SRV, ETC, TMP = 0xFFFF0001000, 0xFFFF0002000, 0xFFFF0003000  # what descriptors name (inodes' addresses)


def test_open_resolution_cwd_chdir_dirfd_dup_fchdir() -> None:
    c = Correlator(wall_offset_ns=1000)
    c.add_root(10, 1, "/home/u")
    out = feed(
        c,
        ev("open", path="a.txt", dfd=-100, oflags=0, mode=0, sc=0, ret=3),
        ev("chdir", path="../v", fd=-100, ret=0),
        ev("open", path="b.txt", dfd=-100, oflags=0, mode=0, sc=0, ret=-2),
        ev("open", path="/srv", dfd=-100, oflags=0o200000, mode=0, sc=0, ret=4, rino=SRV),
        ev("open", path="c/d", dfd=4, oflags=0o101, mode=0o600, sc=0, ret=5, dino=SRV, rino=0x2000),
        ev("dup", oldfd=4, newfd=9, ret=9, rino=SRV),
        ev("fchdir", fd=9, path=None, ret=0, dino=SRV),
        ev("open", path="e", dfd=-100, oflags=0, mode=0, sc=0, ret=6),
        ev("open", path="f", dfd=77, oflags=0, mode=0, sc=0, ret=-9),
    )
    assert [(o["path"], o["result"]) for o in out] == [
        ("/home/u/a.txt", 0),
        ("/home/v/b.txt", "ENOENT"),
        ("/srv", 0),
        ("/srv/c/d", 0),
        ("/srv/e", 0),
        ("<unknown fd 77>/f", "EBADF"),
    ]
    assert out[3]["access"] == ("write", "create") and out[3]["mode"] == 0o600 and out[3]["dirfd"] == 4
    assert out[0]["t"] == 1001


def test_a_descriptor_that_names_another_file_now_is_not_resolved_against() -> None:
    """fd 3 = /etc and fd 4 = /tmp are recorded; fd 4 then names /etc (put there unseen: F_DUPFD,
    SCM_RIGHTS, pidfd_getfd). Every record through it carries what it names now (ETC), so nothing
    resolves against /tmp: the path is unknown, and the stale entry is dropped."""
    c = Correlator(wall_offset_ns=0)
    c.add_root(10, 1, "/home/u")
    opened = feed(
        c,
        ev("open", path="/etc", dfd=-100, oflags=0o200000, mode=0, sc=0, ret=3, rino=ETC),
        ev("open", path="/tmp", dfd=-100, oflags=0o200000, mode=0, sc=0, ret=4, rino=TMP),
        ev("fork", child=11),
    )
    assert opened[-1]["path"] == "/tmp"
    assert c.procs[11].fds == {3: ("/etc", ETC), 4: ("/tmp", TMP)}  # copied at fork, identities too
    out = feed(
        c,
        ev("open", path="passwd", dfd=4, oflags=0, mode=0, sc=0, ret=5, dino=ETC, rino=0x9000),
        ev("open", path="hosts", dfd=4, oflags=0, mode=0, sc=0, ret=6, dino=TMP, rino=0x9100),  # dropped
        ev("open", path="group", dfd=3, oflags=0, mode=0, sc=0, ret=7, dino=ETC, rino=0x9200),  # still /etc
    )
    assert [o["path"] for o in out] == ["<unknown fd 4>/passwd", "<unknown fd 4>/hosts", "/etc/group"]
    # the same through the fast path (open_record), in the child that copied the table
    raw = b"shadow\0"
    (fast,) = c.open_record(5, 0, 11, 0, 5, 4, 0, 0, raw, ETC, 0x9300)
    assert fast["path"] == "<unknown fd 4>/shadow" and 4 not in c.procs[11].fds
    # fchdir, dup, a change, a failed execveat through such a descriptor (the child's fd 3 now: /tmp)
    c.procs[11].fds[3] = ("/etc", ETC)
    rest = feed(
        c,
        ev("dup", tgid=11, oldfd=3, newfd=8, ret=8, rino=TMP),  # fd 3 names /tmp now: 8 unknown
        ev("open", tgid=11, path="x", dfd=8, oflags=0, mode=0, sc=0, ret=-2, dino=TMP),
        ev("change", tgid=11, op="mkdir", path="d", dfd=3, dfd2=0, dino=TMP, dino2=0, path2=None)
        | {"ret": 0, "mode": 0o755, "uid": 0, "gid": 0, "at_flags": 0},
        ev("exec", tgid=11, filename="sh", argv=["sh"], dfd=3, dino=TMP, at_flags=0, old_tid=0, argc=1),
        ret(d.SC_EXEC, -2, tgid=11),
        ev("fchdir", tgid=10, fd=4, path=None, ret=0, dino=ETC),  # the parent's 4 was dropped above
        ev("open", tgid=10, path="motd", dfd=-100, oflags=0, mode=0, sc=0, ret=9),
    )
    assert [r.get("path", r.get("filename")) for r in rest] == [
        "<unknown fd 8>/x",
        "<unknown fd 3>/d",
        "<unknown fd 3>/sh",
        "<unknown cwd>/motd",
    ]
    c.procs[10].fds[4] = ("/tmp", TMP)
    feed(c, ev("fchdir", tgid=10, fd=4, path=None, ret=0, dino=ETC))
    assert c.procs[10].cwd is None and 4 not in c.procs[10].fds  # fchdir through a mismatch: unknown
    # an open the kernel counted (F_STATE) teaches the new identity of the same path
    c.open_record(6, 0, 10, d.F_STATE, 4, -100, 0o200000, 0, b"/tmp\0", 0, 0x7777)
    (again,) = c.open_record(7, 0, 10, 0, 5, 4, 0, 0, b"a\0", 0x7777, 0x9400)
    assert again["path"] == "/tmp/a"


def test_fork_exec_exit_tree_and_depth() -> None:
    c = Correlator(0)
    c.add_root(10, 1, "/w")
    out = feed(
        c,
        ev("fork", tgid=10, child=11),
        ev("exec", tgid=11, filename="./tool", argv=["./tool", "x"], dfd=-100, at_flags=0, old_tid=0, argc=2),
        ev(
            "exec_ok", tgid=11, filename="./tool", argv=["./tool", "x"], dfd=0, at_flags=0, old_tid=11, argc=0
        ),
        ret(d.SC_EXEC, 0, tgid=11),
        ev("fork", tgid=11, child=12),
        ev("exec", tgid=12, filename="/nope", argv=["/nope"], dfd=-100, at_flags=0, old_tid=0, argc=1),
        ret(d.SC_EXEC, -2, tgid=12),
        ev("exit", tgid=12, status=0x0009),
        ev("exit", tgid=11, status=3 << 8),
    )
    execs = [o for o in out if o["k"] == "exec"]
    assert execs[0] == {
        **execs[0],
        "pid": 11,
        "ppid": 10,
        "depth": 1,
        "filename": "/w/tool",
        "argv": ["./tool", "x"],
        "result": 0,
    }
    assert execs[1]["result"] == "ENOENT" and execs[1]["depth"] == 2 and execs[1]["ppid"] == 11
    exits = [o for o in out if o["k"] == "exit"]
    assert exits[0]["signal"] == "SIGKILL" and exits[0]["exit_code"] is None and exits[0]["exe"] == "/w/tool"
    assert exits[1]["exit_code"] == 3 and exits[1]["signal"] is None
    assert c.unpaired == 0


def test_a_path_unreadable_at_entry_and_exit_is_marked() -> None:
    """The kernel reads a path again at exit when its page was not resident at entry; a record that
    still has the fault flag has no path, and says so."""
    c = Correlator(0)
    c.add_root(10, 1, "/w")
    out = feed(
        c,
        ev("open", path="/etc/locale", dfd=-100, oflags=0, mode=0, sc=0, ret=3),
        {**ev("open", path="", dfd=-100, oflags=0, mode=0, sc=0, ret=4), "flags": d.F_FNAME_FAULT},
    )
    assert [o["path"] for o in out] == ["/etc/locale", "<unreadable path>"]


def test_a_failed_exec_whose_name_was_unreadable_is_not_named_after_the_cwd() -> None:
    """A failed exec's name is what the probe read at entry; not resident then (and no exec_ok to
    name it), it is <unreadable path>, not "" resolved against the cwd (found by the red team: the
    bundle said the job tried to execute its working directory)."""
    c = Correlator(0)
    c.add_root(10, 1, "/w")
    flags = d.F_FNAME_FAULT | d.F_ARGS_FAULT
    out = feed(
        c,
        {**ev("exec", filename="", argv=[], dfd=-100, at_flags=0, old_tid=0, argc=0), "flags": flags},
        ret(d.SC_EXEC, -14),
    )
    assert [(o["filename"], o["result"]) for o in out] == [("<unreadable path>", "EFAULT")]


def test_result_without_enter_is_counted() -> None:
    c = Correlator(0)
    assert c.feed(ret(d.SC_EXEC, -2)) == [] and c.unpaired == 0  # a failed exec's result, no attempt
    c.pending.clear()
    assert c.feed(ret(1, 3)) == []
    assert c.unpaired == 1


def test_captured_kernel_records_correlate() -> None:
    c = Correlator(0)
    first = RAW[0]["decoded"]
    c.add_root(first["tgid"], 1, "/work/main")
    out = []
    for r in RAW:
        out += c.feed(d.decode(bytes.fromhex(r["hex"])))
    paths = {o["path"] for o in out if o["k"] == "open"}
    assert {"/etc/hostname", "/etc/passwd", "/nonexistent/file"} <= paths
    conns = {(o["family"], o["address"]) for o in out if o["k"] == "connect"}
    assert ("AF_INET6", "::ffff:127.0.0.1") in conns and ("AF_UNIX", "/nonexistent.sock") in conns
    # the query and its answer: one record; the answer to the second query from a port of the
    # script's own: unsolicited, with where it came from
    dns, forged = [o for o in out if o["k"] == "dns"]
    assert (dns["name"], dns["type"], dns["result"], dns["addresses"]) == (
        "example.org",
        "A",
        "NOERROR",
        ["192.0.2.7"],
    )
    assert dns["server"] == "127.3.5.3" and dns["answers"] == ["example.org A 192.0.2.7"]
    assert (dns["source"], dns["source_port"]) == ("127.3.5.3", 53) and "unsolicited" not in dns
    assert forged["unsolicited"] == "other source" and forged["addresses"] == ["127.0.0.77"]
    assert forged["source"] == "127.3.5.3" and forged["source_port"] not in (None, 53)


def test_flags_and_access_classes() -> None:
    assert decode_open_flags(0) == (("O_RDONLY",), ("read",))
    names, access = decode_open_flags(0o2 | 0o100 | 0o2000000)
    assert names == ("O_RDWR", "O_CREAT", "O_CLOEXEC") and access == ("read", "write", "create")
    assert decode_open_flags(0o1000)[1] == ("read", "write")  # O_RDONLY|O_TRUNC truncates
    assert decode_open_flags(0o10000000)[1] == ()  # O_PATH reads nothing
    assert "O_TMPFILE" in decode_open_flags(0o20200002)[0]
    assert split_status(0x8B00) == (0x8B, None) and split_status(15) == (None, "SIGTERM")


def test_what_a_job_could_hide_behind_is_named() -> None:
    """fchdir to a directory never seen opened leaves the cwd unknown (not the old one); an exec of
    /dev/fd/N keeps that name (lint flags it); opening another cgroup's cgroup.procs for writing (a
    way out of the recording) is a degradation."""
    c = Correlator(0)
    c.cgroup_mount, c.run_cgroup = "/sys/fs/cgroup", "/sys/fs/cgroup/evidence/s1"
    c.add_root(10, 1, "/w")
    out = feed(
        c,
        ev("fchdir", fd=7, path=None, ret=0),
        ev("open", path="secret.txt", dfd=-100, oflags=0, mode=0, sc=0, ret=3),
        ev("open", path="/usr/bin", dfd=-100, oflags=0o200000, mode=0, sc=0, ret=5),
        ev(
            "exec_ok",
            tgid=10,
            filename="/dev/fd/5/id",
            argv=["make", "all"],
            dfd=0,
            at_flags=0,
            old_tid=10,
            argc=0,
        ),
        ev(
            "open",
            path="/sys/fs/cgroup/evidence/s1/sub/cgroup.procs",
            dfd=-100,
            oflags=0o1,
            mode=0,
            sc=0,
            ret=6,
        ),
        ev("open", path="/sys/fs/cgroup/cgroup.procs", dfd=-100, oflags=0o1, mode=0, sc=0, ret=7),
    )
    opens = [o["path"] for o in out if o["k"] == "open"]
    assert opens[0] == "<unknown cwd>/secret.txt"
    (exe,) = [o for o in out if o["k"] == "exec"]
    # close is not traced, so fd 5 may name something else by now (a memfd): kept as the kernel says
    assert exe["filename"] == "/dev/fd/5/id" and exe["argv"] == ["make", "all"]
    (deg,) = [o for o in out if o["k"] == "degradation"]
    assert deg["component"] == "cgroup" and "/sys/fs/cgroup/cgroup.procs" in deg["reason"]


def test_a_way_out_from_a_nested_cgroup_is_a_degradation_the_bundle_accepts() -> None:
    """A process in a cgroup below the run's (a container) that opens another cgroup's cgroup.procs
    for writing: its open names its cgroup and container, the degradation (about the run) does not,
    so the bundle's data check accepts it."""
    from evidence.bundle import format as fmt
    from evidence.bundle.records import to_event

    c = Correlator(0, cgroup_name=lambda cgid: None if cgid == 1 else "sub/docker-" + "ab" * 32 + ".scope")
    c.cgroup_mount, c.run_cgroup = "/sys/fs/cgroup", "/sys/fs/cgroup/evidence/s1"
    c.container_of = lambda name: "ab" * 32
    c.add_root(10, 1, "/w")
    out = feed(
        c, ev("open", path="/sys/fs/cgroup/cgroup.procs", dfd=-100, oflags=0o1, mode=0, sc=0, ret=7, cgid=5)
    )
    (op,) = [o for o in out if o["k"] == "open"]
    (deg,) = [o for o in out if o["k"] == "degradation"]
    assert op["cgroup"].startswith("sub/docker-") and op["container"] == "ab" * 32
    assert "cgroup" not in deg and "container" not in deg
    etype, _, _, data = to_event(deg)
    fmt.DATA_MODELS[etype].model_validate(data)  # what lint's data check applies


def test_a_call_whose_result_never_came_is_recorded_not_dropped() -> None:
    """An exec whose result the ring buffer lost (the thread's next exec arrives first), an exec
    still in progress when the run ends, and a connect the kernel still had in flight (it comes
    with the result NO_RESULT): all are recorded, with the result NO_RESULT."""
    c = Correlator(0)
    c.add_root(10, 1, "/w")
    out = feed(
        c,
        ev("exec", filename="/bin/a", argv=["a"], dfd=-100, at_flags=0, old_tid=0, argc=1),
        # its result was lost: the next exec of the same thread comes
        ev("exec", filename="/bin/b", argv=["b"], dfd=-100, at_flags=0, old_tid=0, argc=1),
        ret(d.SC_EXEC, -2),
        ev("exec", filename="/bin/c", argv=["c"], dfd=-100, at_flags=0, old_tid=0, argc=1),
        ev("connect", family="AF_INET", address="127.0.0.1", port=80, fd=3, ret=NO_RESULT),
    )
    out += c.flush()
    assert [(o["k"], o.get("filename") or o.get("address"), o["result"]) for o in out] == [
        ("exec", "/bin/a", "NO_RESULT"),
        ("exec", "/bin/b", "ENOENT"),
        ("connect", "127.0.0.1", "NO_RESULT"),
        ("exec", "/bin/c", "NO_RESULT"),
    ]
    assert c.flush() == [] and c.pending == {}


def test_a_cwd_changed_unseen_is_named_by_its_identity() -> None:
    """A relative name carries the cwd the kernel read when the call began (dino): the process's
    cwd is used only while it is that directory. A directory a chdir of the run entered is named by
    that path (clone(CLONE_FS): the other process's chdir; a chdir landing while an open is in
    flight); one never entered is unknown, not the process's last cwd."""
    home, shared, other = 0xFFFF0010000, 0xFFFF0020000, 0xFFFF0030000
    c = Correlator(wall_offset_ns=0)
    c.add_root(10, 1, "/home/u")
    opn = {"dfd": -100, "oflags": 0, "mode": 0, "sc": 0, "ret": 3}
    out = feed(
        c,
        ev("open", path="a", dino=home, **opn),  # the first relative name ties /home/u to `home`
        ev("fork", child=11),
        ev("chdir", tgid=11, path="/srv", fd=-100, ret=0, rino=shared),  # CLONE_FS: moves 10 too
        ev("open", path="b", dino=shared, **opn),  # 10, in /srv now without a chdir of its own
        ev("open", path="c", dino=home, **opn),  # an open that began before a chdir landed
        ev("open", path="d", dino=other, **opn),  # a directory no chdir of the run entered
        ev("open", path="e", tgid=11, dino=shared, **opn),
        ev("chdir", tgid=11, path="x", fd=-100, ret=0, dino=shared, rino=other),
        ev("open", path="f", tgid=11, dino=other, **opn),
    )
    assert [o["path"] for o in out] == [
        "/home/u/a",
        "/srv/b",
        "/home/u/c",
        "<unknown cwd>/d",
        "/srv/e",
        "/srv/x/f",
    ]
    assert c.procs[10].cwd == "/home/u" and c.procs[11].cwd == "/srv/x"


def test_openat2_resolve_in_root_names_are_below_their_dirfd() -> None:
    """openat2 with RESOLVE_IN_ROOT: an absolute name, and `..`, stay below the dirfd."""
    c = Correlator(wall_offset_ns=0)
    c.add_root(10, 1, "/home/u")
    etc = 0xFFFF0040000
    opn = {"oflags": 0, "mode": 0, "sc": 1, "ret": 4}
    out = feed(
        c,
        ev("open", path="/etc", dfd=-100, oflags=0o200000, mode=0, sc=0, ret=3, rino=etc),
        ev("open", path="/passwd", dfd=3, dino=etc, flags=d.F_IN_ROOT, **opn),
        ev("open", path="../../group", dfd=3, dino=etc, flags=d.F_IN_ROOT, **opn),
        ev("open", path="/x", dfd=-100, flags=d.F_IN_ROOT, **opn),
        ev("open", path="/passwd", dfd=3, dino=etc, **opn),
    )
    assert [o["path"] for o in out] == ["/etc", "/etc/passwd", "/etc/group", "/home/u/x", "/passwd"]


def test_a_relative_unix_socket_path_names_a_file_in_the_cwd() -> None:
    c = Correlator(wall_offset_ns=0)
    c.add_root(10, 1, "/srv/a")
    a, b = 0xFFFF0050000, 0xFFFF0060000
    conn = {"fd": 3, "family": "AF_UNIX", "port": None, "ret": 0}
    out = feed(
        c,
        ev("connect", address="sock", dino=a, **conn),
        ev("chdir", path="../b", fd=-100, ret=0, dino=a, rino=b),
        ev("connect", address="sock", dino=b, **conn),
        ev("connect", address="/run/x.sock", **conn),
        ev("connect", address="@abstract", **conn),
    )
    assert [o["address"] for o in out] == ["/srv/a/sock", "/srv/b/sock", "/run/x.sock", "@abstract"]


def test_an_open_through_proc_self_fd_names_the_file_the_descriptor_names() -> None:
    """/proc/self/fd/N (thread-self, the own pid, /dev/fd/N) opens what N names: its table entry's
    path when the descriptor returned is that very file (rino), else the name as given."""
    c = Correlator(wall_offset_ns=0)
    c.add_root(10, 1, "/home/u")
    f, g = 0xFFFF0070000, 0xFFFF0080000
    opn = {"dfd": -100, "mode": 0, "sc": 0}
    out = feed(
        c,
        ev("open", path="/srv/victim", oflags=0o10000000, ret=3, rino=f, **opn),  # O_PATH
        ev("open", path="/proc/self/fd/3", oflags=1, ret=4, rino=f, **opn),
        ev("open", path="/dev/fd/3", oflags=0, ret=5, rino=f, **opn),
        ev("open", path="/proc/10/fd/3", oflags=0, ret=6, rino=f, **opn),
        ev("open", path="/proc/11/fd/3", oflags=0, ret=7, rino=f, **opn),  # another process's
        ev("open", path="/proc/self/fd/3", oflags=0, ret=8, rino=g, **opn),  # not that file
        ev("open", path="/proc/thread-self/fd/9", oflags=0, ret=-9, **opn),
    )
    assert [o["path"] for o in out] == [
        "/srv/victim",
        "/srv/victim",
        "/srv/victim",
        "/srv/victim",
        "/proc/11/fd/3",
        "/proc/self/fd/3",
        "/proc/thread-self/fd/9",
    ]
    assert [o["raw_path"] for o in out][1] == "/proc/self/fd/3"


def test_normal_and_join_keep_a_dotdot_after_a_component() -> None:
    """A '..' after a component may follow a symlink: kept. One at the root is the root, and a
    relative name's leading ones go up a base that is the kernel's name (no symlink in it)."""
    from evidence.agent.recorder.names import join, normal

    assert normal("/tmp/l/../passwd") == "/tmp/l/../passwd"
    assert normal("/../etc/./passwd") == "/etc/passwd"
    assert normal("//etc//passwd") == "/etc/passwd"
    assert normal("/a/..") == "/a/.."
    assert join("/etc/ssh", "../group", real=True) == "/etc/group"
    assert join("/etc/ssh", "./../../x/../y", real=True) == "/x/../y"
    assert join("/etc/ssh", "../group", real=False) == "/etc/ssh/../group"
    assert join("/", "../x", real=True) == "/x"
    assert join("/etc", "..", real=True) == "/"


def test_an_open_is_named_by_the_kernel_when_it_says_and_a_cwd_by_its_kernel_name() -> None:
    """F_KNAME: the kernel's name of the file opened (of the new cwd), given for a successful open
    that is a record (even one whose name could not be read), which is then named by it. Without
    it (a failed open), a '..' after a component stays. A chdir the kernel did not name keeps its
    name, whose leading '..' then stay too."""
    c = Correlator(wall_offset_ns=0)
    c.add_root(10, 1, "/home/u")
    opn = {"dfd": -100, "mode": 0, "sc": 0, "oflags": 0}
    kn = d.F_KNAME
    out = feed(
        c,
        ev("open", path="/tmp/l/../passwd", ret=3, flags=kn, kname="/etc/passwd", **opn),
        ev("open", path="/tmp/l/../passwd", ret=4, flags=kn, kname="/srv/passwd", **opn),
        ev("open", path="l/../x", ret=-2, **opn),
        ev("open", path="a..b", ret=5, flags=kn, kname="/elsewhere/a..b", **opn),
        ev("open", path="", ret=6, flags=kn | d.F_FNAME_FAULT, kname="/etc/shadow", **opn),
        ev("chdir", path="/tmp/l", fd=-100, ret=0, flags=kn, kname="/etc/ssh"),
        ev("open", path="../group", ret=7, flags=kn, kname="/etc/group", **opn),
        ev("open", path="../missing", ret=-2, **opn),
        ev("chdir", path="/var/run", fd=-100, ret=0),  # not named by the kernel: as given
        ev("open", path="../missing", ret=-2, **opn),
    )
    assert [o["path"] for o in out] == [
        "/etc/passwd",
        "/srv/passwd",
        "/home/u/l/../x",
        "/elsewhere/a..b",
        "/etc/shadow",
        "/etc/group",
        "/etc/missing",
        "/var/run/../missing",
    ]
    assert out[4]["raw_path"] == "<unreadable path>"
    # the fast path (open_record, from the record's bytes) names them the same
    c2 = Correlator(wall_offset_ns=0)
    c2.add_root(10, 1, "/home/u")
    (a,) = c2.open_record(1, 0, 10, kn, 3, -100, 0, 0, b"/tmp/l/../passwd\0", 0, 0, kname=b"/etc/passwd\0")
    (b,) = c2.open_record(2, 0, 10, kn, 3, -100, 0, 0, b"/tmp/l/../passwd\0", 0, 0, kname=b"/srv/passwd\0")
    (e,) = c2.open_record(3, 0, 10, 0, -2, -100, 0, 0, b"/tmp/l/../nope\0", 0, 0)
    assert [a["path"], b["path"], e["path"]] == ["/etc/passwd", "/srv/passwd", "/tmp/l/../nope"]


def test_names_from_their_directory_are_resolves_names() -> None:
    """Correlator._in_dir (absolute names through their directory's cached names) gives what
    Names.resolve gives the whole name, for any bytes: '.', '..', '//', magic links, bad UTF-8."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from evidence.agent.recorder import decode as dec
    from evidence.agent.recorder.correlate import Correlator, Proc

    parts = st.sampled_from(
        [b"", b".", b"..", b"a", b"proc", b"self", b"fd", b"3", b"dev", b"\xe4\xb8", b"\xad", b"x y", b"\\"]
    )
    proc = Proc(pid=1, ppid=0, depth=0, exe=None, cwd="/")

    @settings(max_examples=400, deadline=None)
    @given(st.lists(parts, min_size=1, max_size=6))
    def check(comps: list[bytes]) -> None:
        corr = Correlator(0)
        raw = b"/" + b"/".join(comps) + b"\0"
        for _ in range(2):  # the directory's names made, then taken from the cache
            got = corr._in_dir(raw)
            if got is not None:
                as_given = dec.cstr(raw)
                assert got == (as_given, corr.names.resolve(proc, as_given))

    check()
