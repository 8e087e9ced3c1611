"""Full detail's C path (src/fast/_fast.c) against the Python path on real records: a job running as
nobody opens names made to trip the C path's name resolution and its fallbacks (dot and empty
components, '..' after a component, magic links to its own descriptors, a cgroup's procs for
writing, bytes that are not UTF-8, control characters, names that look like the lines' pieces,
relative names after a chdir, an open through a descriptor, its own files created and reopened),
and the same job is recorded again with EVIDENCE_PURE_PYTHON=1. Each open is recorded alike both
ways (path, name as given, flags, access, result, descriptor), and both bundles verify and lint."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest

from evidence.bundle import sink
from evidence.bundle.reader import open_bundle
from tests.kernel.util import PY, as_user, evidence, of_type, read_bundle

pytestmark = pytest.mark.kernel

NOBODY = 65534

_JOB = textwrap.dedent(
    r"""
    import os, sys
    base = sys.argv[1]
    os.chdir(base)
    names = [
        'a', './a', 'd//b', 'd/./b', 'd/../a', 'd/x/../../a', '/proc/self/fd/0', '/dev/fd/1',
        '/proc/self/fd/0/x', '/sys/fs/cgroup/unified/cgroup.procs', os.fsdecode(b'n\xff\xfe'),
        'c\x01\x1f\x7f"\\', '","t":1,', '{"data":', '\u2028', 'tmp12345678', 'f' * 40, '.', '..', '',
    ]
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    for round in range(3):
        for name in names:
            for flags in (os.O_RDONLY, os.O_WRONLY | os.O_CREAT, os.O_RDWR | os.O_APPEND):
                for where in (name, os.path.join(base, name)):
                    try:
                        os.close(os.open(where, flags, 0o600))
                    except OSError:
                        pass
                try:
                    os.close(os.open(name, flags, 0o600, dir_fd=fd))
                except OSError:
                    pass
        os.mkdir(f'sub{round}')
        os.chdir(f'sub{round}')
        for i in range(2000):  # distinct names, past the C path's caches and a batch or two
            try:
                os.close(os.open(f'{base}/none/{round}/{i}', os.O_RDONLY))
            except OSError:
                pass
    print('done')
    """
)


def _opens(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [
        (
            d["path"],
            d["raw_path"],
            d["dirfd"],
            d["flags"],
            d["access"],
            d["mode"],
            d["result"],
            d.get("nlink"),
        )
        for d in (e["data"] for e in of_type(events, "file.open"))
    ]


def _same(v: Any, work: str) -> Any:
    if not isinstance(v, str):
        return v
    return re.sub(r"/proc/[0-9]+/|\[[0-9]+\]", "<n>", v.replace(work, "/W"))


def _recorded(tmp_path: Path, name: str, env: dict[str, str]) -> list[tuple[Any, ...]]:
    work = Path(tempfile.mkdtemp(prefix="evidence-c-", dir="/tmp"))  # (nobody reaches /tmp)
    work.chmod(0o777)
    try:
        bundle = tmp_path / name
        job = as_user(NOBODY, PY, "-c", _JOB, str(work))
        proc = evidence("run", "--bundle", str(bundle), "--detail", "full", "--", *job, env=env)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip().endswith("done")
        manifest, events = read_bundle(bundle)
        assert manifest["lost"]["total"] == 0
        list(open_bundle(bundle).events())  # verifies: hashes, root hash, canonical lines
        lint = evidence("lint", str(bundle))
        assert lint.returncode in (0, 1), lint.stdout + lint.stderr  # (findings about such names: fine)
        # what differs between the runs (the work directory's name, process ids, pipes' inodes): said
        # as one name each
        return [tuple(_same(v, str(work)) for v in o) for o in _opens(events)]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_a_hostile_job_is_recorded_alike_by_the_c_and_python_paths(tmp_path: Path) -> None:
    if sink._fast is None:
        pytest.fail("evidence.bundle._fast is not importable: `make setup` did not build it")
    env = {k: v for k, v in os.environ.items() if k != "EVIDENCE_PURE_PYTHON"}
    fast = _recorded(tmp_path, "c.tar.gz", env)
    python = _recorded(tmp_path, "py.tar.gz", {**env, "EVIDENCE_PURE_PYTHON": "1"})
    mine = [o for o in fast if o[0].startswith("/W")]
    assert len(mine) > 6000  # the job's own opens are there, distinct ones past several batches
    assert fast == python


# names the job controls, made to split a run id's sorted runs where the C merge reads them (a tab,
# newlines, a line's pieces, the premade lines' placeholder bytes), each distinct many times over:
# past the run id's in-memory budget (EVIDENCE_WRITER_MEMORY), so they go through its runs on disk
_SPILLING_JOB = textwrap.dedent(
    r"""
    import os, sys
    base = sys.argv[1]
    odd = ['\t', '\n', '\t\n', "'\t", '")\t[', 'run-\x01\x02', '\x1f\xff', os.fsdecode(b'\xff\xfe'), '\\', 'é', '']
    for i in range(1500):
        for k, s in enumerate(odd):
            try:
                os.close(os.open(f'{base}/{i % 7}{s}{i}/{k}', os.O_RDONLY))
            except OSError:
                pass
    print('done')
    """
)


def test_a_hostile_jobs_run_id_through_spills_is_the_python_paths(tmp_path: Path) -> None:
    """The run id's items spilled to sorted runs and merged by C (merge_items) and the premade
    lines' run id put in by C (translate), against the Python path: a job as nobody opening 16,500
    distinct names holding tabs, newlines and the placeholder's bytes, recorded with a writer
    budget of 4,000 items (runs of 1,000 on disk) both ways, in the same directory: the same run id
    and the same events but for times and process ids, both bundles verify."""
    if sink._fast is None:
        pytest.fail("evidence.bundle._fast is not importable: `make setup` did not build it")
    env = {k: v for k, v in os.environ.items() if k != "EVIDENCE_PURE_PYTHON"}
    env["EVIDENCE_WRITER_MEMORY"] = "4000"
    work = Path("/tmp/evidence-c-spill")  # (the same name both times: the run id holds it)
    runs: list[tuple[str, list[tuple[Any, ...]]]] = []
    for name, extra in (("c.tar.gz", {}), ("py.tar.gz", {"EVIDENCE_PURE_PYTHON": "1"})):
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(mode=0o777)
        work.chmod(0o777)
        try:
            bundle = tmp_path / name
            job = as_user(NOBODY, PY, "-c", _SPILLING_JOB, str(work))
            proc = evidence(
                "run", "--bundle", str(bundle), "--detail", "full", "--", *job, env={**env, **extra}
            )
            assert proc.returncode == 0, proc.stderr
            assert proc.stdout.strip().endswith("done")
            manifest, events = read_bundle(bundle)
            assert manifest["lost"]["total"] == 0
            list(open_bundle(bundle).events())  # verifies
            runs.append((manifest["run_id"], [o for o in _opens(events) if o[0].startswith(str(work))]))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    (fast_id, fast), (python_id, python) = runs
    assert len(fast) == 16_500
    assert fast == python
    assert fast_id == python_id
