"""The runtime's MQTT control channel against a real mosquitto: a command sent the moment
the channel exists arrives; retained and stale ones are ignored and counted. (A migration
over MQTT, with the job's answers, status and telemetry, is ``test_e2e``'s.) Each test
has a mosquitto of its own (``own_broker``), which fails under CI when missing."""

from __future__ import annotations

import time
from datetime import timedelta

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from tmd import wire
from tmd.tools.mosquitto import Mosquitto


def test_a_command_sent_once_the_channel_exists_is_never_lost(own_broker: Mosquitto) -> None:
    """The channel returns only after the broker confirmed its subscription: a command
    published the moment it exists is delivered (it was lost about one time in three
    when the channel returned at CONNACK)."""
    from tmd.runtime.group import StoreAddress
    from tmd.runtime.launch import host_store
    from tmd.runtime.mqtt_control import MqttControl

    store = host_store(0)
    pub = paho.Client(CallbackAPIVersion.VERSION2)
    pub.connect(own_broker.host, own_broker.port)
    pub.loop_start()
    try:
        lost = []
        for i in range(12):
            job = f"race{i}"
            channel = MqttControl(
                f"{own_broker.host}:{own_broker.port}",
                job=job,
                node="n0",
                store=StoreAddress("127.0.0.1", store.port),
            )
            try:
                abort = wire.Abort(ts=time.time(), job=job, migration_id="m")
                info = pub.publish(wire.job_topic(job, "ctl"), wire.encode(abort), qos=1)
                info.wait_for_publish(10)
                got: list[object] = []
                deadline = time.monotonic() + 10
                while not got and time.monotonic() < deadline:
                    got = list(channel.poll())
                    time.sleep(0.01)
                if got != [abort]:
                    lost.append(job)
            finally:
                channel.close()
        assert lost == []
    finally:
        pub.disconnect()
        pub.loop_stop()


def test_retained_and_stale_commands_are_ignored_and_counted(own_broker: Mosquitto) -> None:
    """A retained command (replayed to every process that subscribes later, as a forged
    one would be) and one stamped outside the freshness window, either way, move
    nothing; a fresh one still arrives."""
    from tmd.runtime.group import StoreAddress
    from tmd.runtime.launch import host_store
    from tmd.runtime.mqtt_control import MqttControl

    store = host_store(0)
    pub = paho.Client(CallbackAPIVersion.VERSION2)
    pub.connect(own_broker.host, own_broker.port)
    pub.loop_start()
    topic = wire.job_topic("fresh", "ctl")

    def send(migration_id: str, age_s: float, *, retain: bool = False) -> None:
        stamped = wire.Abort(ts=time.time() - age_s, job="fresh", migration_id=migration_id)
        pub.publish(topic, wire.encode(stamped), qos=1, retain=retain).wait_for_publish(10)

    send("replayed", 0.0, retain=True)  # waits on the broker for the next subscriber
    channel = MqttControl(f"{own_broker.host}:{own_broker.port}", job="fresh", node="n0",
                          store=StoreAddress("127.0.0.1", store.port),
                          max_age=timedelta(seconds=60))  # fmt: skip
    try:
        send("old", 61.0)
        send("from-the-future", -61.0)
        send("now", 0.0)
        got: list[wire.Control] = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            got = channel.poll()
            time.sleep(0.01)
        assert [c.migration_id for c in got] == ["now"]
        assert channel.ignored == {"retained": 1, "stale": 2}
    finally:
        channel.close()
        pub.publish(topic, b"", qos=1, retain=True).wait_for_publish(10)  # clear it
        pub.disconnect()
        pub.loop_stop()
