"""Full detail's writer makes events a batch at a time (bundle/sink.py: FullWriter, as the run goes: bundle/premade.py): a job
running as nobody tries to make a batch come out unlike its events one by one, with names that look
like the pieces the writer puts lines together from (an RFC 3339 time as a name, so that a repeat's
data holds its own time twice; the spool's `","t":` marker; quotes, backslashes, control characters),
each opened a few times in a row (repeats, whose lines the writer puts together from the first's)
and interleaved with distinct names, past several batches. Every open is in the bundle, each as the
canonical JSON of its event, and the bundle verifies and lints at the default level; signed, the
same."""

from __future__ import annotations

import collections
import shutil
import tarfile
import tempfile
import textwrap
from pathlib import Path

import pytest

from evidence.bundle import canonical
from evidence.bundle.reader import open_bundle
from tests.kernel.util import PY, as_user, evidence, of_type, read_bundle, record

NOBODY = 65534

_JOB = textwrap.dedent(
    r"""
    import os, sys, time
    base = sys.argv[1]
    now = time.time_ns()
    secs, frac = divmod(now, 10**9)
    stamp = time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(secs))
    hostile = [
        f'{stamp}.{frac:09d}Z', f'"{stamp}.000000000Z"', '","t":1,', 'q"b\\s', 'ctl\x01\x1f\x7f',
        '\u2028line', '{"data":', 'x' * 200, 'R' * 36, 'run-' + '0' * 32,
    ]
    opened = {}
    for i in range(3000):
        name = os.path.join(base, hostile[i % len(hostile)] if i % 3 else f'd{i}')
        for _ in range(1 + i % 4):  # repeats of the same open, one after the other
            try:
                os.close(os.open(name, os.O_RDONLY))
            except OSError:
                pass
            opened[name] = opened.get(name, 0) + 1
    print(repr(opened))
    """
)


def _opens(events: list[dict], base: str) -> collections.Counter[str]:
    return collections.Counter(
        e["data"]["path"] for e in of_type(events, "file.open") if e["data"]["path"].startswith(base + "/")
    )


def test_a_hostile_full_run_past_many_batches_is_written_whole(tmp_path: Path) -> None:
    work = tmp_path / "w"  # nobody may not even look in it: each open fails, and is recorded
    job = as_user(NOBODY, PY, "-c", _JOB, str(work))
    proc, manifest, events = record(tmp_path, *job, extra=("--detail", "full"))
    assert proc.returncode == 0, proc.stderr
    opened = eval(proc.stdout.splitlines()[-1])  # noqa: S307 - the test's own job printed it
    assert sum(opened.values()) > 3 * 1024  # past several of the writer's batches
    assert _opens(events, str(work)) == collections.Counter(opened)
    assert manifest["lost"]["total"] == 0
    bundle = tmp_path / "run.tar.gz"
    list(open_bundle(bundle).events())  # verifies: hashes, root hash, canonical lines
    lint = evidence("lint", str(bundle))
    assert lint.returncode == 0, lint.stdout + lint.stderr
    # each line is the canonical JSON of its event (the reader's fast path checks it, said here too)
    with tarfile.open(bundle, "r:gz") as tar:
        raw = tar.extractfile("events.ndjson").read()  # type: ignore[union-attr]
    assert raw.splitlines() == [canonical.dumps(e) for e in events]


def test_a_signed_full_run_is_written_whole_too(tmp_path: Path) -> None:
    """A signed bundle's trace sees every event: its events are made one by one, to the same end."""
    key = tmp_path / "key"
    assert evidence("keygen", "--out", str(key)).returncode == 0
    work = tmp_path / "w"  # nobody may not even look in it: each open fails, and is recorded
    job = as_user(NOBODY, PY, "-c", _JOB, str(work))
    bundle = tmp_path / "signed.tar.gz"
    proc = evidence("run", "--bundle", str(bundle), "--detail", "full", "--sign-key", str(key), "--", *job)
    assert proc.returncode == 0, proc.stderr
    verify = evidence("verify", str(bundle), "--key", str(key) + ".pub")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    opened = eval(proc.stdout.splitlines()[-1])  # noqa: S307 - the test's own job printed it
    events = list(open_bundle(bundle).events())
    assert _opens(events, str(work)) == collections.Counter(opened)


_BYTES_JOB = textwrap.dedent(
    r"""
    import os, sys
    base = os.fsencode(sys.argv[1])
    # every byte a name may hold: the control bytes (the premade placeholder's among them), DEL,
    # bytes that are never UTF-8 (0xc0, 0xc1, 0xf5-0xff) and cut sequences; one byte a name, and
    # all in one name
    names = [bytes([b]) for b in range(1, 256) if b not in (0x2E, 0x2F)]  # ("." is the directory)
    names += [bytes(b for b in range(1, 256) if b != 0x2F), b"\xe4\xb8", b"run-" + bytes(range(1, 33))]
    for name in names:
        for _ in range(3):  # repeats too: their lines are put together from the first's
            try:
                os.close(os.open(os.path.join(base, name), os.O_RDONLY | os.O_CREAT, 0o600))
            except OSError:
                pass
    print(" ".join(n.hex() for n in names))
    """
)


def test_names_with_every_byte_are_escaped_in_a_full_runs_lines(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A job as nobody names files with every byte a name may hold, the bytes of the placeholder
    where the premade lines' run id goes among them (bundle/premade.py: control bytes and 0xff):
    each name is recorded escaped, three times, the run id is the manifest's in every line, the
    lines were made as the run went (not from the spool), and the bundle verifies and lints."""
    work = Path(tempfile.mkdtemp(prefix="evidence-bytes-"))  # (in /tmp: nobody reaches it)
    work.chmod(0o777)
    request.addfinalizer(lambda: shutil.rmtree(work, ignore_errors=True))
    job = as_user(NOBODY, PY, "-c", _BYTES_JOB, str(work))
    bundle = tmp_path / "bytes.tar.gz"
    proc = evidence("-v", "run", "--bundle", str(bundle), "--detail", "full", "--", *job)
    assert proc.returncode == 0, proc.stderr
    assert "are not used" not in proc.stderr  # the premade lines were the bundle's
    names = [bytes.fromhex(h) for h in proc.stdout.split()]
    manifest, events = read_bundle(bundle)
    got = _opens(events, str(work))
    want = {str(work) + "/" + n.decode("utf-8", "backslashreplace"): 3 for n in names}
    assert got == collections.Counter(want)
    assert all(
        e["runid"] == manifest["run_id"] and e["id"].startswith(manifest["run_id"] + ":") for e in events
    )
    list(open_bundle(bundle).events())  # verifies: hashes, root hash, canonical lines
    lint = evidence("lint", str(bundle))
    assert lint.returncode in (0, 1), lint.stdout + lint.stderr  # (findings about such names: fine)
    with tarfile.open(bundle, "r:gz") as tar:
        raw = tar.extractfile("events.ndjson").read()  # type: ignore[union-attr]
    assert raw.splitlines() == [canonical.dumps(e) for e in events]
    assert not set(raw) & (set(range(32)) - {0x0A} | {0xFF})  # no placeholder byte left
