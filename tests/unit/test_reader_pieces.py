"""The reader's pieces without a helper process are verify._PIECE bytes inflated at a time (120 KiB,
below glibc's own-mapping threshold: issue 25, the fleet publisher's lint), where they were a
megabyte: what lint, verify and the event stream say of a bundle must not depend on where the
pieces end. Here the same bundles are read in pieces of a megabyte (as before), of the default,
and of a few KiB (a piece boundary inside most lines' neighbourhood), and must come out the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evidence.bundle import container, fastpath, reader, verify
from tests.unit.conftest_bundles import WS, damaged, members, open_, records, write
from tests.unit.test_hostile import HOSTILE
from tests.unit.test_lint_same import _outcome, _rule_runs

_SIZES = (container.CHUNK, verify._PIECE, 4096, 100)


def _outcomes(path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """lint's outcome and the verified events (or the problems) with each piece size, in this
    process's thread alone (the agent's way) and as the CLI reads (an inflating thread)."""
    monkeypatch.setattr(fastpath.Helper, "usable", staticmethod(lambda: False))
    got = []
    for size in _SIZES:
        with monkeypatch.context() as m:
            m.setattr(verify, "_PIECE", size)
            for parallel in (False, True):
                try:
                    events: Any = list(reader.open_bundle(path, parallel=parallel, ahead=parallel).events())
                except reader.VerificationError as e:
                    events = e.problems
                got.append((_outcome(path, parallel=parallel), events))
    return got


@pytest.mark.parametrize("k", range(len(_rule_runs())))
def test_the_rules_bundles_read_the_same_in_any_pieces(
    k: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    got = _outcomes(write(tmp_path / "a.tar.gz", _rule_runs()[k]), monkeypatch)
    assert all(g == got[0] for g in got) and not got[0][0][2]


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_bundles_read_the_same_in_any_pieces(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make, _ = HOSTILE[case]
    manifest, lines = members(write(tmp_path / "valid.tar.gz"))
    got = _outcomes(make(tmp_path / f"{case}.tar.gz", dict(manifest), list(lines)), monkeypatch)
    assert all(g == got[0] for g in got) and got[0][0][2]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    where=st.integers(min_value=0), at=st.integers(min_value=0), byte=st.integers(0, 255), fix=st.booleans()
)
def test_damaged_bundles_read_the_same_in_any_pieces(
    where: int,
    at: int,
    byte: int,
    fix: bool,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tmp = tmp_path_factory.mktemp("d")
    recs = [*records(), *(open_(10_000 + i, f"{WS}/src/f{i}.c", ["read", "write"]) for i in range(200))]
    got = _outcomes(damaged(tmp, recs, where, at, byte, fix), monkeypatch)
    assert all(g == got[0] for g in got)
