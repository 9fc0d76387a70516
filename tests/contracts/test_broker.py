"""The broker contract, run against mosquitto and the embedded broker.

What tmd relies on from whichever broker it runs on: QoS 0 and 1 delivery, retained
state (the job and node status) for late subscribers and its clearing, the agent's
Last Will, ``+``/``#`` filters (the daemon's subscriptions), shared subscriptions,
takeover by client id (a restarted runtime keeps its id), and a broker that is gone
once its ``with`` block ends. The embedded broker's own edge cases (bad packets, slow
subscribers, keep-alive) are in tests/integration/test_embedded_broker.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import aiomqtt
import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from tests.contracts.channels import port_closed
from tests.integration.test_embedded_broker import clients, take, until_marker
from tmd.tools.embedded_broker import EmbeddedBroker
from tmd.tools.mosquitto import Mosquitto

Broker = Mosquitto | EmbeddedBroker


async def test_qos_0_and_1_reach_each_subscriber_at_its_granted_qos(mqtt_broker: Broker) -> None:
    async with clients(mqtt_broker, 3) as (publisher, at1, at0):  # type: ignore[arg-type]
        assert await at1.subscribe("q/#", qos=1) == [1]
        assert await at0.subscribe("q/#", qos=0) == [0]
        await asyncio.wait_for(publisher.publish("q/0", b"zero", qos=0), 5)
        await asyncio.wait_for(publisher.publish("q/1", b"one", qos=1), 5)

        got1 = sorted(await take(at1, 2), key=lambda m: m.topic.value)
        got0 = sorted(await take(at0, 2), key=lambda m: m.topic.value)
    assert [(m.topic.value, m.payload, m.qos) for m in got1] == [
        ("q/0", b"zero", 0),
        ("q/1", b"one", 1),
    ]
    assert [(m.topic.value, m.payload, m.qos) for m in got0] == [
        ("q/0", b"zero", 0),
        ("q/1", b"one", 0),  # downgraded to the subscription's QoS
    ]


async def test_retained_state_reaches_late_subscribers_until_cleared(mqtt_broker: Broker) -> None:
    async with clients(mqtt_broker, 2) as (publisher, live):  # type: ignore[arg-type]
        await live.subscribe([("r/#", 1), ("end", 1)])
        await publisher.publish("r/job", b"status", qos=1, retain=True)
        await publisher.publish("r/node", b"online", qos=1, retain=True)
        await publisher.publish("end", qos=1)
        assert [(m.topic.value, m.retain) for m in await until_marker(live)] == [
            ("r/job", False),  # news to a live subscriber, not state
            ("r/node", False),
        ]
        async with clients(mqtt_broker, 1) as (late,):  # type: ignore[arg-type]
            await late.subscribe("r/#", qos=1)
            got = sorted(await take(late, 2), key=lambda m: m.topic.value)
            assert [(m.topic.value, m.payload, m.retain) for m in got] == [
                ("r/job", b"status", True),
                ("r/node", b"online", True),
            ]

        await publisher.publish("r/job", b"", qos=1, retain=True)  # clears r/job
        async with clients(mqtt_broker, 1) as (later,):  # type: ignore[arg-type]
            await later.subscribe([("r/#", 1), ("end", 1)])
            await publisher.publish("end", qos=1)
            got = await until_marker(later)
    assert [(m.topic.value, m.payload, m.retain) for m in got] == [("r/node", b"online", True)]


def _vanish(b: Broker, client_id: str, **will: Any) -> None:
    """Connect with a Will, then drop the socket without DISCONNECT (a node that died)."""
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id)
    client.will_set(**will)
    client.connect(b.host, b.port)
    client.loop(2)  # CONNACK
    assert client.is_connected()
    sock = client.socket()
    assert isinstance(sock, socket.socket)
    sock.close()


async def test_the_last_will_goes_out_when_a_client_vanishes_not_when_it_leaves(
    mqtt_broker: Broker,
) -> None:
    b = mqtt_broker
    async with clients(b, 1) as (watcher,):  # type: ignore[arg-type]
        await watcher.subscribe([("lw/#", 1), ("end", 1)])
        will = aiomqtt.Will("lw/leaving", b"left", qos=1)
        async with aiomqtt.Client(b.host, b.port, identifier="leaving", will=will):
            pass  # DISCONNECT: no Will
        await asyncio.to_thread(
            _vanish, b, "vanished", topic="lw/vanished", payload=b"offline", qos=1, retain=True
        )
        (first,) = await take(watcher, 1)
        assert (first.topic.value, first.payload, first.qos) == ("lw/vanished", b"offline", 1)
        async with clients(b, 1) as (publisher,):  # type: ignore[arg-type]
            await publisher.publish("end", qos=1)
        assert await until_marker(watcher) == []  # and nothing from the one that left
        async with clients(b, 1) as (late,):  # type: ignore[arg-type]
            await late.subscribe("lw/#", qos=1)  # a retained Will is state (a node's status)
            (kept,) = await take(late, 1)
    assert (kept.topic.value, kept.payload, kept.retain) == ("lw/vanished", b"offline", True)


TOPICS = ["w", "w/a", "w/a/x", "w/b/x", "w/a/y/x", "v/a/x"]
FILTERS = {
    "w/+/x": ["w/a/x", "w/b/x"],  # one level, exactly
    "w/+": ["w/a"],
    "w/#": ["w", "w/a", "w/a/x", "w/b/x", "w/a/y/x"],  # the parent level too
    "+/a/#": ["w/a", "w/a/x", "w/a/y/x", "v/a/x"],
    "#": TOPICS,
}


async def test_plus_and_hash_match_as_the_daemon_subscribes(mqtt_broker: Broker) -> None:
    async with clients(mqtt_broker, len(FILTERS) + 1) as (publisher, *subs):  # type: ignore[arg-type]
        for sub, text in zip(subs, FILTERS, strict=True):
            await sub.subscribe([(text, 1), ("end", 1)])
        for topic in TOPICS:
            await publisher.publish(topic, topic.encode(), qos=1)
        await publisher.publish("end", qos=1)
        for sub, (text, expected) in zip(subs, FILTERS.items(), strict=True):
            got = [m for m in await until_marker(sub) if m.topic.value != "end"]
            assert sorted(m.topic.value for m in got) == sorted(expected), text
            assert all(m.payload == m.topic.value.encode() for m in got)


async def test_a_shared_subscription_gives_each_message_to_one_member(
    mqtt_broker: Broker,
) -> None:
    n = 20
    async with clients(mqtt_broker, 4) as (publisher, m1, m2, everyone):  # type: ignore[arg-type]
        await m1.subscribe("$share/g/sh/#", qos=1)
        await m2.subscribe("$share/g/sh/#", qos=1)
        await everyone.subscribe([("sh/#", 1), ("end", 1)])
        for i in range(n):
            await publisher.publish("sh/x", str(i), qos=1)
        await publisher.publish("end", qos=1)
        assert [int(m.payload) for m in await until_marker(everyone)] == list(range(n))
        # The group is told the end too, through each member's own filter.
        await m1.subscribe("end", qos=1)
        await m2.subscribe("end", qos=1)
        await publisher.publish("end", qos=1)
        first, second = await until_marker(m1), await until_marker(m2)
    got1, got2 = [int(m.payload) for m in first], [int(m.payload) for m in second]
    assert sorted(got1 + got2) == list(range(n))  # each message once, to one member
    assert got1 and got2  # shared, not all to one member
    assert got1 == sorted(got1) and got2 == sorted(got2)


async def test_a_second_connection_with_the_same_id_takes_over(mqtt_broker: Broker) -> None:
    b = mqtt_broker
    will = aiomqtt.Will("to/will", b"old gone", qos=1)
    async with (
        aiomqtt.Client(b.host, b.port) as watcher,
        aiomqtt.Client(b.host, b.port, identifier="same", will=will) as old,
    ):
        await watcher.subscribe("to/#", qos=1)
        await old.subscribe("to/#", qos=1)
        async with aiomqtt.Client(b.host, b.port, identifier="same") as new:
            with pytest.raises(aiomqtt.MqttError):  # the old connection is dropped
                await take(old, 1)
            (gone,) = await take(watcher, 1)  # and its Will goes out, as for a lost one
            assert (gone.topic.value, gone.payload) == ("to/will", b"old gone")
            await new.subscribe("to/#", qos=1)
            await new.publish("to/x", b"new", qos=1)
            assert [m.payload for m in await take(new, 1)] == [b"new"]
            assert [m.payload for m in await take(watcher, 1)] == [b"new"]


async def test_the_broker_stops_on_exit(broker_type: type[Broker]) -> None:
    with broker_type(host="127.0.0.1", port=0) as b:
        host, port = b.host, b.port
        assert not port_closed(host, port)
        client = aiomqtt.Client(host, port)
        await client.__aenter__()
        try:
            await client.subscribe("x", qos=1)
        except BaseException:
            await client.__aexit__(None, None, None)
            raise
    try:
        assert port_closed(host, port)
        with pytest.raises(aiomqtt.MqttError):  # its clients see the end
            await take(client, 1)
    finally:
        with contextlib.suppress(aiomqtt.MqttError):
            await client.__aexit__(None, None, None)
