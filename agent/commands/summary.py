"""What `evidence run` says of a run, the same whether it recorded the command itself or through an
agent: the summary line it prints last on stderr, whether the run wrote its subjects, and the names
of signals."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any


def summary_line(events: Any, counts: dict[str, int], lost: Any, run_id: Any, bundle: Path) -> str:
    """The last line `evidence run` prints (directly or through an agent): events by kind, loss, bundle."""
    short = {
        k.removeprefix("dev.evidence."): v for k, v in counts.items() if not k.startswith("dev.evidence.run.")
    }
    parts = ", ".join(f"{k} {v}" for k, v in sorted(short.items())) or "none"
    return f"evidence: {events} events ({parts}); {lost} lost; run {run_id}; bundle {bundle}"


def signal_name(n: int) -> str:
    """SIGTERM, ... or SIG40 for a signal Python has no name for (the real-time ones)."""
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"SIG{n}"


def subjects_written(bundle: Path) -> bool:
    """--subject-must-be-written: whether the run wrote every subject, by the bundle's own events
    (the bundle verified first: through an agent it is the downloaded copy); a line on stderr for
    each subject it did not write."""
    from evidence.bundle import provenance, reader

    b = reader.open_bundle(bundle)
    b.verify()
    ties = provenance.ties_of(b.manifest, b.events())
    for tie in ties:
        if not tie.written:
            print(f"evidence: subject {tie.name} was not written by the run: {tie.reason}", file=sys.stderr)
    return all(t.written for t in ties)
