"""Counters and gauges rendered in the Prometheus text exposition format (0.0.4), with no dependency.

Two sources feed /metrics: a `Registry` that components update as things happen (API requests,
refused peers, deliveries), and a `MetricsSnapshot` the recorder backend returns on each scrape
(events by kind, losses, runs active, consumer lag, bundle bytes). `render` turns families into text.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

logger = logging.getLogger(__name__)

MetricType = Literal["counter", "gauge"]
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LabelValues = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Family:
    """One metric: its samples keyed by label values (in the order of `labels`)."""

    name: str  # for counters, without the _total suffix (it is added to each sample)
    help: str
    type: MetricType
    labels: tuple[str, ...] = ()
    samples: Mapping[LabelValues, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class MetricsSnapshot:
    """What the recorder knows at scrape time. Counters only ever grow across snapshots."""

    events_by_kind: Mapping[str, int] = dataclasses.field(default_factory=dict)
    lost_by_kind: Mapping[str, int] = dataclasses.field(default_factory=dict)
    runs_active: int = 0
    runs_started: int = 0
    runs_finished: int = 0
    consumer_lag_seconds: float = 0.0
    bundle_bytes: int = 0
    bundles_written: int = 0


def snapshot_families(s: MetricsSnapshot) -> list[Family]:
    return [
        Family(
            "evidence_events",
            "Events recorded, by kind.",
            "counter",
            ("kind",),
            {(k,): float(v) for k, v in sorted(s.events_by_kind.items())},
        ),
        Family(
            "evidence_events_lost",
            "Events lost (kernel buffer full or agent overload), by kind.",
            "counter",
            ("kind",),
            {(k,): float(v) for k, v in sorted(s.lost_by_kind.items())},
        ),
        Family("evidence_runs_active", "Runs being recorded now.", "gauge", (), {(): float(s.runs_active)}),
        Family("evidence_runs_started", "Runs started.", "counter", (), {(): float(s.runs_started)}),
        Family(
            "evidence_runs_finished",
            "Runs finished (bundle written).",
            "counter",
            (),
            {(): float(s.runs_finished)},
        ),
        Family(
            "evidence_consumer_lag_seconds",
            "Age of the oldest event not yet consumed from the kernel buffer.",
            "gauge",
            (),
            {(): float(s.consumer_lag_seconds)},
        ),
        Family(
            "evidence_bundle_bytes", "Bytes of bundles written.", "counter", (), {(): float(s.bundle_bytes)}
        ),
        Family("evidence_bundles_written", "Bundles written.", "counter", (), {(): float(s.bundles_written)}),
    ]


class _Metric:
    def __init__(
        self, name: str, help: str, type_: MetricType, labels: Sequence[str], lock: threading.Lock
    ) -> None:
        self.name = name
        self.help = help
        self.type: MetricType = type_
        self.labels = tuple(labels)
        self._lock = lock
        self._values: dict[LabelValues, float] = {}
        if not self.labels:
            self._values[()] = 0.0

    def _key(self, labels: Mapping[str, str]) -> LabelValues:
        if set(labels) != set(self.labels):
            raise ValueError(f"{self.name} takes labels {self.labels}, got {tuple(sorted(labels))}")
        return tuple(str(labels[n]) for n in self.labels)

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def family(self) -> Family:
        with self._lock:
            return Family(self.name, self.help, self.type, self.labels, dict(self._values))


class Counter(_Metric):
    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount


class Gauge(_Metric):
    def set(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def dec(self, amount: float = 1.0, **labels: str) -> None:
        self.inc(-amount, **labels)


class Registry:
    """Thread-safe set of named counters and gauges; `counter()`/`gauge()` return the existing metric
    when called again with the same name, so components can share one registry without coordination."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._metrics: dict[str, _Metric] = {}

    def _get(
        self, cls: type[_Metric], name: str, help: str, type_: MetricType, labels: Sequence[str]
    ) -> _Metric:
        with self._lock:
            m = self._metrics.get(name)
            if m is None:
                m = cls(name, help, type_, labels, threading.Lock())
                self._metrics[name] = m
            elif not isinstance(m, cls) or m.labels != tuple(labels):
                raise ValueError(f"metric {name} already registered with another type or labels")
            return m

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        m = self._get(Counter, name, help, "counter", labels)
        assert isinstance(m, Counter)
        return m

    def gauge(self, name: str, help: str, labels: Sequence[str] = ()) -> Gauge:
        m = self._get(Gauge, name, help, "gauge", labels)
        assert isinstance(m, Gauge)
        return m

    def families(self) -> list[Family]:
        with self._lock:
            metrics = sorted(self._metrics.values(), key=lambda m: m.name)
        return [m.family() for m in metrics]


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def render(families: Iterable[Family]) -> str:
    """The text exposition format: HELP and TYPE lines, then one line per sample, sorted."""
    out: list[str] = []
    seen: set[str] = set()
    for fam in families:
        if fam.name in seen:
            raise ValueError(f"metric family {fam.name} rendered twice")
        seen.add(fam.name)
        sample_name = f"{fam.name}_total" if fam.type == "counter" else fam.name
        out.append(f"# HELP {sample_name} {_escape_help(fam.help)}")
        out.append(f"# TYPE {sample_name} {fam.type}")
        for values in sorted(fam.samples):
            value = fam.samples[values]
            if fam.labels:
                pairs = ",".join(f'{n}="{_escape_label(v)}"' for n, v in zip(fam.labels, values, strict=True))
                out.append(f"{sample_name}{{{pairs}}} {_number(value)}")
            else:
                out.append(f"{sample_name} {_number(value)}")
    return "\n".join(out) + "\n"
