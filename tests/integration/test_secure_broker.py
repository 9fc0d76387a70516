"""The shipped broker configuration (``deploy/mosquitto``) on a real mosquitto: TLS
only, anonymous clients refused, and the ACL confining each role to its own topics;
the runtime's MQTT client connects to it with the options the daemon and the agent
use (``tmd.config.MqttConfig``), and a wrong password stops it with a clear error."""

from __future__ import annotations

import queue
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from tests.conftest import _need_mosquitto, need_tool
from tests.integration.test_mqtt_options import _pki
from tmd import wire
from tmd.config import MqttConfig
from tmd.errors import ConfigError
from tmd.tools.mosquitto import Mosquitto, free_port

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "mosquitto"
USERS = {
    "tmd-daemon": "d43m0n", "worker1": "n0de1", "worker2": "n0de2", "llm": "j0b", "rival": "r1v"
}  # fmt: skip


@dataclass
class SecureBroker:
    broker: Mosquitto
    pki: Path

    def options(self, user: str = "", password: str = "") -> MqttConfig:
        secret = self.pki / f"password-{user or 'none'}"
        secret.write_text(password or USERS.get(user, ""))
        return MqttConfig(host="127.0.0.1", port=self.broker.port, tls=True,
                          ca_file=str(self.pki / "ca.crt"), username=user,
                          password_file=str(secret) if user else "")  # fmt: skip

    def client(self, user: str = "", password: str | None = None) -> Client:
        return Client(self, user, USERS.get(user, "") if password is None else password)


