"""Prometheus metrics of the daemon, all prefixed ``tmd_``, on one registry per daemon
(so tests and benchmarks can run several daemons in one process).

A label that names a training job is called ``tmd_job``, never ``job``: Prometheus
sets ``job`` to the scrape job and would rename ours ``exported_job`` (or, with
``honor_labels``, let it replace the scrape job). Counters whose label values are
known in advance are exported from 0, so the first increase is one ``rate`` sees.
"""

from __future__ import annotations

import bisect
from collections import Counter as Tallies
from collections.abc import Iterator
from typing import TYPE_CHECKING, get_args, get_type_hints

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

import tmd
from tmd import wire
from tmd.daemon import events

if TYPE_CHECKING:
    from tmd.daemon.view import ClusterView, JobView

    # policies import the plug-in API, which imports this module
    from tmd.policies.base import Stragglers

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
# Of a migration or a checkpoint restart; and what the view's machines and standbys can be.
OUTCOMES: tuple[str, ...] = get_args(get_type_hints(events.MigrationFinished)["outcome"])
NODE_ROLES: tuple[str, ...] = get_args(get_type_hints(wire.NodeStatus)["role"])
# "unknown": the view knows the machine from a sample or an XID, not yet its status
NODE_STATES: tuple[str, ...] = (*get_args(get_type_hints(wire.NodeStatus)["state"]), "unknown")
STANDBY_STATES: tuple[str, ...] = get_args(get_type_hints(wire.StandbyInfo)["state"])
# "unknown": the view knows the job from its ranks' steps, not yet from its status
JOB_STATES: tuple[str, ...] = (*get_args(get_type_hints(wire.JobStatus)["state"]), "unknown")


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LOOP_STALL_S = 5.0
"""An event-loop lag this long is a stall: /healthz fails, and it is counted."""


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
            (
                "tmd_messages_lost",
                "Messages that never reached this daemon (gaps in their senders' sequence"
                " numbers: a broker drops what a subscriber that lags cannot take),"
                " by kind of topic",
                "kind",
                m.lost_by,
            ),
            (
                "tmd_shard_dropped",
                "Telemetry the daemon dropped rather than pass on to an ingest shard that"
                " fell behind (ingest.shards), by kind of topic",
                "kind",
                m.dropped_by,
            ),
            (
                "tmd_gpu_samples",
                "GPU samples applied, by form: full; brief (each GPU's clock event reasons,"
                " its counters and flags as in the last full one); unresolved (brief, that"
                " full one never came: a heartbeat only)",
                "form",
                m.samples_by,
            ),
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


