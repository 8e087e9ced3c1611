"""The reader's C shortcut (src/fast/_verify.c `shortcut`: an event line taken apart where its
constant parts are, only its data parsed) against a job that names its own files to mislead it: run
as nobody, it opens names holding what the shortcut cuts the line at (a time and a type's tail, the
envelope's constant parts, quotes, backslashes, a quote at the end, bytes that are not UTF-8, a
control byte, U+2028, a long name). The run is recorded for real; its bundle must then read the
same through the C with the shortcut, through the C without it, and through the Python reference:
the same events (keys in the same order, the same values and types), and lint finds the same."""

from __future__ import annotations

import shutil
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest

from evidence.bundle import fastpath, lint, reader
from tests.kernel.util import PY, as_user, evidence, of_type

pytestmark = pytest.mark.kernel

NOBODY = 65534

_JOB = textwrap.dedent(
    r"""
    import os, sys
    base = sys.argv[1]
    t = '2026-11-28T12:00:00.000000000Z'
    names = [
        'a","time":"' + t + '","type":"dev.evidence.file.open"}',
        'b","time":"' + t + '","type":"dev.evidence.loss"}',
        'c,"datacontenttype":"application/json","id":"run-0:1","runid":"run-0","seq":1,',
        'd","source":"urn:evidence:run:run-0","specversion":"1.0","subject":"e',
        'f"', 'g\\', '\\"', '"', '\\', 'h\\u0041', 'i\x01j', 'k\u2028l', 'm\x7fn', 'é', '😀',
        os.fsdecode(b'o\xff\xfe'), os.fsdecode(b'p\xed\xa0\x80'), '{"data":{}}', '}', 'q' * 250,
    ]
    for name in names:
        for flags in (os.O_RDONLY, os.O_WRONLY | os.O_CREAT):
            try:
                os.close(os.open(os.path.join(base, name), flags, 0o600))
            except OSError:
                pass
    for i in range(300):  # ordinary lines around them, which the shortcut takes
        try:
            os.close(os.open(f'{base}/plain/{i}', os.O_RDONLY))
        except OSError:
            pass
    print('done')
    """
)


def _read(bundle: Path) -> Any:
    """(the events as (key, value, type) lists in order, lint's findings)."""
    events = [
        [(k, v, type(v)) for k, v in ev.items()] for ev in reader.open_bundle(bundle, parallel=False).events()
    ]
    _, findings, dropped, _ = lint.lint_signed(str(bundle), parallel=False)
    return events, [f.as_dict() for f in findings], dropped


def test_unprivileged_names_made_to_mislead_the_shortcut_read_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if fastpath._verify is None:
        pytest.fail("evidence.bundle._verify is not importable: `make setup` did not build it")
    work = Path(tempfile.mkdtemp(prefix="evidence-cut-", dir="/tmp"))  # (nobody reaches /tmp)
    work.chmod(0o777)
    try:
        bundle = tmp_path / "run.tar.gz"
        job = as_user(NOBODY, PY, "-c", _JOB, str(work))
        proc = evidence("run", "--bundle", str(bundle), "--detail", "full", "--", *job)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip().endswith("done")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    monkeypatch.setattr(fastpath.Helper, "usable", staticmethod(lambda: False))
    seen: list[bytes] = []
    loads = fastpath.orjson.loads

    def counting(b: Any) -> Any:
        seen.append(bytes(b[:8]))
        return loads(b)

    with monkeypatch.context() as m:  # the C, loads counted: which lines went whole
        m.setattr(fastpath.orjson, "loads", counting)
        shortcut = _read(bundle)
    with monkeypatch.context() as m:  # the C without the shortcut: every line whole
        m.setattr(fastpath, "_fast_c", _whole_lines_only)
        whole = _read(bundle)
    with monkeypatch.context() as m:
        m.setattr(fastpath, "_verify", None)
        python = _read(bundle)
    assert shortcut == whole == python
    events = [dict((k, v) for k, v, _ in ev) for ev in python[0]]
    mine = [e for e in of_type(events, "file.open") if "evidence-cut-" in e["subject"]]
    assert len(mine) > 300
    assert any('","time":"' in e["subject"] for e in mine)  # the misleading names were recorded
    # the shortcut took the plain lines (loads saw their data, not the line), not the others
    assert seen.count(b'{"data":') < len(events) / 2


def _whole_lines_only(lines: list[bytes], seq: int, ctx: fastpath.Context, passed: fastpath.Passed) -> Any:
    """fastpath._fast_c without the envelope: the C's whole-line steps alone."""
    assert fastpath._verify is not None
    return fastpath._verify.lines(
        lines, seq, *fastpath._envelope_parts(ctx), fastpath._CORE_MIDDLE, fastpath._TYPES, fastpath._SPECS,
        fastpath.orjson.loads, fastpath.orjson.dumps, fastpath.orjson.OPT_SORT_KEYS, fastpath.TIME,
        passed.hashes, passed.counts, fastpath._ERRORS,
    )  # fmt: skip
