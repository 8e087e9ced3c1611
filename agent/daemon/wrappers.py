"""What the backend wraps around a recorder's parts: each session's spool writer, and the probes.

`ObservedSpool`: records are held back until the run's inventory is written first, then every batch
is passed on as it is written (counted by kind for /metrics, copied to the live event stream), and
flushed now and then by the housekeeping thread, so that the spool of an agent that dies is readable
up to the last flush (agent/recorder/recovery.py).

`HandoverProbes`: when a window is cut (`RecorderBackend.rotate`), the new run is tracked before the
old one is finished, and the old one's untrack is skipped, so the cgroup is never untracked between.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from evidence.bundle.record_types import SpoolRecord
    from evidence.bundle.spool import SpoolWriter


class ObservedSpool:
    """Wraps a session's SpoolWriter: holds records back until the inventory is written first, then
    passes every batch to `observe` as it is written. Thread-safe (the recorder's worker writes,
    the housekeeping thread flushes, the finishing thread closes)."""

    def __init__(self, inner: SpoolWriter, observe: Callable[[Sequence[SpoolRecord]], None]) -> None:
        self._inner = inner
        self._observe = observe
        self._lock = threading.Lock()
        self._held: list[SpoolRecord] | None = []  # None once the prelude is written
        self._closed = False
        self._dirty = False

    @property
    def path(self) -> Path:
        return self._inner.path

    @property
    def records(self) -> int:
        return self._inner.records

    def size(self) -> int:
        try:
            return os.stat(self._inner.path).st_size
        except FileNotFoundError:
            return 0

    def _write(self, recs: Sequence[SpoolRecord]) -> None:
        if recs:
            self._inner.write_many(recs)
            self._dirty = True
            self._observe(recs)

    def set_prelude(self, recs: Sequence[SpoolRecord]) -> None:
        """Write `recs` (the inventory), then whatever arrived meanwhile."""
        with self._lock:
            if self._held is None or self._closed:
                return
            held, self._held = self._held, None
            self._write(list(recs))
            self._write(held)

    def write_many(self, recs: Sequence[SpoolRecord]) -> None:
        with self._lock:
            if self._held is not None:
                self._held.extend(recs)
            else:
                self._write(recs)

    def write(self, rec: SpoolRecord) -> None:
        self.write_many([rec])

    def flush(self) -> None:
        with self._lock:
            if not self._closed and self._dirty:
                self._inner.flush()
                self._dirty = False

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            if self._held is not None:
                held, self._held = self._held, None
                self._write(held)
            self._closed = True
            self._inner.close()


class HandoverProbes:
    """Wraps the recorder's probes so that one untrack can be skipped: when a window is cut, the new
    run already owns the cgroup (track overwrote the map entry), and the old run's finish must not
    take it away. Everything else is passed through."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._keep: dict[int, int] = {}
        self._lock = threading.Lock()

    def keep(self, cgroup_id: int) -> None:
        with self._lock:
            self._keep[cgroup_id] = self._keep.get(cgroup_id, 0) + 1

    def untrack(self, cgroup_id: int) -> None:
        with self._lock:
            n = self._keep.get(cgroup_id, 0)
            if n:
                if n == 1:
                    del self._keep[cgroup_id]
                else:
                    self._keep[cgroup_id] = n - 1
                self._inner.clear_cache()
                return
        self._inner.untrack(cgroup_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
