"""An embedded MQTT 3.1.1 broker, so ``tmd demo`` and tests run where no mosquitto is.

Owns the server side of MQTT 3.1.1 (protocol level 4, and level 3 ``MQIsdp``) on
plain TCP: CONNECT with Last Will and keep-alive (1.5 x, as the spec asks), session
takeover by client id, PUBLISH at QoS 0 and 1 both ways, retained messages,
SUBSCRIBE with ``+``/``#`` and ``$share/{group}/{filter}`` (one member of the group
per message, round robin), UNSUBSCRIBE, PINGREQ and DISCONNECT. ``MiniBroker`` runs
on the caller's event loop; ``EmbeddedBroker`` runs one on its own loop in a daemon
thread and is used like ``tmd.tools.mosquitto.Mosquitto``.

One task per connection reads 64 KiB at a time and handles every complete packet in
it; what they produce is written once per client per read, never awaited, so one
publisher's burst costs a write per subscriber rather than one per message. Framing
and topic matching are pure functions in ``tmd.mqtt_codec``.

Limits, on purpose, because this is not a production broker:

- No persistence and no sessions: every connection is a clean session. A CONNECT
  with ``clean_session=0`` is accepted, answered with session-present 0, and its
  subscriptions end with the connection; unacknowledged QoS 1 messages are never
  resent (a reconnecting client resubscribes and gets retained state again).
- No TLS, no authentication, no ACLs: user names and passwords are read and ignored.
- MQTT 5 is refused with CONNACK 0x01 (unacceptable protocol level).
- QoS 2 is accepted from publishers (PUBREC / PUBREL / PUBCOMP, delivered once per
  packet id) but subscriptions are granted at most QoS 1, so nothing leaves at QoS 2.
- A client more than ``queue_bytes`` behind loses the QoS 0 messages meant for it
  (counted in ``dropped``, logged once per client); four times that behind, or with
  65,535 QoS 1 messages unacknowledged, it is disconnected.
- A packet over ``max_packet_bytes`` or a malformed one disconnects its sender only.
- Retained messages are held in memory without a bound; shared subscriptions pick
  members in turn, not by load, and retained messages are not sent to them.
- A client whose filters overlap gets one copy of a message, at the highest QoS
  granted (mosquitto sends one per filter; MQTT 3.1.1 allows both).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import threading
from datetime import timedelta
from types import TracebackType
from typing import Final

from tmd import log
from tmd.errors import ProtocolError, TmdError
from tmd.mqtt_codec import (
    Fields,
    SubscriptionTree,
    encode_length,
    matches,
    packet_bounds,
    packet_id,
    parse_filter,
    publish_packet,
    topic_field,
    utf8,
    valid_topic,
)
from tmd.tools.mosquitto import free_port

CONNECT, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 3, 4, 5, 6, 7
SUBSCRIBE, UNSUBSCRIBE, PINGREQ, DISCONNECT = 8, 10, 12, 14
_FIXED_FLAGS: Final = {PUBREL: 2, SUBSCRIBE: 2, UNSUBSCRIBE: 2}  # 0 for every other type
_PROTOCOLS: Final = {("MQTT", 4), ("MQIsdp", 3)}
_CONNACK_OK: Final = b"\x20\x02\x00\x00"
_PINGRESP: Final = b"\xd0\x00"
_READ_BYTES: Final = 1 << 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class BrokerConfig:
    max_packet_bytes: int = 64 << 20
    """A packet whose remaining length is larger disconnects its sender."""
    queue_bytes: int = 8 << 20
    """Unsent bytes to one client past which its QoS 0 messages are dropped; four
    times this and the client is disconnected."""
    connect_timeout: timedelta = timedelta(seconds=10)
    """How long a new connection has to send CONNECT."""


# -- one connection --------------------------------------------------------------------


class _Client:
    """One connection: its output, its subscriptions, its Will, its packet ids."""

    def __init__(self, broker: MiniBroker, writer: asyncio.StreamWriter) -> None:
        self.broker = broker
        self.writer = writer
        self.transport = writer.transport
        peer = writer.get_extra_info("peername")
        self.name = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "?"
        self.client_id = ""
        self.connected = False
        self.ended = False
        self.timeout: float | None = broker.config.connect_timeout.total_seconds()
        self.will: tuple[str, bytes, int, bool] | None = None
        self.filters: dict[str, tuple[str | None, tuple[str, ...]]] = {}
        self.out: list[bytes] = []
        self.out_bytes = 0
        self.inflight: set[int] = set()  # QoS 1 packet ids sent, not yet acknowledged
        self.last_id = 0
        self.qos2: set[int] = set()  # QoS 2 packet ids received, not yet released
        self.dropped = 0

    def backlog(self) -> int:
        return self.transport.get_write_buffer_size() + self.out_bytes

    def send(self, data: bytes) -> None:
        """Acks and QoS 1 messages: never dropped; a client far behind is cut off."""
        if self.ended:
            return
        if self.backlog() > 4 * self.broker.config.queue_bytes:
            self.broker.cut(self, "output queue full")
            return
        self._queue(data)

    def send_droppable(self, data: bytes) -> None:
        """QoS 0 messages: dropped while the client is ``queue_bytes`` behind."""
        if self.ended:
            return
        if self.backlog() > self.broker.config.queue_bytes:
            self.dropped += 1
            self.broker.dropped += 1
            if self.dropped == 1:
                self.broker.log.warning(
                    "slow client: dropping its QoS 0 messages", client=self.client_id
                )
            return
        self._queue(data)

    def send_qos1(self, field: bytes, payload: bytes, *, retain: bool) -> None:
        if self.ended:
            return
        if len(self.inflight) >= 0xFFFF:
            self.broker.cut(self, "65535 QoS 1 messages unacknowledged")
            return
        pid = self.last_id
        while True:
            pid = pid % 0xFFFF + 1
            if pid not in self.inflight:
                break
        self.last_id = pid
        self.inflight.add(pid)
        self.send(publish_packet(field, payload, retain=retain, pid=pid))

    def _queue(self, data: bytes) -> None:
        if not self.out:
            self.broker.dirty.append(self)
        self.out.append(data)
        self.out_bytes += len(data)

    def flush(self) -> None:
        if self.out and not self.transport.is_closing():
            self.transport.write(b"".join(self.out))
        self.out.clear()
        self.out_bytes = 0


# -- the broker ------------------------------------------------------------------------


class MiniBroker:
    """The broker on the running event loop: ``async with MiniBroker() as b:``."""

    def __init__(
        self, *, host: str = "127.0.0.1", port: int = 0, config: BrokerConfig = BrokerConfig()
    ) -> None:
        self.host = host
        self.port = port
        self.config = config
        self.log = log.get("minibroker")
        self.dropped = 0
        """QoS 0 messages dropped for slow clients."""
        self.protocol_errors = 0
        """Clients disconnected for a malformed or forbidden packet."""
        self.dirty: list[_Client] = []  # clients with output queued in this read
        self._server: asyncio.Server | None = None
        self._sessions: dict[str, _Client] = {}
        self._open: set[_Client] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._subscriptions: SubscriptionTree[_Client] = SubscriptionTree()
        self._retained: dict[str, tuple[bytes, bytes, int]] = {}  # topic: (topic, payload, qos)
        self._closing = False
        self._ids = itertools.count(1)

    async def start(self) -> MiniBroker:
        self._server = await asyncio.start_server(
            self._serve, self.host, self.port, limit=_READ_BYTES
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def close(self) -> None:
        """Stop listening and drop every connection; Wills are not published."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for client in list(self._open):
            client.transport.abort()
        # Aborted, each connection's task ends by itself. Cancelling it instead makes
        # asyncio (3.11) log the cancellation as an error of the stream callback.
        if self._tasks:
            _, stuck = await asyncio.wait(list(self._tasks), timeout=5.0)
            for task in stuck:
                task.cancel()
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> MiniBroker:
        return await self.start()

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # -- connections -------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        client = _Client(self, writer)
        self._open.add(client)
        graceful = False
        try:
            graceful = await self._read(client, reader)
        except ProtocolError as exc:
            self.protocol_errors += 1
            self.log.warning(
                "client disconnected: bad packet",
                client=client.client_id or client.name,
                reason=exc.reason,
                detail=exc.detail[:200],
            )
        except TimeoutError:
            what = "keep-alive" if client.connected else "CONNECT"
            self.log.info("client disconnected: silent past its " + what, client=client.name)
        except (ConnectionError, OSError):
            pass
        except Exception:  # a bug: it costs this client its connection, nothing more
            self.log.exception("client disconnected: internal error", client=client.name)
        finally:
            self._end(client, will=not graceful)
            self._open.discard(client)
            self._tasks.discard(task)
            self._flush()
            writer.close()

    async def _read(self, client: _Client, reader: asyncio.StreamReader) -> bool:
        """Read and handle packets until the connection ends; True after DISCONNECT."""
        buf = bytearray()
        limit = self.config.max_packet_bytes
        while True:
            async with asyncio.timeout(client.timeout):
                chunk = await reader.read(_READ_BYTES)
            if not chunk:
                return False
            buf += chunk
            pos = 0
            try:
                with memoryview(buf) as view:
                    while (bounds := packet_bounds(view, pos, limit)) is not None:
                        first, start, pos = bounds
                        if self._handle(client, first, bytes(view[start:pos])):
                            return True
                        if client.ended:  # taken over, cut off, or refused
                            return False
            finally:
                self._flush()
            del buf[:pos]
            if client.transport.get_write_buffer_size() > self.config.queue_bytes:
                # Its own acks pile up: stop reading from it until it reads.
                async with asyncio.timeout(client.timeout or 60.0):
                    await client.writer.drain()

    def _flush(self) -> None:
        dirty, self.dirty = self.dirty, []
        for client in dirty:
            client.flush()

    def cut(self, client: _Client, why: str) -> None:
        self.log.warning("client disconnected", client=client.client_id, reason=why)
        self._end(client, will=True)
        client.transport.abort()

    def _end(self, client: _Client, *, will: bool) -> None:
        """Forget the client's subscriptions; publish its Will unless told not to."""
        if client.ended:
            return
        client.ended = True
        for group, levels in client.filters.values():
            self._subscriptions.remove(client, group, levels)
        client.filters.clear()
        if self._sessions.get(client.client_id) is client:
            del self._sessions[client.client_id]
        last, client.will = client.will, None
        if will and last is not None and not self._closing:
            topic, payload, qos, retain = last
            self._route(topic, topic.encode(), payload, qos, retain=retain)

    # -- packets -----------------------------------------------------------------------

    def _handle(self, client: _Client, first: int, body: bytes) -> bool:
        """Handle one packet; True when it was DISCONNECT."""
        kind, flags = first >> 4, first & 0x0F
        if kind == PUBLISH and client.connected:
            self._on_publish(client, flags, body)
            return False
        if kind != PUBLISH and flags != _FIXED_FLAGS.get(kind, 0):
            raise ProtocolError("packet", f"flags {flags:#x} on packet type {kind}")
        if kind == CONNECT:
            self._on_connect(client, body)
        elif not client.connected:
            raise ProtocolError("packet", f"packet type {kind} before CONNECT")
        elif kind == PUBACK:
            client.inflight.discard(packet_id(body))
        elif kind == PUBREL:
            client.qos2.discard(packet_id(body))
            client.send(b"\x70\x02" + body)
        elif kind == SUBSCRIBE:
            self._on_subscribe(client, body)
        elif kind == UNSUBSCRIBE:
            self._on_unsubscribe(client, body)
        elif kind in (PINGREQ, DISCONNECT):
            if body:
                raise ProtocolError("packet", f"packet type {kind} with a body")
            if kind == DISCONNECT:
                self._end(client, will=False)
                return True
            client.send(_PINGRESP)
        elif kind in (PUBREC, PUBCOMP):
            packet_id(body)  # answers to QoS 2, which this broker never sends: ignored
        else:
            raise ProtocolError("packet", f"packet type {kind} is not sent to a server")
        return False

    def _on_connect(self, client: _Client, body: bytes) -> None:
        if client.connected:
            raise ProtocolError("packet", "second CONNECT")
        fields = Fields(body)
        name, level = fields.text(), fields.u8()
        if (name, level) not in _PROTOCOLS:
            self._refuse(client, 0x01)
            return
        flags, keepalive = fields.u8(), fields.u16()
        if flags & 0x01:
            raise ProtocolError("packet", "reserved CONNECT flag set")
        client_id = fields.text()
        will = None
        if flags & 0x04:
            topic, message, qos = fields.text(), fields.binary(), (flags >> 3) & 3
            if qos == 3 or not valid_topic(topic):
                raise ProtocolError("packet", "bad Will topic or QoS")
            will = (topic, message, qos, bool(flags & 0x20))
        elif flags & 0x38:
            raise ProtocolError("packet", "Will QoS or retain without a Will")
        if flags & 0x80:
            fields.text()  # user name: anonymous broker, ignored
        if flags & 0x40:
            if not flags & 0x80:
                raise ProtocolError("packet", "password without a user name")
            fields.binary()
        fields.end()
        if not client_id:
            if not flags & 0x02:  # a session to resume needs a name
                self._refuse(client, 0x02)
                return
            client_id = f"auto-{next(self._ids)}-{client.name}"
        previous = self._sessions.get(client_id)
        if previous is not None:  # takeover, as in MQTT-3.1.4-2; mosquitto sends its Will too
            self.log.info("client taken over", client=client_id)
            self._end(previous, will=True)
            previous.transport.close()
        client.client_id = client_id
        client.connected = True
        client.will = will
        client.timeout = keepalive * 1.5 or None
        self._sessions[client_id] = client
        client.send(_CONNACK_OK)

    def _refuse(self, client: _Client, code: int) -> None:
        client.send(bytes((0x20, 0x02, 0x00, code)))
        client.ended = True
        client.flush()
        client.transport.close()

    def _on_publish(self, client: _Client, flags: int, body: bytes) -> None:
        qos = (flags >> 1) & 3
        if qos == 3:
            raise ProtocolError("packet", "PUBLISH with QoS 3")
        n = len(body)
        end = 2 + int.from_bytes(body[:2], "big")
        if n < 2 or end > n:
            raise ProtocolError("packet", "PUBLISH topic runs past the end")
        topic_bytes = body[2:end]
        topic = utf8(topic_bytes)
        if not valid_topic(topic):
            raise ProtocolError("packet", f"cannot publish to {topic[:100]!r}")
        retain = bool(flags & 0x01)
        if not qos:
            self._route(topic, topic_bytes, body[end:], 0, retain=retain)
            return
        ident = body[end : end + 2]
        if len(ident) != 2 or ident == b"\x00\x00":
            raise ProtocolError("packet", "PUBLISH without a packet id")
        if qos == 1:
            self._route(topic, topic_bytes, body[end + 2 :], 1, retain=retain)
            client.send(b"\x40\x02" + ident)
            return
        pid = int.from_bytes(ident, "big")
        if pid not in client.qos2:  # else a resend: delivered already
            client.qos2.add(pid)
            self._route(topic, topic_bytes, body[end + 2 :], 2, retain=retain)
        client.send(b"\x50\x02" + ident)

    def _route(
        self, topic: str, topic_bytes: bytes, payload: bytes, qos: int, *, retain: bool
    ) -> None:
        if retain:
            if payload:
                self._retained[topic] = (topic_bytes, payload, qos)
            else:
                self._retained.pop(topic, None)
        targets = self._subscriptions.match(topic)
        if not targets:
            return
        field = topic_field(topic_bytes)
        packet = None  # one QoS 0 packet for every QoS 0 receiver
        for client, granted in targets.items():
            if qos and granted:
                client.send_qos1(field, payload, retain=False)
            else:
                if packet is None:
                    packet = publish_packet(field, payload, retain=False)
                client.send_droppable(packet)

    def _on_subscribe(self, client: _Client, body: bytes) -> None:
        fields = Fields(body)
        ident = fields.take(2)
        codes = bytearray()
        fresh: list[tuple[tuple[str, ...], int]] = []
        while fields.more():
            text, wanted = fields.text(), fields.u8()
            if wanted > 2:
                raise ProtocolError("packet", "SUBSCRIBE with a bad QoS byte")
            parsed = parse_filter(text)
            if parsed is None:
                codes.append(0x80)
                continue
            group, levels = parsed
            qos = min(wanted, 1)
            self._subscriptions.add(client, group, levels, qos)
            client.filters[text] = parsed
            codes.append(qos)
            if group is None:
                fresh.append((levels, qos))
        if not codes:
            raise ProtocolError("packet", "SUBSCRIBE without a topic filter")
        client.send(b"\x90" + encode_length(2 + len(codes)) + ident + codes)
        for levels, qos in fresh:
            for topic, (topic_bytes, payload, kept_qos) in list(self._retained.items()):
                if matches(levels, topic):
                    field = topic_field(topic_bytes)
                    if qos and kept_qos:
                        client.send_qos1(field, payload, retain=True)
                    else:
                        client.send_droppable(publish_packet(field, payload, retain=True))

    def _on_unsubscribe(self, client: _Client, body: bytes) -> None:
        fields = Fields(body)
        ident = fields.take(2)
        if not fields.more():
            raise ProtocolError("packet", "UNSUBSCRIBE without a topic filter")
        while fields.more():
            parsed = client.filters.pop(fields.text(), None)
            if parsed is not None:
                self._subscriptions.remove(client, *parsed)
        client.send(b"\xb0\x02" + ident)


