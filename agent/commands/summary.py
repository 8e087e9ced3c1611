"""What `evidence run` says of a run, the same whether it recorded the command itself or through an
agent: the summary line it prints last on stderr, and the names of signals."""

from __future__ import annotations

import signal
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
