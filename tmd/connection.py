"""The MQTT connection shared by the daemon's ingest and the node agent: clients built
from ``[mqtt]``, and the loop that reconnects them with a back-off."""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiomqtt
import paho.mqtt.client as paho

from tmd.config import MqttConfig
from tmd.errors import ProtocolError
from tmd.mqtt_codec import MAX_REMAINING_LENGTH, packet_bounds


def _default_client_id() -> str:
    # Unique per connection: a broker drops the older of two clients with one id.
    return f"tmd-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class ClientFactory:
    """aiomqtt clients from ``[mqtt]``. Secrets are read and the TLS context is built
    here, once, so a bad file is a ConfigError at start rather than a crash later."""

    def __init__(self, config: MqttConfig) -> None:
        self.config = config
        self.password = config.read_password()
        self.tls_context = config.tls_context()

    def __call__(
        self,
        *,
        will: aiomqtt.Will | None = None,
        queue_type: type[asyncio.Queue[aiomqtt.Message]] | None = None,
        identifier: str | None = None,
    ) -> aiomqtt.Client:
        c = self.config
        return aiomqtt.Client(
            c.host,
            c.port,
            identifier=identifier or c.client_id or _default_client_id(),
            protocol=(
                aiomqtt.ProtocolVersion.V5 if c.protocol == "5" else aiomqtt.ProtocolVersion.V311
            ),
            username=c.username or None,
            password=self.password or None,
            tls_context=self.tls_context,
            tls_insecure=c.tls_insecure if c.tls else None,
            keepalive=int(c.keepalive_s),
            timeout=c.connect_timeout_s,
            will=will,
            queue_type=queue_type,
        )


class Backoff:
    """The wait between reconnect attempts: ``min_s`` at first, doubled after each
    attempt up to ``max_s``; each wait is jittered to 50-100 % of the delay so that many
    clients losing one broker do not come back in step. ``reset`` after a connection
    that worked starts over from ``min_s``."""

    def __init__(self, *, min_s: float, max_s: float) -> None:
        self.min_s = min_s
        self.max_s = max_s
        self.delay = min_s  # the delay the next wait is drawn from

    def next(self) -> float:
        """Seconds to wait now; the delay after this one doubles."""
        wait = self.delay * (0.5 + random.random() / 2)
        self.delay = min(self.delay * 2, self.max_s)
        return wait

    def reset(self) -> None:
        self.delay = self.min_s


async def reconnect_forever(
    session: Callable[[], Awaitable[None]],
    *,
    config: MqttConfig,
    log: Any,
    connected: Callable[[], bool],
    closed: Callable[[], None],
    failed: Callable[[], None] = lambda: None,
    errors: tuple[type[Exception], ...] = (aiomqtt.MqttError,),
) -> None:
    """Run ``session`` (connect, work, until the connection is lost) forever. A lost
    connection (one of ``errors``) is counted (``failed``) and logged; ``closed`` runs
    after every session; then the loop waits its ``Backoff`` and connects again. The
    back-off starts over after a session that got ``connected``, so a broker restart
    costs ``mqtt.reconnect_min_s``, and a broker that refuses us is not hammered."""
    backoff = Backoff(min_s=config.reconnect_min_s, max_s=config.reconnect_max_s)
    while True:
        try:
            await session()
        except errors as exc:
            if cancelling():
                # The session was cancelled, and aiomqtt's disconnect on the way out
                # timed out: the error replaced the CancelledError, which must not be
                # lost (the loop would reconnect, and its task group wait forever).
                raise asyncio.CancelledError from exc
            failed()
            if connected():
                backoff.reset()
            retry_in_s = round(backoff.delay, 2)
            log.warning("broker connection lost", error=str(exc), retry_in_s=retry_in_s)
        finally:
            closed()
        await asyncio.sleep(backoff.next())


