"""MQTT ingest: subscribe to the v1 topics, decode once at the edge, update the view,
hand the decoded message to the bus.

Supervision is a plain loop: connect, subscribe, read until the connection drops,
back off, reconnect. Input never kills it: a bad message is counted in
``tmd_messages_rejected_total{reason}``, logged at most once per (topic kind,
reason) per interval, and dropped.

Messages are handled inline, in the callback that reads them from the socket: the
default aiomqtt iterator costs an asyncio task per message, which at tens of
thousands of messages a second is most of a core. ``handle`` is synchronous and
O(size of the message).
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import socket
import ssl
from collections.abc import Callable
from typing import Any, Final

import aiomqtt

from tmd import log, wire
from tmd.bus import Bus
from tmd.clock import Clock
from tmd.config import IngestConfig, MqttConfig
from tmd.errors import ProtocolError
from tmd.metrics import Metrics
from tmd.view import ClusterView

_NODE_KINDS: Final = {"status": "node_status", "gpu": "gpu", "xid": "xid"}
_JOB_KINDS: Final = {"status": "job_status", "ack": "ack"}
_TYPES: Final[dict[str, type[wire.Message]]] = {
    "node_status": wire.NodeStatus,
    "gpu": wire.NodeGpu,
    "xid": wire.XidEvent,
    "iter": wire.IterBatch,
    "job_status": wire.JobStatus,
    "ack": wire.Ack,
}


def classify(topic: str) -> tuple[str, str, int | None]:
    """``(kind, node or job, rank)`` of a v1 topic; ProtocolError ``topic`` otherwise."""
    parts = topic.split("/")
    n = len(parts)
    if n >= 5 and parts[0] == "tmd" and parts[1] == "v1":
        if n == 5 and parts[2] == "node" and parts[4] in _NODE_KINDS:
            return _NODE_KINDS[parts[4]], parts[3], None
        if n == 5 and parts[2] == "job" and parts[4] in _JOB_KINDS:
            return _JOB_KINDS[parts[4]], parts[3], None
        if n == 7 and parts[2] == "job" and parts[4] == "rank" and parts[6] == "iter":
            text = parts[5]
            if text.isdigit() and len(text) <= 8 and (text == "0" or text[0] != "0"):
                return "iter", parts[3], int(text)
            raise ProtocolError("topic", f"bad rank {text[:16]!r} in topic")
    raise ProtocolError("topic", "not a tmd v1 topic")


class Ingest:
    def __init__(
        self,
        *,
        mqtt: MqttConfig,
        config: IngestConfig,
        view: ClusterView,
        bus: Bus,
        metrics: Metrics,
        clock: Clock,
    ) -> None:
        self._mqtt = mqtt
        self._config = config
        self._view = view
        self._bus = bus
        self._metrics = metrics
        self._clock = clock
        self._log = log.get("ingest")
        self._reject_logged: dict[tuple[str, str], tuple[float, int]] = {}
        self.subscribed = asyncio.Event()
        self.connected = False
        # Test and benchmark hook: called with (batch, now) after a batch is applied.
        self.on_iter: Callable[[wire.IterBatch, float], None] | None = None
        # Benchmark baseline: aiomqtt's stock iterator (a task per message) instead.
        self.use_stock_iterator = False

    # -- the edge: one message in ----------------------------------------------------

    def handle(self, topic: str, payload: bytes) -> None:
        now = self._clock.now()
        kind = "?"
        try:
            kind, owner, rank = classify(topic)
            limit = (
                self._config.max_status_bytes
                if kind == "job_status"
                else self._config.max_payload_bytes
            )
            if len(payload) > limit:
                raise ProtocolError("oversize", f"{len(payload)} bytes > {limit}")
            if not payload and kind in ("node_status", "job_status"):
                return  # a retained message being cleared
            message = wire.decode(payload, _TYPES[kind])
            self._metrics.received_by[kind].inc()
            self._apply(kind, owner, rank, message, now)
        except ProtocolError as exc:
            self._reject(topic, kind, exc, now)

    def _apply(self, kind: str, owner: str, rank: int | None, message: Any, now: float) -> None:
        view = self._view
        if kind == "iter":
            if message.job != owner or message.rank != rank:
                raise ProtocolError("mismatch", "job or rank differs from the topic")
            applied = view.apply_iter(message, now)
            m = self._metrics
            if applied.accepted:
                m.steps_by["accepted"].inc(applied.accepted)
            if applied.duplicate:
                m.steps_by["duplicate"].inc(applied.duplicate)
            if applied.late:
                m.steps_by["late"].inc(applied.late)
            m.latency.observe(max(0.0, now - message.ts))
            if self.on_iter is not None:
                self.on_iter(message, now)
        elif kind in ("node_status", "gpu", "xid"):
            if message.node != owner:
                raise ProtocolError("mismatch", "node differs from the topic")
            if kind == "node_status":
                view.apply_node_status(message, now)
            elif kind == "gpu":
                view.apply_gpu(message, now)
            else:
                view.apply_xid(message, now)
        else:
            if message.job != owner:
                raise ProtocolError("mismatch", "job differs from the topic")
            if kind == "job_status":
                view.apply_job_status(message, now)
        self._bus.publish(message)

    def _reject(self, topic: str, kind: str, exc: ProtocolError, now: float) -> None:
        self._metrics.rejected_by[exc.reason].inc()
        key = (kind, exc.reason)
        last, suppressed = self._reject_logged.get(key, (-1e18, 0))
        if now - last < self._config.reject_log_interval_s:
            self._reject_logged[key] = (last, suppressed + 1)
            return
        self._reject_logged[key] = (now, 0)
        self._log.warning(
            "message rejected",
            topic=topic[:200],
            reason=exc.reason,
            detail=exc.detail[:300],
            suppressed_since_last=suppressed,
        )

    # -- the connection loop -----------------------------------------------------------

    async def run(self) -> None:
        """Connect, subscribe, read; on any connection loss back off and do it again.

        The back-off doubles on each failed attempt (with jitter, up to
        ``mqtt.reconnect_max_s``) and starts over after a session that got subscribed.
        """
        delay = self._mqtt.reconnect_min_s
        while True:
            try:
                await self._session()
            except aiomqtt.MqttError as exc:
                self._metrics.mqtt_failures.inc()
                if self.connected:
                    delay = self._mqtt.reconnect_min_s
                self._log.warning(
                    "broker connection lost", error=str(exc), retry_in_s=round(delay, 2)
                )
            finally:
                self.connected = False
                self._metrics.mqtt_connected.set(0)
            await asyncio.sleep(delay * (0.5 + random.random() / 2))
            delay = min(delay * 2, self._mqtt.reconnect_max_s)

    async def _session(self) -> None:
        queue_type = None if self.use_stock_iterator else _inline_queue(self.handle)
        async with make_client(self._mqtt, queue_type=queue_type) as client:
            prefix = f"$share/{self._mqtt.shared_group}/" if self._mqtt.shared_group else ""
            await client.subscribe(
                [(prefix + t, 1) for t in wire.SUBSCRIPTIONS],
                timeout=self._mqtt.connect_timeout_s,
            )
            self.connected = True
            self._metrics.mqtt_connects.inc()
            self._metrics.mqtt_connected.set(1)
            self._log.info("subscribed", host=self._mqtt.host, port=self._mqtt.port)
            self.subscribed.set()
            # The inline queue never holds a message, so with it this loop only ends
            # by raising MqttError when the connection drops.
            async for message in client.messages:
                self.handle(message.topic.value, _payload_bytes(message))


def _inline_queue(handle: Callable[[str, bytes], None]) -> type[asyncio.Queue[aiomqtt.Message]]:
    class InlineQueue(asyncio.Queue[aiomqtt.Message]):
        def put_nowait(self, item: aiomqtt.Message) -> None:
            handle(item.topic.value, _payload_bytes(item))

    return InlineQueue


def _payload_bytes(message: aiomqtt.Message) -> bytes:
    # aiomqtt declares payload as bytes; paho hands it bytes. Guard against a change.
    payload: object = message.payload
    return payload if isinstance(payload, bytes) else bytes(str(payload), "utf-8")


def _default_client_id() -> str:
    # Unique per connection: a broker drops the older of two clients with one id.
    return f"tmd-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def make_client(
    config: MqttConfig,
    *,
    will: aiomqtt.Will | None = None,
    queue_type: type[asyncio.Queue[aiomqtt.Message]] | None = None,
    identifier: str | None = None,
) -> aiomqtt.Client:
    """An aiomqtt client from ``[mqtt]``: protocol, auth, TLS, keepalive, Last Will."""
    password = config.password
    if config.password_file:
        with open(config.password_file) as f:
            password = f.read().strip()
    tls_context = None
    if config.tls:
        tls_context = ssl.create_default_context(cafile=config.ca_file or None)
        if config.cert_file:
            tls_context.load_cert_chain(config.cert_file, config.key_file)
        if config.tls_insecure:
            tls_context.check_hostname = False
            tls_context.verify_mode = ssl.CERT_NONE
    protocol = (
        aiomqtt.ProtocolVersion.V5 if config.protocol == "5" else aiomqtt.ProtocolVersion.V311
    )
    return aiomqtt.Client(
        config.host,
        config.port,
        identifier=identifier or config.client_id or _default_client_id(),
        protocol=protocol,
        username=config.username or None,
        password=password or None,
        tls_context=tls_context,
        tls_insecure=config.tls_insecure if config.tls else None,
        keepalive=int(config.keepalive_s),
        timeout=config.connect_timeout_s,
        will=will,
        queue_type=queue_type,
    )
