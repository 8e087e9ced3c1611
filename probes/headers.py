"""Kernel headers for BCC's compile, found without changing the host.

BCC compiles against `/lib/modules/<release>/build` unless `BCC_KERNEL_SOURCE` names another tree
(libbcc 0.26 honours it). When the running kernel's own headers are installed, they are used where
they are. Otherwise the newest installed Debian-style pair (`linux-headers-<v>-<flavour>` and
`linux-headers-<v>-common`) is joined into one tree of symlinks under evidence's own state directory
and BCC is pointed at it through the environment: nothing is written under `/lib/modules`, so DKMS,
bpftrace and other BCC users see the host as it was. The probes take no struct layout from these
headers (tracepoint arguments, BPF helpers and BTF offsets only), so headers of another kernel are
fine; the mismatch is recorded in every manifest.

Versions before 0.2 linked `/lib/modules/<release>/{build,source}` to the distro headers and left
the links there: `remove_old_links` takes them away again, but only links that point exactly where
that version would have pointed them, and it logs what it removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ENV = "BCC_KERNEL_SOURCE"
MODULES = Path("/lib/modules")
SRC = Path("/usr/src")
FARM_ROOT = Path("/var/lib/evidence/kernel-headers")
_DONE = ".evidence-complete"


@dataclasses.dataclass(frozen=True)
class Headers:
    kernel: str  # the running kernel's release
    headers: str | None  # the release the headers are for (None: no headers found)
    match: bool
    path: str | None  # the tree BCC compiles against
    via: str  # "modules" (the kernel's own /lib/modules build), "BCC_KERNEL_SOURCE", or "none"

    def as_dict(self) -> dict[str, Any]:  # the manifest's `headers` (a dict of JSON values)
        return dataclasses.asdict(self)


def headers_release(tree: Path) -> str | None:
    for rel in ("include/config/kernel.release", "include/generated/utsrelease.h"):
        try:
            text = (tree / rel).read_text()
        except OSError:
            continue
        m = re.search(r'"([^"]+)"', text)
        return m.group(1) if m else text.strip()
    return None


def distro_headers(src: Path = SRC) -> tuple[Path, Path] | None:
    """The newest Debian-style (flavour dir, common dir) pair of installed kernel headers."""
    pairs = []
    for d in src.glob("linux-headers-*"):
        m = re.fullmatch(r"linux-headers-(\d+\.\d+\.\d+-\d+)-(?!common)[\w-]+", d.name)
        common = src / f"linux-headers-{m.group(1)}-common" if m else None
        if m and common and common.is_dir() and (d / "include").is_dir():
            pairs.append((tuple(int(x) for x in re.findall(r"\d+", m.group(1))), d, common))
    if not pairs:
        return None
    _, flavour, common = max(pairs)
    return flavour, common


def remove_old_links(release: str, modules: Path = MODULES, src: Path = SRC) -> list[Path]:
    """Remove `/lib/modules/<release>/{build,source}` where an earlier evidence made them: symlinks
    to exactly the distro pair it would have chosen. Anything else is left alone."""
    pair = distro_headers(src)
    if pair is None:
        return []
    kdir = modules / release
    removed = []
    for name, target in (("build", pair[0]), ("source", pair[1])):
        link = kdir / name
        with contextlib.suppress(OSError):
            if link.is_symlink() and Path(os.readlink(link)) == target:
                link.unlink()
                removed.append(link)
    if removed:
        with contextlib.suppress(OSError):
            kdir.rmdir()  # only when empty: a directory the old version created for its links
        logger.warning(
            "removed %s: links to %s that an earlier evidence left there (BCC now gets %s instead)",
            ", ".join(map(str, removed)),
            pair[0].name,
            ENV,
        )
    return removed


def _farm(flavour: Path, common: Path, root: Path) -> Path:
    """One tree of symlinks joining the common and the flavour headers (the flavour wins), made once
    and kept: a complete farm has a marker file, an incomplete one is never used."""
    farm = root / flavour.name
    if (farm / _DONE).exists():
        return farm
    root.mkdir(parents=True, exist_ok=True, mode=0o755)
    tmp = Path(tempfile.mkdtemp(prefix=f".{flavour.name}-", dir=root))
    try:
        subprocess.run(["cp", "-rs", f"{common}/.", str(tmp)], check=True, capture_output=True)
        subprocess.run(["cp", "-rsf", f"{flavour}/.", str(tmp)], check=True, capture_output=True)
        (tmp / _DONE).write_text(f"{common}\n{flavour}\n")
        os.chmod(tmp, 0o755)
        shutil.rmtree(farm, ignore_errors=True)
        os.rename(tmp, farm)
    except (OSError, subprocess.CalledProcessError):
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("joined %s and %s into %s", common.name, flavour.name, farm)
    return farm


def ensure_headers(
    modules: Path = MODULES,
    src: Path = SRC,
    farm_root: Path = FARM_ROOT,
    environ: MutableMapping[str, str] = os.environ,
) -> Headers:
    """Find headers for BCC and set `BCC_KERNEL_SOURCE` in `environ` when they are not the kernel's
    own /lib/modules tree. Never writes under `modules`, except to remove an earlier version's links."""
    release = os.uname().release
    remove_old_links(release, modules, src)
    given = environ.get(ENV)
    if given and Path(given, "include").is_dir():
        hrel = headers_release(Path(given))
        return Headers(release, hrel, hrel == release, given, ENV)
    build = modules / release / "build"
    if (build / "include").is_dir():
        hrel = headers_release(build)
        return Headers(release, hrel, hrel == release, str(build.resolve()), "modules")
    pair = distro_headers(src)
    if pair is None:
        return Headers(release, None, False, None, "none")
    try:
        farm = _farm(*pair, farm_root)
    except (OSError, subprocess.CalledProcessError) as e:
        logger.warning("cannot join the kernel headers under %s: %s", farm_root, e)
        return Headers(release, None, False, None, "none")
    environ[ENV] = str(farm)
    hrel = headers_release(pair[0])
    return Headers(release, hrel, hrel == release, str(farm), ENV)
