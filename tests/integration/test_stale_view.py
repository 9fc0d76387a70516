"""The daemon knows when its own view is stale: a paused broker (SIGSTOP) and a
daemon whose intake stops while the cluster goes on publishing end with no lost node,
no stalled rank and no migration for machines that kept running, and the view says
so on /healthz and in ``tmd_ingest_lag_seconds``. Timeouts are scaled down (2 s for
a lost node) so each test takes seconds; the pause is three of those timeouts."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from tests.conftest import DaemonFactory
from tests.helpers import eventually
from tmd import wire
from tmd.daemon.daemon import Daemon
from tmd.tools.mosquitto import Mosquitto

NODES = ("n0", "n1", "n2")
TIMEOUT_S = 2.0
SECTIONS = {
    "detectors": {
        "node_lost": {"heartbeat_timeout_s": TIMEOUT_S},
        "rank_stalled": {"stall_after_s": TIMEOUT_S, "stall_steps": 2},
    },
    # Stale well before a silence could count: a probe every 0.25 s, late past 0.5 s.
    "ingest": {"probe_interval_s": 0.25, "stale_lag_s": 0.5, "stale_settle_s": 2.0},
}


@pytest.fixture
def cluster(own_broker: Mosquitto) -> Iterator[threading.Event]:
    """Three machines beating and a job of one rank on each stepping, 5 times a second,
    until the test ends; the running flag stops it."""
    stop = threading.Event()
    client = paho.Client(CallbackAPIVersion.VERSION2)
    client.connect(own_broker.host, own_broker.port, keepalive=60)
    client.loop_start()

    def run() -> None:
        step = 0
        while not stop.wait(0.2):
            step += 1
            t = time.time()
            for rank, node in enumerate(NODES):
                client.publish(
                    wire.node_topic(node, "gpu"), wire.encode(wire.NodeGpu(ts=t, node=node))
                )
                timing = wire.StepTiming(step, t, 0.2, 0.1, 0.05, 0.03, 0.02)
                batch = wire.IterBatch(ts=t, job="j", rank=rank, node=node, steps=[timing])
                client.publish(wire.iter_topic("j", rank), wire.encode(batch))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield stop
    stop.set()
    thread.join()
    client.disconnect()
    client.loop_stop()


def findings(daemon: Daemon) -> list[str]:
    return [
        f"{e.kind} {e.node}"
        for k in ("NodeLost", "RankStalled")
        for e in daemon.journal.events(kind=k)
    ]


async def running(daemon: Daemon) -> None:
    """Every machine and rank in the view, and the view trusted."""
    await eventually(
        lambda: (
            set(NODES) <= set(daemon.view.nodes)
            and "j" in daemon.view.jobs
            and len(daemon.view.jobs["j"].ranks) == len(NODES)
            and daemon.health()["view"] == "current"
        ),
        timeout_s=20,
    )


async def test_a_paused_broker_loses_no_node(
    own_broker: Mosquitto, cluster: threading.Event, start_daemon: DaemonFactory
) -> None:
    daemon = await start_daemon(own_broker, **SECTIONS)
    await running(daemon)
    assert own_broker.pid is not None
    os.kill(own_broker.pid, signal.SIGSTOP)
    try:
        await eventually(lambda: daemon.health()["view"] == "stale", timeout_s=10)
        # The gauge follows at the probe loop's next turn.
        gauge = daemon.metrics.registry.get_sample_value
        lag = await eventually(lambda: (gauge("tmd_ingest_lag_seconds") or 0) > 0.5 and
                               gauge("tmd_ingest_lag_seconds"), timeout_s=10)  # fmt: skip
        await asyncio.sleep(3 * TIMEOUT_S)  # every heartbeat stopped, three timeouts long
    finally:
        os.kill(own_broker.pid, signal.SIGCONT)
    await eventually(lambda: daemon.health()["view"] == "current", timeout_s=20)
    await asyncio.sleep(2 * TIMEOUT_S)  # long enough for a wrong finding to show
    assert lag > 0.5
    assert findings(daemon) == []
    assert daemon.journal.recent_migrations(0) == []


async def test_an_intake_that_falls_behind_loses_no_node(
    own_broker: Mosquitto, cluster: threading.Event, start_daemon: DaemonFactory
) -> None:
    """The daemon's loop is held (as a daemon starved of CPU, or swamped by a burst,
    is) while the cluster publishes on: its silence timers run out before it reads the
    backlog, and the probe that has not come back says its view is behind."""
    daemon = await start_daemon(own_broker, **SECTIONS)
    await running(daemon)
    time.sleep(3 * TIMEOUT_S)  # noqa: ASYNC251  # holds the daemon's loop: nothing is read
    await asyncio.sleep(0)
    assert daemon.health()["view"] != "current"
    await eventually(lambda: daemon.health()["view"] == "current", timeout_s=20)
    await asyncio.sleep(2 * TIMEOUT_S)
    assert findings(daemon) == []
    assert daemon.journal.recent_migrations(0) == []
