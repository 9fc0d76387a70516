"""node_lost: Last Will and heartbeat timeout, one finding per loss (pure, table-driven)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fakes.clock import FakeClock
from tmd import wire
from tmd.daemon import events
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
