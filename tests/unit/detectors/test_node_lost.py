"""node_lost: Last Will and heartbeat timeout, one finding per loss (pure, table-driven)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fakes.clock import FakeClock
from tmd import wire
from tmd.daemon import events
from tmd.daemon.freshness import Freshness
from tmd.daemon.plugins import Context
from tmd.daemon.view import ClusterView
from tmd.detectors.node_lost import NodeLostConfig, NodeLostDetector

T0 = 1_800_000_000.0


def beat(node: str) -> wire.NodeGpu:
    return wire.NodeGpu(ts=T0, node=node)


def status(node: str, state: str) -> wire.NodeStatus:
    return wire.NodeStatus(ts=T0, node=node, state=state)  # type: ignore[arg-type]


# (time offset, event or "tick") -> the (node, cause) findings expected at that point
SCRIPTS: dict[str, list[tuple[float, Any, list[tuple[str, str]]]]] = {
    "last will": [
        (0, beat("a"), []),
        (1, status("a", "offline"), [("a", "last_will")]),
        (2, status("a", "offline"), []),  # retained copy again: no second finding
        (30, "tick", []),  # no heartbeat finding for a node already lost
    ],
    "heartbeat timeout": [
        (0, beat("a"), []),
        (0, beat("b"), []),
        (9, beat("b"), []),
        (10.5, "tick", [("a", "heartbeat")]),
        (11, "tick", []),
        (20, "tick", [("b", "heartbeat")]),
    ],
    "comes back and is lost again": [
        (0, beat("a"), []),
        (11, "tick", [("a", "heartbeat")]),
        (12, status("a", "online"), []),
        (13, beat("a"), []),
        (24, "tick", [("a", "heartbeat")]),
    ],
    "never seen nodes are not lost": [
        (100, "tick", []),
    ],
}


@pytest.mark.parametrize("script", SCRIPTS.values(), ids=SCRIPTS.keys())
def test_node_lost(script: list[tuple[float, Any, list[tuple[str, str]]]]) -> None:
    clock = FakeClock(T0)
    detector = NodeLostDetector(
        NodeLostConfig(heartbeat_timeout_s=10), context=Context(view=ClusterView(), clock=clock)
    )
    for offset, event, expected in script:
        now = T0 + offset
        found = list(detector.tick(now) if event == "tick" else detector.observe(event, now))
        assert all(isinstance(f, events.NodeLost) for f in found)
        assert [(f.node, f.cause) for f in found] == expected, (offset, event)


def test_lost_nodes_are_forgotten_after_a_while() -> None:
    clock = FakeClock(T0)
    detector = NodeLostDetector(
        NodeLostConfig(heartbeat_timeout_s=10, forget_after_s=100),
        context=Context(view=ClusterView(), clock=clock),
    )
    list(detector.observe(status("gone", "offline"), T0))
    assert "gone" in detector._lost
    list(detector.tick(T0 + 50))
    assert "gone" in detector._lost
    list(detector.tick(T0 + 101))
    assert "gone" not in detector._lost


def judged_by_freshness() -> tuple[NodeLostDetector, Freshness]:
    """A detector (10 s timeout) whose view judges its own freshness, current at T0."""
    view = ClusterView()
    view.freshness = f = Freshness(interval_s=1.0, max_lag_s=2.0, settle_s=5.0)
    f.connection(True, T0)
    f.answered(T0, T0)
    context = Context(view=view, clock=FakeClock(T0))
    return NodeLostDetector(NodeLostConfig(heartbeat_timeout_s=10), context=context), f


def test_nothing_is_lost_while_the_daemon_s_own_view_is_not_current() -> None:
    """A paused broker: every heartbeat stops, and on resume it replays Last Wills of
    agents whose connections it timed out. Nothing is found while the view is stale or
    settling; silences count from when it became current; a Last Will read meanwhile
    is a silence from then, reported unless the node beats within the timeout."""
    detector, f = judged_by_freshness()

    def run(offset: float, event: Any = "tick") -> list[tuple[str, str]]:
        now = T0 + offset
        if event == "tick":
            f.answered(now, now)  # the probe came back: current
            found = list(detector.tick(now))
        else:
            found = list(detector.observe(event, now))
        return [(e.node, e.cause) for e in found]

    for node in ("a", "b", "c"):
        assert run(6, beat(node)) == []
    assert run(7) == []
    # The broker pauses for 30 s: no probe, no beat; the view goes stale.
    assert list(detector.tick(T0 + 37)) == []
    f.answered(T0 + 37, T0 + 37.5)  # resumed: the first probe back
    assert run(37.6, status("a", "offline")) == []  # replayed Last Wills
    assert run(37.6, status("b", "offline")) == []
    assert run(38, beat("b")) == []  # b is alive after all
    assert run(40) == []  # settling
    assert run(43) == []  # trusted, but a's agent may still be reconnecting
    assert run(46) == []  # silences count from 37.5, not from 6
    assert run(48) == [("a", "last_will"), ("c", "heartbeat")]


def test_a_silence_that_messages_lost_on_the_way_explain_is_not_a_loss() -> None:
    """The probe comes back in time, but the broker dropped messages queued for the
    daemon (ingest saw gaps in the agents' sequence numbers): a node silent since before
    the last loss is not found lost until the timeout passes after it."""
    detector, f = judged_by_freshness()
    for t in range(1, 30):  # probes back every second; messages lost at 9 and 12
        f.answered(T0 + t, T0 + t)
        if t == 6:
            list(detector.observe(beat("a"), T0 + t))
        if t in (9, 12):
            assert f.lost(T0 + t) == (t == 9)  # trusted before the first only
        found = [e.node for e in detector.tick(T0 + t)]
        assert found == (["a"] if t == 23 else []), t  # 12 + 10 s of silence, not 6 + 10
