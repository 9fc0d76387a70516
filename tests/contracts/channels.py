"""Both control channels as the runtime sees them, each with the controller that drives it.

A ``Harness`` owns one job: its store server (both channels keep the standby registry
and the compare-and-set status there), the channels opened for its nodes, and a
``Controller``: the other end of the wire, reduced to what the real one does.

- store: ``JobController`` over the job's TCPStore, the direct Python API.
- mqtt: a paho client doing what the daemon does: commands published at QoS 1 on
  ``tmd/v1/job/{job}/ctl`` (the actuator's ``job_topic(command.job, "ctl")``), acks
  and the retained status read from ``ack`` and ``status`` and decoded with
  ``tmd.wire`` (as ingest does).
"""

from __future__ import annotations

import gc
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from tmd import wire
from tmd.runtime.control import CTL_LOG, ControlChannel, JobController, StoreControl, append
from tmd.runtime.group import StoreAddress
from tmd.runtime.launch import host_store
from tmd.runtime.mqtt_control import MqttControl
from tmd.tools.mosquitto import Mosquitto

Command = wire.Prepare | wire.Switch | wire.Abort
T = TypeVar("T")
WAIT_S = 10.0


def until(check: Callable[[], T], what: str, *, timeout_s: float = WAIT_S) -> T:
    """Poll ``check`` until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.01)


def promptly(call: Callable[[], T], *, timeout_s: float = 5.0) -> T:
    """``call()``, run on a thread so that a call that blocks fails the test instead of
    hanging it. The bound is a generous timeout, not a performance claim."""
    out: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"{call} still blocked after {timeout_s} s"
    if errors:
        raise errors[0]
    return out[0]


def poll_through(channel: ControlChannel, marker: Command) -> list[Command]:
    """Everything ``channel`` polls up to and including ``marker``, boundary by boundary."""
    got: list[Command] = []

    def reached() -> bool:
        got.extend(channel.poll())
        return marker in got

    until(reached, f"{marker} polled")
    return got


def port_closed(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return True
    return False


class Controller(Protocol):
    def send(self, command: Command) -> None: ...
    def send_raw(self, payload: bytes) -> None:
        """Put ``payload`` where this job's commands go, undecoded."""
        ...

    def acks(self) -> list[wire.Ack]:
        """Every ack read so far, in order."""
        ...

    def status(self) -> wire.JobStatus | None: ...
    def sync(self) -> None:
        """Return once whatever reached the transport before the call can be read."""
        ...

    def close(self) -> None: ...


class Harness:
    """One job on one kind of channel."""

    kind: str
    controller: Controller
    store: Any  # the job's TCPStore server

    def __init__(self) -> None:
        self.job = f"job-{uuid.uuid4().hex[:10]}"
        self.store = host_store(0)
        self.address = StoreAddress("127.0.0.1", self.store.port)
        self._channels: list[ControlChannel] = []
        self._closed: set[int] = set()

    def open(self, node: str) -> ControlChannel:
        channel = self._open(node)
        self._channels.append(channel)
        return channel

    def close_channel(self, channel: ControlChannel) -> None:
        if id(channel) not in self._closed:
            self._closed.add(id(channel))
            channel.close()

    def command(self, kind: type[T], migration_id: str, **fields: Any) -> T:
        return kind(ts=time.time(), job=self.job, migration_id=migration_id, **fields)

    def cut(self) -> None:
        """Take the transport away (the broker, or the store server)."""
        raise NotImplementedError

    def close(self) -> None:
        for channel in self._channels:
            self.close_channel(channel)
        self.controller.close()

    def _open(self, node: str) -> ControlChannel:
        raise NotImplementedError


class StoreController:
    def __init__(self, store: Any, job: str) -> None:
        self.store = store
        self.api = JobController(store, job=job)

    def send(self, command: Command) -> None:
        self.api.send(command)

    def send_raw(self, payload: bytes) -> None:
        append(self.store, CTL_LOG, payload)

    def acks(self) -> list[wire.Ack]:
        return self.api.acks()

    def status(self) -> wire.JobStatus | None:
        return self.api.status()

    def sync(self) -> None:
        pass  # a write to the store is readable once it returns

    def close(self) -> None:
        pass


