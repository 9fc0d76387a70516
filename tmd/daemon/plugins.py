"""Plug-ins (detectors and policies): the interface, the registry and the supervised
runner that wraps every one of them.

A plug-in is a class with a ``name``, a ``Config`` dataclass (its ``[detectors.NAME]``
or ``[policies.NAME]`` table), the event types it ``consumes`` and an optional
``tick_interval``. Its ``Config``'s ``validate()`` runs for every table, enabled or
not, and ``validate_enabled()``, if it has one, for an enabled plug-in only (what only
a running plug-in needs, a model file, say); its constructor opens what it needs, so a
bad config fails at start; ``observe`` and ``tick`` are plain synchronous functions that return
new events, with the time passed in, so the simulator can drive them without asyncio.

Built-ins are listed explicitly in ``tmd.detectors.BUILTIN`` / ``tmd.policies.BUILTIN``;
third-party plug-ins come through the entry-point groups ``tmd.detectors`` and
``tmd.policies``. One runner wraps every plug-in with timing, metrics and isolation:
an exception restarts that plug-in (rebuilt from its config) after a back-off, and
never touches the others.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from importlib.metadata import entry_points
from typing import Any, ClassVar, Literal

from tmd import config as config_mod
from tmd import log
from tmd.clock import Clock
from tmd.connection import cancelling
from tmd.daemon import events
from tmd.daemon.bus import Bus, Subscription
from tmd.daemon.metrics import Metrics
from tmd.daemon.view import ClusterView
from tmd.errors import ConfigError, PluginError

Kind = Literal["detectors", "policies"]


@dataclass(frozen=True, kw_only=True)
class NoConfig:
    """For plug-ins without settings of their own."""


@dataclass(frozen=True)
class Context:
    """What a plug-in may read: the cluster view (read only, by convention) and time."""

    view: ClusterView
    clock: Clock


class Plugin:
    name: ClassVar[str]
    Config: ClassVar[type[Any]] = NoConfig
    consumes: ClassVar[tuple[type, ...]] = ()
    tick_interval: ClassVar[timedelta | None] = None
    enabled_by_default: ClassVar[bool] = True

    def __init__(self, config: Any, *, context: Context) -> None:
        self.config = config
        self.context = context

    def observe(self, event: Any, now: float) -> Iterable[events.Event]:
        return ()

    def tick(self, now: float) -> Iterable[events.Event]:
        return ()


@dataclass(frozen=True)
class Spec:
    """A configured, enabled plug-in: enough to (re)build it."""

    kind: Kind
    name: str
    factory: type[Plugin]
    config: Any

    def build(self, context: Context) -> Plugin:
        return self.factory(self.config, context=context)


def available(kind: Kind, builtin: Mapping[str, type[Plugin]]) -> dict[str, type[Plugin]]:
    """``builtin`` plus the entry-point plug-ins of ``kind``, by name. The built-ins are
    passed in (``tmd.detectors.BUILTIN``...) because those packages import this one."""
    found: dict[str, type[Plugin]] = dict(builtin)
    for ep in entry_points(group=f"tmd.{kind}"):
        if ep.name in found:
            raise PluginError(f"{kind} plug-in {ep.name!r} from {ep.value} shadows a built-in")
        try:
            cls = ep.load()
        except Exception as exc:
            raise PluginError(
                f"cannot load {kind} plug-in {ep.name!r} ({ep.value}): {exc}"
            ) from exc
        if not (isinstance(cls, type) and issubclass(cls, Plugin)):
            raise PluginError(f"{kind} plug-in {ep.name!r} ({ep.value}) is not a Plugin class")
        if getattr(cls, "name", None) != ep.name:
            raise PluginError(
                f"{kind} plug-in {ep.value} is registered as {ep.name!r} but named "
                f"{getattr(cls, 'name', None)!r}: one name per plug-in"
            )
        found[ep.name] = cls
    return found


def configure(
    kind: Kind, tables: Mapping[str, Mapping[str, Any]], known: Mapping[str, type[Plugin]]
) -> list[Spec]:
    """Specs of the enabled plug-ins, every table checked against its plug-in's Config."""
    for name in tables:
        if name not in known:
            raise ConfigError(
                f"{kind}.{name}", f"no such plug-in (known: {', '.join(sorted(known)) or 'none'})"
            )
    specs = []
    for name, factory in sorted(known.items()):
        table = dict(tables.get(name, {}))
        enabled = table.pop("enabled", factory.enabled_by_default)
        if not isinstance(enabled, bool):
            raise ConfigError(f"{kind}.{name}.enabled", f"must be true or false, got {enabled!r}")
        cfg = config_mod.build_section(factory.Config, table, f"{kind}.{name}")
        validate = getattr(cfg, "validate", None)
        if callable(validate):
            validate()
        if enabled:
            # What only an enabled plug-in needs (a model file, say) is checked here.
            needed = getattr(cfg, "validate_enabled", None)
            if callable(needed):
                needed()
            specs.append(Spec(kind, name, factory, cfg))
    return specs


