"""The runtime against a real mosquitto: control on ``ctl``, acks, status, telemetry."""

from __future__ import annotations

import contextlib
import queue
import time
from datetime import timedelta
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from tests.integration.conftest import Undisturbed
from tests.integration.runtime_conftest_helpers import assert_same_as, release, run_job
from tmd import wire
from tmd.runtime.control import standbys
from tmd.tools.mosquitto import Mosquitto

# Each test gets its own mosquitto (``own_broker``), which fails under CI when missing.
pytestmark = pytest.mark.slow

NPROC = 3
STEPS = 80
JOB = "mqttjob"
SENTINEL = f"{wire.PREFIX}/job/{JOB}/observer-sentinel"


class Observer:
    """The daemon's side of the wire, reduced to a paho client and a queue."""

    def __init__(self, port: int) -> None:
        self.messages: queue.SimpleQueue[tuple[str, bytes]] = queue.SimpleQueue()
        self.client = paho.Client(CallbackAPIVersion.VERSION2)
        self.client.on_message = lambda _c, _u, m: self.messages.put((m.topic, bytes(m.payload)))
        self.client.connect("127.0.0.1", port)
        self.client.subscribe(f"{wire.PREFIX}/job/{JOB}/#", qos=1)
        self.client.loop_start()
        self.seen: list[tuple[str, bytes]] = []

    def send(self, message: wire.Prepare | wire.Switch) -> None:
        self.client.publish(
            wire.job_topic(JOB, "ctl"), wire.encode(message), qos=1
        ).wait_for_publish(5)

    def acks(self, kind: str, count: int, timeout: float = 60) -> list[wire.Ack]:
        deadline = time.monotonic() + timeout
        while True:
            found = [
                wire.decode(p, wire.Ack) for t, p in self.seen if t == wire.job_topic(JOB, "ack")
            ]
            found = [a for a in found if a.kind == kind]
            if len(found) >= count:
                return found
            assert time.monotonic() < deadline, f"only {len(found)} {kind} acks"
            with contextlib.suppress(queue.Empty):
                self.seen.append(self.messages.get(timeout=0.1))

    def drain(self, timeout: float = 30) -> None:
        """Take in everything published before now: publish a sentinel and read up to
        it. The broker hands us messages in the order it got them (a QoS 1 sentinel
        queues behind earlier QoS 1 messages; QoS 0 ones are never held back), so what
        the job published before it exited arrives first."""
        self.client.publish(SENTINEL, b"", qos=1).wait_for_publish(5)
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(queue.Empty):
                topic, payload = self.messages.get(timeout=0.1)
                if topic == SENTINEL:
                    return
                self.seen.append((topic, payload))
            assert time.monotonic() < deadline, "the sentinel never came back"

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def test_migration_over_mqtt_with_telemetry(
    tmp_path: Path, own_broker: Mosquitto, undisturbed: Undisturbed
) -> None:
    reference = undisturbed(NPROC, STEPS, quiet=False)
    observer = Observer(own_broker.port)
    out = tmp_path / "migrated"
    # Slow steps (sleeping changes no number) until the switch: the workers must not
    # finish all their steps before the standby is warm and the migration done,
    # however busy the machine is; then full speed.
    job = run_job(
        out,
        nproc=NPROC,
        standby=1,
        steps=STEPS,
        job=JOB,
        broker=f"127.0.0.1:{own_broker.port}",
        extra=["--held-sleep", "0.5"],
        held=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not any(s.state == "ready" for s in standbys(job.store)):
            assert time.monotonic() < deadline, "standby never became ready"
            time.sleep(0.05)
        now = time.time()
        observer.send(
            wire.Prepare(ts=now, job=JOB, migration_id="mq1", leaver="worker2", joiner="standby0")
        )
        observer.acks("prepared", NPROC + 1)
        observer.send(wire.Switch(ts=time.time(), job=JOB, migration_id="mq1"))
        switched = observer.acks("switched", NPROC + 1)
        release(out)
        codes = job.wait(timedelta(seconds=120))
        observer.drain()  # every process has exited: all they sent is at the broker
    finally:
        job.terminate()
        observer.close()

    assert set(codes.values()) == {0}
    assert {a.node for a in switched} == {"worker0", "worker1", "worker2", "standby0"}
    statuses = [wire.decode(p, wire.JobStatus) for t, p in observer.seen if t.endswith("/status")]
    assert statuses[-1].state == "stopped"
    assert [m.node for m in statuses[-1].members] == ["worker0", "worker1", "standby0"]
    batches = [wire.decode(p, wire.IterBatch) for t, p in observer.seen if t.endswith("/iter")]
    by_node = {(b.node, b.rank, b.generation) for b in batches}
    assert {("worker0", 0, 0), ("worker1", 1, 0), ("worker2", 2, 0)} <= by_node
    assert ("standby0", 2, 1) in by_node  # the joiner reports as the rank it took over
    steps = sorted(s.step for b in batches if b.rank == 0 for s in b.steps)
    assert steps == list(range(1, STEPS + 1))  # every step of rank 0, none dropped
    assert_same_as(out, reference, NPROC)


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
