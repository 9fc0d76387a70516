"""The daemon's QoS 0 read path (``tmd.connection.handle_qos0_inline``) with aiomqtt,
paho and a real mosquitto: QoS 0 messages reach the handler, every other message
reaches aiomqtt's queue as before, all in the order the broker sent them (many a read,
and one larger than a read); the keep-alive is still answered; a lost broker still
ends the session; a PINGRESP late behind a stream of telemetry does not (a broker
that answers late, below). Its framing alone: tests/unit/test_connection_lane.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

import aiomqtt
import pytest

from tmd.connection import handle_qos0_inline
from tmd.mqtt_codec import packet_bounds, publish_packet, topic_field
from tmd.tools.mosquitto import Mosquitto
from tmd.tools.synth import RawPublisher


def client_with_lane(
    broker: Mosquitto, seen: list[tuple[str, str, bytes, bool]], *, keepalive: int = 60
) -> aiomqtt.Client:
    class Queued(asyncio.Queue[aiomqtt.Message]):
        def put_nowait(self, item: aiomqtt.Message) -> None:
            payload: Any = item.payload
            seen.append(("queue", item.topic.value, payload, item.retain))

    client = aiomqtt.Client(
        broker.host, broker.port, identifier=f"lane-{os.getpid()}-{len(seen)}",
        protocol=aiomqtt.ProtocolVersion.V311, keepalive=keepalive, queue_type=Queued,
    )  # fmt: skip
    assert handle_qos0_inline(client, lambda t, p, r: seen.append(("lane", t, p, r)))
    return client


async def until(condition: Any, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110 (a condition of plain lists)
            await asyncio.sleep(0.01)


async def first_message(client: aiomqtt.Client) -> aiomqtt.Message:
    async for message in client.messages:
        return message
    raise AssertionError("the messages ended without an error")


async def test_qos0_to_the_handler_the_rest_to_the_queue_in_the_broker_s_order(
    broker: Mosquitto,
) -> None:
    seen: list[tuple[str, str, bytes, bool]] = []
    pub = RawPublisher(broker.host, broker.port, "lane-pub")
    pub.publish("tmd-test/lane/q0/kept", b"kept", qos=1, retain=True)
    pub.flush()
    big = os.urandom(600_000)  # more than one read of the socket (256 kB)
    expected: list[tuple[str, str, bytes, bool]] = [
        ("lane", "tmd-test/lane/q0/kept", b"kept", True)  # retained: read on subscribe
    ]
    try:
        async with client_with_lane(broker, seen) as client:
            await client.subscribe([("tmd-test/lane/q0/#", 0), ("tmd-test/lane/q1/#", 1)])
            await until(lambda: len(seen) == 1)
            for i in range(400):
                if i % 7 == 3:  # delivered at QoS 1, acknowledged by paho
                    topic = f"tmd-test/lane/q1/{i}"
                    pub.publish(topic, b"%d" % i, qos=1)
                    expected.append(("queue", topic, b"%d" % i, False))
                else:  # QoS 1 on a QoS 0 subscription is delivered at 0
                    topic = f"tmd-test/lane/q0/{i}"
                    pub.publish(topic, b"%d" % i, qos=i % 2)
                    expected.append(("lane", topic, b"%d" % i, False))
                if i == 200:
                    pub.publish("tmd-test/lane/q0/big", big, qos=0)
                    expected.append(("lane", "tmd-test/lane/q0/big", big, False))
            pub.flush()
            await until(lambda: len(seen) == len(expected))
            assert seen == expected
    finally:
        pub.publish("tmd-test/lane/q0/kept", b"", qos=1, retain=True)
        pub.close()


async def test_the_keep_alive_is_answered_and_a_lost_broker_ends_the_session(
    own_broker: Mosquitto,
) -> None:
    """paho pings every second and drops a connection whose PINGRESP does not come:
    the lane must hand it over. Then the broker goes, and the reading ends as without
    the lane, by an MqttError."""
    seen: list[tuple[str, str, bytes, bool]] = []
    async with client_with_lane(own_broker, seen, keepalive=1) as client:
        await client.subscribe("tmd-test/lane/alive", qos=0)
        reading = asyncio.create_task(first_message(client))  # ends on a lost link
        await asyncio.sleep(3.5)  # three keep-alive periods, no message
        await client.publish("tmd-test/lane/alive", b"still", qos=1)
        await until(lambda: ("lane", "tmd-test/lane/alive", b"still", False) in seen)
        assert not reading.done()
        own_broker.stop()
        with pytest.raises(aiomqtt.MqttError):
            async with asyncio.timeout(10):
                await reading


class LateBroker:
    """Just enough of a broker: CONNACK, SUBACK, a QoS 0 message every 50 ms, and each
    PINGRESP ``late_s`` after its PINGREQ, as a broker whose queue to the daemon is
    long answers. paho pings when it has not heard from the broker for a keep-alive
    period, and gives up when a ping goes that long unanswered and nothing came."""

    def __init__(self, late_s: float) -> None:
        self.late_s = late_s
        self.pings = 0
        self.tasks: set[asyncio.Task[None]] = set()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = bytearray()
        streaming: asyncio.Task[None] | None = None
        try:
            while chunk := await reader.read(4096):
                data += chunk
                while (bounds := packet_bounds(data, 0, 1 << 20)) is not None:
                    first, start, end = bounds
                    kind = first >> 4
                    if kind == 1:  # CONNECT
                        writer.write(b"\x20\x02\x00\x00")
                    elif kind == 8:  # SUBSCRIBE: its packet id back, QoS 0 granted
                        writer.write(b"\x90\x03" + bytes(data[start : start + 2]) + b"\x00")
                        streaming = asyncio.create_task(self._stream(writer))
                    elif kind == 12:  # PINGREQ
                        self.pings += 1
                        task = asyncio.create_task(self._pong(writer))
                        self.tasks.add(task)
                        task.add_done_callback(self.tasks.discard)
                    del data[:end]
        finally:
            if streaming is not None:
                streaming.cancel()
            writer.close()

    async def _stream(self, writer: asyncio.StreamWriter) -> None:
        field = topic_field(b"tmd-test/late")
        while True:
            writer.write(publish_packet(field, b"x" * 100, retain=False))
            await asyncio.sleep(0.05)

    async def _pong(self, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(self.late_s)
        with contextlib.suppress(Exception):
            writer.write(b"\xd0\x00")


async def test_a_late_pingresp_behind_flowing_telemetry_keeps_the_connection() -> None:
    broker = LateBroker(late_s=1.6)
    server = await asyncio.start_server(broker.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    seen: list[tuple[str, str, bytes, bool]] = []
    async with server:
        client = aiomqtt.Client(
            "127.0.0.1", port, identifier="lane-late", keepalive=1,
            protocol=aiomqtt.ProtocolVersion.V311,
        )  # fmt: skip
        assert handle_qos0_inline(client, lambda t, p, r: seen.append(("lane", t, p, r)))
        async with client:
            await client.subscribe("tmd-test/late", qos=0)
            reading = asyncio.create_task(first_message(client))  # ends on a lost link
            await asyncio.sleep(4.5)  # pings unanswered for 1.6 s, each past keep-alive
            assert broker.pings >= 2 and not reading.done()
            count = len(seen)
            await until(lambda: len(seen) > count)  # still reading
            reading.cancel()
