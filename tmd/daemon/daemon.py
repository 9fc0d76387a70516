"""The daemon: builds every component from the config and supervises them under one
``asyncio.TaskGroup``.

Plug-ins restart themselves (``tmd.daemon.plugins.Runner``); the core (ingest loop,
housekeeping, watchdog) does not: if it fails, the task group fails, the daemon
exits non-zero and systemd restarts it. READY=1 goes to systemd only once the HTTP
port is bound and the MQTT subscriptions are acknowledged; watchdog pings come from
a task that also measures the event loop's lag, so a stalled loop stops the pings.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any, Final

from tmd import detectors, log, policies, sdnotify, wire
from tmd.clock import Clock, SystemClock
from tmd.config import Config
from tmd.daemon import events, plugins, routes
from tmd.daemon.actuator import Actuator
from tmd.daemon.actuator.membership import RUNTIME
from tmd.daemon.api import Api
from tmd.daemon.bus import Bus
from tmd.daemon.ingest import Ingest
from tmd.daemon.journal import Journal
from tmd.daemon.metrics import LOOP_STALL_S, Metrics
from tmd.daemon.shards import Shards
from tmd.daemon.view import ClusterView
from tmd.errors import JournalError
from tmd.policies.base import Stragglers

HOUSEKEEPING_INTERVAL_S = 60.0
LAG_PROBE_INTERVAL_S = 1.0
FULL_COLLECTION_EVERY: Final = 100
"""Middle-generation collections per full one, at least (``collect_rarely``)."""


def collect_rarely() -> None:
    """Python starts a full collection every 10 collections of its middle generation,
    once what outlived them grew by a quarter, and a full one walks every tracked
    object. A cluster's first reports make objects by the rank and by the GPU (some
    450,000 at 131,072 ranks): measured, six full collections in that first second,
    0.53 s of the daemon's time when its backlog is largest. Every 100 instead: one.
    Young objects are collected as before; cyclic garbage that outlived two young
    collections waits longer for the full one (some 700,000 net allocations at
    Python 3.11's thresholds). Jobs and ranks the view drops are freed by their
    reference counts, not by a full collection. (CPython 3.14.0-3.14.4's incremental
    collector ignores this threshold.)"""
    young, middle, full = gc.get_threshold()
    gc.set_threshold(young, middle, max(full, FULL_COLLECTION_EVERY))


def plugin_specs(config: Config) -> list[plugins.Spec]:
    """The enabled detectors and policies, built-in and from entry points, each table
    checked against its plug-in's Config (a bad one raises ConfigError)."""
    return [
        *plugins.configure(
            "detectors", config.detectors, plugins.available("detectors", detectors.BUILTIN)
        ),
        *plugins.configure(
            "policies", config.policies, plugins.available("policies", policies.BUILTIN)
        ),
    ]


def note_finding(view: ClusterView, event: events.Event, now: float) -> None:
    """What the view must know of a finding before anyone hears of it: the policies
    and the actuator both ask the view for ready standbys, and neither may offer a
    faulty or lost machine. A lost machine's processes are not asked to restart
    (``ClusterView.lost``). The daemon and the simulator (``tmd.sim``) both call it."""
    if isinstance(event, (events.GpuFault, events.NodeLost)):
        view.note_fault(event.node, now, lost=isinstance(event, events.NodeLost))


class Daemon:
    def __init__(self, config: Config, *, clock: Clock | None = None) -> None:
        self.config = config
        self.clock = clock or SystemClock()
        self.metrics = Metrics()
        self.log = log.get("daemon")
        ing = config.ingest
        self.view = ClusterView.of(config)
        # The machines flagged slow now, for /metrics (the policies keep their own).
        self.stragglers = Stragglers()
        self.metrics.watch(self.view, self.stragglers)
        self.bus = Bus(on_drop=self._on_bus_drop)
        self.specs = plugin_specs(config)
        # Every policy that can start a migration, counted from 0 now: a runtime's
        # failover, or a migration resumed after a restart, may start and end between
        # two scrapes, and an increase from a series's first sample is none. (Operators'
        # requests are the drain policy's, alerts the alert policy's.)
        for name in (*(s.name for s in self.specs if s.kind == "policies"), RUNTIME):
            self.metrics.migration_started(name)
        self.journal = Journal(config.journal.resolved_path())
        self.ingest = Ingest(
            mqtt=config.mqtt,
            config=ing,
            view=self.view,
            bus=self.bus,
            metrics=self.metrics,
            clock=self.clock,
        )
        context = plugins.Context(view=self.view, clock=self.clock)
        # With ingest shards, the detectors that read ranks run in them (on the jobs each
        # owns), the rest here (``tmd.daemon.shards``).
        self.shards: Shards | None = None
        here = self.specs
        if ing.shards:
            sharded = [s for s in self.specs if getattr(s.factory, "reads_ranks", False)]
            here = [s for s in self.specs if s not in sharded]
            self.shards = Shards(
                config=config, specs=sharded, metrics=self.metrics, view=self.view,
                emit=self.emit, clock=self.clock,
            )  # fmt: skip
            self.ingest.shards = self.shards
            self.view.on_forget_job = self.shards.forget
            for spec in here:  # the ranks' steps never reach this process's bus
                if spec.kind == "detectors" and wire.IterBatch in spec.factory.consumes:
                    self.log.warning(
                        "a detector that takes rank telemetry without reads_ranks = True "
                        "sees none with ingest.shards", plugin=spec.name,
                    )  # fmt: skip
        self.runners = [
            plugins.Runner(s, context=context, bus=self.bus, metrics=self.metrics, emit=self.emit)
            for s in here
        ]
        self.api = Api(
            config=config.api,
            view=self.view,
            journal=self.journal,
            metrics=self.metrics,
            clock=self.clock,
            health=self.health,
        )
        self.actuator = Actuator(
            config=config.actuator,
            guard=config.guardrails,
            view=self.view,
            journal=self.journal,
            emit=self.emit,
            metrics=self.metrics,
        )
        if self.shards is not None:
            self.api.shard_rows = self.shards.rank_rows
        for route in routes.routes(self.emit, now=self.clock.now):
            self.api.add_route(route.method, route.path, route.handler)
        self.ready = asyncio.Event()
        self.loop_lag_s = 0.0

    def emit(self, event: events.Event, source: str) -> None:
        """A finding, decision or request: journal it, count it, log it, pass it on."""
        kind = type(event).__name__
        now = self.clock.now()
        note_finding(self.view, event, now)
        if isinstance(event, Stragglers.consumes):
            self.stragglers.observe(event, now)
        self.metrics.events.labels(kind=kind).inc()
        try:
            self.journal.record(event, source=source)
        except JournalError as exc:
            self.metrics.journal_errors.inc()
            self.log.error("journal write failed", error=str(exc), kind=kind)
        self.log.info(
            _what(event),
            kind=kind,
            source=source,
            **{k: v for k, v in _fields(event).items() if k != "ts"},
        )
        self.bus.publish(event)

    def health(self) -> dict[str, Any]:
        up = {r.spec.name: r.up for r in self.runners}
        view = self.view.freshness.state(self.clock.now())
        if self.shards is not None:
            up.update(self.shards.plugins_up())
            if view == "current" and self.shards.stale():
                view = "stale"  # the ranks' part of the view is behind
        lag_ok = self.loop_lag_s < LOOP_STALL_S
        return {
            "ok": self.ingest.connected and lag_ok,
            "mqtt": "connected" if self.ingest.connected else "disconnected",
            "loop_lag_s": round(self.loop_lag_s, 4),
            "view": view,
            # Telemetry known lost on the way here: each settles the view anew.
            "messages_lost": sum(t.value for t in self.metrics.lost_by.values()),
            "plugins": up,
        }

    async def run(self) -> None:
        collect_rarely()  # the daemon owns its process
        try:
            await self.api.start()
            async with asyncio.TaskGroup() as tg:
                if self.shards is not None:
                    self.shards.start()  # before the first message is read
                    tg.create_task(self.shards.wait_died(), name="shards")
                tg.create_task(self.ingest.run(), name="ingest")
                tg.create_task(self.ingest.probe(), name="probe")
                for runner in self.runners:
                    tg.create_task(runner.run(), name=f"plugin:{runner.spec.name}")
                tg.create_task(
                    self.actuator.run(
                        bus=self.bus,
                        clock=self.clock,
                        publish=self.ingest.publish,
                        subscribed=self.ingest.subscribed,
                    ),
                    name="actuator",
                )
                tg.create_task(self._announce_ready(), name="ready")
                tg.create_task(self._watchdog(), name="watchdog")
                tg.create_task(self._housekeeping(), name="housekeeping")
        finally:
            sdnotify.stopping()
            if self.shards is not None:
                self.shards.stop()
            await self.api.stop()
            self.journal.close()

    async def _announce_ready(self) -> None:
        sdnotify.notify("STATUS=connecting to the MQTT broker")
        await self.ingest.subscribed.wait()
        self.ready.set()
        sdnotify.ready(f"serving on port {self.api.port}")
        self.log.info("ready", api_port=self.api.port, plugins=[s.name for s in self.specs])

    async def _watchdog(self) -> None:
        interval = sdnotify.watchdog_interval()
        probe = LAG_PROBE_INTERVAL_S
        if interval is not None:
            probe = min(probe, interval.total_seconds() / 4)
        max_lag = interval.total_seconds() / 2 if interval is not None else float("inf")
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            await asyncio.sleep(probe)
            self.loop_lag_s = max(0.0, loop.time() - start - probe)
            self.metrics.loop_lagged(self.loop_lag_s)
            if interval is not None and self.loop_lag_s < max_lag:
                sdnotify.watchdog_ping()

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL_S)
            self.housekeep(self.clock.now())

    def housekeep(self, now: float) -> None:
        """Every ``HOUSEKEEPING_INTERVAL_S``: what outside publishers name is forgotten
        once silent (the view), once its job is forgotten or its machine left the job
        (the actuator, the machines flagged slow), or once past the journal's
        retention, so no table grows with every name ever seen."""
        jobs, nodes = self.view.forget_silent(now, self.config.ingest.forget_after_s)
        if jobs or nodes:
            self.log.info("forgot silent jobs and nodes", jobs=jobs, nodes=nodes)
        self.stragglers.forget_gone(self.view.jobs)  # /metrics only reads them
        self.actuator.prune(now)
        try:
            before = now - self.config.journal.retention_days * 86400
            self.journal.prune(before, keep_jobs=self.view.jobs.keys())
        except JournalError as exc:
            self.metrics.journal_errors.inc()
            self.log.error("journal prune failed", error=str(exc))

    def _on_bus_drop(self, subscriber: str) -> None:
        self.metrics.bus_dropped.labels(subscriber=subscriber).inc()


def _what(event: events.Event) -> str:
    if isinstance(event, events.Decision):
        return "decision"
    if isinstance(event, events.Request):
        return "request"
    if isinstance(event, events.MigrationFinished):
        return "migration finished"
    if isinstance(event, events.JobRestarted):
        return "job restarted"
    return "finding"


def _fields(event: events.Event) -> dict[str, Any]:
    return {f: getattr(event, f) for f in event.__struct_fields__}