# -- in a thread, for sync callers -----------------------------------------------------


class EmbeddedBroker:
    """A ``MiniBroker`` on its own event loop in a daemon thread, used like
    ``tmd.tools.mosquitto.Mosquitto``: ``with EmbeddedBroker() as b: connect(b.host, b.port)``.
    The port is chosen at construction (a free one on ``host`` unless given) and kept
    by ``restart``; retained messages are not."""

    def __init__(
        self, *, port: int = 0, host: str = "127.0.0.1", config: BrokerConfig = BrokerConfig()
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.config = config
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._broker: MiniBroker | None = None

    def start(self, timeout_s: float = 10.0) -> EmbeddedBroker:
        if self._loop is not None:
            raise TmdError("the embedded broker is already running")
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(
            target=_run_loop, args=(loop,), name=f"tmd-minibroker-{self.port}", daemon=True
        )
        self._thread.start()
        self._broker = MiniBroker(host=self.host, port=self.port, config=self.config)
        try:
            asyncio.run_coroutine_threadsafe(self._broker.start(), loop).result(timeout_s)
        except (OSError, TimeoutError) as exc:
            self.stop()
            raise TmdError(
                f"embedded broker cannot listen on {self.host}:{self.port}: {exc}"
            ) from exc
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        loop, thread, broker = self._loop, self._thread, self._broker
        if loop is None or thread is None or broker is None:
            return
        self._loop = self._thread = None
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(broker.close(), loop).result(timeout_s)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout_s)

    close = stop

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def dropped(self) -> int:
        """QoS 0 messages dropped for slow clients since the last start."""
        return self._broker.dropped if self._broker else 0

    @property
    def protocol_errors(self) -> int:
        """Clients disconnected for a bad packet since the last start."""
        return self._broker.protocol_errors if self._broker else 0

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        loop.close()
