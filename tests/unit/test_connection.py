"""The reconnect back-off shared by ingest and the agent."""

from __future__ import annotations

import asyncio
import random

import aiomqtt
import pytest

from tmd.config import MqttConfig
from tmd.connection import Backoff, reconnect_forever


def test_the_delay_doubles_up_to_the_maximum() -> None:
    backoff = Backoff(min_s=0.5, max_s=3.0)
    delays = []
    for _ in range(6):
        delays.append(backoff.delay)
        backoff.next()
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]


@pytest.mark.parametrize(("draw", "share"), [(0.0, 0.5), (0.5, 0.75), (0.999999, 0.9999995)])
def test_each_wait_is_jittered_to_half_to_all_of_the_delay(
    monkeypatch: pytest.MonkeyPatch, draw: float, share: float
) -> None:
    monkeypatch.setattr(random, "random", lambda: draw)
    backoff = Backoff(min_s=2.0, max_s=8.0)
    assert [backoff.next() for _ in range(4)] == pytest.approx(
        [2 * share, 4 * share] + [8 * share] * 2
    )


def test_waits_stay_within_the_bounds() -> None:
    backoff = Backoff(min_s=0.1, max_s=1.0)
    waits = [backoff.next() for _ in range(200)]
    assert all(0.05 <= w <= 1.0 for w in waits)
    assert max(waits[10:]) > 0.5  # reached the maximum and stayed there


def test_reset_starts_over_from_the_minimum() -> None:
    backoff = Backoff(min_s=0.5, max_s=30.0)
    for _ in range(5):
        backoff.next()
    assert backoff.delay == 16.0
    backoff.reset()
    assert backoff.delay == 0.5
    backoff.next()
    assert backoff.delay == 1.0


async def test_the_reconnect_loop_counts_each_loss_closes_each_session_and_goes_on() -> None:
    calls: list[str] = []
    state = {"connected": False}

    async def session() -> None:
        calls.append("session")
        if len([c for c in calls if c == "session"]) == 3:
            raise asyncio.CancelledError  # the task group ends the loop
        state["connected"] = len(calls) > 1  # the second session got connected
        raise aiomqtt.MqttError("lost")

    class Log:
        def warning(self, what: str, **fields: object) -> None:
            calls.append(f"{what}: {fields['error']}, retry in {fields['retry_in_s']}")

    config = MqttConfig(reconnect_min_s=0.01, reconnect_max_s=0.04)
    with pytest.raises(asyncio.CancelledError):
        await reconnect_forever(
            session, config=config, log=Log(), connected=lambda: state["connected"],
            closed=lambda: calls.append("closed"), failed=lambda: calls.append("failed"),
        )  # fmt: skip
    assert calls == [
        "session", "failed", "broker connection lost: lost, retry in 0.01", "closed",
        # connected before this loss: the back-off starts over (else 0.02)
        "session", "failed", "broker connection lost: lost, retry in 0.01", "closed",
        "session", "closed",
    ]  # fmt: skip


async def test_a_cancelled_session_whose_disconnect_fails_still_ends_the_loop() -> None:
    """aiomqtt's ``__aexit__`` raises ``MqttError`` when its disconnect times out, which
    replaces the ``CancelledError`` the session was leaving with: the loop must end."""
    sessions = []
    started = asyncio.Event()

    async def session() -> None:
        sessions.append(1)
        started.set()
        if len(sessions) > 1:
            await asyncio.Event().wait()  # connected again: the defect, ended below
        try:
            await asyncio.Event().wait()
        finally:
            raise aiomqtt.MqttError("Operation timed out")  # the disconnect on the way out

    class Log:
        def warning(self, what: str, **fields: object) -> None:
            pass

    config = MqttConfig(reconnect_min_s=0.01, reconnect_max_s=0.01)
    task = asyncio.create_task(reconnect_forever(
        session, config=config, log=Log(), connected=lambda: True, closed=lambda: None,
    ))  # fmt: skip
    await started.wait()
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=5)
    if not done:
        task.cancel()
    assert task in done and task.cancelled()
    assert sessions == [1]  # it never connected again
