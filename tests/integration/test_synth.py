"""The load generator's own MQTT client against a real mosquitto: what it writes is
what a subscriber reads (topics, payloads, retain, QoS), and ``close`` returns once
the broker acknowledged every QoS 1 message."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from tmd.tools.mosquitto import Mosquitto
from tmd.tools.synth import RawPublisher


@contextlib.contextmanager
def subscribed(broker: Mosquitto, topics: str, got: queue.Queue[Any]) -> Iterator[paho.Client]:
    """A paho client subscribed to ``topics`` (SUBACK seen), its messages into ``got``."""
    acked = threading.Event()
    client = paho.Client(CallbackAPIVersion.VERSION2, protocol=paho.MQTTv311)
    client.on_message = lambda _c, _u, m: got.put(m)
    client.on_subscribe = lambda *_: acked.set()
    client.connect(broker.host, broker.port)
    client.subscribe(topics, qos=1)
    client.loop_start()
    try:
        assert acked.wait(10), "no SUBACK"
        yield client
    finally:
        client.disconnect()
        client.loop_stop()


def test_the_raw_publisher_s_packets_reach_a_subscriber_as_published(broker: Mosquitto) -> None:
    got: queue.Queue[paho.MQTTMessage] = queue.Queue()
    with subscribed(broker, "tmd-test/raw/#", got):
        pub = RawPublisher(broker.host, broker.port, "raw-test")
        big = bytes(range(256)) * 64  # a remaining length of three bytes
        pub._pid = 0xFFFF - 10  # as after a long run: the ids wrap past 65535 to 1, never 0
        for i in range(70):
            pub.publish(f"tmd-test/raw/{i % 3}", b"%d" % i, qos=i % 2)
        pub.publish("tmd-test/raw/big", big, qos=1)
        pub.flush()
        pub.close()
        assert pub.sent_qos1 == 36 and pub.acked == 36
        seen = [got.get(timeout=10) for _ in range(71)]
    assert [m.payload for m in seen[:70]] == [b"%d" % i for i in range(70)]
    assert [m.topic for m in seen[:3]] == ["tmd-test/raw/0", "tmd-test/raw/1", "tmd-test/raw/2"]
    assert seen[70].payload == big and not seen[70].retain
    # Retained, and read back by a subscriber that comes later.
    pub = RawPublisher(broker.host, broker.port, "raw-test")
    pub.publish("tmd-test/raw-retained/x", b"kept", qos=1, retain=True)
    pub.close()
    with subscribed(broker, "tmd-test/raw-retained/#", got) as late:
        try:
            retained = got.get(timeout=10)
            assert (retained.payload, retained.retain) == (b"kept", True)
        finally:
            late.publish("tmd-test/raw-retained/x", b"", retain=True).wait_for_publish(5)