class ViewCollector(Collector):
    """What the cluster view holds, counted when scraped (nothing on the ingest path):
    its size, its machines, each job's state and standby machines, and the machines
    flagged slow now (``stragglers``, fed every finding the daemon emits). A scrape
    reads and changes nothing: what the view and the stragglers forget, the daemon's
    housekeeping prunes."""

    def __init__(self, view: ClusterView, stragglers: Stragglers) -> None:
        self._view = view
        self._stragglers = stragglers

    def collect(self) -> Iterator[Metric]:
        view = self._view
        for name, doc, value in (
            ("tmd_view_jobs", "Jobs in the cluster view", len(view.jobs)),
            ("tmd_view_nodes", "Nodes in the cluster view", len(view.nodes)),
            ("tmd_view_ranks", "Ranks in the cluster view", view.reporting_ranks()),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        yield from self._machines()
        yield from self._jobs()
        slowdown = GaugeMetricFamily(
            "tmd_straggler_slowdown",
            "Machines the straggler detector flagged and that are still in their job:"
            " how much slower than their peers (0.2 = 20%) when found",
            labels=["tmd_job", "node"],
        )
        # Only those still in their job, in a job the view still holds.
        for (job, node), straggler in sorted(self._stragglers.present(view.jobs)):
            slowdown.add_metric([job, node], straggler.slowdown)
        yield slowdown

    def _machines(self) -> Iterator[Metric]:
        view = self._view
        by_state: Tallies[tuple[str, str]] = Tallies()
        out: Tallies[str] = Tallies()
        for node in view.nodes.values():
            by_state[(node.role, node.state)] += 1
            out["gpu_fault"] += view.gpu_faulty(node.node, forget=False)
            out["lost"] += view.lost(node.node, forget=False)
        machines = GaugeMetricFamily(
            "tmd_machines",
            "Machines in the cluster view, by role and by their agent's last status",
            labels=["role", "state"],
        )
        for role in NODE_ROLES:
            for state in NODE_STATES:
                machines.add_metric([role, state], by_state[(role, state)])
        yield machines
        unusable = GaugeMetricFamily(
            "tmd_machines_out_of_service",
            "Machines no migration moves work onto, by cause: gpu_fault (a GPU fault since"
            " their agent last started), lost (offline, or silent since a NodeLost)",
            labels=["cause"],
        )
        for cause in ("gpu_fault", "lost"):
            unusable.add_metric([cause], out[cause])
        yield unusable

    def _jobs(self) -> Iterator[Metric]:
        view = self._view
        in_state = GaugeMetricFamily(
            "tmd_job_state",
            "Each job's state by its last status, 1 for the one it is in: running,"
            " migrating, restarting, stopped (it ended; the view keeps it until"
            " ingest.forget_after_s), unknown (no status yet)",
            labels=["tmd_job", "state"],
        )
        listed = GaugeMetricFamily(
            "tmd_job_standbys",
            "Standby machines each job's status lists, by their state",
            labels=["tmd_job", "state"],
        )
        ready = GaugeMetricFamily(
            "tmd_job_standbys_ready",
            "Standby machines that may take a machine of the job now (ready, not a member,"
            " their machine neither offline nor faulty, with the machine's slots and GPU"
            " model), for the job's worst-off machine: the fewest over each kind (slots,"
            " GPU model) of its machines. 0 means a failure of some machine costs a"
            " checkpoint restart",
            labels=["tmd_job"],
        )
        for name, job in sorted(view.jobs.items()):
            for state in JOB_STATES:
                in_state.add_metric([name, state], float(job.state == state))
            states: Tallies[str] = Tallies(s.state for s in job.standbys.values())
            for state in STANDBY_STATES:
                listed.add_metric([name, state], states[state])
            ready.add_metric([name], fewest_ready(view, name, job))
        yield in_state
        yield listed
        yield ready


def fewest_ready(view: ClusterView, name: str, job: JobView) -> int:
    """The ready standbys (``ClusterView.ready_standbys``, changing nothing) of the
    machine of job ``name`` that has fewest: a standby takes a machine of as many
    slots, and of its GPU model, so one representative of each kind of machine is
    asked about. A job without members: its ready standbys, whatever they fit."""
    leavers: dict[tuple[int, str], str] = {}
    for machine, ranks in job.machines().items():
        model = view.gpu_model(machine) if view.same_gpu_model else ""
        leavers.setdefault((len(ranks), model), machine)
    if not leavers:
        return len(view.ready_standbys(name, forget=False))
    return min(
        len(view.ready_standbys(name, leaver=leaver, forget=False)) for leaver in leavers.values()
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
        self.lost_by = {k: Tally() for k in ("gpu", "node_iter", "iter")}
        self.samples_by = {k: Tally() for k in ("full", "brief", "unresolved")}
        self.dropped_by = {k: Tally() for k in ("iter", "node_iter")}
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
        for kind in events.ALL:
            self.events.labels(kind=kind.__name__)
        self.journal_errors = Counter(
            "tmd_journal_errors_total", "Journal writes that failed", registry=r
        )
        # Its children start at 0 for each policy the daemon runs, and the runtime's,
        # when it starts (``migration_started``): the policies are plug-ins, not known
        # here. A migration of another (resumed, of a policy since disabled) starts
        # them when it starts.
        self.migrations = Counter(
            "tmd_migrations_total",
            "Migrations finished, by outcome and by the policy that decided them"
            " (runtime: a failover the job's runtime did by itself)",
            ["outcome", "policy"],
            registry=r,
        )
        self.restarts = Counter(
            "tmd_restarts_total",
            "Checkpoint restarts the actuator asked jobs for, by outcome",
            ["outcome"],
            registry=r,
        )
        for outcome in OUTCOMES:
            self.restarts.labels(outcome=outcome)
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
        self.loop_lag = Gauge(
            "tmd_event_loop_lag_seconds", "Last measured event-loop scheduling lag", registry=r
        )
        self.loop_stalls = Counter(
            "tmd_event_loop_stalls_total",
            f"Event-loop lags of {LOOP_STALL_S:g} s or more, each counted when measured (a"
            " stall between two scrapes too, which the last lag does not show)",
            registry=r,
        )

    def loop_lagged(self, lag_s: float) -> None:
        """The event loop ran ``lag_s`` late (measured about once a second)."""
        self.loop_lag.set(lag_s)
        if lag_s >= LOOP_STALL_S:
            self.loop_stalls.inc()

    def watch(self, view: ClusterView, stragglers: Stragglers) -> None:
        """Export what ``view`` holds, and the machines flagged slow now, when scraped."""
        self.registry.register(ViewCollector(view, stragglers))

    def plugin_started(self, plugin: str) -> None:
        """``plugin``'s restart counter from 0, so its first restart is an increase."""
        self.plugin_restarts.labels(plugin=plugin)

    def migration_started(self, policy: str) -> None:
        """``policy``'s migration counters from 0 (if not yet), so its first failure is
        an increase."""
        for outcome in OUTCOMES:
            self.migrations.labels(outcome=outcome, policy=policy)
