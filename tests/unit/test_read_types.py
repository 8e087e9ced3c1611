"""bundle/read_types.py mirrors what verification guarantees: every field of format.Manifest, required
exactly when the model has no default (and with the model's nested shapes), and the events'
envelope as bundle/verify.py checks it; a real bundle's manifest and events have those keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from evidence.bundle import format as fmt
from evidence.bundle import read_types, reader, verify
from tests.unit import conftest_bundles as cb


def test_the_manifest_type_has_every_field_of_the_model_required_as_the_model_says() -> None:
    fields = fmt.Manifest.model_fields
    typed = read_types.ManifestJSON
    assert set(typed.__annotations__) == set(fields)
    assert typed.__required_keys__ == {n for n, f in fields.items() if f.is_required()}
    assert set(read_types.LostJSON.__annotations__) == set(fmt.LossCounts.model_fields)
    assert set(read_types.FileJSON.__annotations__) == set(fmt.FileEntry.model_fields)


def test_the_event_type_is_the_envelope_verification_checks() -> None:
    typed = read_types.EventJSON
    assert typed.__required_keys__ == verify._ENVELOPE_KEYS
    assert typed.__optional_keys__ == {"labels"}


@pytest.mark.parametrize("labels", [None, {"job": "build"}])
def test_a_written_bundle_reads_back_in_those_shapes(tmp_path: Path, labels: dict[str, str] | None) -> None:
    path = cb.write(tmp_path / "b.tar.gz", **({"labels": labels} if labels else {}))
    bundle = reader.open_bundle(path)
    manifest = bundle.manifest
    assert (
        read_types.ManifestJSON.__required_keys__
        <= manifest.keys()
        <= set(read_types.ManifestJSON.__annotations__)
    )
    envelope = read_types.EventJSON.__required_keys__ | ({"labels"} if labels else set())
    events = list(bundle.events())
    assert events and all(ev.keys() == envelope for ev in events)
