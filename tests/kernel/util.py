"""Helpers for kernel tests: run the real CLI as a subprocess and read the bundle it wrote."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

PY = "/usr/bin/python3"  # Debian's python: no pyenv shims in the recorded process tree


def evidence(
    *args: str, cwd: str | Path | None = None, timeout: float = 120, **kw: Any
) -> subprocess.CompletedProcess[str]:
    env = dict(kw.pop("env", None) or os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return subprocess.run(
        [sys.executable, "-m", "evidence", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        **kw,
    )


def read_bundle(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    with tarfile.open(path, "r:gz") as tar:
        names = tar.getnames()
        assert names == ["manifest.json", "events.ndjson"], names
        manifest = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
        raw = tar.extractfile("events.ndjson").read()  # type: ignore[union-attr]
    events = [json.loads(line) for line in io.BytesIO(raw).read().splitlines()]
    return manifest, events


def of_type(events: list[dict[str, Any]], suffix: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == f"dev.evidence.{suffix}"]


def record(
    tmp_path: Path, *command: str, extra: tuple[str, ...] = (), name: str = "run.tar.gz", **kw: Any
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], list[dict[str, Any]]]:
    bundle = tmp_path / name
    proc = evidence("run", "--bundle", str(bundle), *extra, "--", *command, **kw)
    assert bundle.exists(), f"no bundle; stderr: {proc.stderr}"
    manifest, events = read_bundle(bundle)
    return proc, manifest, events
