"""``node_lost``: a node's agent is gone — its Last Will arrived (status ``offline``),
or its heartbeats (the 1 Hz GPU samples) stopped for longer than the timeout.

One finding per loss: a node found lost is reported again only after it came back.
Only while the daemon's own view is trusted (``tmd.daemon.freshness``): silences count
from when it became current, and a Last Will read while it was not (a broker that
was paused replays them) is held as a silence from then: it is reported if the node
has not beaten within the heartbeat timeout.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from tmd import wire
from tmd.daemon import events
from tmd.detectors.base import Detector
from tmd.errors import ConfigError
from tmd.plugins import Context


@dataclass(frozen=True, kw_only=True)
class NodeLostConfig:
    heartbeat_timeout_s: float = 15.0
    forget_after_s: float = 3600.0  # a lost node silent this long is no longer tracked

    def validate(self) -> None:
        if not self.heartbeat_timeout_s > 0:
            raise ConfigError("detectors.node_lost.heartbeat_timeout_s", "must be > 0")
        if not self.forget_after_s > self.heartbeat_timeout_s:
            raise ConfigError("detectors.node_lost.forget_after_s", "must be > heartbeat_timeout_s")


class NodeLostDetector(Detector):
    name = "node_lost"
    Config = NodeLostConfig
    consumes = (wire.NodeStatus, wire.NodeGpu)
    tick_interval = timedelta(seconds=1)
    config: NodeLostConfig

    def __init__(self, config: NodeLostConfig, *, context: Context) -> None:
        super().__init__(config, context=context)
        self._last_beat: dict[str, float] = {}
        self._lost: dict[str, float] = {}  # node -> when it was found lost
        self._offline: dict[str, float] = {}  # node -> Last Will read while not trusted

    def observe(self, event: Any, now: float) -> Iterable[events.Event]:
        node = event.node
        if isinstance(event, wire.NodeStatus) and event.state == "offline":
            self._last_beat.pop(node, None)
            if self.context.view.freshness.since(now) is None:
                self._offline[node] = now  # judged once the view is trusted again
                return
            if node not in self._lost:
                self._lost[node] = now
                yield events.NodeLost(
                    ts=now, node=node, cause="last_will", detail="agent's Last Will: offline"
                )
            return
        self._lost.pop(node, None)
        self._offline.pop(node, None)
        self._last_beat[node] = now

    def tick(self, now: float) -> Iterable[events.Event]:
        since = self.context.view.freshness.since(now)
        if since is None:
            return  # the view is stale or settling: silence proves nothing
        timeout = self.config.heartbeat_timeout_s
        for node in [n for n, t in self._lost.items() if now - t > self.config.forget_after_s]:
            del self._lost[node]
        # A Last Will read while the view was not trusted (a broker that paused times
        # out every connection) is a silence from when the view became current: its
        # agent has the heartbeat timeout to come back, as a silent one has.
        for node in [n for n in self._offline if now - since > timeout]:
            del self._offline[node]
            if node not in self._lost and node not in self._last_beat:
                self._lost[node] = now
                yield events.NodeLost(
                    ts=now, node=node, cause="last_will", detail="agent's Last Will: offline"
                )
        silent = [n for n, t in self._last_beat.items() if now - max(t, since) > timeout]
        for node in silent:
            del self._last_beat[node]
            self._lost[node] = now
            yield events.NodeLost(
                ts=now, node=node, cause="heartbeat", detail=f"no heartbeat for {timeout:g} s"
            )
