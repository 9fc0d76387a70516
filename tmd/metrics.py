"""Prometheus metrics of the daemon, all prefixed ``tmd_``, on one registry per daemon
(so tests and benchmarks can run several daemons in one process).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

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
MESSAGE_KINDS = ("node_status", "gpu", "xid", "iter", "job_status", "ack", "unknown")


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        Info("tmd_build", "tmd version", registry=r).info({"version": tmd.__version__})
        self.received = Counter(
            "tmd_messages_received_total",
            "MQTT messages received (valid or not), by topic kind",
            ["kind"],
            registry=r,
        )
        self.rejected = Counter(
            "tmd_messages_rejected_total",
            "MQTT messages dropped as invalid, by reason",
            ["reason"],
            registry=r,
        )
        self.steps = Counter(
            "tmd_rank_steps_total", "Rank step reports, by outcome", ["outcome"], registry=r
        )
        self.latency = Histogram(
            "tmd_ingest_latency_seconds",
            "Sender timestamp to applied in the cluster view (includes clock skew)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
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
        self.jobs = Gauge("tmd_view_jobs", "Jobs in the cluster view", registry=r)
        self.nodes = Gauge("tmd_view_nodes", "Nodes in the cluster view", registry=r)
        self.ranks = Gauge("tmd_view_ranks", "Ranks in the cluster view", registry=r)
        self.loop_lag = Gauge(
            "tmd_event_loop_lag_seconds", "Last measured event-loop scheduling lag", registry=r
        )
        # Bound children once: labels() takes a lock and a dict lookup per call.
        self.rejected_by = {k: self.rejected.labels(reason=k) for k in REJECT_REASONS}
        self.received_by = {k: self.received.labels(kind=k) for k in MESSAGE_KINDS}
        self.steps_by = {k: self.steps.labels(outcome=k) for k in ("accepted", "duplicate", "late")}
