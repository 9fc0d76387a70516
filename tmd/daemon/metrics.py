"""Prometheus metrics of the daemon, all prefixed ``tmd_``, on one registry per daemon
(so tests and benchmarks can run several daemons in one process).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

import tmd

REJECT_REASONS = (
    "topic",
    "oversize",
    "json",
    "schema",
    "version",
    "value",
    "mismatch",
    "rank",
    "limit",
    "internal",
)
MESSAGE_KINDS = ("node_status", "gpu", "xid", "iter", "node_iter", "job_status", "ack", "unknown")


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Tally:
    """A lock-free counter for the single-threaded ingest loop."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def inc(self, n: int = 1) -> None:
        self.value += n


class FastHistogram:
    """Fixed buckets counted in a list; cumulated only when scraped."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class _IngestCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._m
        for name, doc, label, tallies in (
            (
                "tmd_messages_received",
                "MQTT messages received (valid or not), by topic kind",
                "kind",
                m.received_by,
            ),
            (
                "tmd_messages_rejected",
                "MQTT messages dropped as invalid, by reason",
                "reason",
                m.rejected_by,
            ),
            ("tmd_rank_steps", "Rank step reports, by outcome", "outcome", m.steps_by),
        ):
            family = CounterMetricFamily(name, doc, labels=[label])
            for key, tally in tallies.items():
                family.add_metric([key], tally.value)
            yield family
        h = m.latency
        cumulative, buckets = 0, []
        for bound, count in zip([*h.bounds, float("inf")], h.counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        yield HistogramMetricFamily(
            "tmd_ingest_latency_seconds",
            "Sender timestamp to applied in the cluster view (includes clock skew)",
            buckets=buckets,
            sum_value=h.sum,
        )


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        Info("tmd_build", "tmd version", registry=r).info({"version": tmd.__version__})
        # The ingest hot path counts in plain integers, exported at scrape time: a
        # prometheus_client child takes a lock per update, several per message.
        self.received_by = {k: Tally() for k in MESSAGE_KINDS}
        self.rejected_by = {k: Tally() for k in REJECT_REASONS}
        self.steps_by = {k: Tally() for k in ("accepted", "duplicate", "late")}
        self.latency = FastHistogram(LATENCY_BUCKETS)
        r.register(_IngestCollector(self))
        self.mqtt_connected = Gauge(
            "tmd_mqtt_connected", "1 while subscribed to the broker", registry=r
        )
        self.mqtt_connects = Counter(
            "tmd_mqtt_connects_total", "Successful broker connections", registry=r
        )
        self.mqtt_failures = Counter(
            "tmd_mqtt_connection_failures_total", "Lost or failed broker connections", registry=r
        )
        self.plugin_up = Gauge("tmd_plugin_up", "1 while a plug-in runs", ["plugin"], registry=r)
        self.plugin_restarts = Counter(
            "tmd_plugin_restarts_total", "Plug-in restarts after an error", ["plugin"], registry=r
        )
        self.plugin_seconds = Histogram(
            "tmd_plugin_batch_seconds",
            "Time a plug-in spent on one batch or tick",
            ["plugin"],
            registry=r,
        )
        self.bus_dropped = Counter(
            "tmd_bus_dropped_total",
            "Events dropped because a subscriber fell behind",
            ["subscriber"],
            registry=r,
        )
        self.events = Counter(
            "tmd_events_total", "Findings and decisions, by kind", ["kind"], registry=r
        )
        self.journal_errors = Counter(
            "tmd_journal_errors_total", "Journal writes that failed", registry=r
        )
        self.migrations = Counter(
            "tmd_migrations_total", "Migrations finished, by outcome", ["outcome"], registry=r
        )
        self.restarts = Counter(
            "tmd_restarts_total",
            "Checkpoint restarts the actuator asked jobs for, by outcome",
            ["outcome"],
            registry=r,
        )
        self.migrations_in_flight = Gauge(
            "tmd_migrations_in_flight", "Migrations the actuator is driving", registry=r
        )
        self.ingest_lag = Gauge(
            "tmd_ingest_lag_seconds",
            "How far behind the daemon's view is: its last probe's trip through the broker,"
            " or how overdue the next one is (-1: none came back yet)",
            registry=r,
        )
        self.view_stale = Gauge(
            "tmd_view_stale",
            "1 while the view is stale or settling: no absence findings, no migrations start",
            registry=r,
        )
        self.actuator_ignored = Counter(
            "tmd_actuator_ignored_total",
            "Well-formed messages the actuator would not act on, by reason",
            ["reason"],
            registry=r,
        )
        self.actuator_errors = Counter(
            "tmd_actuator_errors_total",
            "Unexpected errors in the actuator (it carries on), by what it was doing",
            ["during"],
            registry=r,
        )
        self.migration_downtime = Histogram(
            "tmd_migration_downtime_seconds",
            "Downtime of finished migrations, as the runtime measured it",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
            registry=r,
        )
        self.jobs = Gauge("tmd_view_jobs", "Jobs in the cluster view", registry=r)
        self.nodes = Gauge("tmd_view_nodes", "Nodes in the cluster view", registry=r)
        self.ranks = Gauge("tmd_view_ranks", "Ranks in the cluster view", registry=r)
        self.loop_lag = Gauge(
            "tmd_event_loop_lag_seconds", "Last measured event-loop scheduling lag", registry=r
        )