class Runner:
    """Runs one plug-in forever: feed it batches, tick it, restart it when it fails."""

    # After each batch the runner lets events pile up this long: ingest hands over one
    # message per socket read, and waking every plug-in for each of tens of thousands
    # a second would cost more than the plug-ins' own work. Findings wait at most this.
    LINGER_S = 0.02
    MIN_BACKOFF_S = 0.5
    MAX_BACKOFF_S = 60.0
    STABLE_AFTER_S = 300.0  # running this long resets the back-off

    def __init__(
        self,
        spec: Spec,
        *,
        context: Context,
        bus: Bus,
        metrics: Metrics,
        emit: Callable[[events.Event, str], None],
    ) -> None:
        self.spec = spec
        self._context = context
        self._bus = bus
        self._metrics = metrics
        self._emit = emit
        self._log = log.get(spec.name)
        self.restarts = 0
        self.up = False

    async def run(self) -> None:
        label = self.spec.name
        up = self._metrics.plugin_up.labels(plugin=label)
        self._metrics.plugin_started(label)
        consumes = self.spec.factory.consumes
        # One subscription for the runner's life: events that arrive while the plug-in
        # backs off after a failure wait in the queue instead of being lost.
        sub = self._bus.subscribe(label, consumes) if consumes else None
        backoff = self.MIN_BACKOFF_S
        try:
            while True:
                if cancelling():  # a library swallowed the cancellation and returned
                    raise asyncio.CancelledError
                started = time.monotonic()
                try:
                    plugin = self.spec.build(self._context)
                    self.up = True
                    up.set(1)
                    await self._serve(plugin, sub)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    if cancelling():  # a library's error in place of the cancellation
                        raise asyncio.CancelledError from exc
                    self.up = False
                    up.set(0)
                    self.restarts += 1
                    self._metrics.plugin_restarts.labels(plugin=label).inc()
                    if time.monotonic() - started > self.STABLE_AFTER_S:
                        backoff = self.MIN_BACKOFF_S
                    self._log.exception("plug-in failed; restarting", retry_in_s=backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, self.MAX_BACKOFF_S)
        finally:
            self.up = False
            up.set(0)
            if sub is not None:
                self._bus.unsubscribe(sub)

    async def _serve(self, plugin: Plugin, sub: Subscription | None) -> None:
        clock = self._context.clock
        timer = self._metrics.plugin_seconds.labels(plugin=self.spec.name)
        interval = plugin.tick_interval.total_seconds() if plugin.tick_interval else None
        next_tick = clock.monotonic() + interval if interval else None
        while True:
            wait = None if next_tick is None else max(0.0, next_tick - clock.monotonic())
            if sub is not None:
                batch = await sub.batch(wait)
            else:
                await clock.sleep(wait if wait is not None else 3600.0)
                batch = []
            if batch:
                with timer.time():
                    now = clock.now()
                    for event in batch:
                        self._publish(plugin.observe(event, now))
            if next_tick is not None and clock.monotonic() >= next_tick:
                with timer.time():
                    self._publish(plugin.tick(clock.now()))
                next_tick = max(next_tick + (interval or 0.0), clock.monotonic())
            if batch:
                await asyncio.sleep(self.LINGER_S)

    def _publish(self, out: Iterable[events.Event]) -> None:
        for event in out:
            if not isinstance(event, events.Event):
                raise PluginError(f"{self.spec.name} returned {type(event).__name__}, not an Event")
            self._emit(event, self.spec.name)
