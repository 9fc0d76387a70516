"""What a rank publishes itself is numbered on its topic for each run and generation
(``tmd.wire``), counting only what paho took to send; the client is a stand-in that
says whether it took each message (no broker needed to say that)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

import paho.mqtt.client as paho

from tmd import wire
from tmd.runtime.mqtt_control import MqttControl


@dataclass
class _Info:
    rc: int


@dataclass
class _Client:
    connected: bool = True
    sent: list[tuple[str, bytes]] = field(default_factory=list)

    def subscribe(self, topics: object) -> None:
        pass

    def publish(self, topic: str, payload: bytes, qos: int = 0) -> _Info:
        if not self.connected:
            return _Info(paho.MQTT_ERR_NO_CONN)
        self.sent.append((topic, payload))
        return _Info(paho.MQTT_ERR_SUCCESS)


def sink(client: _Client) -> MqttControl:
    control = MqttControl.__new__(MqttControl)  # the sink alone: no broker, no store
    control._client = client  # type: ignore[assignment]
    control._seq, control._seq_lock, control.published = {}, threading.Lock(), 0
    control.job = "j"
    return control


def batch(step: int, *, generation: int = 0, run: int = 0, rank: int = 0) -> bytes:
    steps = [wire.StepTiming(step, 1.8e9, 1, 1, 0, 0, 0)]
    return wire.encode(wire.IterBatch(ts=1.8e9, job="j", rank=rank, node="n", steps=steps,
                                      generation=generation, run=run))  # fmt: skip


def test_each_topic_run_and_generation_is_numbered_apart_and_only_what_was_sent() -> None:
    client = _Client()
    control = sink(client)
    topic = wire.iter_topic("j", 0)
    control.publish(topic, batch(1))
    control.publish(topic, batch(2))
    client.connected = False
    control.publish(topic, batch(3))  # not taken: its number goes to the next
    client.connected = True
    control.publish(topic, batch(4))
    control.publish(topic, batch(5, generation=1))  # after a switch
    control.publish(topic, batch(6, run=1))  # after a restart
    control.publish(wire.iter_topic("j", 1), batch(7, rank=1))
    control.publish(topic, b"not a batch")  # as it is: the daemon counts it rejected
    numbers = [
        (t, wire.decode(p, wire.IterBatch).seq) for t, p in client.sent if p != b"not a batch"
    ]
    assert numbers == [
        (topic, 1), (topic, 2), (topic, 3), (topic, 1), (topic, 1),
        (wire.iter_topic("j", 1), 1),
    ]  # fmt: skip
    assert client.sent[-1] == (topic, b"not a batch") and control.published == 8


def test_a_reconnect_starts_the_numbers_over() -> None:
    """What paho held for a connection that died is this process's loss: the daemon
    should see a restart, not a gap."""
    client = _Client()
    control = sink(client)
    topic = wire.iter_topic("j", 0)
    for step in range(1, 40):
        control.publish(topic, batch(step))
    control._on_connect(client, None, None, SimpleNamespace(is_failure=False), None)  # type: ignore[arg-type]
    control.publish(topic, batch(40))
    assert wire.decode(client.sent[-1][1], wire.IterBatch).seq == 1