def cancelling() -> bool:
    """Is the current task being cancelled? A library that turns the CancelledError
    into an error of its own (aiomqtt, when a publish or disconnect is interrupted)
    makes ``except Exception`` swallow a cancellation: such a handler re-raises
    ``CancelledError`` where this holds, or its loop runs on and its task group never
    ends."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


# -- the QoS 0 read path -----------------------------------------------------------------

Handler = Callable[[str, bytes, bool], None]


def handle_qos0_inline(client: aiomqtt.Client, handle: Handler) -> bool:
    """Have ``client`` hand every QoS 0 PUBLISH it reads to ``handle(topic, payload,
    retained)`` as soon as it is framed, without paho.

    paho reads a packet with at least three ``recv`` calls (its first byte, each byte
    of its length, its body), one packet per wake-up of the event loop, then builds a
    message object and matches it against its callbacks, and aiomqtt builds another.
    Measured on loopback mosquitto, the reading process's CPU per relayed message of
    3.7 kB, handler doing nothing: 66 us through paho and aiomqtt, 11 us framed here
    with one ``recv`` per wake-up. In ``tmd bench ingest`` the daemon's CPU per
    rank-step went from 84 to 40 us directly (12,288 ranks), from 24 to 18 us via
    agents (32,768 ranks).

    So paho's socket is seen through a ``_Lane``: each ``recv`` paho makes reads what
    the socket has (up to 64 kB), frames it, hands the QoS 0 PUBLISHes at its head to
    ``handle``, and gives paho every other packet (CONNACK, SUBACK, PUBLISH at QoS 1,
    PUBACK, PINGRESP) byte for byte, so paho's state (acknowledgements, keep-alive,
    disconnects, errors) is what it would be without the lane; it tells paho when
    bytes came, as paho's own reads do, so a late PINGRESP behind a queue of telemetry
    is not taken for a dead link. Packets are handled in the order they came: the
    lane stops at a packet for paho until paho has read it. A frame paho would refuse
    goes to paho with every byte after it, and paho drops the connection as before.

    MQTT 3.1.1 over TCP (TLS too) or a Unix socket only (an MQTT 5 PUBLISH carries
    properties the lane does not read). Installed before the client connects; False,
    and the client unchanged, where this aiomqtt or paho does not have the parts it
    hooks (``Client._client``; paho's ``on_socket_open``, ``_sock``, its keep-alive's
    ``_last_bytes_received`` on ``time.monotonic``), so a new version degrades to the
    slow path rather than breaking."""
    paho_client: Any = getattr(client, "_client", None)
    hooked = ("_sock", "_msgtime_mutex", "_last_bytes_received", "on_socket_open")
    if paho_client is None or not all(hasattr(paho_client, a) for a in hooked):
        return False
    if getattr(paho, "time_func", None) is not time.monotonic:
        return False  # its keep-alive clock, which the lane sets
    protocol = getattr(paho_client, "_protocol", None)
    if protocol not in (3, 4) or getattr(paho_client, "_transport", None) not in ("tcp", "unix"):
        return False
    opened = paho_client.on_socket_open
    if opened is None:
        return False

    def on_socket_open(paho_: Any, userdata: Any, sock: Any) -> None:
        def received() -> None:
            with paho_._msgtime_mutex:
                paho_._last_bytes_received = time.monotonic()

        lane = _Lane(sock, handle, received)
        paho_._sock = lane
        opened(paho_, userdata, lane)

    paho_client.on_socket_open = on_socket_open
    return True


class _Lane:
    """paho's socket with the QoS 0 PUBLISHes taken out of what it reads
    (``handle_qos0_inline``). Everything paho or aiomqtt asks of a socket besides
    ``recv`` and ``pending`` goes to the socket itself, but other ways to read it."""

    # Read at most this much a wake-up: 17 relayed messages, some 600 small ones, so
    # the event loop (the HTTP API, timers) waits milliseconds, not a quarter of a MB.
    _CHUNK = 1 << 16

    def __init__(self, sock: Any, handle: Handler, received: Callable[[], None]) -> None:
        self._sock = sock
        self._handle = handle
        self._received = received  # tells paho bytes came (its keep-alive counts them)
        self._inbox = bytearray()  # read from the socket, not framed yet
        self._paho = bytearray()  # whole packets for paho, in order
        self._eof = False
        self._unframed = False  # after a bad frame all is paho's, to refuse

    def __getattr__(self, name: str) -> Any:  # send, fileno, close, setblocking...
        if name.startswith("recv") or name in ("read", "makefile"):
            # A paho that read another way would bypass the lane and lose its frame.
            raise AttributeError(f"{name}: the QoS 0 read path reads with recv only")
        return getattr(self._sock, name)

    def recv(self, n: int) -> bytes:
        if not self._paho:
            self._pump()
        if self._paho:
            out = bytes(self._paho[:n])
            del self._paho[:n]
            return out
        if self._eof:
            return b""  # paho sees the connection closed
        raise BlockingIOError

    def pending(self) -> int:
        """Whether there is more to read before the socket says so: packets for paho,
        whole packets in the inbox, the end of the stream, bytes TLS has decrypted.
        aiomqtt reads on while this is above 0."""
        if self._paho or self._eof or self._framed():
            return 1
        pending = getattr(self._sock, "pending", None)
        return int(pending()) if pending is not None else 0

    def _framed(self) -> bool:
        try:
            return packet_bounds(self._inbox, 0, MAX_REMAINING_LENGTH) is not None
        except ProtocolError:
            return True  # for paho, which refuses it

    def _pump(self) -> None:
        """Handle what the inbox holds; if that gave paho nothing, read the socket once
        (its errors, would-block included, are paho's to handle) and handle that."""
        self._drain()
        if self._paho or self._eof:
            return
        data = self._sock.recv(self._CHUNK)
        if not data:
            self._eof = True
            return
        self._received()
        self._inbox += data
        self._drain()

    def _drain(self) -> None:
        """Hand the QoS 0 PUBLISHes at the head of the inbox to ``handle``, up to the
        first packet of another kind, which moves to paho's buffer. A frame paho would
        refuse (a length of five bytes, an empty topic, a topic past its packet) is
        paho's, and so is every byte after it."""
        inbox, handle = self._inbox, self._handle
        pos, n = 0, len(inbox)
        try:
            while pos < n:
                if self._unframed:
                    self._paho += inbox[pos:]
                    pos = n
                    break
                try:
                    bounds = packet_bounds(inbox, pos, MAX_REMAINING_LENGTH)
                except ProtocolError:
                    self._unframed = True
                    continue
                if bounds is None:
                    break
                first, start, end = bounds
                if first & 0xF6 == 0x30:  # a PUBLISH at QoS 0
                    topic_end = start
                    if end - start > 2:
                        topic_end = start + 2 + (inbox[start] << 8 | inbox[start + 1])
                    if start + 2 < topic_end <= end:
                        with memoryview(inbox) as view:
                            topic = str(view[start + 2 : topic_end], "utf-8", "replace")
                            payload = bytes(view[topic_end:end])
                        pos = end
                        handle(topic, payload, bool(first & 1))
                        continue
                    self._unframed = True  # malformed: paho drops the connection
                self._paho += inbox[pos:end]  # another kind: paho's, then go on
                pos = end
                break
        finally:
            del inbox[:pos]
