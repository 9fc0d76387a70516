"""The actuator's asyncio shell: a bug in one step is counted and the actuator carries
on; a command the broker did not take is sent again by the next resend."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.fakes.clock import FakeClock
from tests.helpers import eventually
from tmd import wire
from tmd.config import ActuatorConfig, GuardrailsConfig
from tmd.daemon import events
from tmd.daemon.actuator import Actuator
from tmd.daemon.bus import Bus
from tmd.daemon.journal import Journal
from tmd.daemon.metrics import Metrics
from tmd.daemon.view import ClusterView
from tmd.errors import PublishError

T0 = 1_800_000_000.0


def status() -> wire.JobStatus:
    return wire.JobStatus(
        ts=T0, job="train", generation=0, world_size=2,
        members=[wire.Member(0, "w0"), wire.Member(1, "w1")],
        standbys=[wire.StandbyInfo(node="s0", state="ready")],
    )  # fmt: skip


async def test_an_unexpected_error_is_counted_and_the_actuator_carries_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    view, bus, metrics, clock = ClusterView(), Bus(), Metrics(), FakeClock(T0)
    actuator = Actuator(
        config=ActuatorConfig(settle_s=0, resend_s=1), guard=GuardrailsConfig(min_standby_pool=0),
        view=view, journal=Journal(tmp_path / "j.sqlite3"), emit=lambda e, s: None,
        metrics=metrics,
    )  # fmt: skip
    record = actuator.memberships.record
    statuses = 0

    def buggy(status: wire.JobStatus, before: object, **kw: float) -> object:
        nonlocal statuses
        statuses += 1
        if statuses == 1:
            raise RuntimeError("a bug")
        return record(status, before, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(actuator.memberships, "record", buggy)
    sent: list[wire.Message] = []
    publishes = 0

    async def publish(topic: str, payload: bytes) -> None:
        nonlocal publishes
        publishes += 1
        if publishes == 1:
            raise PublishError("not connected")  # Ingest.publish with the broker down
        sent.append(wire.decode(payload, wire.Control))

    subscribed = asyncio.Event()
    subscribed.set()
    task = asyncio.create_task(
        actuator.run(bus=bus, clock=clock, publish=publish, subscribed=subscribed)
    )

    def errors() -> float | None:
        return metrics.registry.get_sample_value(
            "tmd_actuator_errors_total", {"during": "JobStatus"}
        )

    try:
        await asyncio.wait_for(actuator.reconciled.wait(), 10)
        view.apply_job_status(status(), T0)
        bus.publish(status())  # the first one meets the bug
        await eventually(lambda: errors() == 1.0)
        bus.publish(status())
        bus.publish(events.Migrate(ts=T0, policy="drain", job="train", node="w1", reason="t"))
        await eventually(lambda: actuator.flights)  # its Prepare was refused by the broker
        assert sent == []
        clock.advance(2)  # the resend carries it
        [prepare] = await eventually(lambda: sent)
        assert isinstance(prepare, wire.Prepare)
        assert (prepare.leaver, prepare.joiner) == ("w1", "s0")
        assert not task.done() and errors() == 1.0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
