"""The embedded broker (tmd.tools.embedded_broker) with real clients: paho and aiomqtt route
through it as MQTT 3.1.1 says (wildcards, ``$`` topics, retained messages, QoS 1 and
the QoS downgrade, Last Will, keep-alive, takeover, shared subscriptions), a bad
packet costs only its sender the connection, a slow subscriber loses QoS 0 messages
instead of growing the broker, and the daemon's ingest runs on it.

Protocol violations are sent as raw bytes over a socket: real clients refuse to send
them. Framing and topic matching are table-tested in tests/unit/test_mqtt_codec.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiomqtt
import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from tests.conftest import DaemonFactory
from tests.helpers import Publisher, eventually
from tests.integration.test_daemon import iter_batch
from tests.unit.test_mqtt_codec import EXPECTED, TOPICS
from tmd import wire
from tmd.errors import TmdError
from tmd.mqtt_codec import encode_length, packet_bounds
from tmd.tools import brokers as broker_mod
from tmd.tools.embedded_broker import BrokerConfig, EmbeddedBroker, MiniBroker


@pytest.fixture
def embedded() -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker() as b:
        yield b


# -- raw MQTT, for what real clients will not send ---------------------------------------


def _str(data: bytes) -> bytes:
    return len(data).to_bytes(2, "big") + data


def _packet(first: int, body: bytes) -> bytes:
    return bytes((first,)) + encode_length(len(body)) + body


def _connect_packet(
    client_id: bytes = b"raw", *, keepalive: int = 60, name: bytes = b"MQTT", level: int = 4
) -> bytes:
    return _packet(
        0x10, _str(name) + bytes((level, 0x02)) + keepalive.to_bytes(2, "big") + _str(client_id)
    )


def _raw(b: EmbeddedBroker, *, connect: bytes | None = None) -> socket.socket:
    s = socket.create_connection((b.host, b.port), timeout=5)
    if connect is not None:
        s.sendall(connect)
        assert s.recv(4) == b"\x20\x02\x00\x00"
    return s


def _closed_by_broker(s: socket.socket, timeout_s: float = 5.0) -> bool:
    s.settimeout(timeout_s)
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def test_invalid_filters_are_refused_one_by_one(embedded: EmbeddedBroker) -> None:
    with _raw(embedded, connect=_connect_packet()) as s:
        filters = [b"a/#/b", b"a+/b", b"$share//x", b"$share/g", b"ok/#", b"$share/g/ok"]
        body = b"\x00\x07" + b"".join(_str(f) + b"\x01" for f in filters)
        s.sendall(_packet(0x82, body))
        assert s.recv(64) == b"\x90\x08\x00\x07" + bytes((0x80, 0x80, 0x80, 0x80, 1, 1))
        s.sendall(b"\xc0\x00")  # still connected: PINGREQ is answered
        assert s.recv(2) == b"\xd0\x00"


@pytest.mark.parametrize(
    ("name", "level"), [(b"MQTT", 5), (b"MQTT", 3), (b"MQIsdp", 4), (b"MQTX", 4)]
)
def test_unknown_protocol_gets_connack_1_and_is_closed(
    embedded: EmbeddedBroker, name: bytes, level: int
) -> None:
    with _raw(embedded) as s:
        s.sendall(_connect_packet(name=name, level=level))
        assert s.recv(4) == b"\x20\x02\x00\x01"
        assert _closed_by_broker(s)
    with _raw(embedded, connect=_connect_packet(b"old", name=b"MQIsdp", level=3)):
        pass  # MQTT 3.1 is served


def _publish(topic: bytes, payload: bytes = b"", *, first: int = 0x30) -> bytes:
    return _packet(first, _str(topic) + payload)


MALFORMED = {
    # name: (bytes, sent after a CONNECT?)
    "reserved packet type": (b"\x00\x00", True),
    "length over four bytes": (b"\x30\xff\xff\xff\xff\x01", True),
    "over the packet limit": (b"\x30" + encode_length(65 << 20), True),
    "topic past the end": (b"\x30\x03\x00\x09a", True),
    "publish to a wildcard": (_publish(b"a/+"), True),
    "topic not UTF-8": (_publish(b"\xff\xfe"), True),
    "QoS 3": (_publish(b"a", b"\x00\x01", first=0x36), True),
    "QoS 1 without an id": (_publish(b"a", b"\x00\x00", first=0x32), True),
    "SUBSCRIBE flags": (_packet(0x80, b"\x00\x01" + _str(b"a") + b"\x00"), True),
    "SUBSCRIBE QoS byte": (_packet(0x82, b"\x00\x01" + _str(b"a") + b"\x03"), True),
    "empty SUBSCRIBE": (_packet(0x82, b"\x00\x01"), True),
    "second CONNECT": (_connect_packet(b"again"), True),
    "CONNACK from a client": (b"\x20\x02\x00\x00", True),
    "PUBACK too long": (b"\x40\x03\x00\x01\x00", True),
    "PUBLISH before CONNECT": (_publish(b"a", b"x"), False),
    "PINGREQ before CONNECT": (b"\xc0\x00", False),
    "Will QoS without a Will": (
        _packet(0x10, _str(b"MQTT") + b"\x04\x12\x00\x3c" + _str(b"w")),
        False,
    ),
    "password without a user": (
        _packet(0x10, _str(b"MQTT") + b"\x04\x42\x00\x3c" + _str(b"p") + _str(b"pw")),
        False,
    ),
}


@pytest.mark.parametrize(("data", "connected"), MALFORMED.values(), ids=MALFORMED.keys())
async def test_a_bad_packet_disconnects_only_its_sender(
    embedded: EmbeddedBroker, data: bytes, connected: bool
) -> None:
    async with aiomqtt.Client(embedded.host, embedded.port) as bystander:
        await bystander.subscribe("ok/#", qos=1)
        with _raw(embedded, connect=_connect_packet() if connected else None) as s:
            s.sendall(data)
            assert await asyncio.to_thread(_closed_by_broker, s)
        await bystander.publish("ok/still", b"here", qos=1)
        (message,) = await take(bystander, 1)
        assert message.payload == b"here"
    assert embedded.protocol_errors == 1


# -- real clients ------------------------------------------------------------------------


async def take(client: aiomqtt.Client, n: int, timeout_s: float = 5.0) -> list[aiomqtt.Message]:
    out: list[aiomqtt.Message] = []
    async with asyncio.timeout(timeout_s):
        async for m in client.messages:
            out.append(m)
            if len(out) == n:
                break
    return out


async def until_marker(client: aiomqtt.Client, marker: str = "end") -> list[aiomqtt.Message]:
    """Messages up to the marker a test publishes last (one publisher keeps order)."""
    out: list[aiomqtt.Message] = []
    async with asyncio.timeout(5):
        async for m in client.messages:
            if m.topic.value == marker:
                return out
            out.append(m)
    raise AssertionError("unreachable")


@contextlib.asynccontextmanager
async def clients(b: EmbeddedBroker, n: int, **kw: Any) -> AsyncIterator[list[aiomqtt.Client]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(aiomqtt.Client(b.host, b.port, **kw)) for _ in range(n)
        ]


async def test_wildcards_route_as_the_spec_says(embedded: EmbeddedBroker) -> None:
    async with clients(embedded, len(EXPECTED) + 1) as (publisher, *subscribers):
        for sub, text in zip(subscribers, EXPECTED, strict=True):
            assert list(await sub.subscribe([(text, 1), ("end", 1)])) == [1, 1]
        for topic in TOPICS:
            await publisher.publish(topic, topic.encode(), qos=1)
        await publisher.publish("end", qos=1)
        for sub, (text, expected) in zip(subscribers, EXPECTED.items(), strict=True):
            got = await until_marker(sub)
            assert [m.topic.value for m in got] == [t for t in TOPICS if t in expected], text
            assert all(m.payload == m.topic.value.encode() for m in got)


async def test_retained_messages_are_kept_sent_to_new_subscribers_and_cleared(
    embedded: EmbeddedBroker,
) -> None:
    async with clients(embedded, 2) as (publisher, early):
        await early.subscribe([("r/#", 1), ("end", 0)])
        await publisher.publish("r/a", b"1", qos=1, retain=True)
        await publisher.publish("r/b", b"2", qos=0, retain=True)
        await publisher.publish("end", qos=1)
        live = await until_marker(early)
        assert [(m.topic.value, m.retain) for m in live] == [("r/a", False), ("r/b", False)]
        async with clients(embedded, 2) as (late, late_qos0):
            await late.subscribe("r/#", qos=1)
            await late_qos0.subscribe("r/#", qos=0)
            got = sorted(await take(late, 2), key=lambda m: m.topic.value)
            assert [(m.topic.value, m.payload, m.qos, m.retain) for m in got] == [
                ("r/a", b"1", 1, True),
                ("r/b", b"2", 0, True),
            ]
            assert {m.qos for m in await take(late_qos0, 2)} == {0}
        await publisher.publish("r/a", b"", qos=1, retain=True)  # clears r/a
        await publisher.publish("end", qos=1)
        (cleared,) = await until_marker(early)
        assert (cleared.topic.value, cleared.payload, cleared.retain) == ("r/a", b"", False)
        async with clients(embedded, 1) as (later,):
            await later.subscribe([("r/#", 1)])
            await publisher.publish("r/end", b"live", qos=1)
            got = await take(later, 2)
            assert [(m.topic.value, m.payload, m.retain) for m in got] == [
                ("r/b", b"2", True),
                ("r/end", b"live", False),
            ]


async def test_qos_1_is_acknowledged_and_delivered_at_the_lower_qos(
    embedded: EmbeddedBroker,
) -> None:
    async with clients(embedded, 3) as (publisher, at1, at0):
        assert list(await at1.subscribe("q/#", qos=2)) == [1]  # QoS 2 is granted as 1
        await at0.subscribe("q/#", qos=0)
        # aiomqtt returns from publish once the broker acknowledged (PUBACK, PUBCOMP).
        await asyncio.wait_for(publisher.publish("q/1", b"a", qos=1), 5)
        await asyncio.wait_for(publisher.publish("q/0", b"b", qos=0), 5)
        await asyncio.wait_for(publisher.publish("q/2", b"c", qos=2), 5)
        assert [(m.topic.value, m.qos) for m in await take(at1, 3)] == [
            ("q/1", 1),
            ("q/0", 0),
            ("q/2", 1),
        ]
        assert [m.qos for m in await take(at0, 3)] == [0, 0, 0]
        # Many in flight at once, in order, with packet ids reused as acks come back.
        n = 3000
        await asyncio.gather(*(publisher.publish("q/many", str(i), qos=1) for i in range(n)))
        got = await take(at1, n, timeout_s=20)
        assert [int(m.payload) for m in got] == list(range(n))


def _paho(b: EmbeddedBroker, client_id: str = "", **will: Any) -> paho.Client:
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id)
    if will:
        client.will_set(**will)
    return client


async def test_last_will_is_published_when_a_client_vanishes_not_when_it_leaves(
    embedded: EmbeddedBroker,
) -> None:
    async with clients(embedded, 1) as (watcher,):
        await watcher.subscribe([("lw/#", 1), ("end", 1)])
        leaving = _paho(embedded, "leaving", topic="lw/leaving", payload=b"x", qos=1)
        leaving.connect(embedded.host, embedded.port)
        leaving.loop(1)
        leaving.disconnect()  # DISCONNECT: no Will
        killed = _paho(embedded, "killed", topic="lw/killed", payload=b"off", qos=1, retain=True)
        killed.connect(embedded.host, embedded.port)
        killed.loop(1)  # CONNACK
        sock = killed.socket()
        assert isinstance(sock, socket.socket)
        sock.close()  # the process died: no DISCONNECT
        (will,) = await take(watcher, 1)
        assert (will.topic.value, will.payload, will.qos, will.retain) == (
            "lw/killed",
            b"off",
            1,
            False,
        )
        async with clients(embedded, 1) as (late,):  # a retained Will is kept
            await late.subscribe("lw/#")
            (kept,) = await take(late, 1)
            assert (kept.topic.value, kept.payload, kept.retain) == ("lw/killed", b"off", True)


def _connect_with_will(client_id: bytes, *, keepalive: int) -> bytes:
    """CONNECT with a QoS 1 Will on ``ka/<client_id>`` that says ``gone``."""
    flags = 0x02 | 0x04 | 0x08  # clean session, Will, Will QoS 1
    return _packet(
        0x10,
        _str(b"MQTT") + bytes((4, flags)) + keepalive.to_bytes(2, "big")
        + _str(client_id) + _str(b"ka/" + client_id) + _str(b"gone"),
    )  # fmt: skip


async def test_a_silent_client_is_dropped_when_its_keepalive_lapses_a_talking_one_is_not(
    embedded: EmbeddedBroker,
) -> None:
    async with clients(embedded, 1) as (watcher,):
        await watcher.subscribe([("ka/#", 1), ("end", 1)])
        with contextlib.ExitStack() as sockets:
            # Connected first but with twice the keep-alive, "slow" outlasts "fast":
            # expiry follows each client's own keep-alive, not the order of connection.
            slow, fast, talker = (
                sockets.enter_context(_raw(embedded, connect=_connect_with_will(name, keepalive=k)))
                for name, k in ((b"slow", 2), (b"fast", 1), (b"talker", 1))
            )
            stop = threading.Event()

            def ping() -> None:  # well inside the keep-alive, as client libraries do
                while not stop.wait(0.2):
                    talker.sendall(b"\xc0\x00")

            pinger = threading.Thread(target=ping, daemon=True)
            pinger.start()
            try:
                wills = await take(watcher, 2, timeout_s=20)
                assert [(m.topic.value, m.payload) for m in wills] == [
                    ("ka/fast", b"gone"),
                    ("ka/slow", b"gone"),
                ]
                for gone in (fast, slow):
                    assert await asyncio.to_thread(_closed_by_broker, gone)
            finally:
                stop.set()
                pinger.join()
            # The talker outlived two of its keep-alive windows. It leaves with
            # DISCONNECT (no Will): nothing comes before a marker published after it.
            talker.sendall(b"\xe0\x00")
            assert await asyncio.to_thread(_closed_by_broker, talker)
        await watcher.publish("end", qos=1)
        assert await until_marker(watcher) == []


async def test_a_second_connection_with_the_same_id_takes_over(
    embedded: EmbeddedBroker,
) -> None:
    async with clients(embedded, 1) as (watcher,):
        await watcher.subscribe("to/#", qos=1)
        will = aiomqtt.Will("to/will", b"first gone", qos=1)
        async with aiomqtt.Client(embedded.host, embedded.port, identifier="same", will=will) as a:
            await a.subscribe("to/#", qos=1)
            async with aiomqtt.Client(embedded.host, embedded.port, identifier="same") as b:
                with pytest.raises(aiomqtt.MqttError):  # the old connection is closed
                    await take(a, 1)
                # As mosquitto does, the old connection's Will goes out.
                (first,) = await take(watcher, 1)
                assert first.payload == b"first gone"
                await b.subscribe("to/#", qos=1)
                await b.publish("to/b", b"new", qos=1)
                assert [m.payload for m in await take(b, 1)] == [b"new"]
                assert [m.payload for m in await take(watcher, 1)] == [b"new"]


def test_shared_subscription_gives_each_message_to_one_member_in_turn(
    embedded: EmbeddedBroker,
) -> None:
    got: dict[str, list[int]] = {"m1": [], "m2": [], "all": []}
    lock = threading.Lock()
    subscribed = threading.Semaphore(0)
    subs = []
    for name, text in [("m1", "$share/g/sh/#"), ("m2", "$share/g/sh/#"), ("all", "sh/#")]:
        c = _paho(embedded, name)

        def on_message(_c: Any, _u: Any, m: paho.MQTTMessage, name: str = name) -> None:
            with lock:
                got[name].append(int(m.payload))

        c.on_message = on_message
        c.on_subscribe = lambda *_: subscribed.release()
        c.connect(embedded.host, embedded.port)
        c.subscribe(text, qos=1)
        c.loop_start()
        subs.append(c)
    try:
        for _ in subs:
            assert subscribed.acquire(timeout=5)
        with contextlib.closing(Publisher(embedded.host, embedded.port)) as publisher:
            for i in range(10):
                publisher.send("sh/x", str(i).encode())
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(got["all"]) + len(got["m1"] + got["m2"]) < 20:
            time.sleep(0.02)
        assert got["all"] == list(range(10))
        assert (got["m1"], got["m2"]) == ([0, 2, 4, 6, 8], [1, 3, 5, 7, 9])
    finally:
        for c in subs:
            c.disconnect()
            c.loop_stop()


async def test_a_slow_subscriber_loses_qos_0_messages_and_nobody_else_does() -> None:
    config = BrokerConfig(queue_bytes=64 << 10)
    n, payload = 2000, b"x" * 4096
    with EmbeddedBroker(config=config) as b, _raw(b, connect=_connect_packet(b"slow")) as slow:
        slow.sendall(_packet(0x82, b"\x00\x01" + _str(b"flood/#") + b"\x00"))
        assert slow.recv(5) == b"\x90\x03\x00\x01\x00"
        async with clients(b, 2) as (publisher, fast):
            await fast.subscribe("flood/#")

            async def send() -> None:
                for _ in range(n):  # QoS 1: paced by the broker's acks
                    await publisher.publish("flood/x", payload, qos=1)

            _, got = await asyncio.gather(send(), take(fast, n, timeout_s=30))
            assert len(got) == n
        # The slow one, which never read, is still connected and lost what did not fit.
        assert b.dropped > 0
        slow.sendall(b"\xc0\x00")  # PINGREQ
        assert await asyncio.to_thread(_publishes_before_pingresp, slow) + b.dropped == n


def _publishes_before_pingresp(s: socket.socket) -> int:
    buf, count, pos = bytearray(), 0, 0
    while True:
        data = s.recv(1 << 20)
        assert data, "closed by the broker"
        buf += data
        while (bounds := packet_bounds(buf, pos, 1 << 30)) is not None:
            first, _, pos = bounds
            if first == 0xD0:
                return count
            count += first >> 4 == 3


async def test_the_daemon_ingests_through_the_embedded_broker(
    embedded: EmbeddedBroker, start_daemon: DaemonFactory
) -> None:
    daemon = await start_daemon(embedded)
    with contextlib.closing(Publisher(embedded.host, embedded.port)) as publisher:
        topic = wire.iter_topic("j", 0)
        assert topic == "tmd/v1/job/j/rank/0/iter"
        publisher.send(topic, wire.encode(iter_batch("j", 0, range(1, 4))))
        await eventually(lambda: "j" in daemon.view.jobs and daemon.view.jobs["j"].ranks)
    assert daemon.view.jobs["j"].ranks[0].last_step == 3


def test_local_broker_falls_back_to_the_embedded_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(broker_mod, "find_mosquitto", lambda: None)
    b = broker_mod.local_broker()
    assert isinstance(b, EmbeddedBroker)
    with b:
        port = b.port
        with _raw(b, connect=_connect_packet()):
            pass
        b.restart()  # keeps its port, like Mosquitto.restart
        assert b.port == port
        with _raw(b, connect=_connect_packet()):
            pass
    with pytest.raises(OSError):
        socket.create_connection((b.host, port), timeout=1).close()


def test_a_taken_port_fails_at_start(embedded: EmbeddedBroker) -> None:
    with pytest.raises(TmdError, match="cannot listen"):
        EmbeddedBroker(port=embedded.port).start()


async def test_the_broker_also_runs_on_the_callers_event_loop() -> None:
    async with MiniBroker() as b, aiomqtt.Client(b.host, b.port) as c:
        await c.subscribe("loop/#", qos=1)
        await c.publish("loop/x", b"same loop", qos=1)
        assert [m.payload for m in await take(c, 1)] == [b"same loop"]
