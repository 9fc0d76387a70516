"""What a real mosquitto drops on the way to a daemon that lags is counted, exactly.

mosquitto keeps at most ``max_queued_messages`` unsent packets for a subscriber and
drops the QoS 0 ones past that; the daemon's lag probe comes back behind them all the
same. The agents' sequence numbers (``tmd.wire``) are what tell: here a daemon whose
event loop is held while a machine's agent sends a burst far past the socket buffers
counts every message it did not get in ``tmd_messages_lost_total``, no more, and
settles its view anew rather than trust a silence the broker made (mosquitto 2: 1.6
did not drop QoS 0 messages for a connected client)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from tests.conftest import DaemonFactory, _need_mosquitto
from tests.helpers import eventually
from tmd import wire
from tmd.tools.mosquitto import Mosquitto

NODE = "dropped-node"
BURST = 2000  # of 64 GPUs each, some 24 kB: 48 MB, past any socket buffer


@pytest.fixture
def small_queue_broker() -> Iterator[Mosquitto]:
    _need_mosquitto()
    with Mosquitto(max_queued_messages=10) as b:
        yield b


async def test_a_broker_s_drops_are_counted_as_lost_and_settle_the_view(
    small_queue_broker: Mosquitto, start_daemon: DaemonFactory
) -> None:
    broker = small_queue_broker
    # Its loop held for a while is not a stale view here (probes may be 60 s late): what
    # settles it anew is the loss alone.
    daemon = await start_daemon(broker, ingest={"stale_settle_s": 1.0, "stale_lag_s": 60.0})
    agent = paho.Client(CallbackAPIVersion.VERSION2, client_id="agent-" + NODE)
    agent.connect(broker.host, broker.port)
    agent.loop_start()
    topic = wire.node_topic(NODE, "gpu")
    gpus = [wire.GpuSample(index=i, temp_c=50.0, ecc_dbe_volatile=0) for i in range(64)]

    start = time.time()

    def sample(seq: int) -> bytes:
        """As an agent sampling at its fastest (every 0.05 s) stamps them: a burst here
        stands for a backlog, and what goes missing is believed only where the agent
        could have sent that many in between (``ClusterView.gap``)."""
        stamp = start + 0.05 * seq
        return wire.encode(wire.NodeGpu(ts=stamp, node=NODE, gpus=gpus, seq=seq))

    def sent_through() -> None:
        """Wait until the broker has dealt with all published so far (a QoS 1 message
        behind them, acknowledged)."""
        agent.publish("tmd-test/marker", b"", qos=1).wait_for_publish(30)

    try:
        for seq in (1, 2):  # the node made, and its count started
            agent.publish(topic, sample(seq), qos=0)
        node = await eventually(lambda: (n := daemon.view.nodes.get(NODE)) and n.seq.get("gpu"))
        assert node == (2, node[1])
        freshness = daemon.ingest.freshness
        await eventually(lambda: freshness.state(daemon.clock.now()) == "current")
        received = daemon.metrics.received_by["gpu"].value
        # The daemon's loop is held (this coroutine does not yield) while the burst goes
        # out from paho's own thread and the broker has all of it.
        for seq in range(3, 3 + BURST):
            agent.publish(topic, sample(seq), qos=0)
        sent_through()
        held_until = daemon.clock.now()

        # Then, the loop running again, one more until one gets through (a gap shows
        # only to the message after it; while the backlog drains, the broker drops
        # these too).
        def last_read() -> int:
            return int(daemon.view.nodes[NODE].seq.get("gpu", (0, 0.0))[0])

        async def read_soon(seq: int) -> None:
            with contextlib.suppress(AssertionError):
                await eventually(lambda: last_read() == seq, timeout_s=1)

        last = 2 + BURST
        while last_read() != last:
            assert last < 2 + BURST + 30, "nothing gets through any more"
            last += 1
            agent.publish(topic, sample(last), qos=0)
            await read_soon(last)
        got = daemon.metrics.received_by["gpu"].value - received
        lost = daemon.metrics.lost_by["gpu"].value
        assert lost > 0 and got + lost == last - 2, (got, lost, last)
        assert daemon.health()["messages_lost"] == lost
        # Absence is measured from the loss, found once the loop ran again.
        assert freshness.fresh_since is not None and freshness.fresh_since >= held_until
    finally:
        agent.disconnect()
        agent.loop_stop()
