"""Plug-ins: the registry (built-ins, entry points, config), and the supervised runner
that restarts a failing plug-in with back-off without touching the others."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import eventually
from tmd import detectors, policies, wire
from tmd.clock import SystemClock
from tmd.daemon import events, plugins
from tmd.daemon.bus import Bus
from tmd.daemon.metrics import Metrics
from tmd.daemon.view import ClusterView
from tmd.errors import ConfigError, PluginError

TS = 1_800_000_000.0


def test_builtins_and_their_config() -> None:
    known = plugins.available("detectors", detectors.BUILTIN)
    assert "node_lost" in known
    specs = plugins.configure("detectors", {"node_lost": {"heartbeat_timeout_s": 3}}, known)
    (spec,) = [s for s in specs if s.name == "node_lost"]
    assert spec.config.heartbeat_timeout_s == 3
    names = [
        s.name for s in plugins.configure("detectors", {"node_lost": {"enabled": False}}, known)
    ]
    assert "node_lost" not in names and "straggler" in names
    with pytest.raises(ConfigError) as err:
        plugins.configure("detectors", {"node_lost": {"heartbeat_timeout_s": -1}}, known)
    assert err.value.key == "detectors.node_lost.heartbeat_timeout_s"
    with pytest.raises(ConfigError) as err:
        plugins.configure("detectors", {"node_lost": {"enabled": "yes"}}, known)
    assert err.value.key == "detectors.node_lost.enabled"


@contextlib.contextmanager
def installed(tmp_path: Path, module: str, source: str, entry_points: str) -> Iterator[None]:
    """A real installed distribution (dist-info on sys.path) exposing entry points."""
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
    info = tmp_path / f"{module}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points)
    sys.path.insert(0, str(tmp_path))
    try:
        yield
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(module, None)


def test_entry_point_plugins_are_found(tmp_path: Path) -> None:
    source = """
        from tmd.detectors import Detector
        class Thermal(Detector):
            name = "thermal"
    """
    with installed(
        tmp_path, "acme_detect", source, "[tmd.detectors]\nthermal = acme_detect:Thermal\n"
    ):
        known = plugins.available("detectors", detectors.BUILTIN)
        assert known["thermal"].__module__ == "acme_detect"
        assert "thermal" in [s.name for s in plugins.configure("detectors", {}, known)]


def test_entry_point_name_must_be_the_plugin_name(tmp_path: Path) -> None:
    source = "from tmd.policies import Policy\nclass P(Policy):\n    name = 'other'\n"
    entry = "[tmd.policies]\nmine = misnamed_mod:P\n"
    with (
        installed(tmp_path, "misnamed_mod", source, entry),
        pytest.raises(PluginError, match="one name per plug-in"),
    ):
        plugins.available("policies", policies.BUILTIN)


def test_entry_point_that_is_not_a_plugin_is_refused(tmp_path: Path) -> None:
    with (
        installed(
            tmp_path, "bogus_mod", "thing = 42\n", "[tmd.policies]\nbogus = bogus_mod:thing\n"
        ),
        pytest.raises(PluginError, match="not a Plugin class"),
    ):
        plugins.available("policies", policies.BUILTIN)


@dataclass(frozen=True, kw_only=True)
class FlakyConfig:
    fail_first: int = 2


class Flaky(plugins.Plugin):
    """Raises on its first ``fail_first`` builds' first event, then echoes findings."""

    name = "flaky"
    Config = FlakyConfig
    consumes = (wire.XidEvent,)
    builds = 0

    def __init__(self, config: FlakyConfig, *, context: plugins.Context) -> None:
        super().__init__(config, context=context)
        type(self).builds += 1
        self.fail = type(self).builds <= config.fail_first

    def observe(self, event: Any, now: float) -> Iterable[events.Event]:
        if self.fail:
            raise RuntimeError("boom")
        yield events.GpuFault(ts=now, node=event.node, gpu=event.gpu, cause=f"xid {event.xid}")


class Steady(plugins.Plugin):
    name = "steady"
    consumes = (wire.XidEvent,)

    def observe(self, event: Any, now: float) -> Iterable[events.Event]:
        yield events.GpuDegraded(ts=now, node=event.node, gpu=event.gpu, cause="seen")


async def test_failing_plugin_is_restarted_and_others_keep_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(plugins.Runner, "MIN_BACKOFF_S", 0.01)
    Flaky.builds = 0
    bus, metrics = Bus(), Metrics()
    out: list[tuple[str, events.Event]] = []
    context = plugins.Context(view=ClusterView(), clock=SystemClock())
    runners = [
        plugins.Runner(
            plugins.Spec("detectors", cls.name, cls, cfg),
            context=context,
            bus=bus,
            metrics=metrics,
            emit=lambda e, src: out.append((src, e)),
        )
        for cls, cfg in ((Flaky, FlakyConfig()), (Steady, plugins.NoConfig()))
    ]
    tasks = [asyncio.create_task(r.run()) for r in runners]
    await eventually(lambda: all(r.up for r in runners))
    published = 0
    try:
        for code in range(200):
            bus.publish(wire.XidEvent(ts=TS, node="n", gpu=0, xid=code))
            published += 1
            await asyncio.sleep(0.01)
            if any(src == "flaky" for src, _ in out):
                break
        await eventually(lambda: any(src == "flaky" for src, _ in out))
        # The healthy plug-in saw every event, including those the flaky one died on.
        await eventually(lambda: sum(src == "steady" for src, _ in out) == published)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert runners[0].restarts == 2 and runners[1].restarts == 0
    restarts = metrics.registry.get_sample_value("tmd_plugin_restarts_total", {"plugin": "flaky"})
    assert restarts == 2.0
    assert metrics.registry.get_sample_value("tmd_plugin_up", {"plugin": "steady"}) == 0.0


async def test_plugin_returning_garbage_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    class Garbage(plugins.Plugin):
        name = "garbage"
        consumes = (wire.XidEvent,)

        def observe(self, event: Any, now: float) -> Iterable[Any]:
            return ["not an event"]

    monkeypatch.setattr(plugins.Runner, "MIN_BACKOFF_S", 0.01)
    bus = Bus()
    runner = plugins.Runner(
        plugins.Spec("detectors", "garbage", Garbage, plugins.NoConfig()),
        context=plugins.Context(view=ClusterView(), clock=SystemClock()),
        bus=bus,
        metrics=Metrics(),
        emit=lambda e, s: None,
    )
    task = asyncio.create_task(runner.run())
    await eventually(lambda: runner.up)
    bus.publish(wire.XidEvent(ts=TS, node="n", gpu=0, xid=1))
    await eventually(lambda: runner.restarts == 1)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