class StoreHarness(Harness):
    kind = "store"

    def __init__(self) -> None:
        super().__init__()
        self.controller = StoreController(self.store, self.job)

    def _open(self, node: str) -> ControlChannel:
        return StoreControl(self.address, job=self.job, poll_interval=timedelta(milliseconds=5))

    def cut(self) -> None:
        # The server lives as long as its master TCPStore: drop every reference to it.
        self.store = self.controller = None  # type: ignore[assignment]
        gc.collect()
        until(lambda: port_closed(self.address.host, self.address.port), "store server gone")
        self.controller = StoreController(None, self.job)  # close() has nothing to do


class MqttController:
    def __init__(self, broker: Mosquitto, job: str) -> None:
        self.job = job
        self._lock = threading.Lock()
        self._seen: list[tuple[str, bytes]] = []
        self._subscribed = threading.Event()
        self._sync = f"contracts/{job}/sync"
        client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"controller-{job}")
        client.on_message = self._on_message
        client.on_subscribe = lambda *_: self._subscribed.set()
        client.connect(broker.host, broker.port)
        client.loop_start()
        topics = [wire.job_topic(job, "ack"), wire.job_topic(job, "status"), self._sync]
        client.subscribe([(t, 1) for t in topics])
        assert self._subscribed.wait(WAIT_S), "controller not subscribed"
        self.client = client

    def _on_message(self, _c: Any, _u: Any, message: paho.MQTTMessage) -> None:
        with self._lock:
            self._seen.append((message.topic, bytes(message.payload)))

    def _payloads(self, topic: str) -> list[bytes]:
        with self._lock:
            return [p for t, p in self._seen if t == topic]

    def _publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        info = self.client.publish(topic, payload, qos=1, retain=retain)
        info.wait_for_publish(WAIT_S)
        assert info.is_published(), f"not published on {topic}"

    def send(self, command: Command) -> None:
        self._publish(wire.job_topic(command.job, "ctl"), wire.encode(command))

    def send_raw(self, payload: bytes) -> None:
        self._publish(wire.job_topic(self.job, "ctl"), payload)

    def acks(self) -> list[wire.Ack]:
        return [wire.decode(p, wire.Ack) for p in self._payloads(wire.job_topic(self.job, "ack"))]

    def status(self) -> wire.JobStatus | None:
        found = [p for p in self._payloads(wire.job_topic(self.job, "status")) if p]
        return wire.decode(found[-1], wire.JobStatus) if found else None

    def sync(self) -> None:
        # The broker queues a message for its subscribers before it acknowledges it,
        # and sends each subscriber its messages in order: once this marker is back,
        # everything published before it is here.
        marker = uuid.uuid4().hex.encode()
        self._publish(self._sync, marker)
        until(lambda: marker in self._payloads(self._sync), "sync marker back")

    def close(self) -> None:
        # The session broker outlives the test: leave no retained status behind.
        self.client.publish(wire.job_topic(self.job, "status"), b"", qos=1, retain=True)
        self.client.disconnect()
        self.client.loop_stop()


class MqttHarness(Harness):
    kind = "mqtt"

    def __init__(self, broker: Mosquitto) -> None:
        super().__init__()
        self.broker = broker
        self.controller = MqttController(broker, self.job)

    def _open(self, node: str) -> ControlChannel:
        channel = MqttControl(
            f"{self.broker.host}:{self.broker.port}", job=self.job, node=node, store=self.address
        )
        self._await_subscription(channel)
        return channel

    def _await_subscription(self, channel: MqttControl) -> None:
        # MqttControl returns once CONNACK is in and its SUBSCRIBE is sent, not once the
        # broker has it, so a command sent at once can be lost (see test_control_channel's
        # module docstring). Probe until one gets through, then drain the probes.
        deadline = time.monotonic() + WAIT_S
        while True:
            self.controller.send(self.command(wire.Abort, "probe"))
            try:
                until(channel.poll, "a probe polled", timeout_s=0.2)
                break
            except AssertionError:
                assert time.monotonic() < deadline, "the channel never subscribed"
        end = self.command(wire.Abort, "probe-end")
        self.controller.send(end)
        poll_through(channel, end)

    def cut(self) -> None:
        self.broker.stop()
        assert port_closed(self.broker.host, self.broker.port)
