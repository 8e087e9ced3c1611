"""Helpers to build valid bundles (with the real writer) and to take them apart and repack them
(for hostile variants). Test-only: the tarfile use here trusts its input."""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
from pathlib import Path
from typing import Any

import orjson

from evidence.bundle import canonical
from evidence.bundle import format as fmt
from evidence.bundle.writer import RunMeta, write_bundle

T0 = 1_700_000_000_000_000_000
WS = "/home/ci/work"


def meta(**over: Any) -> RunMeta:
    base: dict[str, Any] = dict(
        session_id="sess-1",
        command=["make", "test"],
        cwd=WS,
        pid=100,
        cgroup="/evidence/sess-1",
        started_ns=T0,
        finished_ns=T0 + 5_000_000_000,
        exit_code=0,
        detail="summary",
        host={"kernel": "6.1.0"},
        capabilities={"btf": True},
        headers={},
    )
    base.update(over)
    return RunMeta(**base)


def exec_(
    t: int, pid: int, ppid: int, filename: str, argv: list[str], depth: int = 1, result: Any = 0
) -> dict[str, Any]:
    return dict(
        k="exec",
        t=T0 + t,
        pid=pid,
        ppid=ppid,
        depth=depth,
        filename=filename,
        argv=argv,
        cwd=WS,
        result=result,
    )


def open_(
    t: int, path: str, access: list[str], result: Any = 0, pid: int = 101, exe: str = "/usr/bin/make"
) -> dict[str, Any]:
    flags = ["O_WRONLY", "O_CREAT"] if "write" in access else ["O_RDONLY"]
    return dict(
        k="open",
        t=T0 + t,
        pid=pid,
        ppid=100,
        exe=exe,
        path=path,
        raw_path=path,
        flags=flags,
        access=access,
        result=result,
    )


def change(
    t: int,
    operation: str,
    path: str,
    target: str | None = None,
    result: Any = 0,
    pid: int = 101,
    exe: str = "/usr/bin/make",
    **extra: Any,
) -> dict[str, Any]:
    access = {"link": ["create"], "symlink": ["create"], "mkdir": ["create"], "mknod": ["create"]}
    rec = dict(
        k="change",
        t=T0 + t,
        pid=pid,
        ppid=100,
        exe=exe,
        operation=operation,
        path=path,
        raw_path=path,
        access=access.get(operation, ["write", "create"] if operation == "rename" else ["write"]),
        result=result,
        **extra,
    )
    if target is not None:
        rec["target"] = target
    return rec


def connect(
    t: int, address: str, port: int | None = 443, family: str = "AF_INET", result: Any = 0
) -> dict[str, Any]:
    return dict(
        k="connect",
        t=T0 + t,
        pid=102,
        ppid=101,
        exe="/usr/bin/curl",
        family=family,
        address=address,
        port=port,
        result=result,
    )


def dns(
    t: int,
    name: str,
    addresses: list[str],
    result: str = "NOERROR",
    server: str = "127.0.0.53",
    *,
    configured: bool = True,
    unsolicited: str | None = None,
    source: tuple[str, int] | None = None,
) -> dict[str, Any]:
    """A DNS query with its answer, as the recorder spools it (agent/recorder/dns.py): from the
    server the query went to, one of the run's configured resolvers (`configured`); or an answer
    credited to no query (`unsolicited`, from `source`)."""
    rec = dict(
        k="dns",
        t=T0 + t,
        pid=102,
        ppid=101,
        exe="/usr/bin/curl",
        server=server,
        port=53,
        name=name,
        type="A",
        result=result,
        answers=[f"{name} A {a}" for a in addresses],
        addresses=sorted(addresses),
        configured_resolver=configured,
        source=(source or (server, 53))[0],
        source_port=(source or (server, 53))[1],
    )
    if unsolicited is not None:
        rec["unsolicited"] = unsolicited
    return rec


def exit_(t: int, pid: int, code: int = 0) -> dict[str, Any]:
    return dict(k="exit", t=T0 + t, pid=pid, ppid=100, exe=None, exit_code=code)


def denial(t: int, target: str, operation: str = "write") -> dict[str, Any]:
    return dict(
        k="denial",
        t=T0 + t,
        pid=103,
        exe="/bin/sh",
        operation=operation,
        target=target,
        rule="workspace-only",
        enforced=True,
        result="EACCES",
    )


def approval(t: int, state: str = "requested", **answer: Any) -> dict[str, Any]:
    return dict(
        k="approval",
        t=T0 + t,
        id="a1",
        state=state,
        pid=104,
        program="/usr/bin/git",
        argv=["git", "push", "--force"],
        argv_truncated=False,
        depth=1,
        rule="commands.rules[0] (no-force-push)",
        message="force-push needs a human",
        requested_at=fmt.format_time(T0 + 1000),
        **answer,
    )


def limit(t: int, kind: str = "oom_kill", **more: Any) -> dict[str, Any]:
    return (
        dict(
            k="limit",
            t=T0 + t,
            limit={"oom_kill": "memory", "fork_refused": "pids", "wall": "wall"}.get(kind, "memory"),
            kind=kind,
            count=1,
            pids=[105],
            certain=True,
            detail="1 processes killed by the OOM killer at limits.memory",
        )
        | more
    )


def violation(t: int, *reasons: str, killed: bool = True) -> dict[str, Any]:
    """An exec the exec check killed (the run's `sh` rewrote its argv after the decision)."""
    no_pin = "no_pin" in reasons
    return dict(
        k="violation",
        t=T0 + t,
        pid=105,
        tid=106,
        exe="/usr/bin/sh",
        operation="exec",
        reasons=list(reasons or ("args",)),
        loaded="254:1:131",
        decided=None if no_pin else "254:1:131",
        args_len=24,
        decided_args_len=None if no_pin else 17,
        rule=fmt.EXEC_CHECK_RULE,
        killed=killed,
        result="SIGKILL" if killed else "EAGAIN",
    )


