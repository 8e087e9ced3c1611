"""The run's artifacts: the files its `--subject` patterns match in the workspace when it ended,
each hashed once (sha256, size, mtime, ctime), to become subjects of the signed attestation.

`collect(workspace, patterns)` is the one call (the recorder makes it once the command has exited).
The job is the attacker, and the caller is root, so a match is refused, with the reason listed in
`Artifacts.refused`, when it:

- leads out of the workspace (a symlink, or a `..`): the caller would hash a file the job cannot
  read (its digest is a hint about its content) and call it the job's;
- is not a regular file (a directory, a FIFO, a device, a socket): never opened, so a FIFO cannot
  block the recorder and a device is never read;
- has other names (a link count above 1): a hard link can be a file from outside the workspace;
- changed while it was hashed (its size or times differ before and after), or cannot be read;
- has a path longer than MAX_PATH bytes, or comes past the caps: MAX_FILES subjects, MAX_BYTES bytes in all (the files past either are listed
  as refused, in name order, so the same tree always gives the same subjects); past MAX_MATCHES
  names matched, the rest are only counted (`refused_more`).

A pattern that matches nothing is listed as refused too (its name is the pattern). Patterns are
relative to the workspace, matched as pathlib does (`**` matches any depth without descending into
symlinked directories; `*` matches hidden names too). A match through a symlink that leads out is
refused under the symlink's name, never the names beyond it (the caller is root: they are not the
job's to learn).
The order is deterministic: subjects by name; refusals by name.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from evidence.bundle import format as fmt

logger = logging.getLogger(__name__)

# subjects of one run, and the length of each one's path: what the manifest (at most 1 MiB, with
# the run's argv and policy) holds of them stays under 400 KiB
MAX_FILES = 256
MAX_PATH = 512  # bytes of the real path
MAX_BYTES = 4 * 1024**3  # bytes hashed for one run's subjects, in all
MAX_REFUSED = 100  # refusals listed (the rest are counted: Artifacts.refused_more)
MAX_PATTERNS = 64
MAX_MATCHES = 100_000  # names the patterns may match in all before the rest are not looked at
_CHUNK = 1 << 20


class SubjectError(ValueError):
    """A `--subject` pattern that cannot be used (absolute, or leading out of the workspace)."""


def check_pattern(pattern: str) -> str:
    """The pattern, if it can name subjects; SubjectError (a usage error) if not."""
    if not pattern or "\0" in pattern:
        raise SubjectError(f"--subject {pattern!r}: an empty pattern")
    if pattern.startswith("/"):
        raise SubjectError(f"--subject {pattern!r}: patterns are relative to the workspace")
    if ".." in pattern.split("/"):
        raise SubjectError(f"--subject {pattern!r}: a pattern may not leave the workspace ('..')")
    return pattern


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _inside(path: str, root: str) -> bool:
    return root == "/" or path == root or path.startswith(root + "/")


def _way_out(root: str, name: str) -> tuple[str, str]:
    """The first component of `name` (relative to `root`) that leads out of it, and what that
    symlink says (the job's own words): a match beyond it is refused under its name alone, so the
    names of what root can read out there never reach the bundle."""
    parts = name.split("/")
    for i in range(1, len(parts) + 1):
        prefix = "/".join(parts[:i])
        path = os.path.join(root, prefix)
        real = os.path.realpath(path)
        if not _inside(real, root) or real == root:
            try:
                return prefix, os.readlink(path)
            except OSError:
                return prefix, "outside"
    return name, "outside"


def _hash(real: str, root: str) -> tuple[str, os.stat_result] | str:
    """(sha256, its stat) of the regular file at `real`, or why it is refused."""
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as e:
        return f"cannot be opened: {e.strerror or e}"
    try:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode):
            return _kind(before.st_mode)
        if before.st_nlink > 1:
            return f"has {before.st_nlink} names (a hard link may be a file from outside the workspace)"
        # what was opened, whatever happened to the path's directories since it was resolved
        opened = os.readlink(f"/proc/self/fd/{fd}")
        if not _inside(opened, root):
            return "leads out of the workspace (its directories changed while it was opened)"
        h = hashlib.sha256()
        while chunk := os.read(fd, _CHUNK):
            h.update(chunk)
        after = os.fstat(fd)
    except OSError as e:
        return f"cannot be read: {e.strerror or e}"
    finally:
        os.close(fd)
    if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) != (
        before.st_size,
        before.st_mtime_ns,
        before.st_ctime_ns,
    ):
        return "changed while it was hashed"
    return h.hexdigest(), before


def collect(
    workspace: str | os.PathLike[str],
    patterns: Sequence[str],
    *,
    max_files: int = MAX_FILES,
    max_bytes: int = MAX_BYTES,
    now_ns: int | None = None,
) -> fmt.Artifacts:
    """The subjects the patterns match in `workspace` (module docstring: what is refused and why)."""
    import time

    collected = time.time_ns() if now_ns is None else now_ns
    if len(patterns) > MAX_PATTERNS:
        raise SubjectError(f"more than {MAX_PATTERNS} --subject patterns")
    for p in patterns:
        check_pattern(p)
    root = os.path.realpath(workspace)
    names: set[str] = set()
    refused: dict[str, str] = {}
    more = 0
    base = Path(root)
    for pattern in patterns:
        n = 0
        # pathlib's `**` does not descend into symlinked directories (glob.glob's does)
        for m in base.glob(pattern):
            n += 1
            if len(names) >= MAX_MATCHES:
                more += 1
                if more >= MAX_MATCHES:
                    break
                continue
            names.add(os.path.normpath(os.path.relpath(m, root)))
        if not n:
            refused.setdefault(pattern, "the pattern matched nothing")
    files: list[fmt.ArtifactFile] = []
    total = 0
    for name in sorted(names):
        where = os.path.join(root, name)
        real = os.path.realpath(where)
        if not _inside(real, root) or real == root:
            link = _way_out(root, name)  # named, not what is beyond it: root may read what the job cannot
            refused[link[0]] = f"leads out of the workspace (a symlink to {link[1]})"
            continue
        try:
            st = os.stat(real)
        except OSError as e:
            refused[name] = f"cannot be read: {e.strerror or e}"
            continue
        if len(real.encode("utf-8", "surrogateescape")) > MAX_PATH:
            refused[name] = f"its path is longer than {MAX_PATH} bytes"
            continue
        if not stat.S_ISREG(st.st_mode):
            if not stat.S_ISDIR(st.st_mode):  # a directory a pattern named: its files are named apart
                refused[name] = _kind(st.st_mode)
            continue
        if len(files) >= max_files:
            refused[name] = f"past the cap of {max_files} subjects"
            continue
        if total + st.st_size > max_bytes:
            refused[name] = f"past the cap of {max_bytes} bytes hashed for the subjects"
            continue
        got = _hash(real, root)
        if isinstance(got, str):
            refused[name] = got
            continue
        digest, st = got
        total += st.st_size
        files.append(
            fmt.ArtifactFile(
                name=name,
                path=real,
                sha256=digest,
                size=st.st_size,
                mtime=fmt.format_time(st.st_mtime_ns),
                ctime=fmt.format_time(st.st_ctime_ns),
            )
        )
    listed = sorted(refused.items())
    if listed:
        logger.warning(
            "%d --subject matches refused: %s", len(listed), "; ".join(f"{n}: {r}" for n, r in listed[:5])
        )
    return fmt.Artifacts(
        workspace=root,
        patterns=list(patterns),
        collected_at=fmt.format_time(collected),
        max_files=max_files,
        max_bytes=max_bytes,
        files=files,
        refused=[fmt.ArtifactRefusal(name=n, reason=r) for n, r in listed[:MAX_REFUSED]],
        refused_more=max(0, len(listed) - MAX_REFUSED) + more,
    )


def collect_as(
    uid: int, gid: int, workspace: str | os.PathLike[str], patterns: Sequence[str], *, timeout: float = 600
) -> fmt.Artifacts:
    """collect(), in a process of `uid` and `gid` (no other groups): what a client of the agent
    names is read with the client's rights, never root's. What cannot be collected so is said in
    `refused`, once a pattern (the bundle is written all the same)."""
    import json
    import subprocess
    import sys
    import time

    request = json.dumps({"workspace": os.fspath(workspace), "patterns": list(patterns)}).encode()
    why = ""
    try:
        done = subprocess.run(  # noqa: S603 - this interpreter, this module
            [sys.executable, "-m", "evidence.bundle.subjects"],
            input=request,
            capture_output=True,
            user=uid,
            group=gid,
            extra_groups=[],
            cwd="/",
            env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"},
            timeout=timeout,
            check=False,
        )
        if done.returncode == 0:
            return fmt.Artifacts.model_validate_json(done.stdout)
        why = (done.stderr.decode(errors="replace").strip().splitlines() or [f"exit {done.returncode}"])[-1]
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        why = str(e)
    logger.warning("the subjects could not be collected as uid %d: %s", uid, why)
    return fmt.Artifacts(
        workspace=os.fspath(workspace),
        patterns=list(patterns),
        collected_at=fmt.format_time(time.time_ns()),
        max_files=MAX_FILES,
        max_bytes=MAX_BYTES,
        files=[],
        refused=[
            fmt.ArtifactRefusal(name=p, reason=f"not collected: {why[:200]}") for p in patterns[:MAX_REFUSED]
        ],
    )


def _main() -> int:
    """`python -m evidence.bundle.subjects`: collect() of the JSON request on stdin, as JSON."""
    import json
    import sys

    request = json.loads(sys.stdin.buffer.read(1 << 20))
    got = collect(request["workspace"], [str(p) for p in request["patterns"]])
    sys.stdout.write(got.model_dump_json())
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
