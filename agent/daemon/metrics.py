"""The agent's Prometheus metrics, kept and rendered by prometheus_client in a registry of its own.

Two sources feed /metrics: counters and gauges that components update as things happen (API
requests, refused peers, deliveries), and a `MetricsSnapshot` the recorder backend returns on each
scrape (events by kind, losses, runs active, consumer lag, bundle bytes). Each agent has its own
`Registry` (a private `CollectorRegistry`, never prometheus_client's global one); `Registry.render`
is the text exposition format (0.0.4), without the `_created` series prometheus_client would add.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4


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


def snapshot_families(s: MetricsSnapshot) -> list[Metric]:
    """The snapshot as metric families (counter names without their _total suffix)."""
    events = CounterMetricFamily("evidence_events", "Events recorded, by kind.", labels=("kind",))
    for kind, n in sorted(s.events_by_kind.items()):
        events.add_metric((kind,), float(n))
    lost = CounterMetricFamily(
        "evidence_events_lost",
        "Events lost (kernel buffer full or agent overload), by kind.",
        labels=("kind",),
    )
    for kind, n in sorted(s.lost_by_kind.items()):
        lost.add_metric((kind,), float(n))
    return [
        events,
        lost,
        GaugeMetricFamily("evidence_runs_active", "Runs being recorded now.", value=s.runs_active),
        CounterMetricFamily("evidence_runs_started", "Runs started.", value=s.runs_started),
        CounterMetricFamily(
            "evidence_runs_finished", "Runs finished (bundle written).", value=s.runs_finished
        ),
        GaugeMetricFamily(
            "evidence_consumer_lag_seconds",
            "Age of the oldest event not yet consumed from the kernel buffer.",
            value=s.consumer_lag_seconds,
        ),
        CounterMetricFamily("evidence_bundle_bytes", "Bytes of bundles written.", value=s.bundle_bytes),
        CounterMetricFamily("evidence_bundles_written", "Bundles written.", value=s.bundles_written),
    ]


class SnapshotCollector:
    """A prometheus_client collector that asks `source` for a snapshot at each scrape (nothing
    while there is no source)."""

    def __init__(self, source: Callable[[], MetricsSnapshot] | None = None) -> None:
        self.source = source

    def collect(self) -> Iterable[Metric]:
        return [] if self.source is None else snapshot_families(self.source())

    def describe(self) -> Iterable[Metric]:
        # the names it may produce, so that the registry refuses a counter or gauge clashing with one
        return snapshot_families(MetricsSnapshot())


class _WithoutCreated:
    """The registry's families minus prometheus_client's `<name>_created` samples, which the
    agent's exposition never had (scrapers and dashboards see the same series as before)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        for fam in self._registry.collect():
            out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            out.samples = [s for s in fam.samples if s.name != f"{fam.name}_created"]
            yield out


class Registry:
    """One agent's metrics. `counter()`/`gauge()` return the existing metric when called again with
    the same name and labels, so components can share one registry without coordination; another
    type or other labels under a taken name is a ValueError. Thread-safe, as prometheus_client is."""

    def __init__(self) -> None:
        self.collectors = CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        self._metrics: dict[str, tuple[Counter | Gauge, tuple[str, ...]]] = {}
        self._snapshot = SnapshotCollector()
        self.collectors.register(self._snapshot)

    def _get(
        self, cls: type[Counter] | type[Gauge], name: str, help: str, labels: Sequence[str]
    ) -> Counter | Gauge:
        with self._lock:
            known = self._metrics.get(name)
            if known is None:
                metric = cls(name, help, tuple(labels), registry=self.collectors)
                self._metrics[name] = (metric, tuple(labels))
                return metric
            if type(known[0]) is not cls or known[1] != tuple(labels):
                raise ValueError(f"metric {name} already registered with another type or labels")
            return known[0]

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        """A counter; its samples are named `<name>_total`."""
        metric = self._get(Counter, name, help, labels)
        assert isinstance(metric, Counter)
        return metric

    def gauge(self, name: str, help: str, labels: Sequence[str] = ()) -> Gauge:
        metric = self._get(Gauge, name, help, labels)
        assert isinstance(metric, Gauge)
        return metric

    def read_snapshot_from(self, source: Callable[[], MetricsSnapshot]) -> None:
        """Have each scrape include `source()`'s snapshot (one source; a later call replaces it)."""
        self._snapshot.source = source

    def value(self, sample: str, **labels: str) -> float:
        """The current value of one sample (`evidence_api_refused_peers_total`, ...), 0 if none yet."""
        return self.collectors.get_sample_value(sample, labels) or 0.0

    def render(self) -> bytes:
        """Every metric in the text exposition format (0.0.4): see CONTENT_TYPE."""
        return generate_latest(_WithoutCreated(self.collectors))


@dataclasses.dataclass(frozen=True)
class FleetMetrics:
    """The fleet publisher's metrics (agent/daemon/fleet.py): its outbox's backlog by kind (bundle,
    event), what was sent, and the errors by what failed (connect, publish, bundle, layout, nats,
    outbox), a refusal of the server's among them."""

    backlog_items: Gauge
    backlog_bytes: Gauge
    backlog_age: Gauge
    connected: Gauge
    events_published: Counter
    events_duplicate: Counter
    events_dropped: Counter
    bundles_stored: Counter
    bundle_bytes_stored: Counter
    errors: Counter

    @classmethod
    def of(cls, reg: Registry) -> FleetMetrics:
        kind = ("kind",)
        return cls(
            backlog_items=reg.gauge(
                "evidence_fleet_backlog_items", "Bundles and events in the fleet outbox.", kind
            ),
            backlog_bytes=reg.gauge("evidence_fleet_backlog_bytes", "Bytes in the fleet outbox.", kind),
            backlog_age=reg.gauge(
                "evidence_fleet_backlog_age_seconds", "Age of the oldest item in the fleet outbox.", kind
            ),
            connected=reg.gauge("evidence_fleet_connected", "1 while connected to the fleet's NATS servers."),
            events_published=reg.counter(
                "evidence_fleet_events_published", "Live events JetStream acknowledged."
            ),
            events_duplicate=reg.counter(
                "evidence_fleet_events_duplicate", "Live events sent again that JetStream already had."
            ),
            events_dropped=reg.counter(
                "evidence_fleet_events_dropped",
                "Live events dropped (each is in its run's bundle): the outbox full or unwritable, or larger than the server takes.",
            ),
            bundles_stored=reg.counter("evidence_fleet_bundles_stored", "Bundles stored and indexed."),
            bundle_bytes_stored=reg.counter("evidence_fleet_bundle_bytes_stored", "Bytes of bundles stored."),
            errors=reg.counter(
                "evidence_fleet_errors", "Fleet publishing errors, by what failed.", ("what",)
            ),
        )
