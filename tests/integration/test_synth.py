"""The load generator's own MQTT client against a real mosquitto: what it writes is
what a subscriber reads (topics, payloads, retain, QoS), and ``close`` returns once
the broker acknowledged every QoS 1 message."""

from __future__ import annotations

import queue
import time

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from tmd.tools.mosquitto import Mosquitto
from tmd.tools.synth import RawPublisher


def test_the_raw_publisher_s_packets_reach_a_subscriber_as_published(broker: Mosquitto) -> None:
    got: queue.Queue[paho.MQTTMessage] = queue.Queue()
    sub = paho.Client(CallbackAPIVersion.VERSION2, protocol=paho.MQTTv311)
    sub.on_message = lambda _c, _u, m: got.put(m)
    sub.connect(broker.host, broker.port)
    sub.subscribe("tmd-test/raw/#", qos=1)
    sub.loop_start()
    try:
        time.sleep(0.3)  # subscribed before anything is published
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
        late = paho.Client(CallbackAPIVersion.VERSION2, protocol=paho.MQTTv311)
        late.on_message = lambda _c, _u, m: got.put(m)
        late.connect(broker.host, broker.port)
        late.subscribe("tmd-test/raw-retained/#", qos=1)
        late.loop_start()
        try:
            retained = got.get(timeout=10)
            assert (retained.payload, retained.retain) == (b"kept", True)
        finally:
            late.publish("tmd-test/raw-retained/x", b"", retain=True).wait_for_publish(5)
            late.loop_stop()
            late.disconnect()
    finally:
        sub.loop_stop()
        sub.disconnect()
