"""Labels ride on every event as one `labels` extension attribute, equal to the manifest's labels;
the reader holds every event to it, on the fast path, the careful path and the helper process."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from evidence.bundle import format as fmt
from evidence.bundle.reader import VerificationError, open_bundle
from evidence.cli import main
from tests.unit.conftest_bundles import T0, exec_, members, open_, rebuild, write

LABELS = {"job": "123", "k8s/pod": "web-0", "team": "payments"}


def test_every_event_carries_the_manifests_labels(tmp_path: Path) -> None:
    path = write(tmp_path / "l.tar.gz", labels=LABELS)
    manifest, lines = members(path)
    assert manifest["labels"] == LABELS
    want = fmt.labels_attribute(LABELS)
    assert want == '{"job":"123","k8s/pod":"web-0","team":"payments"}'
    assert all(orjson.loads(x)["labels"] == want for x in lines)
    assert main(["lint", str(path), "--fail-on", "none"]) == 0


def test_no_labels_no_attribute(tmp_path: Path) -> None:
    _, lines = members(write(tmp_path / "n.tar.gz"))
    assert all("labels" not in orjson.loads(x) for x in lines)


@pytest.mark.parametrize("where", [1, -2])
def test_a_tampered_or_missing_label_fails_verification(
    tmp_path: Path, where: int, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest, lines = members(write(tmp_path / "l.tar.gz", labels=LABELS))
    ev = orjson.loads(lines[where])
    ev["labels"] = fmt.labels_attribute({**LABELS, "job": "999"})
    tampered = rebuild(
        tmp_path / "t.tar.gz",
        manifest,
        [*lines[:where], fmt_line(ev), *lines[where + 1 :]]
        if where > 0
        else [*lines[:where], fmt_line(ev), lines[-1]],
    )
    assert main(["lint", str(tampered)]) == 2
    err = capsys.readouterr().err
    assert "labels" in err and "Traceback" not in err
    del ev["labels"]
    missing = rebuild(
        tmp_path / "m.tar.gz",
        manifest,
        [*lines[:where], fmt_line(ev), *lines[where + 1 :]]
        if where > 0
        else [*lines[:where], fmt_line(ev), lines[-1]],
    )
    with pytest.raises(VerificationError, match="lacks attribute 'labels'"):
        list(open_bundle(missing).events())


def test_labels_on_an_unlabelled_run_are_refused(tmp_path: Path) -> None:
    manifest, lines = members(write(tmp_path / "n.tar.gz"))
    ev = orjson.loads(lines[1])
    ev["labels"] = fmt.labels_attribute(LABELS)
    bad = rebuild(tmp_path / "b.tar.gz", manifest, [lines[0], fmt_line(ev), *lines[2:]])
    with pytest.raises(VerificationError, match='unknown attribute "labels"'):
        list(open_bundle(bad).events())


def test_a_large_labelled_bundle_verifies_on_both_cores(tmp_path: Path) -> None:
    # big enough for the helper process (>= 1 MiB compressed): distinct paths defeat compression
    recs = [exec_(T0 + 10, 101, 100, "/usr/bin/make", ["make"])]
    recs += [
        open_(T0 + 100 + i, f"/w/src/{i:07d}/{(i * 7919) % 1000003:x}.c", ["read"]) for i in range(60_000)
    ]
    path = write(tmp_path / "big.tar.gz", recs, labels=LABELS, detail="full")
    assert path.stat().st_size >= 1 << 20
    b = open_bundle(path)
    n = sum(1 for _ in b.events())
    assert n == b.manifest["events"]


def fmt_line(ev: dict) -> bytes:
    from evidence.bundle import canonical

    return canonical.dumps(ev, check=False)
