"""The MQTT control channel and telemetry sink of a training process.

One paho-mqtt client per process, running its network loop in paho's own thread:
commands on ``tmd/v1/job/{job}/ctl`` are decoded there (once, at the edge) and
queued for the next step boundary; acks, status and telemetry are handed to paho,
which sends them from that thread. Nothing here waits for the broker on the
training thread, and a broker that is down only delays acks and drops telemetry
(QoS 0); paho reconnects by itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import queue
import threading
import time
from datetime import timedelta
from typing import Any

import msgspec
import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from tmd import wire
from tmd.config import MqttConfig
from tmd.errors import ConfigError, ProtocolError
from tmd.runtime.control import _Poller, put_status, standbys
from tmd.runtime.group import StoreAddress, connect_store

log = logging.getLogger("tmd.runtime.mqtt")


def parse_broker(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError("TMD_BROKER", f"must be host:port, got {text!r}")
    return host, int(port)


class MqttControl:
    """A ``ControlChannel`` over MQTT, and the ``Telemetry`` sink (``publish``)."""

    def __init__(
        self,
        broker: MqttConfig | str,
        *,
        job: str,
        node: str,
        store: StoreAddress,
        keepalive: timedelta = timedelta(seconds=30),
        connect_timeout: timedelta = timedelta(seconds=10),
        max_age: timedelta = timedelta(seconds=120),
    ) -> None:
        self.job = job
        self.rejected = 0
        self.ignored: dict[str, int] = {}  # well-formed commands not acted on, by why
        self._max_age_s = max_age.total_seconds()
        self.published = 0
        self._seq: dict[tuple[str, int | None, int], int] = {}  # the telemetry's numbers
        self._seq_lock = threading.Lock()
        self._inbox: queue.SimpleQueue[wire.Control] = queue.SimpleQueue()
        self._stopped = False
        self._last: paho.MQTTMessageInfo | None = None
        self._connected = threading.Event()
        # The standby registry lives in the job's store; reading it is the one slow
        # part of publishing a status, so it runs on a worker thread.
        self._store = connect_store(store, timeout=connect_timeout)
        # Rank 0 owns the job's status, whose standby list the daemon picks joiners
        # from: once it asks (``standbys_changed``), this thread re-reads the registry
        # every second, so a standby that becomes ready is known within about a second
        # rather than at the next periodic status.
        self._watch_standbys = False
        self._standbys_seen: list[wire.StandbyInfo] | None = None
        # Changes counted by the channel's thread, read by the training thread: a
        # counter has one writer, so no change is lost between a read and a reset.
        self._standby_changes = 0
        self._standby_changes_read = 0
        self._worker = _Poller(f"tmd-mqtt-{job}", timedelta(seconds=1), self._check_standbys)
        if isinstance(broker, str):
            host, port = parse_broker(broker)
            broker = MqttConfig(host=host, port=port, keepalive_s=keepalive.total_seconds())
        self._refused: list[str] = []  # the CONNACK's reason, once refused
        client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=_client_id(job, node, prefix=broker.client_id or "tmd-runtime"),
            protocol=paho.MQTTv5 if broker.protocol == "5" else paho.MQTTv311,
        )
        # The same options, secrets and TLS files the daemon and the agent use.
        if broker.username:
            client.username_pw_set(broker.username, broker.read_password() or None)
        context = broker.tls_context()
        if context is not None:
            client.tls_set_context(context)
            client.tls_insecure_set(broker.tls_insecure)
        client.on_connect = self._on_connect
        client.on_subscribe = self._on_subscribe
        client.on_message = self._on_message
        client.reconnect_delay_set(min_delay=1, max_delay=10)
        client.connect_async(broker.host, broker.port, keepalive=int(broker.keepalive_s))
        client.loop_start()
        self._client = client
        # Commands sent before this process subscribed are lost (QoS 1 without a
        # session), so the first subscription is awaited once, at start.
        self._connected.wait(connect_timeout.total_seconds())
        if self._refused:
            self.close()
            why = f"the broker refused this client: {self._refused[0]}"
            raise ConfigError("mqtt.username", why)

    def _on_connect(self, client: paho.Client, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
        if reason.is_failure:
            if not self._connected.is_set() and str(reason) in _REFUSED:
                self._refused.append(str(reason))  # credentials or ACL: no retry can help
                self._connected.set()
            return
        with self._seq_lock:
            # What went into the connection that died is this process's loss, not one on
            # the way to the daemon: the numbers start over (the daemon sees a restart).
            self._seq.clear()
        client.subscribe(
            [(wire.job_topic(self.job, "ctl"), 1), (wire.job_topic(self.job, "status"), 1)]
        )

    def _on_subscribe(self, _c: paho.Client, _u: Any, _mid: Any, _codes: Any, _p: Any) -> None:
        # The broker's SUBACK, not its CONNACK: only from here on is a command on the
        # ctl topic delivered to this process.
        self._connected.set()

    def _on_message(self, _c: paho.Client, _u: Any, message: paho.MQTTMessage) -> None:
        try:
            if message.topic.endswith("/status"):
                status = wire.decode(bytes(message.payload), wire.JobStatus)
                self._stopped = status.state == "stopped"
                return
            command = wire.decode(bytes(message.payload), wire.Control)
        except ProtocolError:
            self.rejected += 1  # counted and dropped; a bad message never kills the loop
            return
        if command.job != self.job:
            return
        why = self._not_fresh(command, retained=bool(message.retain))
        if why:
            self._ignore(why, command)
            return
        self._inbox.put(command)

    def _not_fresh(self, command: wire.Control, *, retained: bool) -> str:
        """Why ``command`` must not be acted on ('' if it may). The daemon never
        retains a command and stamps each send: a retained one (a replay into every
        later subscriber) or one older than ``max_age`` on this process's clock (a
        replay, or a copy that sat in a queue) is ignored, whoever sent it."""
        if retained:
            return "retained"
        age = time.time() - command.ts
        if abs(age) > self._max_age_s:
            return "stale"
        return ""

    def _ignore(self, why: str, command: wire.Control) -> None:
        self.ignored[why] = self.ignored.get(why, 0) + 1
        if self.ignored[why] == 1:  # logged once per reason; the count says the rest
            log.warning("ignoring a %s %s command for %s (%s)", why, type(command).__name__,
                        command.migration_id, self.job)  # fmt: skip

    # -- ControlChannel ----------------------------------------------------------------

    def poll(self) -> list[wire.Control]:
        out = []
        while not self._inbox.empty():
            out.append(self._inbox.get_nowait())
        return out

    def ack(self, ack: wire.Ack) -> None:
        self._last = self._client.publish(wire.job_topic(self.job, "ack"), wire.encode(ack), qos=1)

    def publish_status(self, status: wire.JobStatus) -> None:
        def send() -> None:
            registry = self._standbys_seen = standbys(self._store)  # what this one reports
            # Launchers read the status from the store; the store also says whether a
            # newer one was published meanwhile (then this one is not sent at all).
            payload = put_status(self._store, status, registry)
            if payload is None:
                return
            topic = wire.job_topic(self.job, "status")
            self._last = self._client.publish(topic, payload, qos=1, retain=True)

        self._worker.submit(send)

    def stopped(self) -> bool:
        return self._stopped

    def standbys_changed(self) -> bool:
        self._watch_standbys = True
        changes = self._standby_changes
        if changes == self._standby_changes_read:
            return False
        self._standby_changes_read = changes
        return True

    def _check_standbys(self) -> None:
        if not self._watch_standbys:
            return
        now = standbys(self._store)
        if self._standbys_seen is not None and now != self._standbys_seen:
            self._standby_changes += 1
        self._standbys_seen = now

    def close(self, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Send what is queued (the last ack or status), then disconnect."""
        self._worker.close()
        last = self._last
        if last is not None and self._connected.is_set():
            # Not sent in time, or the connection is lost: the daemon times out instead.
            with contextlib.suppress(RuntimeError, ValueError):
                last.wait_for_publish(timeout.total_seconds())
        self._client.disconnect()
        self._client.loop_stop()

    # -- telemetry sink ----------------------------------------------------------------

    def publish(self, topic: str, payload: bytes) -> None:
        """Publish a batch (an encoded ``IterBatch``), numbered on its topic for its run
        and generation (``tmd.wire``): only what paho took to send counts. One at a
        time (the telemetry thread flushes, and so does the training thread at a
        switch), so the numbers go out in order. A payload that is not a valid batch
        goes as it is: the daemon counts it rejected."""
        try:
            batch = wire.decode(payload, wire.IterBatch)
        except ProtocolError:
            self._client.publish(topic, payload, qos=0)
            self.published += 1
            return
        key = (topic, batch.run, batch.generation)
        with self._seq_lock:
            seq = self._seq.get(key, 0) + 1
            numbered = wire.encode(msgspec.structs.replace(batch, seq=seq))
            if self._client.publish(topic, numbered, qos=0).rc == paho.MQTT_ERR_SUCCESS:
                if len(self._seq) >= _MAX_NUMBERED and key not in self._seq:
                    self._seq.clear()  # a rank's topic once a generation: never this many
                self._seq[key] = seq
        self.published += 1


_MAX_NUMBERED = 1024


_REFUSED = frozenset({"Bad user name or password", "Not authorized"})
"""CONNACK reasons (paho's names, MQTT 3.1.1 and 5) that no retry can cure."""


def _client_id(job: str, slot: str, *, prefix: str = "tmd-runtime") -> str:
    """One MQTT client id per process of the job: a broker disconnects a client whose
    id another one takes. Long names are cut, with a hash keeping them distinct."""
    whole = f"{prefix}-{job}-{slot}".replace("/", "-")
    if len(whole) <= 128:
        return whole
    return f"{whole[:111]}-{hashlib.sha256(whole.encode()).hexdigest()[:16]}"