class Client:
    """A paho client of the secure broker; ``refused`` is its CONNACK's reason."""

    def __init__(self, b: SecureBroker, user: str, password: str) -> None:
        self.messages: queue.SimpleQueue[tuple[str, bytes]] = queue.SimpleQueue()
        self.reason: Any = None
        self._answered = threading.Event()
        self._subscribed = threading.Event()
        c = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"test-{user or 'anon'}-{id(self)}")
        c.tls_set(ca_certs=str(b.pki / "ca.crt"))
        if user:
            c.username_pw_set(user, password)
        c.on_connect = self._on_connect
        c.on_subscribe = lambda *_: self._subscribed.set()
        c.on_message = lambda _c, _u, m: self.messages.put((m.topic, bytes(m.payload)))
        c.connect_async(b.broker.host, b.broker.port)
        c.loop_start()
        self.c = c
        assert self._answered.wait(10), "no CONNACK"

    def _on_connect(self, _c: Any, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
        self.reason = reason
        self._answered.set()
        if reason.is_failure:
            self.c.disconnect()

    @property
    def refused(self) -> bool:
        return bool(self.reason.is_failure)

    def subscribe(self, topic: str) -> None:
        self._subscribed.clear()
        self.c.subscribe(topic, qos=1)
        assert self._subscribed.wait(10)

    def send(self, topic: str, payload: bytes = b"x") -> None:
        self.c.publish(topic, payload, qos=1).wait_for_publish(5)

    def received(self, until: str, timeout_s: float = 10.0) -> list[str]:
        """Topics received up to and including the first on ``until`` (a sentinel the
        test publishes last: what a client sent before it has arrived by then)."""
        got, deadline = [], time.monotonic() + timeout_s
        while True:
            topic, _ = self.messages.get(timeout=max(0.01, deadline - time.monotonic()))
            got.append(topic)
            if topic == until:
                return got

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


@pytest.fixture
def secure(tmp_path: Path) -> Iterator[SecureBroker]:
    _need_mosquitto()
    for tool, package in (("mosquitto_passwd", "mosquitto"), ("openssl", "openssl")):
        need_tool(tool, shutil.which(tool), install=f"apt-get install -y {package}")
    _pki(tmp_path)
    passwd = tmp_path / "passwd"
    passwd.touch(mode=0o600)
    for user, password in USERS.items():
        subprocess.run(["mosquitto_passwd", "-b", str(passwd), user, password],
                       check=True, capture_output=True)  # fmt: skip
    shutil.copy(DEPLOY / "tmd.acl", tmp_path / "acl")
    for name in ("ca.crt", "server.crt", "server.key"):
        (tmp_path / name).chmod(0o600)
    port = free_port()
    shipped = (DEPLOY / "tmd.conf").read_text()
    assert "listener 8883\n" in shipped
    config = shipped.replace("/etc/mosquitto/tmd/", f"{tmp_path}/").replace(
        "listener 8883\n", f"listener {port} 127.0.0.1\n"
    )
    with Mosquitto(port=port, config=config) as broker:
        yield SecureBroker(broker, tmp_path)


def test_anonymous_and_wrong_passwords_are_refused(secure: SecureBroker) -> None:
    assert secure.client().refused
    assert secure.client("llm", password="guess").refused
    assert secure.client("nobody", password="x").refused
    ok = secure.client("llm")
    assert not ok.refused
    ok.close()


def test_each_role_publishes_only_its_own_topics(secure: SecureBroker) -> None:
    head = secure.client("tmd-daemon")
    head.subscribe("tmd/v1/#")
    job, rival, agent = secure.client("llm"), secure.client("rival"), secure.client("worker1")
    job.subscribe("tmd/v1/job/llm/ctl")
    rival.subscribe("tmd/v1/job/llm/#")  # another job may not read llm's commands
    forged = [  # (client, topic): each would move or mislead job llm if it arrived
        (agent, wire.job_topic("llm", "ctl")),
        (agent, wire.node_topic("worker2", "xid")),  # an agent speaking for another node
        (agent, wire.job_topic("llm", "ack")),
        (rival, wire.job_topic("llm", "ctl")),
        (rival, wire.job_topic("llm", "ack")),
        (rival, wire.job_topic("llm", "status")),
        (rival, wire.iter_topic("llm", 0)),
        (rival, wire.node_topic("worker1", "xid")),
        (job, wire.job_topic("llm", "ctl")),  # a job may not command itself either
        (job, wire.node_topic("worker1", "xid")),
    ]
    for client, topic in forged:
        client.send(topic)
    allowed = [
        (agent, wire.node_topic("worker1", "xid")),
        (agent, wire.node_topic("worker1", "gpu")),
        (job, wire.iter_topic("llm", 3)),
        (job, wire.job_topic("llm", "ack")),
        (job, wire.job_topic("llm", "status")),
    ]
    for client, topic in allowed:
        client.send(topic)
    head.send(wire.job_topic("llm", "ctl"), b"the real command")
    # Each client's messages arrive in order: by the sentinel, any forged one has too.
    seen = head.received(until=wire.job_topic("llm", "ctl"))
    assert sorted(seen) == sorted([t for _, t in allowed] + [wire.job_topic("llm", "ctl")])
    assert job.received(until=wire.job_topic("llm", "ctl")) == [wire.job_topic("llm", "ctl")]
    rival.send(wire.job_topic("rival", "status"))  # its own status: readable, not llm's
    assert rival.messages.empty()
    for c in (head, job, rival, agent):
        c.close()


def test_the_runtime_connects_with_tls_and_a_password_file(secure: SecureBroker) -> None:
    from torch.distributed import TCPStore

    from tmd.runtime.group import StoreAddress
    from tmd.runtime.mqtt_control import MqttControl

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = StoreAddress("127.0.0.1", store.port)
    control = MqttControl(secure.options("llm"), job="llm", node="worker1/0", store=address)
    head = secure.client("tmd-daemon")
    try:
        prepare = wire.Prepare(ts=time.time(), job="llm", migration_id="m1", leaver="worker1",
                               joiner="spare")  # fmt: skip
        head.send(wire.job_topic("llm", "ctl"), wire.encode(prepare))
        deadline = time.monotonic() + 10
        got: list[wire.Control] = []
        while not got and time.monotonic() < deadline:
            got = control.poll()
            time.sleep(0.02)
        assert [c.migration_id for c in got] == ["m1"]
    finally:
        control.close()
        head.close()
    with pytest.raises(ConfigError, match=r"mqtt\.username.*refused"):
        MqttControl(secure.options("llm", password="wrong"), job="llm", node="worker1/0",
                    store=address, connect_timeout=timedelta(seconds=10))  # fmt: skip