def audit(t: int, program: str = "/usr/bin/git", argv: list[str] | None = None) -> dict[str, Any]:
    """An exec an `audit` command rule matched (format.PolicyAudit)."""
    return dict(
        k="audit",
        t=T0 + t,
        pid=105,
        program=program,
        argv=argv or ["git", "push", "origin", "main"],
        argv_truncated=False,
        depth=2,
        rule="commands.rules[1] (note-pushes)",
        rule_index=1,
        rule_name="note-pushes",
        message="pushes are looked at",
    )


def records() -> list[dict[str, Any]]:
    """A small, realistic run: make -> sh -> cc, some files, one connect."""
    return [
        exec_(1000, 101, 100, "/usr/bin/make", ["make", "test"], depth=0),
        open_(2000, WS + "/Makefile", ["read"]),
        open_(2500, WS + "/Makefile", ["read"]),
        exec_(3000, 102, 101, "/bin/sh", ["sh", "-c", "cc -o app app.c"], depth=1),
        exec_(4000, 103, 102, "/usr/bin/cc", ["cc", "-o", "app", "app.c"], depth=2),
        open_(5000, WS + "/app.c", ["read"], pid=103, exe="/usr/bin/cc"),
        open_(6000, WS + "/app", ["write", "create"], pid=103, exe="/usr/bin/cc"),
        open_(6500, "/etc/missing.conf", ["read"], result="ENOENT"),
        connect(7000, "127.0.0.1", 8080),
        exit_(8000, 103),
        exit_(9000, 102),
    ]


def write(path: Path, recs: list[dict[str, Any]] | None = None, **over: Any) -> Path:
    rs = records() if recs is None else recs
    write_bundle(path, meta(**over), lambda: iter(rs))
    return path


def members(path: Path) -> tuple[dict[str, Any], list[bytes]]:
    """(manifest, event lines without newlines) of a bundle."""
    with tarfile.open(path, "r:gz") as tar:
        m = tar.extractfile(fmt.MANIFEST_NAME).read()  # type: ignore[union-attr]
        ev = tar.extractfile(fmt.EVENTS_NAME).read()  # type: ignore[union-attr]
    return orjson.loads(m), ev.split(b"\n")[:-1]


def tarinfo(name: str, size: int, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size = size
    ti.type = kind
    ti.linkname = linkname
    ti.mtime = 0
    return ti


def tar_bytes(entries: list[tuple[tarfile.TarInfo, bytes]], fmt_: int = tarfile.USTAR_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt_) as tar:
        for ti, data in entries:
            tar.addfile(ti, io.BytesIO(data) if ti.isreg() else None)
    return buf.getvalue()


def gz(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


def pack(path: Path, entries: list[tuple[str, bytes]]) -> Path:
    path.write_bytes(gz(tar_bytes([(tarinfo(n, len(d)), d) for n, d in entries])))
    return path


def rebuild(
    path: Path,
    manifest: dict[str, Any],
    lines: list[bytes],
    *,
    fix_root: bool = True,
    fix_files: bool = True,
    fix_counts: bool = False,
) -> Path:
    """Write a bundle from a manifest and event lines, recomputing the hashes (so that a change to
    an event is caught by a later check than the hashes) unless told not to."""
    events = b"".join(line + b"\n" for line in lines)
    m = dict(manifest)
    if fix_files:
        m["files"] = {fmt.EVENTS_NAME: {"sha256": hashlib.sha256(events).hexdigest(), "size": len(events)}}
    if fix_root:
        hashes = []
        for line in lines:
            try:
                hashes.append(fmt.content_hash(orjson.loads(line)))
            except Exception:
                hashes.append("0" * 64)
        m["root_hash"] = fmt.root_hash(hashes)
    if fix_counts:
        counts: dict[str, int] = {}
        for line in lines:
            t = orjson.loads(line)["type"]
            counts[t] = counts.get(t, 0) + 1
        m["counts"] = dict(sorted(counts.items()))
        m["events"] = len(lines)
    return pack(path, [(fmt.MANIFEST_NAME, canonical.dumps(m, check=False)), (fmt.EVENTS_NAME, events)])


def line(obj: dict[str, Any]) -> bytes:
    return canonical.dumps(obj, check=False)


def namespace(
    t: int,
    operation: str,
    flags: list[str],
    paths: list[str] | None = None,
    result: Any = 0,
    pid: int = 101,
    exe: str = "/usr/bin/unshare",
    **extra: Any,
) -> dict[str, Any]:
    """A dev.evidence.process.namespace record (unshare, mount, ptrace, ...)."""
    return dict(
        k="namespace",
        t=T0 + t,
        pid=pid,
        ppid=100,
        exe=exe,
        operation=operation,
        flags=flags,
        paths=paths or [],
        result=result,
        **extra,
    )


def damaged(tmp: Path, recs: list[dict[str, Any]], where: int, at: int, byte: int, fix: bool) -> Path:
    """A bundle of `recs` with one byte of one event line replaced (line `where`, byte `at`, both
    taken modulo), rebuilt with its root hash fixed (`fix`) or not: the hypothesis tests' damage."""
    manifest, lines = members(write(tmp / "a.tar.gz", recs))
    lines = list(lines)
    i = where % len(lines)
    lines[i] = lines[i][: at % len(lines[i])] + bytes([byte]) + lines[i][at % len(lines[i]) + 1 :]
    return rebuild(tmp / "d.tar.gz", manifest, lines, fix_root=fix)
