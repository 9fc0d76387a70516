"""Event bus: routing by type (and subclass), batches, drop-oldest with a count."""

from __future__ import annotations

import asyncio

from tmd import wire
from tmd.daemon import events
from tmd.daemon.bus import Bus

TS = 1_800_000_000.0


async def test_routes_by_type_and_subclass() -> None:
    bus = Bus()
    findings = bus.subscribe("policies", (events.Finding,))
    xids = bus.subscribe("gpu", (wire.XidEvent,))
    lost = events.NodeLost(ts=TS, node="n", cause="last_will")
    xid = wire.XidEvent(ts=TS, node="n", gpu=0, xid=79)
    bus.publish(lost)
    bus.publish(xid)
    bus.publish(events.Hold(ts=TS, policy="p", reason="r"))  # nobody wants decisions
    assert await findings.batch(0) == [lost]
    assert await xids.batch(0) == [xid]


async def test_batch_waits_for_the_first_event() -> None:
    bus = Bus()
    sub = bus.subscribe("s", (wire.XidEvent,))
    assert await sub.batch(0.01) == []
    xid = wire.XidEvent(ts=TS, node="n", gpu=0, xid=79)
    waiter = asyncio.create_task(sub.batch(5))
    await asyncio.sleep(0)
    bus.publish(xid)
    bus.publish(xid)
    assert await waiter == [xid, xid]


async def test_slow_subscriber_drops_oldest_and_counts() -> None:
    dropped: list[str] = []
    bus = Bus(on_drop=dropped.append)
    sub = bus.subscribe("slow", (wire.XidEvent,), maxlen=3)
    for code in range(5):
        bus.publish(wire.XidEvent(ts=TS, node="n", gpu=0, xid=code))
    assert [e.xid for e in await sub.batch(0)] == [2, 3, 4]  # type: ignore[attr-defined]
    assert dropped == ["slow", "slow"] and sub.dropped == 2


async def test_unsubscribed_get_nothing() -> None:
    bus = Bus()
    sub = bus.subscribe("s", (wire.XidEvent,))
    bus.unsubscribe(sub)
    bus.publish(wire.XidEvent(ts=TS, node="n", gpu=0, xid=1))
    assert len(sub) == 0
