"""Correlation: decoded probe records -> spool records, per run. Pure: no BCC, no root.

It keeps the process tree (pid, ppid, depth from the run's root process, exe), each process's cwd and
a table of its file descriptors (from successful opens, dup and chdir), so that relative paths are
resolved against the cwd or the dirfd they were opened through. Opens, connects, chdir, fchdir and
dup come as one record with their result (paired in the kernel); an exec's attempt waits in `pending`
for its result record (or its success, exec_ok) from the same thread. What a call's record says
from its own fields (results, flags, file changes, namespace calls) is agent/recorder/calls.py; DNS
queries and answers agent/recorder/dns.py; names resolved through the tables agent/recorder/names.py.

(Over 600 lines on purpose: the process table, with each process's cwd, descriptors and namespace
marks, is what every record kind is resolved against; what a call's own fields say is calls.py's.)
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import posixpath
import signal
from collections.abc import Callable
from typing import Any, Final, cast

from evidence.agent.recorder import decode as d
from evidence.agent.recorder.calls import (
    NO_RESULT,
    change_record,
    decode_open_flags,
    namespace_record,
    result_of,
    split_status,
)
from evidence.agent.recorder.dns import Resolutions
from evidence.agent.recorder.names import AT_FDCWD, MAGIC, UNREADABLE, Names, normal
from evidence.bundle.format import COMPAT_RULE, EXEC_CHECK_RULE
from evidence.bundle.record_types import (
    ChangeRecord,
    ConnectRecord,
    DegradationRecord,
    DenialRecord,
    DnsRecord,
    ExecRecord,
    ExitRecord,
    NamespaceRecord,
    OpenRecord,
    Result,
    ViolationRecord,
)
from evidence.bundle.sink import compiled

logger = logging.getLogger(__name__)


# What the correlator makes (bundle/record_types.py): every kind of spool record but the inventory
# (inventory.py); its only denials are the 32-bit system calls the run's seccomp filter refused (a
# policy's are enforce.py's)
Correlated = (
    ExecRecord
    | ExitRecord
    | OpenRecord
    | ChangeRecord
    | ConnectRecord
    | DnsRecord
    | NamespaceRecord
    | DegradationRecord
    | DenialRecord
    | ViolationRecord
)

_MNTNS_KINDS: Final = ("open", "change", "exec", "connect", "namespace")  # a tuple, as _PAIRED
_PATH_CACHE = 4096  # entries in each of open_record's caches (emptied when full)
# an open named by any of these is not a plain one (open_record's C path does not take it)
_NOT_PLAIN: Final = d.F_FNAME_FAULT | d.F_KNAME | d.F_STATE | d.F_IN_ROOT | d.F_OTHER_NS

_fast = compiled()  # the C hot path: open_plain


@dataclasses.dataclass
class Proc:
    pid: int
    ppid: int
    depth: int
    exe: str | None
    cwd: str | None
    # the directory `cwd` names (its inode's identity, the kernel's cwd_inode), 0 until known: a
    # relative name is resolved against `cwd` only while the kernel says the cwd is that directory
    cwd_ino: int = 0
    # `cwd` is the kernel's name of it (a chdir's F_KNAME, os.getcwd, /proc/<pid>/cwd): no symlink
    # in it, so a relative name's leading '..' are its real ancestors (join)
    cwd_real: bool = True
    # descriptor -> (the path it was opened as, what it named: its inode's identity, decode.py's
    # rino); an entry is used only while the descriptor still names that inode (_fd_path)
    fds: dict[int, tuple[str, int]] = dataclasses.field(default_factory=dict)


# Looks a live process up in /proc (injected so correlation stays pure): (ppid, cwd, exe) or None.
ProcLookup = Callable[[int], tuple[int, str | None, str | None] | None]


# record kinds that carry their own result (paired in the kernel); a tuple, not a set: mypy narrows
# a record's type by `in` it
_PAIRED: Final = ("open", "change", "connect", "chdir", "fchdir", "dup", "namespace")


class Correlator:
    def __init__(
        self,
        wall_offset_ns: int,
        proc_lookup: ProcLookup | None = None,
        cgroup_name: Callable[[int], str | None] | None = None,
        abi_of: Callable[[int, str], str | None] | None = None,
        # exe_hash.Hasher: the program's hash fields, or an exe_hash.Pending
        hash_of: Callable[[int, str, Any], object] | None = None,
    ) -> None:
        self.hash_of = hash_of
        # (pid, filename) -> "ia32" for a 32-bit x86 program: the kernel's syscall tracepoints do
        # not fire for its system calls, so its exec is flagged as a degradation
        self.abi_of = abi_of
        self.wall_offset_ns = wall_offset_ns
        # cgroup id -> the name a record carries ("cgroup"), None for the run's own cgroup
        self.cgroup_name = cgroup_name
        # that name -> a container id (runc/containerd/CRI-O/docker scope names), or None
        self.container_of: Callable[[str], str | None] | None = None
        # the cgroup2 mount and the run's cgroup (absolute paths): opening cgroup.procs outside the
        # run's cgroup for writing is flagged (a way out of the recording)
        self.cgroup_mount: str | None = None
        self.run_cgroup: str | None = None
        self.procs: dict[int, Proc] = {}
        self.pending: dict[int, d.ExecEvent] = {}  # a thread's exec attempt, until its result
        self.proc_lookup = proc_lookup
        self.unpaired = 0  # result records whose enter record was lost
        self._exited: dict[int, str | None] = {}  # pid -> exe of recently exited processes
        self.dns = Resolutions()  # ---- dns: the run's DNS queries and the names of addresses
        # a thread id -> its process id (from /proc, injected), to tell whether a ptrace or
        # process_vm_writev target is a process of the run
        self.tgid_of: Callable[[int], int | None] | None = None
        # a pid -> its cgroup2 path (as /proc/<pid>/cgroup says, from the cgroup2 mount), injected
        self.cgroup_of: Callable[[int], str | None] | None = None
        # open_record's caches: a path's bytes (and base) -> (raw path, resolved path); cgroup id ->
        # (cgroup name, container id)
        self._paths: dict[Any, tuple[str, str]] = {}
        self._cgroups: dict[int, tuple[str | None, str | None]] = {}
        # a directory's bytes -> (its name as given, resolved), each with a '/' after (_in_dir)
        self._dirs: dict[bytes, tuple[str, str]] = {}
        # (pid, path) of the writes to another cgroup's procs said already (of opens counted in the
        # kernel: the first of each key says it with its record)
        self._left: set[tuple[int, str]] = set()
        self.names = Names()  # how names are resolved (its table of directories chdirs entered)
        # open_record's plain opens in C when built (src/fast/_fast.c open_plain; the Python path
        # is the reference: tests/unit/test_fast.py), with its caches: oflags -> decode_open_flags,
        # a negative result -> result_of
        self.fast = _fast is not None
        self._flag_names: dict[int, object] = {}
        self._results: dict[int, object] = {}
        # the process that starts the run's command (`run`, `run --agent`), and the record of its
        # first successful exec: what the kernel executed, the manifest's command (bundle/command.py)
        self.root_pid: int | None = None
        self.root_exec: ExecRecord | None = None
        # the exec check (issue 24): kills a process whose exec the kernel could not kill itself
        # (an exec_violation record with killed false); the process's id -> whether it was killed
        self.kill: Callable[[int], bool] = self._kill_in_run

    def exe_of(self, pid: int) -> str | None:
        p = self.procs.get(pid)
        return p.exe if p else self._exited.get(pid)

    def add_root(self, pid: int, ppid: int, cwd: str, exe: str | None = None, depth: int = 0) -> None:
        self.procs[pid] = Proc(pid=pid, ppid=ppid, depth=depth, exe=exe, cwd=cwd)

    def _proc(self, tgid: int) -> Proc:
        p = self.procs.get(tgid)
        if p is None:
            found = self.proc_lookup(tgid) if self.proc_lookup else None
            ppid, cwd, exe = found if found else (0, None, None)
            parent = self.procs.get(ppid)
            p = Proc(pid=tgid, ppid=ppid, depth=parent.depth + 1 if parent else -1, exe=exe, cwd=cwd)
            self.procs[tgid] = p
        return p

    def open_record(
        self,
        ts: int,
        cgid: int,
        tgid: int,
        flags: int,
        ret: int,
        dfd: int,
        oflags: int,
        mode: int,
        raw: bytes,
        dino: int = 0,
        rino: int = 0,
        kname: bytes = b"",
        nlink: int = 0,
    ) -> list[Correlated]:
        """feed() of an open record, from its fields as decode.OPEN_REC unpacks them and its path's
        bytes (`raw`, up to path_len): the same records, without the decoded dict. Opens are by far
        the most frequent records, and most name a path the run named before: the decoded and
        resolved path is cached by what it depends on (the bytes, and for a relative path the
        directory it is resolved against). An open the kernel counted already (F_STATE) only updates
        the descriptor table and makes no record (the pipeline's _process would drop it). `dino`: what
        dfd named at entry, `rino`: what the descriptor returned names, `kname`: the kernel's name of
        it (F_KNAME: the bytes after the path; see _open_path), `nlink`: a write open's file's link
        count (decode.py)."""
        p = self.procs.get(tgid) or self._proc(tgid)
        if (
            self.fast
            and not flags & _NOT_PLAIN
            and raw[:1] == b"/"
            and (self.cgroup_name is None or (self._cgroups.get(cgid) or self._cgroup_named(cgid))[0] is None)
        ):
            # the most frequent open in C (src/fast/_fast.c open_plain): the same record, or None
            rec = _fast.open_plain(
                p, ts + self.wall_offset_ns, raw, dfd, oflags, mode, ret, rino, nlink, *self.fast_caches()
            )
            if rec is not None:
                return [rec]
        if flags & (d.F_FNAME_FAULT | d.F_KNAME):
            raw_path = UNREADABLE if flags & d.F_FNAME_FAULT else d.cstr(raw)
            kn = d.cstr(kname) if flags & d.F_KNAME else None
            path = self.names.open_path(p, raw_path, dfd, dino, flags, rino, kn)
        else:
            in_root = bool(flags & d.F_IN_ROOT)
            if raw[:1] == b"/" and not in_root:
                key: Any = raw
                hit = self._paths.get(key) or self._in_dir(raw)
            else:
                base, real = self.names.base(p, dfd, dino)
                key = (raw, base, real, dfd if base is None else AT_FDCWD, in_root)
                hit = self._paths.get(key)
            if hit is None:
                raw_path = d.cstr(raw)
                path = self.names.resolve(p, raw_path, dfd, dino, in_root)
                if path.startswith(MAGIC):  # another file each time: named each time, never cached
                    path = self.names.through_fd(p, path, rino)
                else:
                    if len(self._paths) >= _PATH_CACHE:
                        self._paths.clear()
                    self._paths[key] = (raw_path, path)
            else:
                raw_path, path = hit
        if flags & d.F_STATE:  # counted by the kernel already: only the descriptor table needs it,
            if ret < 0:  # and a write to another cgroup's procs its degradation (even past the cap)
                return []
            p.fds[ret] = (path, rino)
            if not oflags & 3 or (p.pid, path) in self._left:
                return []
            out = self._leaving(p, path, ts + self.wall_offset_ns)
            if out:  # said once per process and file: a repeat adds nothing
                self._left.add((p.pid, path))
            return out
        out = self._named(
            self._open(p, ts + self.wall_offset_ns, path, raw_path, dfd, oflags, mode, ret, rino, nlink), cgid
        )
        rec = out[-1]
        if flags & d.F_OTHER_NS and rec["k"] == "open":  # the last record is the open's
            rec["mntns"] = "other"
        return out

    def fast_caches(self) -> tuple[object, ...]:
        """What the C path's open_plain and process_opens take after an open's fields: the caches
        of names (as open_record's), and of flags and results (src/fast/_fast.c)."""
        return (
            self._paths,
            self._dirs,
            _dir_names,
            _PATH_CACHE,
            decode_open_flags,
            self._flag_names,
            result_of,
            self._results,
        )

    def _in_dir(self, raw: bytes) -> tuple[str, str] | None:
        """(raw path, resolved path) of the absolute name `raw` (with its NUL) from its directory's,
        cached (a run that names many files in few directories: their names never repeat, their
        directories do): its last component joined to the directory's names, when that component
        is a plain name (not empty, '.' or '..') and the whole is no magic link (names.MAGIC); else
        None, for Names.resolve. The same names as resolve's: `normal` of a directory and a plain
        name is `normal` of the directory joined to it."""
        slash = raw.rfind(b"/")
        leaf = raw[slash + 1 :]
        if leaf.find(b"\0") != len(leaf) - 1 or leaf in (b"\0", b".\0", b"..\0"):
            return None
        where = raw[:slash]
        known = self._dirs.get(where)
        if known is None:
            if len(self._dirs) >= _PATH_CACHE:
                self._dirs.clear()
            known = self._dirs[where] = _dir_names(where)
        name = leaf[:-1].decode("utf-8", "backslashreplace")
        path = known[1] + name
        if path.startswith(MAGIC):
            return None
        return known[0] + name, path

    def _open(
        self,
        p: Proc,
        t: int,
        path: str,
        raw_path: str,
        dfd: int,
        oflags: int,
        mode: int,
        ret: int,
        rino: int = 0,
        nlink: int = 0,
    ) -> list[Correlated]:
        """An open's record, last, after the degradation a write to another cgroup's procs makes;
        a descriptor it returns now names `path` (while it names inode `rino`); `nlink`: the link
        count of the file a write open opened (the kernel's, 0: not read), kept when it has other
        names. One shape for open_record and feed."""
        names, access = decode_open_flags(oflags)
        out: list[Correlated] = []
        if ret >= 0:
            p.fds[ret] = (path, rino)
            if "write" in access:
                out = self._leaving(p, path, t)
        out.append(
            {
                "k": "open",
                "t": t,
                "pid": p.pid,
                "ppid": p.ppid,
                "exe": p.exe,
                "path": path,
                "raw_path": raw_path,
                "dirfd": None if dfd == AT_FDCWD else dfd,
                "flags": names,
                "access": access,
                "mode": mode if "create" in access else None,
                "result": result_of(ret),
            }
        )
        if nlink > 1:
            cast(OpenRecord, out[-1])["nlink"] = nlink  # other names: lint EV004
        return out

    def _cgroup_named(self, cgid: int) -> tuple[str | None, str | None]:
        """(cgroup name, container id) of a cgroup id, cached: a cgroup's name does not change."""
        assert self.cgroup_name is not None
        name = self.cgroup_name(cgid)
        container = self.container_of(name) if name is not None and self.container_of else None
        if len(self._cgroups) >= _PATH_CACHE:
            self._cgroups.clear()
        self._cgroups[cgid] = (name, container)
        return name, container

    def feed(self, ev: d.RawEvent) -> list[Correlated]:
        """Consume one decoded record; return the spool records it completes."""
        out = self._named(self._feed(ev), ev.get("cgid", 0))
        if out and ev["flags"] & d.F_OTHER_NS:
            # by a process that left the run's mount or user namespace (or mounted, or chrooted):
            # its paths may name other files than the same paths in the run's namespace
            for rec in out:
                if rec["k"] in _MNTNS_KINDS:
                    rec["mntns"] = "other"
        return out

    def in_run(self, pid: int) -> bool:
        """Whether `pid` (a process or thread id) is a process of the run, now or earlier."""
        if pid in self.procs or pid in self._exited:
            return True
        tgid = self.tgid_of(pid) if self.tgid_of else None
        if tgid is not None and tgid in self.procs:
            return True
        # a process in the run's cgroup never seen (a run that attached late)
        cg = self.cgroup_of(pid) if self.cgroup_of else None
        mount, run = self.cgroup_mount, self.run_cgroup
        if cg is None or mount is None or run is None:
            return False
        where = mount.rstrip("/") + cg
        return where == run or where.startswith(run + "/")

    def flush(self) -> list[Correlated]:
        """The execs still waiting for their result when the run ends (in progress, or a result the
        ring buffer lost): recorded with the result NO_RESULT, not dropped. (Other calls in flight
        are read from the kernel's map by the recorder and come as records with NO_RESULT.)"""
        out: list[Correlated] = []
        for enter in list(self.pending.values()):
            out += self._named(
                self._complete(enter, NO_RESULT, enter["ts"] + self.wall_offset_ns), enter.get("cgid", 0)
            )
        self.pending.clear()
        for query in self.dns.flush():  # ---- dns: the queries whose answer was not seen
            out += self._named([query], query.pop("_cgid", 0))
        return out

    def _named(self, out: list[Correlated], cgid: int) -> list[Correlated]:
        """The records, with the cgroup (and container) of cgroup `cgid` when not the run's own (not
        a degradation: it is about the run, and its event has no such fields)."""
        if out and self.cgroup_name is not None:
            name, container = self._cgroups.get(cgid) or self._cgroup_named(cgid)
            if name is not None:
                for rec in out:  # (a degradation, denial or violation has no such fields)
                    if rec["k"] == "degradation" or rec["k"] == "denial" or rec["k"] == "violation":
                        continue
                    rec["cgroup"] = name
                    if container:
                        rec["container"] = container
        return out

    def _feed(self, ev: d.RawEvent) -> list[Correlated]:
        t = ev["ts"] + self.wall_offset_ns
        if ev["kind"] in _PAIRED:
            return self._complete(ev, ev["ret"], t)
        if ev["kind"] == "dns":
            return self._dns(ev, t)
        if ev["kind"] == "exec":
            stale = self.pending.get(ev["tid"])
            self.pending[ev["tid"]] = ev
            if stale is None:
                return []
            # the thread's previous exec returned, but its result was lost: recorded, not dropped
            return self._complete(stale, NO_RESULT, stale["ts"] + self.wall_offset_ns)
        if ev["kind"] == "ret":
            enter = self.pending.pop(ev["tid"], None)
            if enter is None:
                if ev["sc"] != d.SC_EXEC:  # a successful exec's result follows exec_ok, which took it
                    self.unpaired += 1
                return []
            return self._complete(enter, ev["ret"], ev["ts"] + self.wall_offset_ns)
        if ev["kind"] == "exec_ok":
            return self._exec_ok(ev, t)
        if ev["kind"] == "fork":
            parent = self._proc(ev["tgid"])
            self.procs[ev["child"]] = Proc(
                pid=ev["child"],
                ppid=parent.pid,
                depth=parent.depth + 1 if parent.depth >= 0 else -1,
                exe=parent.exe,
                cwd=parent.cwd,
                cwd_ino=parent.cwd_ino,
                cwd_real=parent.cwd_real,
                fds=dict(parent.fds),
            )
            return []
        if ev["kind"] == "sigsys":  # a 32-bit system call, refused by the run's seccomp filter
            p = self._proc(ev["tgid"])
            denial: DenialRecord = {
                "k": "denial",
                "t": t,
                "pid": p.pid,
                "exe": p.exe,
                "operation": "syscall",
                "target": d.refused_call(ev["arch"], ev["nr"]),
                "rule": COMPAT_RULE,
                "enforced": True,
                "result": "SIGSYS",
            }
            return [denial]
        if ev["kind"] == "exec_violation":  # ---- the exec check: killed before its first instruction
            return [self._violation(ev, t)]
        if ev["kind"] == "exit":
            p = self._proc(ev["tgid"])
            code, sig = split_status(ev["status"])
            self.procs.pop(ev["tgid"], None)
            if len(self._exited) >= 4096:
                self._exited.pop(next(iter(self._exited)))
            self._exited[p.pid] = p.exe
            rec: ExitRecord = {
                "k": "exit",
                "t": t,
                "pid": p.pid,
                "ppid": p.ppid,
                "exe": p.exe,
                "exit_code": code,
                "signal": sig,
            }
            return [rec]
        return []

    def _violation(self, ev: d.ExecViolationEvent, t: int) -> ViolationRecord:
        """An exec the kernel ran otherwise than the supervisor allowed (bpf/exec_check.bpf.c). The
        kernel killed it; if it could not (bpf_send_signal failed), the recorder kills it here, on
        reading the record (the new program may have run a little)."""
        p = self._proc(ev["tgid"])
        killed, result = ev["killed"], "SIGKILL"
        if not killed:
            result = errno.errorcode.get(-ev["kill_error"], str(ev["kill_error"]))
            killed = self.kill(p.pid)
        dev, ino = ev["file"]
        decided = ev["decided"]
        return {
            "k": "violation",
            "t": t,
            "pid": p.pid,
            "tid": ev["old_tid"],
            "exe": p.exe,
            "operation": "exec",
            "reasons": cast(Any, ev["reasons"]),
            "loaded": _file_id(dev, ino) if ino else None,
            "decided": None if decided is None else _file_id(*decided),
            "args_len": ev["args_len"],
            "decided_args_len": None if decided is None else ev["decided_args_len"],
            "rule": EXEC_CHECK_RULE,
            "killed": killed,
            "result": result,
        }

    def _kill_in_run(self, pid: int) -> bool:
        """SIGKILL process `pid` if it is still the run's (through a pidfd: the signal goes to the
        process checked, never to one that took its id since)."""
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return False
        try:
            if not self.in_run(pid):
                return False
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def _exec_record(
        self, p: Proc, t: int, filename: str, argv: list[str], trunc: bool, result: Result
    ) -> ExecRecord:
        return {
            "k": "exec",
            "t": t,
            "pid": p.pid,
            "ppid": p.ppid,
            "depth": p.depth,
            "filename": filename,
            "argv": argv,
            "argv_truncated": trunc,
            "cwd": p.cwd,
            "result": result,
        }

    def _leaving(self, p: Proc, path: str, t: int) -> list[Correlated]:
        """A degradation when a process opens for writing the cgroup.procs or cgroup.threads of a
        cgroup outside the run's: it can move processes out of the run's cgroup, and what they do
        there is not recorded (only root, or a job a cgroup is delegated to, may)."""
        mount, run = self.cgroup_mount, self.run_cgroup
        name = posixpath.basename(path)
        if mount is None or run is None or name not in ("cgroup.procs", "cgroup.threads"):
            return []
        where = posixpath.dirname(path)
        if (
            not (where == mount or where.startswith(mount + "/"))
            or where == run
            or where.startswith(run + "/")
        ):
            return []
        return [
            {
                "k": "degradation",
                "t": t,
                "component": "cgroup",
                "reason": f"{p.exe or '?'} (pid {p.pid}) opened {path} for writing: it can move processes out of the run's cgroup",
                "impact": "what a process moved out of the run's cgroup does afterwards is not recorded",
            }
        ]

    def _exec_ok(self, ev: d.ExecOkEvent, t: int) -> list[Correlated]:
        old = ev["old_tid"] or ev["tid"]
        enter = self.pending.pop(old, None) or self.pending.pop(ev["tid"], None)
        p = self._proc(ev["tgid"])
        dfd = enter["dfd"] if enter else AT_FDCWD
        dino = enter["dino"] if enter else 0
        filename = self.names.resolve(p, ev["filename"], dfd if dfd != 0 else AT_FDCWD, dino)
        trunc = bool(ev["flags"] & d.F_ARGS_TRUNC)
        argv = ev["argv"]
        if ev["flags"] & d.F_ARGS_FAULT and enter:
            argv = enter["argv"]
        p.exe = filename
        rec = self._exec_record(p, t, filename, argv, trunc, 0)
        if p.pid == self.root_pid and self.root_exec is None:
            self.root_exec = rec  # its hash's fields are filled in place (exe_hash.settle)
        out: list[Correlated] = [rec]
        if self.hash_of:  # the fields, or a pending hash the recorder fills in (exe_hash.PENDING)
            where = filename
            if ev["flags"] & d.F_OTHER_NS and filename.startswith("/"):
                # in another mount namespace the path names another file here: read it through the
                # process's own root (gone by then: not hashed, never the wrong file)
                where = f"/proc/{p.pid}/root{filename}"
            h = self.hash_of(p.pid, where, ev.get("file"))
            # exe_hash names its fields at run time (a prefix for an interpreter's): typed here
            # (cast to the whole record: mypy's update() takes no TypedDict with fewer keys)
            rec.update(cast(ExecRecord, h) if isinstance(h, dict) else {"_hash": h})
        abi = self.abi_of(p.pid, filename) if self.abi_of else None
        if abi:
            out.append(
                {
                    "k": "degradation",
                    "t": t,
                    "component": "recorder",
                    "reason": f"{filename} (pid {p.pid}) is a {abi} program: the kernel's syscall tracepoints do not see its system calls",
                    "impact": "its opens, connects and execs are not recorded (a policy's Landlock and connect rules still apply to it)",
                }
            )
        return out

    def _complete(
        self,
        enter: d.OpenEvent
        | d.ChangeEvent
        | d.ConnectEvent
        | d.ChdirEvent
        | d.FchdirEvent
        | d.DupEvent
        | d.NamespaceEvent
        | d.ExecEvent,
        ret: int,
        t_ret: int,
    ) -> list[Correlated]:
        p = self._proc(enter["tgid"])
        t = enter["ts"] + self.wall_offset_ns
        if enter["kind"] == "open":
            if enter["flags"] & d.F_FNAME_FAULT:
                enter["path"] = UNREADABLE
            path = self.names.open_path(
                p, enter["path"], enter["dfd"], enter["dino"], enter["flags"], enter["rino"], enter["kname"]
            )
            return self._open(
                p,
                t,
                path,
                enter["path"],
                enter["dfd"],
                enter["oflags"],
                enter["mode"],
                ret,
                enter["rino"],
                enter["nlink"],
            )
        if enter["kind"] == "change":
            return [change_record(self.names, p, enter, ret, t)]
        if enter["kind"] == "namespace":
            return [namespace_record(self.names, p, enter, ret, t, self.in_run)]
        if enter["kind"] == "exec":
            if ret == 0:
                return []  # exec_ok already recorded it
            if enter["flags"] & d.F_FNAME_FAULT:
                # not in memory at entry (the kernel faults it in, a probe cannot): never resolved
                # as "" (that names the cwd); a successful exec is named by the kernel (exec_ok)
                filename = UNREADABLE
            else:
                filename = self.names.resolve(p, enter["filename"], enter["dfd"], enter["dino"])
            return [
                self._exec_record(
                    p, t, filename, enter["argv"], bool(enter["flags"] & d.F_ARGS_TRUNC), result_of(ret)
                )
            ]
        if enter["kind"] == "connect":
            address = enter["address"]
            if enter["family"] == "AF_UNIX" and address and address[0] not in "/@<":
                address = self.names.resolve(p, address, AT_FDCWD, enter["dino"])  # a file in the cwd
            rec: ConnectRecord = {
                "k": "connect",
                "t": t,
                "pid": p.pid,
                "ppid": p.ppid,
                "exe": p.exe,
                "family": enter["family"],
                "address": address,
                "port": enter["port"],
                "result": result_of(ret),
            }
            names = self.dns.names_of(enter["address"])
            if names:  # what the answers of the run's configured resolvers named the address
                rec["names"] = names
            others = self.dns.other_names_of(enter["address"])
            if others:  # ... and those of other servers (shown, never a key of diff or profile)
                rec["other_names"] = others
            return [rec]
        if enter["kind"] in ("chdir", "fchdir"):
            if ret == 0:
                # named by the kernel; else (too deep, not below the process's root) by the name
                # as given, or the descriptor's path: a directory never seen opened, or not the one
                # seen, makes the cwd unknown
                cwd = enter["kname"]
                if cwd is not None:
                    self.names.entered(p, enter["rino"], cwd, True)
                elif enter["kind"] == "fchdir":
                    self.names.entered(
                        p, enter["rino"], self.names.fd_path(p, enter["fd"], enter["dino"]), False
                    )
                elif enter["flags"] & d.F_FNAME_FAULT:
                    self.names.entered(p, enter["rino"], None, False)
                else:
                    path = self.names.resolve(p, enter["path"] or "", AT_FDCWD, enter["dino"])
                    self.names.entered(p, enter["rino"], path, False)
        elif enter["kind"] == "dup" and ret >= 0:
            # the new descriptor names what oldfd names (rino): oldfd's path if that is what it named
            src = self.names.fd_path(p, enter["oldfd"], enter["rino"])
            if src is not None:
                p.fds[ret] = (src, enter["rino"])
            else:
                p.fds.pop(ret, None)
        return []

    # ---- dns

    def _dns(self, ev: d.DnsEvent, t: int) -> list[Correlated]:
        """A DNS message: a query waits for its answer (the pair is one record, at the query's
        time), an answer teaches the names of the addresses it gives. What the kernel delivered to
        a socket (by no process) is what received messages are checked against (dns.py)."""
        if ev["delivered"]:
            self.dns.deliver(ev)
            return []
        p = self._proc(ev["tgid"])
        out: list[Correlated] = []
        for rec in self.dns.feed(ev, t, p.pid, p.ppid, p.exe):
            rec.pop("_cgid", None)
            out.append(rec)
        return out


def _dir_names(where: bytes) -> tuple[str, str]:
    """A directory's bytes -> (its name as given, resolved), each with a '/' after (_in_dir)."""
    as_given = where.decode("utf-8", "backslashreplace")
    resolved = normal(as_given) if as_given else "/"
    return as_given + "/", resolved if resolved == "/" else resolved + "/"


def _file_id(dev: int, ino: int) -> str:
    """A file's identity as policy.violation gives it: MAJOR:MINOR:INODE."""
    return f"{os.major(dev)}:{os.minor(dev)}:{ino}"
